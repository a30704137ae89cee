"""A sequence chain's dense linear step (linear -> bias -> ReLU -> linear, issue 13) through the grouped product
kernel (csrc/torch/chain_program.cpp: linear_step; grouped_kernel.h: linear_product_kernel): the bias and the ReLU
in the kernel's last pass, the weight stored once in the kernel's panels and kept by version and fingerprint.
Checked against eager at odd sizes (one row, three, more than a register tile of rows; hidden sizes that are not a
whole vector), float32 and float64, on every target this CPU runs (a target whose tile is too small runs ATen's
addmm), a weight changed in place, the fallback with no compiler, and the compiled MLP."""

from __future__ import annotations

import pytest
import torch

import scorch_backend as sb
from scorch_backend.custom_ops import chain as Ch
from scorch_backend.custom_ops import region as R
from scorch_backend.tools import zoo
from test_grouped_kernel import _run, _targets, _tile

P, O = R.Program, R.Operand


def _program(cached=True, then=("aten.relu",)):
    """fc2(relu(fc1(x))): step 0 a dense linear with its bias, step 1 reads its result compressed. The weights
    are parameters (cached and `weight`, as the backend marks them; a cached data input is not taken by the
    linear step, test_backend_edge_cases)."""
    s0 = Ch.ChainStep(P((O("ac"), O("bc", cached=cached, weight=cached), O("b", "add")), "ab").text(), (0, 1, 2),
                      then)
    s1 = Ch.ChainStep(P((O("ab", "sparse"), O("cb", cached=cached, weight=cached), O("c", "add")), "ac").text(),
                      (-1, 3, 4))
    return Ch.ChainProgram((s0, s1), "s", kind="sequence").text()


def _mlp(batch, d_in, hidden, d_out, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, dtype=dtype, generator=g)
    w1 = torch.randn(hidden, d_in, dtype=dtype, generator=g)
    b1 = torch.randn(hidden, dtype=dtype, generator=g) - 2.0  # most of the ReLU output zero
    w2 = torch.randn(d_out, hidden, dtype=dtype, generator=g)
    b2 = torch.randn(d_out, dtype=dtype, generator=g)
    return [x, w1, b1, w2, b2]


def _eager(ops, then=("aten.relu",)):
    x, w1, b1, w2, b2 = ops
    h = x @ w1.t() + b1
    for f in then:
        h = Ch.CHAIN_ELEMENTWISE[f](h)
    return h @ w2.t() + b2


def _taken(target, dtype):
    rows, vectors, lanes = _tile(target)
    return rows * vectors * lanes * 4 // dtype.itemsize >= 64


# (batch, d_in, hidden, d_out); 300 inputs: the kernel's K runs in several blocks (the bias enters in the first,
# the ReLU after the last)
SIZES = [(1, 7, 37, 5), (3, 16, 100, 9), (257, 33, 70, 12), (20, 64, 256, 16), (50, 300, 40, 7)]


@pytest.mark.parametrize("target", _targets())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_linear_step_equals_eager(target, dtype, size):
    ops = _mlp(*size, dtype)
    ref = _eager(ops)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    with sb.using_target(target):
        for threads in (1, 2, 4):  # 4: more threads than column panels, the rows cut into parts too
            y, calls = _run(_program(), ops, threads)
            assert calls == (1 if _taken(target, dtype) else 0)
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("then", [("aten.relu",), ("aten.tanh",), ("aten.neg", "aten.relu"), ()])
def test_linear_step_other_elementwise_ops_after_it(then):
    """Only a ReLU right after the product goes into the kernel's last pass; other ops run on its result."""
    ops = _mlp(9, 12, 40, 6, torch.float64, seed=3)
    y, calls = _run(_program(then=then), ops, 2)
    assert calls == (1 if _taken(None, torch.float64) else 0)
    torch.testing.assert_close(y, _eager(ops, then), rtol=1e-10, atol=1e-10)


def test_linear_step_not_taken_for_uncached_weights_and_gradients_right():
    """A weight that is not a parameter (no kept copy) runs the region op (ATen's addmm). With gradients wanted the
    op's forward still runs below autograd (the kernel may take it) and the gradient runs the steps again through
    the region op recording them: the gradients are eager's."""
    ops = _mlp(8, 12, 40, 6, torch.float64, seed=4)
    y, calls = _run(_program(cached=False), ops, 2)
    assert calls == 0
    torch.testing.assert_close(y, _eager(ops), rtol=1e-10, atol=1e-10)
    args = [t.clone().requires_grad_() for t in ops]
    torch.ops.scorch.chain(_program(), args).sum().backward()
    ref_args = [t.clone().requires_grad_() for t in ops]
    _eager(ref_args).sum().backward()
    for a, b in zip(args, ref_args):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-8)


def test_linear_step_sees_a_weight_changed_in_place():
    """The kept panel copy of the weight follows the weight: after an in-place change (version counter) and after
    a write that leaves the version alone (fingerprint), the result is the new weight's."""
    ops = _mlp(16, 20, 48, 8, torch.float32, seed=5)
    text = _program()
    torch.testing.assert_close(_run(text, ops, 2)[0], _eager(ops), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ops[1].mul_(-1.5)
    torch.testing.assert_close(_run(text, ops, 2)[0], _eager(ops), rtol=1e-4, atol=1e-4)
    ops[1].data.copy_(torch.randn(ops[1].shape, generator=torch.Generator().manual_seed(6)))  # via .data
    torch.testing.assert_close(_run(text, ops, 2)[0], _eager(ops), rtol=1e-4, atol=1e-4)


def test_clear_cache_drops_the_kept_panels():
    """R.clear_cache() also lets go of the weights' copies kept in the kernel's panels, and the next call stores
    the weight again with the same result. The cache holds the weight itself only weakly (a dropped model's
    weights are freed: test_backend_edge_cases.py), so its storage's use count does not move."""
    from scorch_backend import _C

    ops = _mlp(16, 20, 48, 8, torch.float32, seed=7)
    text = _program()
    uses = lambda t: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731
    R.clear_cache()
    before = uses(ops[1])
    first = _run(text, ops, 2)[0]
    if not _taken(_targets()[0], torch.float32):
        pytest.skip("the default target's tile is too small for the kernel")
    assert _C.region_cache_sizes()["forms"] > 0  # the panels (and the other layouts) kept
    assert uses(ops[1]) == before
    R.clear_cache()
    assert _C.region_cache_sizes()["forms"] == 0
    torch.testing.assert_close(_run(text, ops, 2)[0], first)


def test_linear_step_with_inference_mode_weights():
    """A weight made under torch.inference_mode has no version counter: no copy is kept, ATen runs it."""
    with torch.inference_mode():
        ops = _mlp(10, 12, 40, 6, torch.float32, seed=7)
        y, calls = _run(_program(), ops, 2)
        assert calls == 0
        torch.testing.assert_close(y, _eager(ops), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("env", [{"SCORCH_JIT": "0"}, {"CXX": "/nonexistent/c++", "SCORCH_JIT": "1"}])
def test_linear_step_without_the_kernel(tmp_path, env):
    """No kernel to be had (the JIT off and no bundle, or no compiler): the step runs ATen's addmm, right. (The
    second step runs dense too: its sparse kernel would need the JIT as well.)"""
    import os
    import subprocess
    import sys

    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_sequence_kernel import _program, _mlp, _eager, _run
ops = _mlp(30, 16, 70, 8, torch.float32)
y, calls = _run(_program(), ops, 2)
torch.testing.assert_close(y, _eager(ops), rtol=1e-4, atol=1e-4)
print("calls", calls)
"""
    env = {**env, "SCORCH_CACHE_DIR": str(tmp_path / "cache"), "SCORCH_DISPATCH": "dense"}
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "calls 0" in r.stdout


@pytest.mark.parametrize("batch,dispatch", [(1, "sparse"), (3, "sparse"), (257, "sparse"), (256, "auto")])
def test_compiled_relu_mlp_takes_the_kernel_by_default(batch, dispatch, monkeypatch):
    """The compiled MLP in inference: one chain call whose first step is the kernel (sequences are on by default),
    right. The small model (24 -> 100 -> 10) is left dense by the cost model (measured at compile time: its
    products take microseconds), so the sparse dispatch is forced there; at batch 1 fc2's region reads the
    activation as a vector (its row letter squeezed), which no sequence takes: fc1 stays the fallback's linear
    (the op-level tests run the kernel at one row). Under the automatic dispatch the benchmark's shape
    (512 -> 2048 -> 512, 90% zeros), where fc2's sparse kernel is about 3x its dense product."""
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    dims = dict(d_in=512, hidden=2048, d_out=512) if dispatch == "auto" else dict(d_in=24, hidden=100, d_out=10)
    case = zoo.relu_mlp_sparse(batch=batch, **dims)
    model = case.model.eval()
    x = case.inputs[0]
    torch._dynamo.reset()
    f = torch.compile(model, backend="scorch")
    with torch.no_grad():
        want = model(x)
        f(x)
        with torch.profiler.profile() as prof:
            got = f(x)
    names = [e.name for e in prof.events()]
    sequence = batch > 1
    assert names.count("scorch::chain") == (1 if sequence else 0)
    assert names.count("scorch::grouped_product") == (1 if sequence and _taken(None, torch.float32) else 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", ["bias_0d", "x_3d", "w_1d"])
def test_linear_step_bad_shapes_get_the_region_ops_message(bad):
    """A direct call with operands of the wrong rank is left by the kernel path to the region op, which raises a
    clear error about the dimensions (not an IndexError from inside the kernel path)."""
    ops = _mlp(8, 12, 20, 5, torch.float32, seed=8)
    if bad == "bias_0d":
        ops[2] = torch.tensor(0.5)
    elif bad == "x_3d":
        ops[0] = ops[0].unsqueeze(0)
    else:
        ops[1] = ops[1][0]
    with pytest.raises((RuntimeError, ValueError), match="the program gives it|does not match the number of dimensions"):
        _run(_program(), ops, 2)
