"""torch.sparse in, Scorch out: models that take or hold torch.sparse tensors, compiled with sb.compile
(backend "scorch", fullgraph=True), against the same code run eagerly on torch.sparse."""

import warnings

import pytest
import torch

import scorch_backend as sb
from scorch_backend.tensors import frontend
from scorch_backend.tensors import sparse_tensor as st

from conftest import random_dense

LAYOUTS = {
    "coo": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "csc": lambda d: d.to_sparse_csc(),
}

PRODUCTS = {
    "sparse.mm": lambda A, x: torch.sparse.mm(A, x),
    "matmul operator": lambda A, x: A @ x,
    "torch.mm": lambda A, x: torch.mm(A, x),
    "torch.matmul": lambda A, x: torch.matmul(A, x),
    "to_dense": lambda A, x: A.to_dense() @ x,
    "sparse.addmm": lambda A, x: torch.sparse.addmm(torch.ones(A.shape[0], x.shape[1]), A, x, beta=0.5, alpha=2.0),
}


@pytest.fixture
def no_dense_copies():
    """Any SparseTensor op that falls back to a dense copy fails the test (the products must be kernels)."""
    st._warned_ops.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="scorch: .* has no sparse implementation")
        yield


@pytest.fixture
def einsum_calls(monkeypatch):
    """Counts the products that reach Scorch's einsum (the kernels' entry), while tracing or eager."""
    calls = []
    real = frontend.einsum

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(frontend, "einsum", counting)
    return calls


def _close(a, b, tol=1e-5):
    a = a.to_dense() if a.layout != torch.strided or isinstance(a, sb.SparseTensor) else a
    b = b.to_dense() if b.layout != torch.strided else b
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op", list(PRODUCTS))
def test_products_on_sparse_inputs_match_eager(layout, op, no_dense_copies, einsum_calls):
    torch._dynamo.reset()
    d = random_dense((24, 20), 0.15, seed=3)
    f = PRODUCTS[op]
    A = LAYOUTS[layout](d)
    x = torch.randn(20, 5, requires_grad=True)
    fast = sb.compile(f, fullgraph=True)
    y = fast(A, x)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = f(A, x_ref)
    ref.sum().backward()
    _close(y, ref)
    _close(x.grad, x_ref.grad)
    if op != "to_dense":
        assert einsum_calls, f"{op} on a converted {layout} tensor did not reach a Scorch kernel"


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_gradient_of_sparse_values_matches_eager(layout):
    """A sparse input built from values that require grad: the values' gradient is torch.sparse's."""
    torch._dynamo.reset()
    d = random_dense((16, 16), 0.2, seed=4)
    base = LAYOUTS[layout](d)
    x = torch.randn(16, 3)

    def build(v):
        if layout == "csr":
            return torch.sparse_csr_tensor(base.crow_indices(), base.col_indices(), v, base.shape)
        return torch.sparse_coo_tensor(base.indices(), v, base.shape)

    base = base if layout == "csr" else base.coalesce()
    v = base.values().detach().clone().requires_grad_()
    v_ref = v.detach().clone().requires_grad_()
    fast = sb.compile(lambda A, x: torch.sparse.mm(A, x).relu(), fullgraph=True)
    out = fast(build(v), x)
    (out * torch.arange(3.0)).sum().backward()
    ref = torch.sparse.mm(build(v_ref), x).relu()
    (ref * torch.arange(3.0)).sum().backward()
    _close(out, ref)
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-5, atol=1e-5)


class _GCN(torch.nn.Module):
    """Two graph convolutions over an adjacency held as a sparse buffer."""

    def __init__(self, adj, n_in=8, n_hidden=6, n_out=3):
        super().__init__()
        self.register_buffer("adj", adj)
        self.lin1 = torch.nn.Linear(n_in, n_hidden)
        self.lin2 = torch.nn.Linear(n_hidden, n_out)

    def forward(self, x):
        h = torch.sparse.mm(self.adj, self.lin1(x)).relu()
        return self.adj @ self.lin2(h)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_model_holding_a_sparse_buffer(layout, no_dense_copies):
    torch._dynamo.reset()
    d = random_dense((40, 40), 0.1, seed=5)
    torch.manual_seed(0)
    model = _GCN(LAYOUTS[layout](d))
    torch.manual_seed(0)
    ref = _GCN(LAYOUTS[layout](d))
    x = torch.randn(40, 8)
    fast = sb.compile(model, fullgraph=True)
    assert isinstance(model.adj, sb.SparseTensor) and model.adj.layout == LAYOUTS[layout](d).layout
    for _ in range(2):
        out = fast(x)
        out.square().sum().backward()
    for _ in range(2):
        r = ref(x)
        r.square().sum().backward()
    _close(out, r)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


class _SparseLinear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return torch.sparse.mm(self.weight, x).tanh()


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_model_holding_a_sparse_parameter_trains_like_eager(layout):
    """A torch.sparse COO or CSR parameter: same outputs, a gradient at its stored positions, and an optimizer
    built before the conversion still updates it."""
    torch._dynamo.reset()
    d = random_dense((20, 12), 0.2, seed=6)
    model, ref = _SparseLinear(LAYOUTS[layout](d)), _SparseLinear(LAYOUTS[layout](d))
    param = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    fast = sb.compile(model, fullgraph=True)
    assert model.weight is param and isinstance(param, sb.SparseTensor)
    x = torch.randn(12, 4)
    for _ in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        out = fast(x)
        out.sum().backward()
        r = ref(x)
        r.sum().backward()
        _close(out, r)
        assert isinstance(param.grad, sb.SparseTensor)
        _close(param.grad, ref.weight.grad)
        opt.step()
        opt_ref.step()
        _close(param, ref.weight)


def test_layout_seen_by_compiled_code_is_torch_sparse():
    """Code that branches on the layout takes the same branch compiled as eager."""
    torch._dynamo.reset()
    d = random_dense((10, 10), 0.3, seed=7)

    def f(A, x):
        if A.layout == torch.sparse_csr:
            return A @ x * 2
        return A @ x

    x = torch.randn(10, 2)
    out = sb.compile(f, fullgraph=True)(d.to_sparse_csr(), x)
    torch.testing.assert_close(out, 2 * d @ x, rtol=1e-5, atol=1e-5)


def test_accessors_answer_as_torch_sparse():
    d = random_dense((7, 9), 0.3, seed=8)
    for torch_layout, fmt in [(torch.sparse_csr, "csr"), (torch.sparse_csc, "csc"), (torch.sparse_coo, "coo")]:
        t = {"csr": d.to_sparse_csr(), "csc": d.to_sparse_csc(), "coo": d.to_sparse()}[fmt]
        A = sb.from_torch_sparse(t)
        assert A.layout == torch_layout == t.layout
        if fmt == "csr":
            assert torch.equal(A.crow_indices().long(), t.crow_indices())
            assert torch.equal(A.col_indices().long(), t.col_indices())
        if fmt == "csc":
            assert torch.equal(A.ccol_indices().long(), t.ccol_indices())
            assert torch.equal(A.row_indices().long(), t.row_indices())
        if fmt == "coo":
            assert torch.equal(A.indices(), t.indices())
        assert torch.equal(A.values(), t.values())
        assert A._nnz() == t._nnz()
        if fmt == "coo":
            assert A.is_coalesced() and A.coalesce() is A
        assert A.to_sparse_csr().format.name == "csr" and torch.equal(A.to_sparse_csr().to_dense(), d)
    assert sb.sparse(d, "dcsr").layout == torch.strided  # no torch.sparse layout stores it
    with pytest.raises(RuntimeError, match="crow_indices.*csr"):
        sb.sparse(d, "csc").crow_indices()


def test_sparse_mm_reduce():
    d = random_dense((12, 10), 0.3, seed=9)
    x = torch.randn(10, 3, requires_grad=True)
    A = sb.from_torch_sparse(d.to_sparse_csr())
    for reduce in ("sum", "mean"):
        x.grad = None
        out = torch.sparse.mm(A, x, reduce)
        out.sum().backward()
        g = x.grad.clone()
        x_ref = x.detach().clone().requires_grad_()
        ref = torch.sparse.mm(d.to_sparse_csr(), x_ref, reduce)
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, x_ref.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="reduce='amax'"):
        torch.sparse.mm(A, x, "amax")


def test_changed_input_is_converted_again():
    """The per-call conversion cache sees an in-place change of the values."""
    torch._dynamo.reset()
    d = random_dense((10, 8), 0.3, seed=10)
    A = d.to_sparse_csr()
    x = torch.randn(8, 2)
    fast = sb.compile(lambda A, x: torch.sparse.mm(A, x), fullgraph=True)
    torch.testing.assert_close(fast(A, x), d @ x, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        A.values().mul_(3.0)
    torch.testing.assert_close(fast(A, x), 3 * d @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
@pytest.mark.parametrize("member", ["values", "indices"])
def test_writes_to_the_tensors_a_sparse_argument_was_built_from_are_seen(layout, member):
    # A torch.sparse tensor built from index and value tensors shares their storage but not their version
    # counters: writing the caller's own value (or index) tensor left every counter as it was and the cached
    # conversion gave the old result (helper-48).
    torch._dynamo.reset()
    d = random_dense((12, 9), 0.3, seed=12)
    d[0, :] = 0
    d[0, 0] = 5.0  # the first stored entry, alone in its row; moved below to (0, 1) (CSC: to (1, 0))
    d[1:3, 0] = 0
    x = torch.randn(9, 3)
    if layout == "coo":
        c = d.to_sparse_coo().coalesce()
        idx, vals = c.indices().clone(), c.values().clone()
        A = torch.sparse_coo_tensor(idx, vals, d.shape, is_coalesced=True)
        index = idx[1]  # each entry's column (a view: writing it writes idx)
    elif layout == "csr":
        c = d.to_sparse_csr()
        ptr, index, vals = c.crow_indices().clone(), c.col_indices().clone(), c.values().clone()
        A = torch.sparse_csr_tensor(ptr, index, vals, d.shape)
    else:
        c = d.to_sparse_csc()
        ptr, index, vals = c.ccol_indices().clone(), c.row_indices().clone(), c.values().clone()
        A = torch.sparse_csc_tensor(ptr, index, vals, d.shape)
    fast = sb.compile(lambda A, x: torch.sparse.mm(A, x), fullgraph=True)
    torch.testing.assert_close(fast(A, x), d @ x, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        if member == "values":
            vals.mul_(10.0)
        else:
            index[0] = 1
    want = A.to_dense() @ x
    assert not torch.allclose(want, d @ x)  # the write changed the product
    torch.testing.assert_close(fast(A, x), want, rtol=1e-5, atol=1e-5)


def test_training_through_a_sparse_product_made_dense_runs_as_eager():
    # The product's entry count is only known from data, and AOTAutograd's tracing branched on it: the compile
    # raised (helper-48). The graph now runs uncompiled around its Scorch ops, with eager's values and gradients.
    torch._dynamo.reset()
    a, b = random_dense((7, 6), 0.4, seed=13), random_dense((6, 5), 0.4, seed=14)
    w = torch.randn(7, 5)

    def leaves():
        A, B = a.to_sparse_csr(), b.to_sparse_csr()
        va, vb = A.values().clone().requires_grad_(), B.values().clone().requires_grad_()
        return (va, vb, torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), va, a.shape),
                torch.sparse_csr_tensor(B.crow_indices(), B.col_indices(), vb, b.shape))

    fn = lambda A, B: torch.sparse.mm(A, B).to_dense()  # noqa: E731
    va, vb, A, B = leaves()
    y = sb.compile(fn, fullgraph=True)(A, B)
    (y * w).sum().backward()
    ra, rb, A2, B2 = leaves()
    ref = fn(sb.from_torch_sparse(A2), sb.from_torch_sparse(B2))
    (ref * w).sum().backward()
    torch.testing.assert_close(y, a @ b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(va.grad, ra.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vb.grad, rb.grad, rtol=1e-5, atol=1e-5)
    # the gradient of each stored value of A: row i of w times B's rows, at A's stored columns
    ga = (w @ b.t())[a != 0]
    torch.testing.assert_close(va.grad, ga, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csc"])
@pytest.mark.parametrize("density", [0.0, 0.4, 1.0])
def test_torch_sparse_sum_and_softmax_on_converted_tensors_match_torch(fmt, density):
    # GCN code's degrees (torch.sparse.sum(adj, dim=1)) and attention over a sparse pattern (torch.sparse.softmax)
    # raised ATen dispatch errors on a converted tensor (helper-48).
    d = random_dense((7, 5), density, seed=15)
    if density:
        d[2] = 0  # an empty row
    T = d.to_sparse_coo().coalesce()
    S = sb.sparse(d, fmt)
    for dim in (0, 1, (0, 1), -1):
        torch.testing.assert_close(torch.sparse.sum(S, dim=dim).to_dense(), torch.sparse.sum(T, dim=dim).to_dense())
    torch.testing.assert_close(torch.sparse.sum(S), torch.sparse.sum(T))
    for dims in ((1, 1), (0, -2), (1, 0, -1)):  # a repeated dimension: torch's error, not a sum over it once
        with pytest.raises(RuntimeError, match="appears multiple times"):
            torch.sparse.sum(T, dims)
        with pytest.raises(RuntimeError, match="appears multiple times"):
            torch.sparse.sum(S, dims)
        with pytest.raises(RuntimeError, match="appears multiple times"):
            S.sum(dims)
    torch.testing.assert_close(torch.sparse.sum(S, dim=1, dtype=torch.float64).to_dense(),
                               torch.sparse.sum(T, dim=1, dtype=torch.float64).to_dense())
    w = torch.randn(7, 5)
    for fn in (torch.sparse.softmax, torch.sparse.log_softmax):
        for dim in (0, 1):
            vs = S.stored_values.clone().requires_grad_()
            got = fn(S.with_values(vs), dim)
            assert isinstance(got, sb.SparseTensor) and got.format == S.format
            vt = T.values().clone().requires_grad_()
            want = fn(torch.sparse_coo_tensor(T.indices(), vt, T.shape, is_coalesced=True), dim)
            torch.testing.assert_close(got.to_dense(), want.to_dense())
            (got.to_dense() * w).sum().backward()
            (want.to_dense() * w).sum().backward()
            # (S stores its values in its own order: compare the gradients as dense matrices)
            gs = S.with_values(vs.grad).to_dense()
            gt = torch.sparse_coo_tensor(T.indices(), vt.grad, T.shape).to_dense()
            torch.testing.assert_close(gs, gt)


def test_a_transposed_coo_reads_as_torch_reads_its_transpose():
    # S.t() of a "coo" SparseTensor (a permuted COO, no copy) read as strided: code branching on
    # `A.t().layout == torch.sparse_coo` took the other branch and indices()/coalesce() raised (helper-48).
    d = random_dense((5, 4), 0.4, seed=16)
    A = d.to_sparse_coo().coalesce()
    S = sb.from_torch_sparse(A)
    for T, ref in ((S.t(), A.t()), (S.permute(1, 0), A.permute(1, 0)), (S.t().t(), A.t().t())):
        assert T.layout == torch.sparse_coo == ref.layout
        coords, vals = T.indices(), T.values()
        # (torch marks every transpose uncoalesced; one stored in order may say it is, when it truly is)
        assert T.is_coalesced() == ref.is_coalesced() or (T.is_coalesced() and torch.equal(
            coords, torch.sparse_coo_tensor(coords, vals, T.shape).coalesce().indices()))
        torch.testing.assert_close(torch.sparse_coo_tensor(coords, vals, T.shape).to_dense(), ref.to_dense())
        C = T.coalesce()
        assert C.is_coalesced()
        torch.testing.assert_close(C.indices(), ref.coalesce().indices())
        torch.testing.assert_close(C.values(), ref.coalesce().values())
        assert T._nnz() == ref._nnz()
    f = sb.compile(lambda A: A.t().coalesce().indices().float().sum() if A.t().layout == torch.sparse_coo
                   else torch.tensor(-1.0), fullgraph=True)
    assert f(A).item() == A.t().coalesce().indices().float().sum().item()


def test_torch_sparse_functions_without_a_sparse_tensor_form_say_so():
    # torch.smm / hspmm / sspaddmm return torch.sparse's own layouts (hybrid COO): on a converted tensor they
    # raised ATen's dispatch errors (helper-48); now an error naming the function and what to use instead.
    S = sb.sparse(torch.eye(4), "coo")
    x = torch.randn(4, 3)
    for name, call in (("torch.smm", lambda: torch.smm(S, x)), ("torch.hspmm", lambda: torch.hspmm(S, x)),
                       ("torch.sspaddmm", lambda: torch.sspaddmm(S, S, x)),
                       ("Tensor.sspaddmm", lambda: S.sspaddmm(S, x))):
        with pytest.raises(NotImplementedError, match=f"{name} has no SparseTensor form.*to_torch"):
            call()
    torch.testing.assert_close(torch.smm(S.to_torch(), x).to_dense(), x)  # the way out it names


def test_unsupported_inputs_raise_clear_errors():
    d = random_dense((6, 6), 0.4, seed=11)
    hybrid = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 3), (6, 3))
    with pytest.raises(ValueError, match="hybrid"):
        sb.from_torch_sparse(hybrid)
    with pytest.raises(TypeError, match="float"):
        sb.from_torch_sparse(d.to(torch.int64).to_sparse())
    with pytest.raises(ValueError, match="sparse_bsc"):
        sb.from_torch_sparse(d.to_sparse_bsc((2, 2)))
    batched = torch.stack([d, d]).to_sparse_csr(dense_dim=0)
    with pytest.raises(ValueError, match="batched"):
        sb.from_torch_sparse(batched)
    with pytest.raises(TypeError, match="torch.sparse"):
        sb.from_torch_sparse(d)
    with pytest.raises(ValueError, match="backend='scorch'"):
        sb.compile(lambda x: x, backend="inductor")
    A = sb.from_torch_sparse(d.to_sparse_csr())
    with pytest.raises(NotImplementedError, match="in place"):
        A.exp_()  # (the unstored zeros would become ones; a scaling mul_ works on the stored values)


def test_bsr_input():
    torch._dynamo.reset()
    d = random_dense((8, 8), 0.3, seed=12)
    x = torch.randn(8, 3)
    fast = sb.compile(lambda A, x: torch.sparse.mm(A, x), fullgraph=True)
    torch.testing.assert_close(fast(d.to_sparse_bsr((2, 2)), x), d @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatch", ["auto"])
def test_products_under_the_automatic_dispatch(dispatch, monkeypatch):
    """Under the cost model (small products run dense), results and gradients are the same."""
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    test_model_holding_a_sparse_parameter_trains_like_eager("coo")


def test_bsr_gradient_comes_back_as_bsr():
    d = random_dense((8, 8), 0.3, seed=13)
    v = d.to_sparse_bsr((2, 2)).values().detach().clone().requires_grad_()
    base = d.to_sparse_bsr((2, 2))
    A = torch.sparse_bsr_tensor(base.crow_indices(), base.col_indices(), v, base.shape)
    x = torch.randn(8, 3)
    torch.sparse.mm(sb.from_torch_sparse(A), x).sum().backward()
    expected = (torch.ones(8, 3) @ x.t())  # d(sum(A @ x))/dA, taken inside the stored blocks
    blocks = expected.reshape(4, 2, 4, 2).permute(0, 2, 1, 3)
    rows = torch.repeat_interleave(torch.arange(4), base.crow_indices().diff())
    torch.testing.assert_close(v.grad, blocks[rows, base.col_indices()], rtol=1e-5, atol=1e-5)


def test_sten_model_weights_come_into_scorch_in_one_call():
    """A STen-sparsified model (sten.SparsityBuilder, CSR and COO weights): one sb.convert_module call turns
    its sparse weights into SparseTensors; the model then runs eagerly and under torch.compile (backend
    "scorch", fullgraph) with STen's outputs, and a sparse weight's gradient is the dense one at its pattern."""
    sten = pytest.importorskip("sten", reason="STen installs with pip install --no-deps sten (see docs/torch_sparse.md)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    builder = sten.SparsityBuilder()
    builder.set_weight(name="0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.9),
                       out_format=sten.CsrTensor)
    builder.set_weight(name="2.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5),
                       out_format=sten.CooTensor)
    sparse_model = builder.get_sparse_model(model)
    x = torch.randn(5, 32)
    expected = sparse_model(x).detach()
    dense = {n: (p.wrapped_tensor.to_dense() if hasattr(p, "wrapped_tensor") else p).detach().clone()
             for n, p in sparse_model.named_parameters()}

    assert sorted(sb.convert_module(sparse_model)) == ["0.weight", "2.weight"]
    w0, w2 = sparse_model[0].weight, sparse_model[2].weight
    assert isinstance(w0, sb.SparseTensor) and w0.format.name == "csr"
    assert isinstance(w2, sb.SparseTensor) and w2.format.name == "coo" and w2.requires_grad
    _close(w0, dense["0.weight"])
    torch.testing.assert_close(sparse_model(x), expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    out = torch.compile(sparse_model, backend="scorch", fullgraph=True)(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()

    w = dense["2.weight"].clone().requires_grad_()
    h = torch.relu(x @ dense["0.weight"].t() + dense["0.bias"])
    (h @ w.t() + dense["2.bias"]).square().sum().backward()
    assert isinstance(w2.grad, sb.SparseTensor)
    _close(w2.grad, w.grad * (dense["2.weight"] != 0))


def test_converted_model_saves_and_loads(tmp_path):
    """A model whose sparse buffer was converted saves its state with torch.save and loads it with torch.load
    (weights_only, the default) as SparseTensors; a file whose index buffers were tampered with is refused."""
    d = random_dense((12, 12), 0.2, seed=14)
    model = _GCN(d.to_sparse_csr())
    sb.convert_module(model)
    path = tmp_path / "state.pt"
    torch.save(model.state_dict(), path)
    state = torch.load(path)
    assert isinstance(state["adj"], sb.SparseTensor) and state["adj"].format == model.adj.format
    _close(state["adj"], d)
    fresh = _GCN(d.to_sparse_csr())
    sb.convert_module(fresh)
    fresh.load_state_dict(state)
    x = torch.randn(12, 8)
    torch.testing.assert_close(fresh(x), model(x))

    bad = sb.sparse(d, "csr")
    bad.level_buffers["crd1"][0] = 99  # a column out of range
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError):
        torch.load(tmp_path / "bad.pt")


# Building a SparseTensor where torch.compile(fullgraph=False) traces: the construction is a graph break, run
# as Python (Dynamo used to resume halfway through it and fail with an internal error on the unfinished
# object): sb.sparse, a sparse einsum result and a sum of SparseTensors.
def test_sparse_tensors_built_inside_compiled_functions():
    eye = torch.eye(5)
    made = torch.compile(lambda t: sb.sparse(t, "csr"), backend="eager")(eye)
    assert isinstance(made, sb.SparseTensor)
    torch.testing.assert_close(made.to_dense(), eye)
    torch._dynamo.reset()
    S = sb.sparse(eye * 3, "csr")
    prod = torch.compile(lambda a: sb.einsum("ij,ij->ij", a, a), backend="eager")(S)
    torch.testing.assert_close(prod.to_dense(), eye * 9)
    torch._dynamo.reset()
    total = torch.compile(lambda a, b: a + b, backend="eager")(S, sb.sparse(eye, "csr"))
    torch.testing.assert_close(total.to_dense(), eye * 4)
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr"])
@pytest.mark.parametrize("fmt", ["coo", "csc", "csr", "dcsr"])
def test_a_compressed_torch_tensor_with_bad_indices_is_a_value_error(layout, fmt):
    # Made without torch's invariant check; torch's own to_sparse_coo reads out of bounds on it (a SIGSEGV).
    pos, crd = torch.tensor([0, 2, 1]), torch.tensor([1, 0])
    if layout == "bsr":
        x = torch.sparse_bsr_tensor(pos, crd, torch.ones(2, 2, 2), (4, 4), check_invariants=False)
    else:
        make = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
        x = make(pos, crd, torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False)
    with pytest.raises(ValueError):
        sb.sparse(x, fmt)


BAD_COMPRESSED = {  # (pointers, indices, what the error names); a 2x2 matrix (2x2 blocks of 4x4 for BSR)
    "pointers decrease": ([0, 3, 2], [1, 0], "decreases"),
    "last pointer past the entries": ([0, 2, 9], [1, 0], "end at the number of stored entries"),
    "first pointer not 0": ([1, 1, 2], [1, 0], "start at 0"),
    "index past the end": ([0, 1, 2], [1, 7], "outside 0..1"),
    "negative index": ([0, 1, 2], [-3, 0], "outside 0..1"),
}


def _compressed(layout, pos, crd, values=None):
    pos, crd = torch.tensor(pos), torch.tensor(crd)
    if layout == "bsr":
        blocks = torch.ones(crd.numel(), 2, 2)
        return torch.sparse_bsr_tensor(pos, crd, blocks, (4, 4), check_invariants=False)
    make = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
    values = torch.arange(1.0, crd.numel() + 1) if values is None else values
    return make(pos, crd, values, (2, 2), check_invariants=False)


@pytest.mark.parametrize("case", list(BAD_COMPRESSED))
@pytest.mark.parametrize("layout", ["csr", "csc", "bsr"])
@pytest.mark.parametrize("entry", ["from_torch_sparse", "sparse_coo", "sparse_csr", "compiled_input"])
def test_bad_compressed_torch_tensors_are_refused_by_every_entry(case, layout, entry):
    # sb.from_torch_sparse (and the conversion of a compiled model's torch.sparse inputs) fell back to torch's
    # to_sparse_coo on a tensor whose own buffers were refused: a SIGSEGV for bad pointers.
    pos, crd, message = BAD_COMPRESSED[case]
    x = _compressed(layout, pos, crd)
    with pytest.raises(ValueError, match=message):
        if entry == "from_torch_sparse":
            sb.from_torch_sparse(x)
        elif entry == "compiled_input":
            torch._dynamo.reset()
            sb.compile(lambda a, v: a @ v)(x, torch.ones(x.shape[1]))  # the entry that converts torch.sparse
        else:
            sb.sparse(x, entry.split("_")[1])


@pytest.mark.parametrize("layout", ["csr", "csc"])
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", None])
def test_unsorted_and_repeated_indices_in_a_row_are_sorted_and_summed(layout, fmt):
    # torch allows them without its invariant check (docs/torch_sparse.md: re-sorted); sb.sparse refused them.
    x = _compressed(layout, [0, 3, 4], [1, 0, 1, 0], torch.tensor([1.0, 2.0, 4.0, 8.0]))
    want = torch.tensor([[2.0, 5.0], [8.0, 0.0]])
    want = want if layout == "csr" else want.t()
    for got in (sb.sparse(x, fmt) if fmt else sb.sparse(x), sb.from_torch_sparse(x)):
        torch.testing.assert_close(got.to_dense(), want)
        assert got.nnz == 3
