"""A pattern factor on exactly the output's letters, dense enough against the other compressed operands (the
sampled gradient of a pruned layer's ReLU input: pattern 0.5, weight 0.1), is not co-iterated by the kernel: the
op runs the product and zeroes its result where the pattern is 0 (a "mask" operand, csrc/torch/region.cpp:
demoted_variant). A sparse pattern keeps the sampled kernel. A two-factor matrix product on the dense path is one
mm, in the requested order when the program asks for it."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_dense
from scorch_backend import _C


def _sampled(name, out_order=None):
    # dh(a, c) = g(a, b) W(b, c), kept where h(a, c) is nonzero: g compressed, W a cached weight, h the pattern
    d = {"operands": [["ab", "sparse", False, True, 0, False], ["bc", "sparse", True, True, 0, True],
                      ["ac", "pattern", False, False, 0, False]],
         "out": "ac", "coef": 1.0, "frozen": False, "name": name, "label": "mask test", "col_major": [1]}
    if out_order:
        d["out_order"] = out_order
    return json.dumps(d)


def _same_layout(a, b):
    """The same strides where they matter (a dimension of size 1 may have any)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _operands(m, k, n, pattern_density, seed, g_density=0.35):
    g = random_dense((m, k), g_density, seed=seed)
    w = random_dense((k, n), 0.1, seed=seed + 1)
    h = random_dense((m, n), pattern_density, seed=seed + 2)
    return g, w, h


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("shape", [(64, 512, 512), (1, 7, 5), (33, 65, 17)])
def test_dense_pattern_becomes_a_mask(monkeypatch, dispatch, shape):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    g, w, h = _operands(*shape, 0.5, seed=10)
    text = _sampled(f"mask{shape}{dispatch}")
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(text, [g, w, h])
    torch.testing.assert_close(out, (g @ w) * (h != 0), rtol=1e-4, atol=1e-4)
    if dispatch == "sparse":
        assert _C.region_stats()["demoted"] > before
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.scorch.region(text, [mode.from_tensor(t) for t in (g, w, h)])
    assert _same_layout(out, fake)


def test_mask_zeroes_what_the_product_puts_outside_it(monkeypatch):
    """Zeroed, not multiplied: an infinite product entry outside the pattern is 0, as the sampled kernel leaves
    it; inside the pattern it stays."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    g, w, h = _operands(16, 40, 24, 0.5, seed=20)
    g[3, :] = 0
    g[3, 5] = float("inf")
    w[5, :] = 1.0
    h[3, :] = 0
    h[3, 2] = 1.0
    out = torch.ops.scorch.region(_sampled("mask_inf"), [g, w, h])
    assert out[3, 2] == float("inf")
    assert torch.all(out[3, torch.arange(24) != 2] == 0)
    keep = torch.ones(16, dtype=torch.bool)
    keep[3] = False
    torch.testing.assert_close(out[keep], ((g @ w) * (h != 0))[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("pattern_density", [0.05, 0.5])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_value_under_an_output_pattern_is_eagers_select(monkeypatch, dispatch, pattern_density, value):
    # Eager: the dense product (inf times the weight's zeros is NaN), then a select on the pattern (0 outside).
    # The sampled kernel skipped those zeros and kept inside the pattern what eager makes NaN (helper-44).
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    g, w, h = _operands(64, 512, 512, pattern_density, seed=10)
    g[3, 7] = value
    out = torch.ops.scorch.region(_sampled(f"nonfinite{pattern_density}{dispatch}{value}"), [g, w, h])
    torch.testing.assert_close(out, torch.where(h != 0, g @ w, 0.0), equal_nan=True, rtol=1e-4, atol=1e-4)


def test_sparse_pattern_keeps_the_sampled_kernel(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    g, w, h = _operands(48, 64, 40, 0.02, seed=30, g_density=0.1)  # nothing else dense enough to demote
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(_sampled("mask_sparse_pattern"), [g, w, h])
    torch.testing.assert_close(out, (g @ w) * (h != 0), rtol=1e-4, atol=1e-4)
    assert _C.region_stats()["demoted"] == before


def test_mask_under_debug_logging(monkeypatch):
    """The variant's text (with its mask operand) reaches Python's log hook, which must read it."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    g, w, h = _operands(20, 30, 25, 0.5, seed=40)
    out = _C.region_run(_sampled("mask_debug"), [g, w, h], "")
    torch.testing.assert_close(out, (g @ w) * (h != 0), rtol=1e-4, atol=1e-4)


def _mask_program(mask_letters, grad=False, name="mask_text"):
    return json.dumps({"operands": [["ab", "dense", False, True, 0, False], ["bc", "sparse", False, True, 0, False],
                                    [mask_letters, "mask", False, grad, 0, False]],
                       "out": "ac", "coef": 2.0, "frozen": False, "name": name})


@pytest.mark.parametrize("force", ["", "dense", "sparse"])
def test_mask_operand_in_program_text(force):
    x = torch.randn(12, 20, generator=torch.Generator().manual_seed(50))
    w = random_dense((20, 9), 0.3, seed=51)
    m = random_dense((9, 12), 0.5, seed=52)  # letters "ca": the output's, the other way round
    out = _C.region_run(_mask_program("ca"), [x, w, m], force)
    torch.testing.assert_close(out, 2.0 * (x @ w) * (m.t() != 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("letters,grad", [("ab", False), ("a", False), ("ca", True)])
def test_bad_mask_is_a_value_error(letters, grad):
    x, w, m = torch.randn(4, 5), torch.randn(5, 6), torch.randn(6, 4)
    with pytest.raises(ValueError):
        _C.region_run(_mask_program(letters, grad, name=f"bad_mask_{letters}_{grad}"), [x, w, m], "")


def test_mask_program_has_no_gradient_program():
    with pytest.raises(ValueError):
        _C.region_gradient(_mask_program("ca"), 0)


@pytest.mark.parametrize("out_order", [None, "requested"])
def test_dense_matrix_product_path(out_order):
    """dW(b, c) = g(a, b) h(a, c) on the dense path (one mm): the values, and the layout the Meta kernel gives."""
    d = {"operands": [["ab", "sparse", False, True, 0, False], ["ac", "sparse", False, True, 0, False]],
         "out": "bc", "coef": 0.5, "frozen": False, "name": f"dense_mm_{out_order}", "col_major": [0, 1]}
    if out_order:
        d["out_order"] = out_order
    text = json.dumps(d)
    g = random_dense((24, 40), 0.4, seed=60)
    h = random_dense((24, 36), 0.5, seed=61)
    out = _C.region_run(text, [g, h], "dense")
    torch.testing.assert_close(out, 0.5 * g.t() @ h, rtol=1e-4, atol=1e-4)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.scorch.region(text, [mode.from_tensor(g), mode.from_tensor(h)])
    assert _same_layout(out, fake)
    if out_order == "requested":
        assert out.is_contiguous()
