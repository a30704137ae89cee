"""Autograd beyond one reverse pass: gradients of gradients (create_graph=True) through the eager ops whose
backward hands over a SparseTensor, and forward-mode AD, which Scorch does not derive and must refuse rather
than drop a tangent. Meta-device values are refused too (a kernel would return uninitialized memory)."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import scorch_backend as sb

D = torch.float64
DENSE = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, -1.5], [0.5, 0.0, 0.0, 4.0]], dtype=D)

OPS = {
    "times 2": lambda S, _: S * 2,
    "negated": lambda S, _: -S,
    "halved": lambda S, _: S / 2,
    "relu": lambda S, _: S.relu(),
    "abs": lambda S, _: S.abs(),
    "squared by *": lambda S, _: S * S,
    "squared by einsum": lambda S, _: sb.einsum("ij,ij->ij", S, S),
    "times another pattern": lambda S, O: S * O,
    "plus another pattern": lambda S, O: S + O * S,
    "matmul": lambda S, O: sb.einsum("ij,kj->ik", S, O),
}


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr"])
@pytest.mark.parametrize("op", list(OPS))
def test_gradients_of_gradients(fmt, op):
    # The first gradient was right but cut from its history: no grad_fn (a second grad raised), or, for S * S,
    # a silently wrong second derivative ([4, 16, 36] for [12, 48, 108]).
    A = sb.sparse(DENSE, fmt)
    other_dense = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, -1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 2.0]], dtype=D)
    other = sb.sparse(other_dense, fmt)
    v = A.stored_values.detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda vv: OPS[op](A.with_values(vv), other).to_dense(), (v,))


def test_second_derivative_of_a_square_is_exact():
    A = sb.sparse(DENSE, "csr")
    v = A.stored_values.detach().clone().requires_grad_()
    out = (A.with_values(v) * A.with_values(v)).to_dense()
    (g,) = torch.autograd.grad(out.pow(2).sum(), v, create_graph=True)  # 4 v^3
    (h,) = torch.autograd.grad(g.sum(), v)
    torch.testing.assert_close(h, 12 * v.detach() ** 2)


def _dual_cases(A, x):
    return {"sb.einsum": lambda xx: sb.einsum("ij,j->i", A, xx), "A @ x": lambda xx: A @ xx,
            "values": lambda xx: (A.with_values(xx[: A.nnz] * 1.0) * 2).to_dense().sum(1),
            "sb.sparse of a dual": lambda xx: sb.sparse(xx.reshape(1, -1), "csr").to_dense().reshape(-1)}


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("case", ["sb.einsum", "A @ x", "values", "sb.sparse of a dual"])
@pytest.mark.parametrize("api", ["jvp", "dual"])
def test_forward_mode_ad_is_refused_or_right(monkeypatch, dispatch, case, api):
    # The kernel's Autograd kernel ran below autograd for dual inputs (no requires_grad): a zero tangent.
    # Under the automatic dispatch a tiny product may run as dense ATen, whose tangent is right.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    big = torch.zeros(400, 400, dtype=D)
    big[torch.arange(400), (torch.arange(400) * 7) % 400] = torch.arange(1.0, 401.0, dtype=D)
    A, x, t = sb.sparse(big, "csr"), torch.randn(400, dtype=D), torch.randn(400, dtype=D)
    f = _dual_cases(A, x)[case]
    with torch.no_grad():
        want = torch.autograd.functional.jvp(f, x, t)[1] if case != "sb.sparse of a dual" else t
    try:
        if api == "jvp":
            got = torch.func.jvp(f, (x,), (t,))[1]
        else:
            with fwAD.dual_level():
                got = fwAD.unpack_dual(f(fwAD.make_dual(x, t))).tangent
    except NotImplementedError as e:
        assert "forward-mode AD" in str(e)
        return
    assert dispatch == "auto" and case in ("sb.einsum", "A @ x")  # only dense ATen may answer
    torch.testing.assert_close(got, want)


def test_meta_values_are_refused():
    A = sb.sparse(DENSE, "csr")
    with pytest.raises(ValueError, match="meta"):
        A.with_values(torch.empty(A.nnz, dtype=D, device="meta"))
