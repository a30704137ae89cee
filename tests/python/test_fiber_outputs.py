"""Outputs that share a sparse factor's leading levels and are dense below them (OutputMode::fibers).

TTM's Y(i,j,r) = sum_k X(i,j,k) U(k,r) on a CSF X has a value only under the (i, j) fibers X stores: the planner
stores Y with X's first levels (their index buffers copied) and a dense block of R values under each of their
positions, written in place by the kernel (no dense I x J x R result). Each case checks the format the planner
chose, that the shared buffers equal X's, and the values against dense torch, for odd sizes, widths that are not
a multiple of the vector width, empty tensors, fibers without entries below them, output orders other than the
operand's, a summed last level (TTV, no dense level), float32/float64, int32/int64 indices, under
SCORCH_DISPATCH=sparse and the default automatic dispatch; gradients; corrupted index buffers.
"""

import pytest
import torch

import scorch_backend as sb

DISPATCH_MODES = ("sparse", "auto")


def random_tensor3(shape, nnz, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = shape[0] * shape[1] * shape[2]
    lin = torch.unique(torch.randint(0, max(total, 1), (nnz,), generator=g)) if total and nnz else torch.zeros(0, dtype=torch.long)
    idx = torch.stack([lin // (shape[1] * shape[2]), (lin // shape[2]) % shape[1], lin % shape[2]]) if lin.numel() \
        else torch.zeros(3, 0, dtype=torch.long)
    vals = (torch.rand(lin.numel(), generator=g, dtype=torch.float64) + 0.5).to(dtype)
    dense = torch.zeros(shape, dtype=dtype)
    if lin.numel():
        dense[idx[0], idx[1], idx[2]] = vals
    return idx, vals, dense


def fibers_of(dense3):
    """The (i, j) pairs of a dense 3-D tensor that have an entry, in row-major order."""
    return (dense3 != 0).any(dim=2).nonzero()


def check_fibers(Y, ref, X, shared_buffers):
    """Y holds ref's values under X's fibers, with X's first buffers."""
    if not isinstance(Y, sb.SparseTensor):  # the automatic dispatch may run dense
        torch.testing.assert_close(Y, ref, rtol=1e-5, atol=1e-5)
        return
    for name in shared_buffers:
        assert torch.equal(Y.level_buffers[name], X.level_buffers[name]), name
    torch.testing.assert_close(Y.to_dense(), ref, rtol=1e-5, atol=1e-5)


SHAPES = [(7, 9, 11), (1, 1, 1), (13, 5, 40), (30, 30, 30)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("R", [1, 5, 16, 37, 130])
def test_ttm_csf(shape, R, scorch_dispatch):
    idx, vals, dense = random_tensor3(shape, max(1, shape[0] * shape[1] // 4), seed=R)
    X = sb.from_coordinates(idx, vals, shape, "csf")
    U = torch.randn(shape[2], R, generator=torch.Generator().manual_seed(1))
    ref = torch.einsum("ijk,kr->ijr", dense, U)
    Y = sb.einsum("ijk,kr->ijr", X, U)
    if scorch_dispatch == "sparse" and 2 * vals.numel() <= shape[0] * shape[1]:
        assert isinstance(Y, sb.SparseTensor)
        assert Y.format.canonical == "compressed(0),compressed(1),dense(2)", Y.format
        assert Y.nnz == fibers_of(dense).shape[0] * R
    check_fibers(Y, ref, X, ["pos0", "crd0", "pos1", "crd1"])


def test_plan_reason():
    idx, vals, _ = random_tensor3((20, 20, 20), 50)
    X = sb.from_coordinates(idx, vals, (20, 20, 20), "csf")
    p = sb.plan_einsum("ijk,kr->ijr", X, torch.randn(20, 8))
    assert p["out_format"] == "compressed(0),compressed(1),dense(2)"
    assert any("leading levels are those of the sparse factor" in r for r in p["reasons"]), p["reasons"]
    # A factor with as many values as fibers could be there: dense, as SpMM's rows.
    idx, vals, _ = random_tensor3((4, 4, 20), 200)
    X = sb.from_coordinates(idx, vals, (4, 4, 20), "csf")
    assert sb.plan_einsum("ijk,kr->ijr", X, torch.randn(20, 8))["out_format"] == "strided"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dtypes(dtype, index_dtype, scorch_dispatch):
    shape = (11, 12, 13)
    idx, vals, dense = random_tensor3(shape, 30, dtype=dtype)
    X = sb.from_coordinates(idx, vals, shape, "csf", index_dtype=index_dtype)
    U = torch.randn(13, 19, dtype=dtype)
    Y = sb.einsum("ijk,kr->ijr", X, U)
    assert Y.dtype == dtype
    if scorch_dispatch == "sparse":  # (a dense run converted by the caller takes its own index type)
        assert Y.index_dtype == index_dtype
    check_fibers(Y, torch.einsum("ijk,kr->ijr", dense, U), X, ["pos0", "crd0", "pos1", "crd1"])


def ttm_case(shape, nnz, fmt, equation, R):
    """X (stored as `fmt`), its dense copy, U (K x R) and Scorch's result of `equation`."""
    idx, vals, dense = random_tensor3(shape, nnz)
    X = sb.from_coordinates(idx, vals, shape, fmt)
    U = torch.randn(shape[2], R)
    return X, dense, U, sb.einsum(equation, X, U)


def test_dense_first_level():
    """X stored dense(0),compressed(1),compressed(2): the output shares the dense level and the compressed one."""
    X, dense, U, Y = ttm_case((6, 40, 9), 40, "dense(0),compressed(1),compressed(2)", "ijk,kr->ijr", 7)
    assert Y.format.canonical == "dense(0),compressed(1),dense(2)", Y.format
    check_fibers(Y, torch.einsum("ijk,kr->ijr", dense, U), X, ["pos1", "crd1"])


def test_output_order_and_ttv():
    # r first in the output: the dense level is the output's dimension 0, stored below the fibers.
    X, dense, U, Y = ttm_case((10, 11, 12), 25, "csf", "ijk,kr->rij", 6)
    assert Y.format.canonical == "compressed(1),compressed(2),dense(0)", Y.format
    torch.testing.assert_close(Y.to_dense(), torch.einsum("ijk,kr->rij", dense, U), rtol=1e-5, atol=1e-5)
    # TTV: k summed, no dense level: one value per fiber.
    x = torch.randn(12)
    Z = sb.einsum("ijk,k->ij", X, x)
    assert Z.format.canonical == "compressed(0),compressed(1)", Z.format
    assert Z.nnz == fibers_of(dense).shape[0]
    torch.testing.assert_close(Z.to_dense(), torch.einsum("ijk,k->ij", dense, x), rtol=1e-5, atol=1e-5)
    # Two dense factors under the fibers.
    w = torch.randn(6)
    W = sb.einsum("ijk,kr,r->ijr", X, U, w)
    torch.testing.assert_close(W.to_dense(), torch.einsum("ijk,kr,r->ijr", dense, U, w), rtol=1e-5, atol=1e-5)


def test_empty():
    X = sb.from_coordinates(torch.zeros(3, 0, dtype=torch.long), torch.zeros(0), (5, 6, 7), "csf")
    Y = sb.einsum("ijk,kr->ijr", X, torch.randn(7, 4))
    assert Y.nnz == 0 and torch.equal(Y.to_dense(), torch.zeros(5, 6, 4))


def test_fiber_without_entries():
    """A fiber whose k segment is empty gets zeros (the kernel stores every value once, into unzeroed memory)."""
    shape = (3, 4, 5)
    idx, vals, dense = random_tensor3(shape, 6, seed=3)
    X = sb.from_coordinates(idx, vals, shape, "csf")
    b = dict(X.level_buffers)
    # Drop the first fiber's entries: its segment [pos2[0], pos2[1]) becomes empty.
    pos2 = b["pos2"]
    if pos2.numel() < 3:
        pytest.skip("needs two fibers")
    first = int(pos2[1] - pos2[0])
    pos2 = (pos2 - first).clamp(min=0)
    keep = b["crd2"][first:]
    v = X.stored_values[first:]
    Z = sb.SparseTensor(X.format, shape, [b["pos0"], b["crd0"], b["pos1"], b["crd1"], pos2, keep], v)
    ref = Z.to_dense()
    torch.manual_seed(0)
    for _ in range(3):  # fresh outputs over freed, dirty memory
        junk = torch.full((10000,), float("nan"))
        del junk
        U = torch.randn(5, 37)
        Y = sb.einsum("ijk,kr->ijr", Z, U)
        out = Y.to_dense()
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, torch.einsum("ijk,kr->ijr", ref, U), rtol=1e-5, atol=1e-5)


def test_gradients():
    shape = (6, 7, 8)
    idx, vals, dense = random_tensor3(shape, 12, dtype=torch.float64)
    U = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    X = sb.from_coordinates(idx, vals, shape, "csf")
    Y = sb.einsum("ijk,kr->ijr", X, U)
    Y.to_dense().sum().backward() if isinstance(Y, sb.SparseTensor) else Y.sum().backward()
    ref_U = U.detach().clone().requires_grad_(True)
    torch.einsum("ijk,kr->ijr", dense, ref_U).sum().backward()
    torch.testing.assert_close(U.grad, ref_U.grad)


def test_bad_index_buffer():
    shape = (5, 6, 7)
    idx, vals, _ = random_tensor3(shape, 10)
    X = sb.from_coordinates(idx, vals, shape, "csf")
    b = dict(X.level_buffers)
    crd2 = b["crd2"].clone()
    crd2[0] = 1000
    bad = sb.SparseTensor(X.format, shape, [b["pos0"], b["crd0"], b["pos1"], b["crd1"], b["pos2"], crd2],
                          X.stored_values, validate=False)
    with pytest.raises((ValueError, IndexError)):
        sb.einsum("ijk,kr->ijr", bad, torch.randn(7, 3))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shape = (50, 40, 30)
        idx, vals, dense = random_tensor3(shape, 300, seed=threads)
        X = sb.from_coordinates(idx, vals, shape, "csf")
        U = torch.randn(30, 20)
        check_fibers(sb.einsum("ijk,kr->ijr", X, U), torch.einsum("ijk,kr->ijr", dense, U), X,
                     ["pos0", "crd0", "pos1", "crd1"])
    finally:
        torch.set_num_threads(old)


def _sampled_and_fiber_results():
    """A TTM fibers result (X's first four buffers copied) and an SDDMM sampled result (S's buffers copied)."""
    idx, vals, _ = random_tensor3((20, 18, 16), 60, seed=3)
    X = sb.from_coordinates(idx, vals, (20, 18, 16), "csf")
    Y = sb.einsum("ijk,kr->ijr", X, torch.randn(16, 5))
    g = torch.Generator().manual_seed(4)
    S = sb.sparse(torch.where(torch.rand(30, 25, generator=g) < 0.1, torch.rand(30, 25, generator=g), 0.0), "csr")
    Z = sb.einsum("ij,ik,kj->ij", S, torch.randn(30, 6, generator=g), torch.randn(6, 25, generator=g))
    return [(X, Y, ["pos0", "crd0", "pos1", "crd1"]), (S, Z, ["pos1", "crd1"])]


def test_result_buffers_are_independent_of_the_operand(scorch_dispatch):
    # scorch::kernel's outputs never alias its inputs (its schema says so): the index buffers a sampled or
    # fibers result shares with its operand by value are copies, so a write into one leaves the other as it was.
    for operand, result, names in _sampled_and_fiber_results():
        if not isinstance(result, sb.SparseTensor):  # the automatic dispatch may run dense
            continue
        for name in names:
            mine, theirs = result.level_buffers[name], operand.level_buffers[name]
            assert torch.equal(mine, theirs), name
            assert mine.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr(), name
            before = theirs.clone()
            mine.zero_()
            assert torch.equal(theirs, before), name


def test_written_result_buffers_are_validated_again(scorch_dispatch):
    # An executor result is wrapped without validation (its buffers come from a kernel) and records its
    # buffers' versions then: an in-place write afterwards is noticed, and the next call taking the result as
    # an operand re-validates it and reports the bad coordinate instead of running the kernel on it.
    for _, result, _ in _sampled_and_fiber_results():
        if not isinstance(result, sb.SparseTensor):
            continue
        assert result._checked_versions == result._buffer_versions()
        result.check_unchanged()  # nothing written: nothing to do
        crd = result.level_buffers["crd1"]
        if crd.numel() == 0:
            continue
        crd[0] = 10_000
        other = torch.randn(result.shape[1], 3)
        with pytest.raises((ValueError, IndexError)):
            if result.dim() == 3:
                sb.einsum("ijr,js->irs", result, other)
            else:
                sb.einsum("ij,jk->ik", result, other)


@pytest.mark.parametrize("fmt,eq,shape", [
    ("compressed(0),dense(1)", "ij,jk->ik", (9, 1)),
    ("compressed(0),dense(1)", "ij,jk->ik", (9, 3)),
    ("bitmap(0),dense(1)", "ij,jk->ik", (40, 2)),
    ("bitmap(1),dense(0)", "ji,jk->ik", (3, 31)),
    ("dense(0),compressed(1),dense(2)", "bij,bjk->bik", (2, 6, 1)),
    ("dense(0),bitmap(1),dense(2)", "bij,bjk->bik", (2, 6, 3)),
])
@pytest.mark.parametrize("K", [1, 2, 8, 37])
def test_dense_level_below_of_another_length(fmt, eq, shape, K, scorch_dispatch):
    # The operand's dense last level (no index buffer) has length j, the output's has K: the result's values were
    # sized by the operand's count, so for K > j the kernel wrote past their end (heap corruption, an abort) and
    # for K < j the result was refused ("values has 15 entries, buffers describe 10"): helper-52.
    g = torch.Generator().manual_seed(K)
    A = torch.randn(shape, generator=g, dtype=torch.float64)
    A *= torch.rand(shape, generator=g) < 0.3
    A.view(-1)[0] = 1.0  # (never all zero)
    S = sb.sparse(A, fmt)
    B = torch.randn((*shape[:-2], shape[-2] if eq.startswith("ji") else shape[-1], K), generator=g,
                    dtype=torch.float64)
    want = torch.einsum(eq, A, B)
    for out_format in (None, sb.plan_einsum(eq, S, B)["out_format"]):
        got = sb.einsum(eq, S, B, out_format=out_format) if out_format else sb.einsum(eq, S, B)
        torch.testing.assert_close(got.to_dense() if isinstance(got, sb.SparseTensor) else got, want)


def test_dense_level_below_of_another_length_under_the_default_dispatch(monkeypatch):
    # Large enough for the automatic dispatch to run the kernel: 10 stored rows of 20000, j = 1, K = 64.
    monkeypatch.delenv("SCORCH_DISPATCH", raising=False)
    A = torch.zeros(20000, 1)
    A[::2000, 0] = torch.arange(1.0, 11.0)
    B = torch.randn(1, 64)
    got = sb.einsum("ij,jk->ik", sb.sparse(A, "compressed(0),dense(1)"), B)
    torch.testing.assert_close(got.to_dense() if isinstance(got, sb.SparseTensor) else got, A @ B)
