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
