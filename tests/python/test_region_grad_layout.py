"""A parameter's gradient program hands its result back contiguous in the parameter's layout (out_order
"requested", csrc/torch/region.cpp: row_major), so autograd's accumulation keeps it instead of copying it; the
transposed copy is blocked (csrc/torch/region_compress.cpp) and must be exact at every shape, edges included.
Other operands' gradients keep the storage order; the Meta kernel agrees with the run in both cases."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_dense
from scorch_backend import _C


def _linear(name, x_kind="sparse", w_cached=True):
    return json.dumps({"operands": [["ac", x_kind, False, True, 0, False], ["bc", "dense", w_cached, True, 0, False]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": name, "label": "layout test"})


def _fake_of(text, operands):
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        return torch.ops.scorch.region(text, [mode.from_tensor(t) for t in operands])


def test_every_gradient_program_asks_for_the_requested_order():
    # A parameter's gradient for autograd's accumulation; an activation's too since torch 2.13's Inductor
    # miscompiled a backward fed with the storage order (test_backend_training's embedding gradient).
    text = _linear("layout_flags")
    gw, _, produced = _C.region_gradient(text, 1)  # the weight: cached
    gx, _, _ = _C.region_gradient(text, 0)  # the activation: not a parameter
    assert json.loads(gw)["out_order"] == "requested" and produced == "bc"
    assert json.loads(gx)["out_order"] == "requested"
    assert json.loads(_C.region_gradient(_linear("layout_flags2", w_cached=False), 1)[0])["out_order"] == "requested"


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("shape", [(256, 512, 96), (1, 1, 1), (7, 9, 13), (65, 130, 67), (8, 64, 72)])
def test_weight_gradient_is_contiguous_and_exact(monkeypatch, dispatch, shape):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    m, k, n = shape
    x = random_dense((m, k), 0.1, seed=1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    g = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    text = _linear(f"layout{m}x{k}x{n}{dispatch}")
    gtext, ops, _ = _C.region_gradient(text, 1)
    args = [g if j < 0 else [x, w][j] for j in ops]
    out = torch.ops.scorch.region(gtext, args)
    assert out.is_contiguous() and out.shape == w.shape
    assert out.stride() == _fake_of(gtext, args).stride()
    torch.testing.assert_close(out, g.t() @ x, rtol=1e-4, atol=1e-4)
    # the same program with the storage order: a transposed view, the same values (the same path when forced;
    # the automatic choice may time the two programs apart and take the dense path for one)
    stored = torch.ops.scorch.region(gtext.replace(',"out_order":"requested"', ""), args)
    assert stored.stride() == _fake_of(gtext.replace(',"out_order":"requested"', ""), args).stride()
    exact = dispatch == "sparse"
    torch.testing.assert_close(out, stored, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulated_gradient_keeps_the_parameter_layout(monkeypatch, dtype):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = random_dense((48, 80), 0.1, seed=4).to(dtype)
    w = torch.nn.Parameter(torch.randn(40, 80, dtype=dtype, generator=torch.Generator().manual_seed(5)))
    out = torch.ops.scorch.region(_linear(f"layout_acc{dtype}"), [x, w])
    g = torch.randn_like(out)
    out.backward(g)
    assert w.grad.is_contiguous()
    torch.testing.assert_close(w.grad, g.t() @ x, rtol=1e-6 if dtype == torch.float64 else 1e-4, atol=1e-4)


def test_out_order_is_checked():
    bad = json.loads(_linear("layout_bad"))
    bad["out_order"] = "sideways"
    with pytest.raises(ValueError, match="out_order"):
        torch.ops.scorch.region(json.dumps(bad), [torch.ones(2, 3), torch.ones(4, 3)])


@pytest.mark.parametrize("density", [0.0, 0.02, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_column_order_operand_with_empty_rows_and_columns(monkeypatch, density, dtype):
    """The weight gradient's activation is compressed by columns straight off the row-major tensor
    (region_compress.cpp: compress_columns): empty columns, empty rows, all zeros and all nonzeros."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = random_dense((70, 45), density, seed=6).to(dtype) if density < 1 else torch.randn(70, 45, dtype=dtype)
    x[:, 3:9] = 0
    x[10:20] = 0
    w = torch.randn(33, 45, dtype=dtype, generator=torch.Generator().manual_seed(7))
    g = torch.randn(70, 33, dtype=dtype, generator=torch.Generator().manual_seed(8))
    gtext, ops, _ = _C.region_gradient(_linear(f"layout_cols{density}{dtype}"), 1)
    assert json.loads(gtext)["col_major"] == [1]
    out = torch.ops.scorch.region(gtext, [g if j < 0 else [x, w][j] for j in ops])
    torch.testing.assert_close(out, g.t() @ x, rtol=1e-6 if dtype == torch.float64 else 1e-4, atol=1e-4)
