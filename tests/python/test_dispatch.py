"""ATen ops on SparseTensors run as compiled kernels in eager mode, and agree with torch on dense copies."""

import contextlib
import warnings

import pytest
import torch

import scorch_backend as sb
from scorch_backend import _C
from conftest import random_dense

A = random_dense((12, 9), 0.3, dtype=torch.float64, seed=1)
B = random_dense((9, 7), 0.3, dtype=torch.float64, seed=2)


def dense(x):
    return x.to_dense() if isinstance(x, sb.SparseTensor) else x


@contextlib.contextmanager
def no_fallback():
    # Any densify-and-run fallback would warn; these ops must not.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="scorch: .* has no sparse implementation")
        yield


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
def test_matrix_products(fmt):
    S = sb.sparse(A, fmt)
    D = torch.randn(9, 5, dtype=torch.float64)
    x = torch.randn(9, dtype=torch.float64)
    with no_fallback():
        torch.testing.assert_close(torch.mm(S, D), A @ D)
        torch.testing.assert_close(S @ D, A @ D)
        torch.testing.assert_close(torch.mv(S, x), A @ x)
        C = torch.mm(S, sb.sparse(B, "csr"))
        assert isinstance(C, sb.SparseTensor)
        torch.testing.assert_close(C.to_dense(), A @ B)
        bias = torch.randn(12, 5, dtype=torch.float64)
        torch.testing.assert_close(torch.addmm(bias, S, D, beta=0.5, alpha=2.0), 0.5 * bias + 2 * (A @ D))
        torch.testing.assert_close(torch.addmm(torch.randn(5, dtype=torch.float64).fill_(1.0), S, D), 1 + A @ D)


def test_bmm():
    X = random_dense((3, 6, 5), 0.3, dtype=torch.float64, seed=3)
    Y = torch.randn(3, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(torch.bmm(sb.sparse(X, "csr"), Y), torch.bmm(X, Y))


def test_elementwise_and_sums():
    S = sb.sparse(A, "csr")
    T = sb.sparse(random_dense((12, 9), 0.3, dtype=torch.float64, seed=4), "coo")
    Td = T.to_dense()
    D = torch.randn(12, 9, dtype=torch.float64)
    with no_fallback():
        m = S * T
        assert isinstance(m, sb.SparseTensor)
        torch.testing.assert_close(m.to_dense(), A * Td)
        torch.testing.assert_close(dense(S * D), A * D)
        s = S + T
        assert isinstance(s, sb.SparseTensor)
        torch.testing.assert_close(s.to_dense(), A + Td)
        torch.testing.assert_close(dense(torch.sub(S, T, alpha=3)), A - 3 * Td)
        torch.testing.assert_close(dense(S + D), A + D)
        torch.testing.assert_close(S.sum(), A.sum())
        torch.testing.assert_close(dense(S.sum(0)), A.sum(0))
        torch.testing.assert_close(dense(S.sum(dim=1)), A.sum(1))
    # Broadcasting is not compiled yet: it runs densely, still correct.
    with pytest.warns(UserWarning):
        out = S * torch.ones(9, dtype=torch.float64)
    torch.testing.assert_close(dense(out), A)


def test_torch_einsum_and_matmul():
    S = sb.sparse(A, "csr")
    D = torch.randn(9, 4, dtype=torch.float64)
    with no_fallback():
        torch.testing.assert_close(torch.einsum("ij,jk->ik", S, D), A @ D)
        torch.testing.assert_close(torch.einsum("ij,jk", [S, D]), A @ D)
        torch.testing.assert_close(torch.matmul(S, D), A @ D)
        torch.testing.assert_close(dense(S.to_dense()), A)


# --- the contract does not depend on dispatch (issue 10, item 7): unstored entries are never multiplied, as in
# torch.sparse, so inf or NaN in another operand meets no implicit zero. The dense path would make 0 * inf NaN;
# it is not taken when an operand holds a non-finite value.
class _DenseRuns:
    """Dense runs since it was made: the C++ executor's (dense result) plus Python's (sparse result)."""

    def __init__(self, monkeypatch):
        import scorch_backend.tensors.frontend as F

        self.start = _C.executor_stats()["dense"]
        self.python = []
        real = F._run_dense
        monkeypatch.setattr(F, "_run_dense", lambda *a: self.python.append(1) or real(*a))

    def __len__(self):
        return _C.executor_stats()["dense"] - self.start + len(self.python)


def _count_dense_runs(monkeypatch):
    return _DenseRuns(monkeypatch)


@pytest.mark.parametrize("mode", ["auto", "dense", "sparse"])
def test_non_finite_dense_operand_meets_no_unstored_zero(monkeypatch, mode):
    monkeypatch.setenv("SCORCH_DISPATCH", mode)
    runs = _count_dense_runs(monkeypatch)
    A = sb.sparse(torch.tensor([[1.0, 0, 0], [1, 1, 0]]), "csr")  # the third column is empty
    x = torch.tensor([1.0, 1.0, float("inf")])
    ref = torch.sparse.mm(A.to_torch(torch.sparse_csr), x[:, None]).ravel()
    torch.testing.assert_close(sb.einsum("ij,j->i", A, x), ref)
    torch.testing.assert_close(ref, torch.tensor([1.0, 2.0]))
    X = torch.ones(3, 2)
    X[2, 0] = float("nan")
    torch.testing.assert_close(sb.einsum("ij,jk->ik", A, X), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    assert not runs
    # Finite data of the same size takes the path chosen: dense when forced; the kernel by default too, as the
    # problem is tiny and the operand stored sparse (densifying it would cost more than the kernel).
    torch.testing.assert_close(sb.einsum("ij,j->i", A, torch.ones(3)), torch.tensor([1.0, 2.0]))
    assert len(runs) == (1 if mode == "dense" else 0)
    # Large enough for the density rule to say dense (0.9 over the crossover): a non-finite value still turns
    # the call to the kernel, checked on the final choice (after the measured one).
    big = (torch.rand(120, 150, generator=torch.Generator().manual_seed(0)) < 0.9).float()
    big[:, 7] = 0  # the column the inf meets
    y = torch.ones(150)
    y[7] = float("inf")
    runs = _count_dense_runs(monkeypatch)
    torch.testing.assert_close(sb.einsum("ij,j->i", sb.sparse(big, "csr"), y), big.sum(1))
    assert not runs


@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_non_finite_stored_value_meets_no_unstored_zero(monkeypatch, mode):
    monkeypatch.setenv("SCORCH_DISPATCH", mode)
    A = sb.sparse(torch.tensor([[float("inf"), 0], [1, 2]], dtype=torch.float64), "csr")
    B = sb.sparse(torch.tensor([[0.0, 3], [4, 0]], dtype=torch.float64), "coo")
    ref = (A.to_torch(torch.sparse_coo) * B.to_torch(torch.sparse_coo)).to_dense()
    torch.testing.assert_close(sb.einsum("ij,ij->ij", A, B).to_dense(), ref)
    ref = torch.sparse.mm(A.to_torch(torch.sparse_coo), B.to_torch(torch.sparse_coo)).to_dense()
    torch.testing.assert_close(ref, torch.tensor([[0.0, float("inf")], [8.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(torch.mm(A, B).to_dense(), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finiteness_check_catches_every_non_finite_value(dtype):
    from scorch_backend.tensors.frontend import _all_finite, _operand

    for bad in (float("inf"), -float("inf"), float("nan")):
        x = torch.ones(1000, dtype=dtype)
        assert _all_finite([_operand(x, "x")])
        x[777] = bad
        assert not _all_finite([_operand(x, "x")])
        S = sb.sparse(torch.eye(40, dtype=dtype), "csr")
        S.stored_values[13] = bad
        assert not _all_finite([_operand(torch.ones(40, dtype=dtype), "y"), _operand(S, "S")])


@pytest.mark.parametrize("grain", [None, "1", "1000000000"])
def test_thread_grain_never_changes_values(monkeypatch, grain):
    """SCORCH_THREAD_GRAIN only decides how many threads a kernel call starts (the default runs small calls on
    one thread): the values are those of dense torch, whatever it is."""
    import scorch_backend as sb
    from conftest import random_dense

    if grain is None:
        monkeypatch.delenv("SCORCH_THREAD_GRAIN", raising=False)
    else:
        monkeypatch.setenv("SCORCH_THREAD_GRAIN", grain)
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for shape, density in (((7, 5), 0.4), ((300, 200), 0.05), ((600, 700), 0.2)):
            a = random_dense(shape, density, dtype=torch.float64, seed=shape[0])
            b = torch.randn(shape[1], 9, dtype=torch.float64)
            torch.testing.assert_close(sb.einsum("ij,jk->ik", sb.sparse(a, "csr"), b), a @ b)
            torch.testing.assert_close(sb.einsum("ij,j->i", sb.sparse(a, "csr"), b[:, 0]), a @ b[:, 0])
    finally:
        torch.set_num_threads(old)


def test_thread_grain_bad_value_is_a_clear_error(monkeypatch):
    import scorch_backend as sb

    a = sb.sparse(torch.eye(4), "csr")
    monkeypatch.setenv("SCORCH_THREAD_GRAIN", "lots")
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    with pytest.raises(ValueError, match="SCORCH_THREAD_GRAIN"):
        sb.einsum("ij,jk->ik", a, torch.ones(4, 2))
    # sb.sparse of a dense matrix compresses its rows in parallel too (sized by the grain): the same error
    with pytest.raises(ValueError, match="SCORCH_THREAD_GRAIN"):
        sb.sparse(torch.eye(4), "csr")


def test_an_einsum_without_sparse_operands_runs_dense_aten_code_by_default(monkeypatch):
    # Nothing to skip: the generated loops ran a 1024^3 matmul 200x slower than torch.einsum (helper-43).
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 48, generator=g), torch.randn(48, 40, generator=g)
    runs = _count_dense_runs(monkeypatch)
    torch.testing.assert_close(sb.einsum("ij,jk->ik", a, b), a @ b)
    torch.testing.assert_close(sb.einsum("bij,bjk->bik", a[None], b[None]), (a @ b)[None])
    assert len(runs) == 2
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # forced: the kernel, as the tests of the loops want
    runs = _count_dense_runs(monkeypatch)
    torch.testing.assert_close(sb.einsum("ij,jk->ik", a, b), a @ b, rtol=1e-4, atol=1e-4)
    assert len(runs) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_dense_path_of_half_types_gives_their_dtype(monkeypatch, dtype):
    # float16 is multiplied in float32 there (ATen's float16 products on a CPU are scalar loops) and cast back.
    monkeypatch.setenv("SCORCH_DISPATCH", "dense")
    a = random_dense((40, 30), 0.5, seed=3).to(dtype)
    b = torch.randn(30, 20, generator=torch.Generator().manual_seed(4)).to(dtype)
    A = sb.sparse(a, "csr")
    got = sb.einsum("ij,jk->ik", A, b)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-2)
    s = sb.einsum("ij,ij->ij", A, A)  # a sparse result through the Python path's dense run
    assert s.stored_values.dtype == dtype
    torch.testing.assert_close(s.to_dense().float(), (a * a).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sums_of_half_precision_sparse_tensors_keep_their_dtype(dtype):
    # The scalar of `X + a * Y` is a float32 operand: A + B and A - B came back float32 (helper-43).
    a = random_dense((16, 12), 0.3, seed=5).to(dtype)
    b = random_dense((16, 12), 0.3, seed=6).to(dtype)
    A, B = sb.sparse(a, "csr"), sb.sparse(b, "csr")
    for got, want in ((A + B, a + b), (A - B, a - b), (A + A, a + a)):
        assert got.stored_values.dtype == dtype
        torch.testing.assert_close(got.to_dense(), want)


@pytest.mark.parametrize("density", [0.3, 0.9, 1.0])
def test_an_elementwise_product_with_a_sparse_result_runs_the_kernel_at_any_density(monkeypatch, density):
    # It visits only stored entries; densify, multiply and compress ran 95x slower at 0.75 (helper-43).
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    a = random_dense((300, 200), density, seed=7)
    b = random_dense((300, 200), density, seed=8)
    A, B = sb.sparse(a, "csr"), sb.sparse(b, "csr")
    d = torch.randn(300, 200, generator=torch.Generator().manual_seed(9))
    runs = _count_dense_runs(monkeypatch)
    for got, want in ((sb.einsum("ij,ij->ij", A, B), a * b), (sb.einsum("ij,ij->ij", A, d), a * d),
                      (sb.einsum("ij,ij->ij", A, B, out_format="csr"), a * b)):
        assert isinstance(got, sb.SparseTensor) and got.format == A.format
        torch.testing.assert_close(got.to_dense(), want)
    assert len(runs) == 0
    # A contraction still asks the cost model (at density 1 it runs dense).
    if density == 1.0:
        sb.einsum("ij,kj->ik", A, B, out_format="csr")
        assert len(runs) == 1


@pytest.mark.parametrize("density", [0.05, 0.5, 0.9, 1.0])
def test_a_sampled_product_runs_the_kernel_at_any_density(monkeypatch, density):
    """An SDDMM's result lies within S's entries: the kernel computes only those. The density rule sent it to a
    dense run at 0.9, where torch.einsum formed the (i, j, k) product of S and X first: 144-177x slower than
    torch's S * (X @ Y.T) (helper-75)."""
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    g = torch.Generator().manual_seed(11)
    s = random_dense((70, 90), density, seed=12)
    x, y = torch.randn(70, 16, generator=g), torch.randn(90, 16, generator=g)
    S = sb.sparse(s, "csr")
    runs = _count_dense_runs(monkeypatch)
    for eq, want, fmt in (("ij,ik,jk->ij", s * (x @ y.T), None), ("ik,ij,jk->ji", (s * (x @ y.T)).T, None),
                          ("ij,ik,jk->ij", s * (x @ y.T), "csr")):  # (a preset: the Python path decides)
        ops = (S, x, y) if eq.startswith("ij") else (x, S, y)
        got = sb.einsum(eq, *ops, out_format=fmt)
        assert isinstance(got, sb.SparseTensor)
        torch.testing.assert_close(got.to_dense(), want, rtol=1e-4, atol=1e-4)
    assert len(runs) == 0


def test_the_dense_run_of_a_sampled_product_contracts_a_pair_at_a_time(monkeypatch):
    """Forced dense (or any dense run of three factors with a sparse result): torch.einsum went left to right
    and formed the (i, j, k) product first; now the smallest pair first. Values and gradients as torch's."""
    monkeypatch.setenv("SCORCH_DISPATCH", "dense")
    g = torch.Generator().manual_seed(13)
    s = random_dense((40, 30), 0.6, seed=14, dtype=torch.float64)
    x = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    runs = _count_dense_runs(monkeypatch)
    got = sb.einsum("ij,ik,jk->ij", sb.sparse(s, "csr"), x, y)
    assert len(runs) == 1
    x2, y2 = x.detach().requires_grad_(), y.detach().requires_grad_()
    want = s * (x2 @ y2.T)
    torch.testing.assert_close(got.to_dense(), want.detach())
    got.stored_values.sum().backward()
    (want * (s != 0)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (32, 32), (40, 100)])
def test_a_tiny_product_with_a_stored_sparse_operand_runs_the_kernel_by_default(monkeypatch, shape):
    """Densifying a stored sparse operand costs more than the kernel on a tiny problem (helper-75: a 32x32 SpMV
    36-55 us dense, 5.6-7 us the kernel): the tiny rule is for operands held dense."""
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    a = random_dense(shape, 0.9, seed=15)
    x = torch.randn(shape[1], 3, generator=torch.Generator().manual_seed(16))
    runs = _count_dense_runs(monkeypatch)
    A = sb.sparse(a, "csr")
    torch.testing.assert_close(sb.einsum("ij,jk->ik", A, x), a @ x)
    torch.testing.assert_close(sb.einsum("ij,j->i", A, x[:, 0]), a @ x[:, 0])
    assert len(runs) == 0
