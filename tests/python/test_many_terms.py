"""Sums of many sparse operands: code linear in the number of terms, results equal to dense torch.

The merge lattice of a union of n sparse iterators has 2^n points; past a few of them the lowering merges the
iterators in one loop (csrc/lower/README.md), so 64 terms compile into a kernel a few times the size of 8.
"""

import pytest
import torch

import scorch_backend as sb
from scorch_backend import _C


def sum_spec(n: int, fmt: str = "csr") -> str:
    rhs = " + ".join(f"t{k}(i0,i1)" for k in range(n))
    return f"out(i0,i1) = {rhs}; " + " ".join(f"t{k}={fmt};" for k in range(n)) + f" out={fmt}; f32; i32"


def random_sparse(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)


def test_source_grows_linearly():
    sizes = {n: len(_C.kernel_source(sum_spec(n))) for n in (4, 8, 16, 32, 64)}
    # Linear: equal steps in n add about equal amounts of code (an exponential lattice would double it per term).
    assert sizes[64] < 8 * sizes[8], sizes
    step_small, step_big = sizes[16] - sizes[8], sizes[64] - sizes[32]
    assert step_big < 5 * step_small, sizes
    for fmt in ("coo", "dcsr"):
        a, b = len(_C.kernel_source(sum_spec(8, fmt))), len(_C.kernel_source(sum_spec(64, fmt)))
        assert b < 8 * a, (fmt, a, b)


def test_sum_of_64_csr_operands():
    n = 64
    dense = [random_sparse((37, 53), 0.05, seed=k) for k in range(n)]
    names = {f"A{k}": sb.sparse(d, "csr") for k, d in enumerate(dense)}
    y = sb.compute("y(i,j) = " + " + ".join(f"{a}(i,j)" for a in names), **names)
    assert isinstance(y, sb.SparseTensor)
    torch.testing.assert_close(y.to_dense(), sum(dense), rtol=1e-5, atol=1e-5)
    # Dense output too.
    y = sb.compute("y(i,j) = " + " + ".join(f"{a}(i,j)" for a in names), out_format="dense", **names)
    yd = y.to_dense() if isinstance(y, sb.SparseTensor) else y
    torch.testing.assert_close(yd, sum(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["coo", "dcsr", "csc"])
def test_sum_of_16_operands_in_other_formats(fmt):
    n = 16
    dense = [random_sparse((23, 31), 0.1, seed=100 + k) for k in range(n)]
    names = {f"A{k}": sb.sparse(d, fmt) for k, d in enumerate(dense)}
    y = sb.compute("y(i,j) = " + " + ".join(f"{a}(i,j)" for a in names), **names)
    torch.testing.assert_close(y.to_dense(), sum(dense), rtol=1e-5, atol=1e-5)


def test_mixed_formats_signs_and_scalars():
    fmts = ["csr", "coo", "dcsr", "csr", "coo", "dcsr", "csc", "csr", "csr", "coo"]
    dense = [random_sparse((19, 27), 0.15, seed=200 + k) for k in range(len(fmts))]
    names = {f"A{k}": sb.sparse(d, f) for k, (d, f) in enumerate(zip(dense, fmts))}
    terms, ref = [], torch.zeros(19, 27)
    for k, a in enumerate(names):
        c = float(k % 3 + 1)
        sign = "-" if k % 2 else "+"
        terms.append(f"{sign} {c} * {a}(i,j)" if k else f"{c} * {a}(i,j)")
        ref = ref + (-c if k % 2 and k else c) * dense[k]
    y = sb.compute("y(i,j) = " + " ".join(terms), **names)
    torch.testing.assert_close(y.to_dense(), ref, rtol=1e-5, atol=1e-5)
    y = sb.compute("y(i,j) = -(" + " + ".join(f"{a}(i,j)" for a in names) + ")", **names)
    torch.testing.assert_close(y.to_dense(), -sum(dense), rtol=1e-5, atol=1e-5)


def test_sum_of_sparse_products():
    # Elementwise products of pairs (each an intersection) summed (a union of 12 pairs: 24 iterators).
    n = 12
    A = [random_sparse((21, 33), 0.3, seed=300 + k) for k in range(n)]
    B = [random_sparse((21, 33), 0.3, seed=400 + k) for k in range(n)]
    ops = {}
    for k in range(n):
        ops[f"A{k}"] = sb.sparse(A[k], "csr")
        ops[f"B{k}"] = sb.sparse(B[k], "csr" if k % 2 else "dcsr")
    y = sb.compute("y(i,j) = " + " + ".join(f"A{k}(i,j) * B{k}(i,j)" for k in range(n)), **ops)
    torch.testing.assert_close(y.to_dense(), sum(a * b for a, b in zip(A, B)), rtol=1e-5, atol=1e-5)
    # A product of sums.
    y = sb.compute("y(i,j) = (A0(i,j) + A1(i,j) + A2(i,j)) * (B0(i,j) + B1(i,j) + B2(i,j))", **ops)
    torch.testing.assert_close(y.to_dense(), (A[0] + A[1] + A[2]) * (B[0] + B[1] + B[2]), rtol=1e-5, atol=1e-5)


def test_sparse_and_dense_terms():
    n = 10
    dense = [random_sparse((17, 29), 0.1, seed=500 + k) for k in range(n)]
    names = {f"A{k}": sb.sparse(d, "csr") for k, d in enumerate(dense)}
    D = torch.randn(17, 29)
    x = torch.randn(29)
    expr = "y(i,j) = " + " + ".join(f"{a}(i,j)" for a in names) + " + D(i,j) + 2 * x(j)"
    y = sb.compute(expr, D=D, x=x, **names)
    yd = y.to_dense() if isinstance(y, sb.SparseTensor) else y
    torch.testing.assert_close(yd, sum(dense) + D + 2 * x, rtol=1e-5, atol=1e-5)


def test_absent_entries_are_never_multiplied():
    # inf in a dense factor where the sparse factor stores nothing: that term contributes 0 (torch.sparse's
    # contract), also inside a linear merge.
    n = 8
    dense = [random_sparse((9, 11), 0.3, seed=600 + k) for k in range(n)]
    dense[0][2, 3] = 0.0
    X = torch.randn(9, 11)
    X[2, 3] = float("inf")
    names = {f"A{k}": sb.sparse(d, "csr") for k, d in enumerate(dense)}
    expr = "y(i,j) = A0(i,j) * X(i,j) + " + " + ".join(f"A{k}(i,j)" for k in range(1, n))
    y = sb.compute(expr, X=X, **names)
    yd = y.to_dense() if isinstance(y, sb.SparseTensor) else y
    ref = torch.where(dense[0] != 0, dense[0] * X, torch.zeros(())) + sum(dense[1:])
    assert torch.isfinite(yd).all()
    torch.testing.assert_close(yd, ref, rtol=1e-5, atol=1e-5)


def test_sum_of_many_vectors():
    n = 40
    dense = [random_sparse((200,), 0.05, seed=700 + k) for k in range(n)]
    names = {f"v{k}": sb.sparse(d, ["compressed"]) for k, d in enumerate(dense)}
    y = sb.compute("y(i) = " + " + ".join(f"{a}(i)" for a in names), **names)
    torch.testing.assert_close(y.to_dense(), sum(dense), rtol=1e-5, atol=1e-5)


# --- products of many factors: an index used by one factor is summed over it first -------------------------------

def steps_of(equation: str, *shapes) -> list:
    return _C.split_compute(equation, [], [list(s) for s in shapes], True)


def test_a_factor_s_own_index_is_summed_over_it_first():
    # "a,b,c,d,e,f->" as one loop nest: |a| * ... * |f| multiply-adds (10^12 for six vectors of 1000 with a tenth
    # stored, a call that never returned, helper-53); factor by factor, six sums and a product.
    assert len(steps_of("a,b,c,d,e,f->", *[(1000,)] * 6)) == 6  # (the last sum goes with the product)
    assert len(steps_of("ij,kl->il", (5, 6), (7, 8))) == 3
    assert len(steps_of("ij,ik->i", (5, 6), (5, 8))) == 2
    # Nothing else varies: one loop nest, as before.
    for eq, shapes in [("ij,j->i", [(5, 6), (6,)]), ("ij,jk->ik", [(5, 6), (6, 7)]), ("ij,j->", [(5, 6), (6,)]),
                       ("ij,ij->", [(5, 6), (5, 6)]), ("ij->i", [(5, 6)]), ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 6)])]:
        assert len(steps_of(eq, *shapes)) == 1, eq
    # A temporary over 2^30 elements (a hypersparse operand's dense column sums) is not made.
    steps = steps_of("ij,kl->jl", (2**30, 2**30), (3, 3))
    assert [ops for _, ops in steps] == [[1], [0, 2]], steps  # (only the small factor summed first)
    assert len(_C.split_compute("s = a(i) * b(j) * c(k)", ["a", "b", "c"], [[100], [100], [100]])) == 3


@pytest.mark.parametrize("scorch_dispatch", ["sparse", "auto"], indirect=True)
@pytest.mark.parametrize("fmt", ["coo", "strided"])
def test_products_of_many_factors_match_torch(scorch_dispatch, fmt):
    factors = [random_sparse((1000,), 0.1, seed) for seed in range(6)]
    ops = [sb.sparse(f, fmt) if fmt != "strided" else f for f in factors]
    got = sb.einsum("a,b,c,d,e,f->", *ops)
    torch.testing.assert_close(got, torch.einsum("a,b,c,d,e,f->", *factors), rtol=1e-4, atol=0)
    A, B = random_sparse((40, 30), 0.2, 7), random_sparse((20, 50), 0.2, 8)
    for eq, mats in [("ij,kl->il", (A, B)), ("ij,kl->jk", (A, B)), ("ij,ik->i", (A, random_sparse((40, 9), 0.3, 9)))]:
        got = sb.einsum(eq, *[sb.sparse(m, "csr") for m in mats])  # (stored as the plan says: csr for 2-D)
        got = got.to_dense() if isinstance(got, sb.SparseTensor) else got
        torch.testing.assert_close(got, torch.einsum(eq, *mats), rtol=1e-5, atol=1e-5)
        got = sb.einsum(eq, *[sb.sparse(m, "csr") for m in mats], out_format="coo")
        torch.testing.assert_close(got.to_dense(), torch.einsum(eq, *mats), rtol=1e-5, atol=1e-5)
    vecs = {n: random_sparse((100,), 0.5, k) for k, n in enumerate("pqrstu")}
    got = sb.compute("s = " + " * ".join(f"{n}(i{k})" for k, n in enumerate(vecs)), **vecs)
    want = torch.stack([v.sum() for v in vecs.values()]).prod()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_gradients_through_the_steps():
    A = random_sparse((8, 6), 0.5, 1).double()
    B = random_sparse((5, 7), 0.5, 2).double()
    sa, sbb = sb.sparse(A, "csr"), sb.sparse(B, "csr")
    sa.requires_grad_(True)
    x = torch.randn(7, dtype=torch.float64, requires_grad=True)
    out = sb.einsum("ij,kl,l->i", sa, sbb, x)
    ref_x = x.detach().clone().requires_grad_(True)
    Ad = A.clone().requires_grad_(True)
    ref = torch.einsum("ij,kl,l->i", Ad, B, ref_x)
    torch.testing.assert_close(out, ref)
    w = torch.randn(8, dtype=torch.float64)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(sa.grad.to_dense(), Ad.grad * (A != 0))
