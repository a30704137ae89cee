"""Round trips between dense tensors, torch.sparse, scipy.sparse and every Scorch preset, plus format handling."""

import pytest
import torch

import scorch_backend as sb
from conftest import random_dense

DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)

PRESETS_2D = ["dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr(1,1)", "bsr(2,3)"]
SHAPES_2D = [(0, 5), (5, 0), (1, 1), (7, 9), (101, 203)]
DENSITIES = [0.0, 1e-4, 0.5, 1.0]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def fits(fmt: str, shape) -> bool:
    if fmt.startswith("bsr(2,3)"):
        return shape[0] % 2 == 0 and shape[1] % 3 == 0
    return True


@pytest.mark.parametrize("fmt", PRESETS_2D)
@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("density", DENSITIES)
def test_dense_round_trip(fmt, shape, density):
    if not fits(fmt, shape):
        shape = (shape[0] * 2, shape[1] * 3)
    x = random_dense(shape, density, seed=hash((fmt, shape, density)) % 1000)
    for index_dtype in (torch.int32, torch.int64):
        A = sb.sparse(x, fmt, index_dtype=index_dtype)
        assert A.shape == x.shape and A.dtype == x.dtype
        assert torch.equal(A.to_dense(), x)
        for name, buf in A.level_buffers.items():
            assert buf.dtype == index_dtype, name
        if not A.format.all_dense and not A.format.last_level_dense:
            assert A.nnz == int((x != 0).sum())  # pure sparse formats store exactly the nonzeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", PRESETS_2D)
def test_value_dtypes(dtype, fmt):
    x = random_dense((6, 9), 0.3, dtype=dtype, seed=3)
    A = sb.sparse(x, fmt)
    assert A.dtype == dtype and A.stored_values.dtype == dtype
    assert torch.equal(A.to_dense(), x)
    assert torch.equal(A.to(torch.float64).to_dense(), x.double())


@pytest.mark.parametrize("src", PRESETS_2D)
@pytest.mark.parametrize("dst", PRESETS_2D)
def test_format_to_format(src, dst):
    x = random_dense((6, 9), 0.3, seed=5)
    A = sb.sparse(x, src)
    B = A.to_format(dst)
    assert str(B.format) == ("dcsr" if dst == "csf" else dst)
    assert torch.equal(B.to_dense(), x)
    if dst not in ("dense",) and not dst.startswith("bsr"):
        assert B.nnz == int((x != 0).sum())  # padding zeros of dense levels are not carried over


@pytest.mark.parametrize("fmt", ["coo", "csf", "dense", "csr", ["dense", "compressed", "compressed"]])
@pytest.mark.parametrize("shape", [(3, 4, 5), (1, 1, 1), (0, 2, 3), (5, 1, 7)])
@pytest.mark.parametrize("density", DENSITIES)
def test_three_dimensional(fmt, shape, density):
    x = random_dense(shape, density, dtype=torch.float64, seed=11)
    A = sb.sparse(x, fmt, index_dtype=torch.int64)
    assert torch.equal(A.to_dense(), x)
    coo = A.to_torch(torch.sparse_coo)
    assert torch.equal(coo.to_dense(), x)
    assert torch.equal(sb.sparse(coo, fmt).to_dense(), x)


def test_mode_order_and_level_lists():
    x = random_dense((4, 5, 6), 0.2, seed=2)
    A = sb.sparse(x, ["dense", "compressed", "compressed"], mode_order=[2, 0, 1])
    assert A.format.canonical == "dense(2),compressed(0),compressed(1)"
    assert torch.equal(A.to_dense(), x)
    B = sb.sparse(x[0], ["dense", "compressed"], mode_order=[1, 0])
    assert str(B.format) == "csc"
    C = sb.sparse(x[0], "compressed(1),dense(0)")
    assert str(C.format) == "compressed(1),dense(0)"
    assert torch.equal(C.to_dense(), x[0])


TORCH_LAYOUTS = [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr]


def to_layout(x, layout):
    if layout == torch.sparse_bsr:
        return x.to_sparse_bsr((2, 3))
    return {torch.sparse_coo: x.to_sparse, torch.sparse_csr: x.to_sparse_csr,
            torch.sparse_csc: x.to_sparse_csc}[layout]()


@pytest.mark.parametrize("layout", TORCH_LAYOUTS)
@pytest.mark.parametrize("fmt", PRESETS_2D)
@pytest.mark.parametrize("density", DENSITIES)
def test_torch_sparse_round_trip(layout, fmt, density):
    x = random_dense((8, 9), density, dtype=torch.float64, seed=7)
    A = sb.sparse(to_layout(x, layout), fmt)
    assert torch.equal(A.to_dense(), x)
    for back in TORCH_LAYOUTS:
        y = A.to_torch(back, blocksize=(2, 3) if back == torch.sparse_bsr else None)
        assert y.layout == back
        assert torch.equal(y.to_dense(), x)


def test_torch_bsr_keeps_its_block_size():
    x = random_dense((8, 9), 0.3, seed=1)
    A = sb.sparse(x.to_sparse_bsr((4, 3)), "bsr")
    assert str(A.format) == "bsr(4,3)"
    y = A.to_torch(torch.sparse_bsr)
    assert y.values().shape[1:] == (4, 3)
    assert torch.equal(y.to_dense(), x)


def test_torch_coo_duplicates_are_summed():
    i = torch.tensor([[0, 1, 0, 0], [2, 0, 2, 1]])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    x = torch.sparse_coo_tensor(i, v, (2, 3))  # uncoalesced, (0,2) twice
    for fmt in ["csr", "coo", "csc"]:
        A = sb.sparse(x, fmt)
        assert A.nnz == 3
        assert torch.equal(A.to_dense(), x.to_dense())
    A = sb.from_coordinates(i, v, (2, 3), "csr")
    assert A.stored_values.tolist() == [4.0, 4.0, 2.0]


@pytest.mark.parametrize("fmt", PRESETS_2D)
@pytest.mark.parametrize("kind", ["coo", "csr", "csc", "bsr"])
@pytest.mark.parametrize("density", DENSITIES)
def test_scipy_round_trip(fmt, kind, density):
    sp = pytest.importorskip("scipy.sparse")
    x = random_dense((8, 9), density, dtype=torch.float64, seed=9)
    m = {"coo": sp.coo_array, "csr": sp.csr_array, "csc": sp.csc_array}.get(kind)
    m = m(x.numpy()) if m else sp.bsr_array(x.numpy(), blocksize=(2, 3))
    A = sb.sparse(m, fmt)
    assert torch.equal(A.to_dense(), x)
    back = A.to_scipy()
    assert (back.toarray() == x.numpy()).all()
    if str(A.format) in ("csr", "csc"):
        assert back.format == str(A.format)


def test_scipy_unsorted_and_duplicate_csr():
    sp = pytest.importorskip("scipy.sparse")
    import numpy as np

    m = sp.csr_array((np.array([1.0, 2.0, 3.0]), np.array([2, 0, 2]), np.array([0, 3, 3])), shape=(2, 3))
    assert not m.has_canonical_format
    A = sb.sparse(m, "csr")
    assert A.level_buffers["crd1"].tolist() == [0, 2]
    assert torch.equal(A.to_dense(), torch.tensor(m.toarray()))


def test_properties_and_repr():
    x = random_dense((10, 10), 0.25, seed=4)
    A = sb.sparse(x, "csr")
    assert A.nnz == int((x != 0).sum())
    assert A.density == pytest.approx(A.nnz / 100)
    assert str(A.format) == "csr" and A.format.canonical == "dense(0),compressed(1)"
    assert "format=csr" in repr(A) and "shape=(10, 10)" in repr(A)
    assert sb.sparse(torch.zeros(0, 3), "csr").density == 0.0
    assert set(sb.sparse(x, "coo").level_buffers) == {"pos0", "crd0", "crd1"}


def test_transpose_changes_format_not_data():
    x = random_dense((5, 7), 0.3, seed=8)
    A = sb.sparse(x, "csr")
    At = A.t()
    assert isinstance(At, sb.SparseTensor) and str(At.format) == "csc"
    assert At.level_buffers["crd1"] is A.level_buffers["crd1"]
    assert torch.equal(At.to_dense(), x.t())
    assert torch.equal(A.transpose(0, 1).to_dense(), x.t())
    X = random_dense((2, 3, 4), 0.5, seed=1)
    P = sb.sparse(X, "csf").permute(2, 0, 1)
    assert torch.equal(P.to_dense(), X.permute(2, 0, 1))


def test_pattern_preserving_ops():
    x = random_dense((5, 7), 0.3, seed=8)
    A = sb.sparse(x, "csr")
    for f in [torch.neg, torch.abs, torch.relu, lambda t: t * 2.5, lambda t: 3 * t, lambda t: t / 4]:
        y = f(A)
        assert isinstance(y, sb.SparseTensor) and y.format == A.format
        assert torch.equal(y.to_dense(), f(x))
    assert isinstance(A.clone(), sb.SparseTensor) and torch.equal(A.clone().to_dense(), x)


def test_unhandled_ops_densify_and_warn_once(monkeypatch):
    import scorch_backend.tensors.sparse_tensor as st

    monkeypatch.setattr(st, "_warned_ops", set())  # as in a fresh process (an earlier test may have warned)
    x = random_dense((4, 4), 0.5, seed=1)
    A = sb.sparse(x, "csr")
    with pytest.warns(UserWarning, match="aten.add.Tensor has no sparse implementation"):
        y = A + 1
    assert torch.equal(y, x + 1)
    # Division by zero would make the zeros NaN: that is not pattern-preserving, so it goes dense, correctly.
    with pytest.warns(UserWarning):
        z = A / 0.0
    assert torch.equal(z.isnan(), (x / 0.0).isnan())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A + 2  # second time: no warning


def test_torch_compile_passes_sparse_tensors_through():
    x = random_dense((6, 5), 0.3, seed=2)
    for fmt in ["csr", "coo", "bsr(2,5)", "csc"]:
        A = sb.sparse(x, fmt)
        torch._dynamo.reset()

        @torch.compile(fullgraph=True)
        def scale(t):
            return t * 2.0

        out = scale(A)
        assert isinstance(out, sb.SparseTensor)
        assert out.format == A.format
        assert torch.equal(out.to_dense(), x * 2)

        @torch.compile
        def identity_t(t):
            return t.t()

        out = identity_t(A)
        assert isinstance(out, sb.SparseTensor) and out.format == A.format.permute_dims([1, 0])
        assert torch.equal(out.to_dense(), x.t())


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("n", [4, 600])
def test_duplicates_of_a_non_unique_last_level_are_summed(dispatch, n, monkeypatch):
    # Each entry stored as two halves with the same coordinate: a run the loops would read as one entry.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    from scorch_backend import SparseTensor

    D = random_dense((n, n), 0.3, seed=5)
    csr = sb.sparse(D, "csr")
    pos, crd = csr.level_buffers.values()
    halves = csr.stored_values / 2
    A = SparseTensor("dense(0),compressed[nonunique](1)", (n, n), [pos * 2, crd.repeat_interleave(2)],
                     halves.repeat_interleave(2))
    torch.testing.assert_close(A.to_dense(), D)
    x = torch.randn(n)
    for got, want in ((sb.einsum("ij->i", A), D.sum(1)), (sb.einsum("ij,j->i", A, x), D @ x),
                      (sb.einsum("ij,kj->ik", A, A), D @ D.T)):
        got = got.to_dense() if isinstance(got, SparseTensor) else got
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close((A + A).to_dense(), 2 * D)
    torch.testing.assert_close((A * A).to_dense(), D * D, rtol=1e-5, atol=1e-5)
    plan = sb.plan_einsum("ij,j->i", A, x)
    assert plan["convert"] and any("non-unique" in r for r in plan["reasons"])


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_a_leaf_with_duplicates_used_twice_gets_each_use_once(dispatch, monkeypatch):
    # Autograd adds the two uses' gradients, both in the leaf's pattern: position by position. A merge summed
    # each coordinate's duplicates into every copy, and each stored value got twice its gradient.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    from scorch_backend import SparseTensor

    n = 9
    D = random_dense((n, n), 0.4, seed=6)
    csr = sb.sparse(D, "csr")
    pos, crd = csr.level_buffers.values()
    A = SparseTensor("dense(0),compressed[nonunique](1)", (n, n), [pos * 2, crd.repeat_interleave(2)],
                     (csr.stored_values / 2).repeat_interleave(2)).requires_grad_()
    x, y = torch.randn(n), torch.randn(n)
    (sb.einsum("ij,j->i", A, x).sum() + sb.einsum("ij,j->i", A, y).pow(2).sum()).backward()
    Dl = D.clone().requires_grad_()
    ((Dl @ x).sum() + (Dl @ y).pow(2).sum()).backward()
    torch.testing.assert_close(A.grad.stored_values, Dl.grad[tuple(A.coordinates())], rtol=1e-5, atol=1e-5)
    # Sums of one pattern stay in it, duplicates included, and mean what the dense sums mean.
    torch.testing.assert_close((A - 0.5 * A).to_dense(), 0.5 * D)


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("fmt", ["dense(0),dense(1/2),dense(1%2)", "dense(0/2),dense(1),dense(0%2)",
                                 "dense(1/4),dense(0),dense(1%4)"])
def test_all_dense_blocked_formats(dispatch, fmt, monkeypatch):
    # Stored in level order with a dimension split into blocks: no permute of the tensor's own dimensions fits.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    D = random_dense((6, 8), 0.5, seed=8)
    A = sb.sparse(D, "csr")
    for B in (A.to_format(fmt), sb.sparse(D, fmt)):
        assert B.format.all_dense
        torch.testing.assert_close(B.to_dense(), D)
    torch.testing.assert_close(A.to_format(fmt).stored_values, sb.sparse(D, fmt).stored_values)
    out = sb.einsum("ij,jk->ik", A, torch.eye(8), out_format=fmt)
    torch.testing.assert_close(out.to_dense(), D)
    with pytest.raises(ValueError, match="divisible"):
        sb.sparse(random_dense((5, 8), 0.5, seed=1), "dense(0/2),dense(1),dense(0%2)")


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("fmt", ["compressed(0),singleton(1)", "dense(0),singleton(1)"])
def test_one_entry_per_row_formats_in_unions_products_and_other_orders(monkeypatch, dispatch, fmt):
    # A singleton level under a unique parent promises one entry per row: the result of a union, of a product
    # with another sparse operand, or the operand converted to another dimension order, need not keep that
    # promise (helper-45: "a singleton level needs exactly one coordinate per parent"); each is stored
    # compressed then. A product with dense operands keeps the operand's own pattern and format.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    x = torch.zeros(5, 6, dtype=torch.float64)
    x[0, 1], x[1, 1], x[2, 3], x[3, 0], x[4, 5] = 1, 2, 3, 4, 5  # one entry in every row (dense(0) needs it)
    z = torch.zeros(5, 6, dtype=torch.float64)
    z[0, 2], z[1, 1], z[2, 0], z[3, 4], z[4, 5] = 6, 7, 8, 9, 10
    A, B = sb.sparse(x, fmt), sb.sparse(z, fmt)
    full = torch.randn(5, 6, dtype=torch.float64)
    C, T = sb.sparse(z, "csr"), sb.sparse(full, "csc")
    for got, want in [(A + A, 2 * x), (A + B, x + z), (A + C, x + z), (C + A, x + z), (A - B, x - z),
                      (sb.einsum("ij,ij->ij", T, A), full * x), (sb.einsum("ij,ij->ij", A, C), x * z),
                      (sb.einsum("ij,ij->ij", A, full), x * full)]:
        torch.testing.assert_close(got.to_dense() if isinstance(got, sb.SparseTensor) else got, want)
    y = torch.randn(5, 3, dtype=torch.float64)
    torch.testing.assert_close(sb.einsum("ji,jk->ik", A, y), x.t() @ y)
    torch.testing.assert_close(sb.einsum("ij,kj->ik", A, B).to_dense(), x @ z.t())
    same = sb.einsum("ij,ij->ij", A, full)
    assert not isinstance(same, sb.SparseTensor) or same.nnz == A.nnz


def test_the_to_dense_op_checks_its_values():
    # A raw scatter since to_dense stopped building coordinates: a 2-D values tensor whose first size matches
    # the count scattered its first elements silently (helper-47). It is refused, as validate refuses it.
    S = sb.sparse(torch.tensor([[0.0, 1.0], [2.0, 0.0]]), "csr")
    bufs = list(S.level_buffers.values())
    with pytest.raises((ValueError, TypeError), match="values"):
        torch.ops.scorch.to_dense(bufs, torch.ones(2, 3), [2, 2], S.format.canonical)
    torch.testing.assert_close(torch.ops.scorch.to_dense(bufs, S.stored_values, [2, 2], S.format.canonical),
                               torch.tensor([[0.0, 1.0], [2.0, 0.0]]))


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (0, 5), (5, 0), (3, 5, 6), (64, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_to_csr_by_rows_matches_the_general_path(shape, dtype):
    # sb.sparse(dense, "csr") compresses rows directly (a count and a fill per row: 68 ms -> 3 ms for 1024^2):
    # the same buffers and values as packing the nonzeros' coordinates, NaN kept as a stored value.
    g = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    x = (torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.3)).to(dtype)
    if x.numel():
        x.view(-1)[x.numel() // 2] = float("nan")
    for index_dtype in (torch.int32, torch.int64):
        fast = sb.sparse(x, "csr", index_dtype=index_dtype)
        general = sb.sparse(x, "coo").to_format("csr", index_dtype=index_dtype)
        assert fast.format == general.format and fast.index_dtype == index_dtype == general.index_dtype
        for name, b in fast.level_buffers.items():
            assert torch.equal(b, general.level_buffers[name]), name
        torch.testing.assert_close(fast.stored_values, general.stored_values, equal_nan=True)
    # a transposed (non-contiguous) tensor takes the general path, with the same result
    t = x.transpose(-1, -2)
    torch.testing.assert_close(sb.sparse(t, "csr").to_dense(), t, equal_nan=True)
