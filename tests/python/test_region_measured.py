"""Decisions corrected by measurement (SCORCH_MEASURE, csrc/torch/region.cpp): under the automatic dispatch, a
region whose density rule picks the kernel is timed against the dense path on its first call at a size, and
the faster is kept. The values never depend on the decision; the decision is made once and logged."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import random_dense
from scorch_backend import _C


def _program(name):
    return json.dumps({"operands": [["ac", "dense", False, True, 0, False], ["bc", "sparse", True, True, 0, True]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": name, "label": "measured test"})


def _operands(m=96, k=160, n=120, density=0.05, seed=0):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    w = random_dense((n, k), density, seed=seed + 1)
    return x, w


def _stats():
    return _C.region_stats()


def test_first_call_measures_once_per_size(monkeypatch, caplog):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.delenv("SCORCH_MEASURE", raising=False)
    x, w = _operands()
    text = _program("measured0")
    before = _stats()["measured"]
    with caplog.at_level(logging.INFO, logger="scorch"):
        out = torch.ops.scorch.region(text, [x, w])
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before + 1
    assert any("measured" in r.getMessage() and "measured0" in r.getMessage() for r in caplog.records)
    # The same sizes again (and sizes in the same power-of-two bucket): decided already.
    torch.ops.scorch.region(text, [x, w])
    x2 = torch.randn(90, x.shape[1])
    torch.testing.assert_close(torch.ops.scorch.region(text, [x2, w]), x2 @ w.t(), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before + 1
    # Another size bucket: measured again.
    x3 = torch.randn(300, x.shape[1])
    torch.testing.assert_close(torch.ops.scorch.region(text, [x3, w]), x3 @ w.t(), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before + 2


@pytest.mark.parametrize("env", [{"SCORCH_MEASURE": "0", "SCORCH_DISPATCH": "auto"},
                                 {"SCORCH_DISPATCH": "sparse"}, {"SCORCH_DISPATCH": "dense"}])
def test_no_measurement_when_off_or_forced(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    x, w = _operands(seed=4)
    before = _stats()["measured"]
    out = torch.ops.scorch.region(_program("measured_off_" + "_".join(env.values())), [x, w])
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before


def test_a_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.setenv("SCORCH_MEASURE", "yes")
    x, w = _operands(seed=6)
    with pytest.raises(ValueError, match="SCORCH_MEASURE"):
        torch.ops.scorch.region(_program("measured_bad"), [x, w])


def test_dense_operands_and_dense_choices_are_never_measured(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    x, w = _operands(density=0.9, seed=8)  # above the crossover: the rule says dense
    before = _stats()["measured"]
    out = torch.ops.scorch.region(_program("measured_dense"), [x, w])
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before


def test_measured_region_gradients_match(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    x, w = _operands(seed=10)
    x = x.requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    out = torch.ops.scorch.region(_program("measured_grad"), [x, wr])
    g = torch.randn_like(out)
    out.backward(g)
    torch.testing.assert_close(x.grad, g @ w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wr.grad, g.t() @ x.detach(), rtol=1e-4, atol=1e-4)


def test_a_grouped_choice_is_timed_against_the_kernel_too(monkeypatch, caplog):
    """The rule's grouped choice (a one-hot dispatch to per-group weights, the MoE's shape) is measured against
    the sparse kernel first, then the faster against dense: two decisions on the first call, each logged, and
    none on the next."""
    import torch.nn.functional as F
    from scorch_backend.custom_ops import region as R

    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.delenv("SCORCH_MEASURE", raising=False)
    g = torch.Generator().manual_seed(11)
    b, n, d, h = 512, 16, 32, 24
    s = F.one_hot(torch.randint(0, n, (b,), generator=g), n).float()
    x, w = torch.randn(b, d, generator=g), torch.randn(n, d, h, generator=g)
    text = R.Program((R.Operand("pq", "sparse"), R.Operand("pd"), R.Operand("qdh")), "pqh",
                     name="grouped_measured").text()
    assert R.choose_path(text, [s, x, w]) == "grouped"
    before = _stats()["measured"]
    with caplog.at_level(logging.INFO, logger="scorch"):
        out = torch.ops.scorch.region(text, [s, x, w])
    torch.testing.assert_close(out, torch.einsum("pq,pd,qdh->pqh", s, x, w), rtol=1e-4, atol=1e-4)
    assert _stats()["measured"] == before + 2
    lines = [r.getMessage() for r in caplog.records if "grouped_measured" in r.getMessage()]
    assert any("prefers" in m and "measured" in m for m in lines), lines
    assert any("at these sizes" in m and "dense" in m for m in lines if "prefers" not in m), lines
    torch.ops.scorch.region(text, [s, x, w])
    assert _stats()["measured"] == before + 2
