"""SDDMM's 2-D tiles (csrc/lower/sampled_dot.cpp): long rows of S against a Q larger than half of L2 are visited
one block of rows by one column range of Q at a time. The sizes here take that path on any CPU whose L2 is at
most 4 MB (Q is 8 MB or more, rows hold far more entries than column ranges times the group); the short rows
mixed in, the rows with no entries and the widths that are not a multiple of the vector take the remainders.
Compared with the dense product, under the default target and x86-64-v3 when this CPU runs it."""

import pytest
import torch

import scorch_backend as sb

NATIVE = sb.target_info("native")
V3_OK = all(f in NATIVE["features"] for f in sb.target_info("x86-64-v3")["features"])


def long_rows(rows, cols, seed, dtype):
    """A CSR matrix whose rows hold 0, 1, 3 or several hundred entries (sorted columns, as sb.sparse gives)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.zeros(rows, cols, dtype=dtype)
    for i in range(rows):
        n = (0, 1, 3, 700, 900)[i % 5]
        cols_i = torch.randperm(cols, generator=g)[:n]
        dense[i, cols_i] = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return dense


@pytest.mark.parametrize("target", ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(
    not V3_OK, reason="this CPU does not run x86-64-v3"))])
@pytest.mark.parametrize("dtype,k", [(torch.float32, 128), (torch.float32, 100), (torch.float64, 128)])
def test_tiled_sddmm_matches_dense(target, dtype, k):
    cols = 16384 if dtype == torch.float32 else 8192  # Q: 8 MB (6.25 MB at k=100)
    rows = 23
    Sd = long_rows(rows, cols, seed=k, dtype=dtype)
    S = sb.sparse(Sd, "csr")
    g = torch.Generator().manual_seed(1)
    P = torch.randn(rows, k, generator=g, dtype=dtype)
    Q = torch.randn(cols, k, generator=g, dtype=dtype)
    with sb.using_target(target):
        out = sb.einsum("ij,ik,jk->ij", S, P, Q)
    assert torch.equal(out.level_buffers["crd1"], S.level_buffers["crd1"])
    ref = Sd.double() * (P.double() @ Q.double().t())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.to_dense().double(), ref, **tol)


def test_tiled_sddmm_one_thread_and_a_scale():
    """One thread (the whole matrix in one thread's tiles) and a constant factor applied with S's value."""
    Sd = long_rows(11, 16384, seed=3, dtype=torch.float32)
    S = sb.sparse(Sd, "csr")
    P, Q = torch.randn(11, 128), torch.randn(16384, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = sb.compute("C(i,j) = 3 * S(i,j) * P(i,k) * Q(j,k)", S=S, P=P, Q=Q)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.to_dense(), 3 * Sd * (P @ Q.t()), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows,cols,k", [(1, 1, 1), (7, 5, 3), (40, 33, 17), (23, 16384, 128)])
def test_sddmm_output_is_written_in_full(rows, cols, k):
    """The native SDDMM kernel stores every value of its output (the call does not zero it first): memory the
    output may reuse is filled with NaN right before each call, and empty first and last rows leave positions
    to the other rows only. A value the kernel skipped would read as NaN."""
    g = torch.Generator().manual_seed(rows + cols)
    Sd = torch.rand(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < 0.3)
    Sd[0] = 0
    Sd[-1] = 0
    if rows > 2:
        Sd[1, 0] = 1.0  # at least one stored entry
    S = sb.sparse(Sd, "csr")
    P = torch.randn(rows, k, generator=g)
    Q = torch.randn(cols, k, generator=g)
    ref = Sd.double() * (P.double() @ Q.double().t())
    for _ in range(3):
        poison = torch.full((max(1, S.nnz),), float("nan"))
        del poison
        out = sb.einsum("ij,ik,jk->ij", S, P, Q)
        assert not torch.isnan(out.stored_values).any()
        torch.testing.assert_close(out.to_dense().double(), ref, rtol=1e-4, atol=1e-4)
