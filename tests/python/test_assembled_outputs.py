"""Sparse outputs assembled inside the kernel (csrc/lower/assemble.h), against dense torch.

SpGEMM (Gustavson, row by row: a scaled row, a dense workspace read back through its bits or sorted, or a hash
table) and SpAdd/SpSub (a merge of rows) write CSR's pos, crd and values themselves. Each case checks the
values against dense torch and the CSR invariants (pos starts at 0, never decreases, ends at nnz; each row's
columns strictly increasing, so sorted and duplicate-free), for empty rows, empty matrices, one row, odd sizes,
float32/float64 (and the half types the front end computes in float32), int32/int64 indices, densities 0,
tiny and full, under SCORCH_DISPATCH=sparse (the kernel, which must be the assembled one) and under the default
automatic dispatch. The planner's cost model is checked on A·Bᵀ of two CSR operands (B converted, then
Gustavson), with its reasons.
"""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import scorch_backend as sb
from scorch_backend import _C

SHAPES = {  # (rows of A, inner, columns of B)
    "odd": (37, 23, 29),
    "one_row": (1, 17, 13),
    "one_col": (19, 11, 1),
    "empty_rows": (0, 5, 7),
    "empty_inner": (6, 0, 5),
    "empty_cols": (8, 4, 0),
    "square": (32, 32, 32),
}
DENSITIES = [0.0, 0.01, 0.3, 1.0]
DTYPES = [torch.float32, torch.float64]
INDEX = [torch.int32, torch.int64]


def random_matrix(shape, density, dtype, seed, empty_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5) * torch.where(
        torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = x * (torch.rand(shape, generator=g) < density)
    for r in empty_rows:
        if r < shape[0]:
            x[r] = 0
    return x.to(dtype)


def check_csr(out, ref, dtype):
    """A CSR result equal to `ref`, with sorted, duplicate-free rows."""
    if not isinstance(out, sb.SparseTensor):  # the automatic dispatch may run dense
        torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-4, atol=1e-4)
        return
    assert str(out.format) == "csr", out.format
    pos = out.level_buffers["pos1"].to(torch.int64)
    crd = out.level_buffers["crd1"].to(torch.int64)
    vals = out.values()
    rows = ref.shape[0]
    assert pos.shape == (rows + 1,)
    assert int(pos[0]) == 0 and int(pos[-1]) == crd.numel() == vals.numel()
    assert bool((pos[1:] >= pos[:-1]).all())
    for r in range(rows):
        seg = crd[pos[r]:pos[r + 1]]
        assert bool((seg[1:] > seg[:-1]).all()), f"row {r} is not sorted or repeats a column: {seg.tolist()}"
        assert bool(((seg >= 0) & (seg < ref.shape[1])).all())
    torch.testing.assert_close(out.to_dense(), ref.to(out.dtype), rtol=1e-4 if dtype != torch.float64 else 1e-10,
                               atol=1e-4 if dtype != torch.float64 else 1e-10)


def assembled(spec):
    return sb.kernel_info(spec)["assembled_output"]


@pytest.fixture(params=["sparse", "auto"])
def dispatch(request, monkeypatch):
    if request.param == "sparse":
        monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    else:
        monkeypatch.delenv("SCORCH_DISPATCH", raising=False)
    return request.param


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX)
def test_spgemm(dispatch, shape, density, dtype, index_dtype):
    m, k, n = SHAPES[shape]
    A = random_matrix((m, k), density, dtype, 1, empty_rows=(0, 3))
    B = random_matrix((k, n), density, dtype, 2, empty_rows=(1,))
    As, Bs = sb.sparse(A, "csr", index_dtype=index_dtype), sb.sparse(B, "csr", index_dtype=index_dtype)
    out = sb.einsum("ij,jk->ik", As, Bs)
    check_csr(out, A.double() @ B.double(), dtype)
    if dispatch == "sparse":
        assert isinstance(out, sb.SparseTensor)
        assert out.level_buffers["crd1"].dtype == index_dtype
        assert assembled(sb.plan_einsum("ij,jk->ik", As, Bs)["spec"])


@pytest.mark.parametrize("shape", ["odd", "one_row", "empty_rows", "empty_cols", "square"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX)
@pytest.mark.parametrize("expr", ["A(i,j) + B(i,j)", "A(i,j) - 2 * B(i,j)", "-A(i,j) + 0.5 * B(i,j)"])
def test_spadd(dispatch, shape, density, dtype, index_dtype, expr):
    m, _, n = SHAPES[shape]
    A = random_matrix((m, n), density, dtype, 3, empty_rows=(0,))
    B = random_matrix((m, n), density / 2, dtype, 4, empty_rows=(2,))
    As, Bs = sb.sparse(A, "csr", index_dtype=index_dtype), sb.sparse(B, "csr", index_dtype=index_dtype)
    out = sb.compute("C(i,j) = " + expr, A=As, B=Bs)
    Ad, Bd = A.double(), B.double()
    ref = {"A(i,j) + B(i,j)": Ad + Bd, "A(i,j) - 2 * B(i,j)": Ad - 2 * Bd, "-A(i,j) + 0.5 * B(i,j)": -Ad + 0.5 * Bd}[expr]
    check_csr(out, ref, dtype)
    if dispatch == "sparse":
        assert isinstance(out, sb.SparseTensor)


def test_spadd_of_the_same_operand_and_of_columns(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    A = random_matrix((21, 34), 0.2, torch.float64, 5)
    As = sb.sparse(A, "csr")
    check_csr(sb.compute("C(i,j) = A(i,j) + A(i,j)", A=As), 2 * A, torch.float64)
    # Two CSC operands: the rows merged are the columns, and the result is CSC.
    B = random_matrix((21, 34), 0.1, torch.float64, 6)
    out = sb.compute("C(i,j) = A(i,j) + B(i,j)", A=sb.sparse(A, "csc"), B=sb.sparse(B, "csc"))
    assert str(out.format) == "csc"
    torch.testing.assert_close(out.to_dense(), A + B)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_compute_in_float32(monkeypatch, dtype):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    A = random_matrix((13, 9), 0.4, dtype, 7)
    B = random_matrix((9, 11), 0.4, dtype, 8)
    out = sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr"))
    torch.testing.assert_close(out.to_dense().float(), A.float() @ B.float(), rtol=2e-2, atol=2e-2)
    C = random_matrix((13, 9), 0.3, dtype, 9)
    out = sb.compute("C(i,j) = A(i,j) + B(i,j)", A=sb.sparse(A, "csr"), B=sb.sparse(C, "csr"))
    torch.testing.assert_close(out.to_dense().float(), A.float() + C.float(), rtol=2e-2, atol=2e-2)


def scipy_check(out, ref):
    ref = ref.tocsr()
    ref.sort_indices()
    assert np.array_equal(out.level_buffers["pos1"].numpy(), ref.indptr)
    assert np.array_equal(out.level_buffers["crd1"].numpy(), ref.indices)
    np.testing.assert_allclose(out.values().numpy(), ref.data, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spgemm_workspaces(monkeypatch, threads):
    """Each workspace a row can take: rows of one entry (B's row scaled), a dense workspace over few columns
    read back through its bits, and over columns past L2 a hash table per row (and the dense workspace for
    rows too long for a hash table that fits); also more threads than rows."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(threads)
        # One entry per row of A.
        A = sp.csr_array((rng.standard_normal(40), (np.arange(40), rng.integers(0, 30, 40))), shape=(40, 30))
        B = sp.random_array((30, 50), density=0.2, format="csr", dtype=np.float64, random_state=1)
        scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr")), A @ B)
        # Few columns: dense workspace, rows dense enough to be read back through the bits.
        A = sp.random_array((60, 40), density=0.3, format="csr", dtype=np.float64, random_state=2)
        B = sp.random_array((40, 70), density=0.3, format="csr", dtype=np.float64, random_state=3)
        scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr")), A @ B)
        # The dense workspace's three read-backs over 5,000 columns: a row filling its span (bytes read 8 at a
        # time), a row spread over it (words of bits), a handful of columns far apart (the list sorted), and a
        # row of all four B rows (columns repeated across them).
        cols = 5000
        Bd = np.zeros((4, cols))
        Bd[0, ::3] = rng.standard_normal(len(range(0, cols, 3)))
        Bd[1, rng.choice(cols, 40, replace=False)] = rng.standard_normal(40)
        Bd[2, [0, cols - 1]] = [1.5, -2.0]
        Bd[3, [10, 3, cols - 10]] = [0.25, 3.0, -1.0]
        Ad = np.array([[1.0, 2.0, 0, 0], [0, 1.0, 0, -1.0], [0, 0, 2.0, 1.0], [1.0, -1.0, 0.5, 2.0]])
        A, B = sp.csr_array(Ad), sp.csr_array(Bd)
        scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr")), A @ B)
        # 400,000 columns (a dense workspace of 1.6 MB or more, past any L2): short rows hashed, and a few
        # long rows (an A row of every inner index) in the dense workspace.
        A = sp.random_array((50, 300), density=0.02, format="lil", dtype=np.float64, random_state=4)
        A[7, :] = 1.0
        A = A.tocsr()
        B = sp.random_array((300, 400_000), density=0.0005, format="csr", dtype=np.float64, random_state=5)
        for index_dtype in INDEX:
            scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr", index_dtype=index_dtype),
                                  sb.sparse(B, "csr", index_dtype=index_dtype)), A @ B)
        # More threads than rows, and a single row.
        A = sp.random_array((2, 10), density=0.5, format="csr", dtype=np.float64, random_state=6)
        B = sp.random_array((10, 9), density=0.5, format="csr", dtype=np.float64, random_state=7)
        scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr")), A @ B)
        scipy_check(sb.compute("C(i,j) = A(i,j) + B(i,j)", A=sb.sparse(A[:1], "csr"), B=sb.sparse(A[1:], "csr")),
                    A[:1] + A[1:])
    finally:
        torch.set_num_threads(old)


def test_results_do_not_depend_on_threads(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    A = sp.random_array((500, 300), density=0.02, format="csr", dtype=np.float64, random_state=8)
    B = sp.random_array((300, 400), density=0.02, format="csr", dtype=np.float64, random_state=9)
    old = torch.get_num_threads()
    got = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr"))
            got.append([x.clone() for x in (out.level_buffers["pos1"], out.level_buffers["crd1"], out.values())])
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_a_times_b_transposed_is_planned_as_gustavson(monkeypatch):
    """ij,kj->ik on two CSR operands: the planner converts B (to CSC: its rows are then B's columns) and runs
    Gustavson, instead of an inner product for every output coordinate, and says why."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    A = sp.random_array((300, 200), density=0.02, format="csr", dtype=np.float64, random_state=10)
    B = sp.random_array((250, 200), density=0.02, format="csr", dtype=np.float64, random_state=11)
    As, Bs = sb.sparse(A, "csr"), sb.sparse(B, "csr")
    p = sb.plan_einsum("ij,kj->ik", As, Bs)
    assert p["convert"] == ["", "dense(1),compressed(0)"], p
    reasons = "\n".join(p["reasons"])
    assert "converted from csr to csc" in reasons and "loop order i j k" in reasons and "i k j as given" in reasons, reasons
    info = sb.kernel_info(p["spec"])
    assert info["assembled_output"] and "Gustavson" in "\n".join(info["reasons"])
    scipy_check(sb.einsum("ij,kj->ik", As, Bs), A @ B.T)
    # Tiny operands: a conversion costs more than the inner products save, and the plan says so.
    p = sb.plan_einsum("ij,kj->ik", sb.sparse(A[:3, :4], "csr"), sb.sparse(B[:2, :4], "csr"))
    assert p["convert"] == ["", ""], p
    assert any("kept" in r for r in p["reasons"]), p["reasons"]


def test_bad_indices_raise(monkeypatch):
    """A crd value out of range, written behind the version counter, is a ValueError naming the buffer."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    A = sb.sparse(random_matrix((30, 20), 0.2, torch.float32, 12), "csr")
    B = sb.sparse(random_matrix((20, 25), 0.2, torch.float32, 13), "csr")
    C = sb.sparse(random_matrix((30, 20), 0.2, torch.float32, 14), "csr")
    sb.einsum("ij,jk->ik", A, B)
    sb.compute("C(i,j) = A(i,j) + B(i,j)", A=A, B=C)
    for victim, call in ((B, lambda: sb.einsum("ij,jk->ik", A, B)),
                         (A, lambda: sb.einsum("ij,jk->ik", A, B)),
                         (C, lambda: sb.compute("C(i,j) = A(i,j) + B(i,j)", A=A, B=C))):
        buf = victim.level_buffers["crd1"].numpy()
        old = int(buf[0])
        buf[0] = 10**6
        with pytest.raises(ValueError, match="crd1"):
            call()
        buf[0] = old
        call()


@pytest.mark.parametrize("shape", ["odd", "one_row", "empty_rows", "empty_cols", "square"])
@pytest.mark.parametrize("k", [0, 1, 7, 33, 128])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX)
def test_sddmm(dispatch, shape, k, density, dtype, index_dtype):
    """Sampled dot products written at S's positions (the native SDDMM form: entries of a row in groups,
    a remainder of fewer, and a remainder of the summed index shorter than a vector)."""
    m, _, n = SHAPES[shape]
    S = random_matrix((m, n), density, dtype, 15, empty_rows=(0,))
    g = torch.Generator().manual_seed(16)
    P = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    Q = torch.randn(n, k, generator=g, dtype=torch.float64).to(dtype)
    Ss = sb.sparse(S, "csr", index_dtype=index_dtype)
    ref = S.double() * (P.double() @ Q.double().T)
    out = sb.einsum("ij,ik,jk->ij", Ss, P, Q)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    if isinstance(out, sb.SparseTensor):
        if dispatch == "sparse":  # the kernel keeps S's pattern (the dense path may drop zeros of K = 0)
            assert torch.equal(out.level_buffers["crd1"], Ss.level_buffers["crd1"])
        torch.testing.assert_close(out.to_dense().double(), ref, rtol=tol, atol=tol)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    out = sb.compute("C(i,j) = 3 * S(i,j) * P(i,k) * Q(j,k)", S=Ss, P=P, Q=Q)
    torch.testing.assert_close(out.to_dense().double(), 3 * ref, rtol=tol * 10, atol=tol * 10)
    if dispatch == "sparse":
        info = sb.kernel_info(sb.plan_einsum("ij,ik,jk->ij", Ss, P, Q)["spec"])
        # The native form needs vector registers; a scalar target keeps the general lowering.
        if _C.target_info(info["target"])["vector_bytes"] > 0:
            assert any("sampled dot products" in r for r in info["reasons"]), info["reasons"]


def test_sddmm_gathers_rows_past_l2(monkeypatch):
    """Q larger than half of L2 (its rows prefetched ahead), rows of many entries, and 1-3 threads."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    S = sp.random_array((300, 6000), density=0.01, format="csr", dtype=np.float32, random_state=17)
    g = torch.Generator().manual_seed(18)
    P, Q = torch.randn(300, 64, generator=g), torch.randn(6000, 64, generator=g)
    Ss = sb.sparse(S, "csr")
    ref = torch.from_numpy(S.toarray()).double() * (P.double() @ Q.double().T)
    old = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out = sb.einsum("ij,ik,jk->ij", Ss, P, Q)
            torch.testing.assert_close(out.to_dense().double(), ref, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


def test_kept_buffers_between_calls(monkeypatch):
    """A kernel keeps each thread's buffers and dense workspace from one call to the next: calls of one kernel
    on different column counts (the workspace reallocated or reused, and left zero by each), after a larger and
    a smaller result, and from several Python threads at once, each give their own exact result."""
    import concurrent.futures

    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = np.random.default_rng(11)
        cases = []
        for cols, dens in [(5000, 0.01), (40, 0.5), (5000, 0.002), (70_000, 0.0005), (40, 0.05), (5000, 0.01)]:
            A = sp.random_array((120, 300), density=0.05, format="csr", dtype=np.float64, random_state=rng)
            B = sp.random_array((300, cols), density=dens, format="csr", dtype=np.float64, random_state=rng)
            cases.append((A, B))
        for A, B in cases:
            scipy_check(sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr")), A @ B)
            scipy_check(sb.compute("C(i,j) = A(i,j) + B(i,j)", A=sb.sparse(A, "csr"), B=sb.sparse(A[::-1], "csr")),
                        A + A[::-1])

        def run(k):
            A, B = cases[k % len(cases)]
            out = sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), sb.sparse(B, "csr"))
            scipy_check(out, A @ B)
            return True

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(pool.map(run, range(24)))
    finally:
        torch.set_num_threads(old)
