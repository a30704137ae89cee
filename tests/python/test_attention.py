"""scorch::masked_attention, the C++ op (csrc/torch/attention.cpp): values against the dense formula, gradients
(gradcheck in float64) on the sparse and the dense path, rows with no stored position, batch dimensions, the
mask's cache, input errors, opcheck, and tracing (torch.compile, torch.export, TorchScript)."""

from __future__ import annotations

import math

import pytest
import torch

from scorch_backend import _C
from scorch_backend.custom_ops import attention as A

PATHS = ("sparse", "dense")
op = torch.ops.scorch.masked_attention


def dense_formula(q, k, v, mask, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(mask == 0, float("-inf")), -1) @ v


def make(batch, L=9, S=7, E=4, F=3, density=0.35, dtype=torch.float64, seed=0, empty_rows=(), grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, L, E, dtype=dtype, generator=g)
    k = torch.randn(*batch, S, E, dtype=dtype, generator=g)
    v = torch.randn(*batch, S, F, dtype=dtype, generator=g)
    mask = torch.rand(L, S, generator=g) < density
    mask[torch.arange(L), torch.arange(L) % S] = True  # every row keeps one position ...
    for r in empty_rows:
        mask[r] = False  # ... unless asked
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, mask


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_matches_the_dense_formula(path, batch, dtype, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make(batch, dtype=dtype)
    before = A.stats()[f"{path}_runs"]
    out = op(q, k, v, mask, 0.3)
    assert A.stats()[f"{path}_runs"] == before + 1
    assert out.shape == (*batch, 9, 3) and out.dtype == dtype and out.is_contiguous() and out._base is None
    tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out, dense_formula(q, k, v, mask, 0.3), **tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("batch", [(), (2,), (2, 2)])
def test_gradcheck(path, batch, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make(batch, L=6, S=5, grad=True, seed=1)
    before = A.stats()[f"{path}_backward"]
    assert torch.autograd.gradcheck(lambda q, k, v: op(q, k, v, mask, 0.7), (q, k, v))
    assert A.stats()[f"{path}_backward"] > before
    # Only some inputs asking for a gradient.
    k2 = k.detach()
    assert torch.autograd.gradcheck(lambda q, v: op(q, k2, v, mask, 0.7), (q, v))


def test_gradients_of_both_paths_agree(monkeypatch):
    grads = {}
    for path in PATHS:
        monkeypatch.setenv("SCORCH_DISPATCH", path)
        q, k, v, mask = make((2, 3), L=12, S=10, grad=True, seed=2)
        w = torch.randn(2, 3, 12, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        (op(q, k, v, mask, 0.5) * w).sum().backward()
        grads[path] = [t.grad for t in (q, k, v)]
    for a, b in zip(grads["sparse"], grads["dense"]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_empty_mask_rows_are_nan(path, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,), empty_rows=(0, 4))
    out = op(q, k, v, mask, 0.5)
    assert out[:, [0, 4]].isnan().all()
    keep = [r for r in range(9) if r not in (0, 4)]
    assert not out[:, keep].isnan().any()
    torch.testing.assert_close(out, dense_formula(q, k, v, mask, 0.5), equal_nan=True)


@pytest.mark.parametrize("path", PATHS)
def test_empty_mask_rows_gradients_are_eager_ones(path, monkeypatch):
    # As torch's: an empty row's probabilities are NaN, so dv = P^T g is NaN throughout its batch entry, while
    # the -inf fill's backward zeroes the row's score gradient, so dq and dk stay finite (and gradcheck holds
    # for them, the other rows' outputs only).
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,), L=6, S=5, empty_rows=(1,), grad=True, seed=3)
    keep = [0, 2, 3, 4, 5]
    assert torch.autograd.gradcheck(lambda q, k: op(q, k, v, mask, 0.4)[:, keep], (q, k))
    w = torch.randn(2, 6, 3, dtype=q.dtype)
    got = torch.autograd.grad((op(q, k, v, mask, 0.4) * w).sum(), (q, k, v))
    want = torch.autograd.grad((dense_formula(q, k, v, mask, 0.4) * w).sum(), (q, k, v))
    assert got[2].isnan().all() and not got[0].isnan().any() and not got[1].isnan().any()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_an_all_empty_mask_and_empty_tensors(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    q, k, v, mask = make((2,))
    assert op(q, k, v, torch.zeros_like(mask), 1.0).isnan().all()
    out = op(q[:, :0], k, v, mask[:0], 1.0)  # no query rows
    assert out.shape == (2, 0, 3)
    out = op(q, k, v[..., :0], mask, 1.0)  # no value columns
    assert out.shape == (2, 9, 0)


def test_float_mask_and_a_non_contiguous_input(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    q, k, v, mask = make((2, 3))
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    fmask = mask.double() * 2.5
    torch.testing.assert_close(op(qt, k, v, fmask, 0.5), dense_formula(q, k, v, mask, 0.5))


def test_the_mask_is_compressed_once_and_again_after_a_write(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    q, k, v, mask = make((2,), L=13, S=11, seed=7)
    op(q, k, v, mask, 0.5)
    before = _C.region_stats()["compressions"]
    for _ in range(3):
        op(q, k, v, mask, 0.5)
    assert _C.region_stats()["compressions"] == before
    mask[2, :] = False  # an in-place write: the version counter moves
    torch.testing.assert_close(op(q, k, v, mask, 0.5), dense_formula(q, k, v, mask, 0.5), equal_nan=True)
    assert _C.region_stats()["compressions"] == before + 1


def test_gradients_after_a_write_to_the_mask(monkeypatch):
    # The backward pass reads the mask's pattern transposed, built once per pattern and kept: a write to the
    # mask must reach it as it reaches the forward pass.
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    q, k, v, mask = make((2,), L=13, S=11, seed=8, grad=True)
    w = torch.randn(2, 13, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    for _ in range(2):
        for r in (3, 7):
            mask[r, (r + 1) % 11] = not mask[r, (r + 1) % 11]  # in place: the version counter moves
        got = torch.autograd.grad((op(q, k, v, mask, 0.5) * w).sum(), (q, k, v))
        want = torch.autograd.grad((dense_formula(q, k, v, mask, 0.5) * w).sum(), (q, k, v))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.3, -0.8])
@pytest.mark.parametrize("batch,L,S", [((3, 1), 301, 517), ((3,), 300, 516), ((1,), 256, 130)])
def test_many_rows_against_eager(batch, L, S, dtype, scale, monkeypatch):
    # Enough rows that both threads take a share of the row passes (softmax, its gradient, the transposed
    # pattern's gather); odd lengths, more key rows than query rows or fewer, a negative scale, some empty rows.
    # With an odd number of batch entries and even lengths, two threads cut each entry's query rows (and key
    # rows, in the backward) into halves run as entries of their own.
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    empty = (0, L // 2, L - 1)
    q, k, v, mask = make(batch, L=L, S=S, E=19, F=23, density=0.07, dtype=dtype, seed=10, empty_rows=empty,
                         grad=True)
    w = torch.randn(*batch, L, 23, dtype=dtype, generator=torch.Generator().manual_seed(11))
    out = op(q, k, v, mask, scale)
    want = dense_formula(q, k, v, mask, scale)
    tol = {} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    torch.testing.assert_close(out, want, equal_nan=True, **tol)
    # Gradients as torch's: dv NaN (the empty rows' NaN probabilities reach every row of it), dq and dk finite.
    got = torch.autograd.grad((out * w).sum(), (q, k, v), retain_graph=True)
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    assert got[2].isnan().all()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, equal_nan=True, **tol)
    # The other rows' gradients against the formula without the empty rows: dq and dk, the kernels' own work.
    keep = [r for r in range(L) if r not in empty]
    got = torch.autograd.grad((out[..., keep, :] * w[..., keep, :]).sum(), (q, k))
    kept = dense_formula(q[..., keep, :], k, v, mask[keep], scale)
    ref = torch.autograd.grad((kept * w[..., keep, :]).sum(), (q, k))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **tol)


def test_automatic_choice(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    q, k, v, mask = make((2,))
    assert A._use_dense(mask, q, k)  # a tiny problem: dense has less overhead
    q, k, v, mask = make((4, 4), L=128, S=128, E=32, F=32, density=0.01, dtype=torch.float32)
    assert not A._use_dense(mask, q, k)
    before = A.stats()["sparse_runs"]
    torch.testing.assert_close(op(q, k, v, mask, 0.2), dense_formula(q, k, v, mask, 0.2), rtol=1e-4, atol=1e-5)
    assert A.stats()["sparse_runs"] == before + 1
    with pytest.raises(ValueError, match="SCORCH_DISPATCH"):
        monkeypatch.setenv("SCORCH_DISPATCH", "fast")
        op(q, k, v, mask, 0.2)


@pytest.mark.parametrize("args,match", [
    (lambda q, k, v, m: (q[0, 0], k, v, m), "same rank >= 2, got 1, 3, 3"),
    (lambda q, k, v, m: (q, k[0], v, m), "same rank >= 2, got 3, 2, 3"),
    (lambda q, k, v, m: (q, k[:, :, :2], v, m), r"shapes q \(2, 9, 4\), k \(2, 7, 2\), v \(2, 7, 3\) do not agree"),
    (lambda q, k, v, m: (q, k, v[:, :3], m), "do not agree"),
    (lambda q, k, v, m: (q[:1], k, v, m), "do not agree"),
    (lambda q, k, v, m: (q, k, v, m[:3]), r"mask of shape \(3, 7\), expected \(9, 7\)"),
    (lambda q, k, v, m: (q, k, v, m[0]), r"mask of shape \(7,\), expected \(9, 7\)"),
    (lambda q, k, v, m: (q, k.float(), v, m), "same floating dtype"),
    (lambda q, k, v, m: (q.long(), k.long(), v.long(), m), "same floating dtype"),
])
@pytest.mark.parametrize("path", PATHS)
def test_bad_inputs_are_value_errors(args, match, path, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,))
    with pytest.raises(ValueError, match=match):
        op(*args(q, k, v, mask), 0.5)


def test_backward_op_checks_its_gradient():
    q, k, v, mask = make((2,))
    with pytest.raises(ValueError, match="the gradient has shape"):
        torch.ops.scorch.masked_attention_backward(q, k, v, mask, 0.5, torch.zeros(2, 9, 4, dtype=torch.float64))


def test_double_backward_is_a_clear_error():
    q, k, v, mask = make((2,), grad=True)
    out = op(q, k, v, mask, 0.5)
    (gq,) = torch.autograd.grad(out.sum(), q)  # the ordinary backward works
    assert gq.shape == q.shape
    out = op(q, k, v, mask, 0.5)
    with pytest.raises(ValueError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,), grad=True)
    torch.library.opcheck(op.default, (q, k, v, mask, 0.5))
    q, k, v, mask = make((2,))
    g = torch.randn(2, 9, 3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.scorch.masked_attention_backward.default, (q, k, v, mask, 0.5, g))


class Attn(torch.nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        return torch.ops.scorch.masked_attention(q, k, v, self.mask, 0.5) * 2


def test_compiles_exports_and_scripts(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    q, k, v, mask = make((2,), grad=True, seed=4)
    m = Attn(mask)
    want = m(q, k, v)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for t, w in zip((q, k, v), want_grads):
        torch.testing.assert_close(t.grad, w)
    torch._dynamo.reset()
    args = tuple(t.detach() for t in (q, k, v))
    ep = torch.export.export(m, args)
    assert "scorch.masked_attention" in str(ep.graph)
    torch.testing.assert_close(ep.module()(*args), want.detach())
    scripted = torch.jit.script(m)
    torch.testing.assert_close(scripted(*args), want.detach())


def test_kernel_specs_are_the_ones_the_op_runs(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    from scorch_backend.custom_ops import aot

    q, k, v, mask = make((2, 3), L=10, S=8, seed=6, grad=True)
    op(q, k, v, mask, 0.5).sum().backward()
    used = set(aot.used_kernel_specs())
    specs = A.kernel_specs(q.shape, k.shape, v.shape, q.dtype, training=True)
    # Six kernels, two distinct specs: dP is a sampled product like the scores; dq = dS k, dv = P^T g and
    # dk = dS^T q are products by rows like P v (the last two over the transposed pattern). Each spec is listed
    # once.
    assert len(specs) == 2 == len(set(specs)) and set(specs) <= used
    assert A.kernel_specs(q.shape, k.shape, v.shape, q.dtype, training=False) == specs[:2]
    assert math.prod(q.shape[:-2]) == 6


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward_and_gradients(path, dtype, monkeypatch):
    """float16 and bfloat16 operands (the softmax computed in float, written back): values and gradients against
    the dense formula run in float32 on the same rounded inputs."""
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,), L=33, S=29, E=8, F=5, dtype=dtype, seed=9, grad=True)
    before = A.stats()[f"{path}_runs"]
    out = op(q, k, v, mask, 0.4)
    assert A.stats()[f"{path}_runs"] == before + 1
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = dense_formula(q32, k32, v32, mask, 0.4)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.float16 else {"rtol": 6e-2, "atol": 6e-2}
    torch.testing.assert_close(out.float(), ref, **tol)
    for got, want in zip(grads, torch.autograd.grad(ref, (q32, k32, v32), g.float())):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["v", "q", "k", "grad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_value_spreads_as_in_the_dense_formula(path, where, value, monkeypatch):
    # Eager multiplies the exact zeros the mask gives the probabilities by every value of v (forward) and by
    # v, the output's gradient, q and k (backward): one NaN or inf there spreads to rows the mask hides it from.
    # The kernels skip those zeros, so such a call runs dense, whatever the dispatch (helper-59: a NaN in v at a
    # key hidden from all but one query made 1 NaN row where eager made 256).
    monkeypatch.setenv("SCORCH_DISPATCH", path)
    q, k, v, mask = make((2,), L=9, S=7, seed=4, grad=True)
    hidden = int((~mask).sum(0).argmax())  # the key most queries cannot see
    g = torch.randn(2, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        if where == "v":
            v[1, hidden, 0] = value
        elif where == "k":
            k[1, hidden, 0] = value
        elif where == "q":
            q[1, 0, 0] = value
        else:
            g[1, 0, 0] = value
    refs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = op(q, k, v, mask, 0.5)
    want = dense_formula(*refs, mask, 0.5)
    torch.testing.assert_close(out, want, equal_nan=True)
    out.backward(g)
    want.backward(g)
    for got, ref in zip((q, k, v), refs):
        torch.testing.assert_close(got.grad, ref.grad, equal_nan=True)
