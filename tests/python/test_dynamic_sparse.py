"""torch.compile with dynamic shapes of models that take a SparseTensor input (GNNs on graphs of any size): one
compile serves every graph size (node count and stored entries), in inference and training, with outputs and
gradients as in eager mode. Sizes 0 and 1 are PyTorch's own specialization (one more graph each, then none)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import scorch_backend as sb
from scorch_backend.tools import zoo

DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _gcn_inputs(nodes, edges, seed):
    return zoo.make("gcn", "test", nodes=nodes, edges=edges, seed=seed).inputs


GRAPHS = [(300, 3000, 0), (411, 5000, 3), (57, 400, 4)]


def _run(model, fn, x, adj, train: bool, mark=None):
    """The output, and in training the gradients of x and of the parameters (then cleared)."""
    x = x.clone().requires_grad_(train)
    if mark is not None:
        mark(x, adj)
    with torch.set_grad_enabled(train):
        out = fn(x, adj)
    if not train:
        return out.detach(), []
    out.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.detach(), grads


def _check(model, fast, x, adj, train, what, mark=None):
    out, grads = _run(model, fast, x, adj, train, mark)
    ref, ref_grads = _run(model, model, x, adj, train)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"{what}: output")
    for k, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=f"{what}: gradient {k}")


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_gcn_compiles_once_for_graphs_of_any_size(train):
    model = zoo.make("gcn", "test").model
    fast = torch.compile(model, backend="scorch", dynamic=True)
    for nodes, edges, seed in GRAPHS:
        _check(model, fast, *_gcn_inputs(nodes, edges, seed), train, f"{nodes} nodes")
        assert _graphs() == 1, f"recompiled for {nodes} nodes"


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_empty_and_one_node_graphs_add_only_pytorchs_size_specializations(train):
    model = zoo.make("gcn", "test").model
    fast = torch.compile(model, backend="scorch", dynamic=True)
    _check(model, fast, *_gcn_inputs(300, 3000, 0), train, "300 nodes")
    n = 50
    empty = sb.sparse(torch.zeros(n, n), "csr")  # no edges at all: nothing stored
    _check(model, fast, torch.rand(n, 32), empty, train, "no edges")
    one = sb.sparse(torch.ones(1, 1), "csr")
    _check(model, fast, torch.rand(1, 32), one, train, "one node")
    assert _graphs() <= 3  # Dynamo specializes sizes 0 (no stored entries) and 1 (one node)
    for nodes, edges, seed in GRAPHS[1:]:
        _check(model, fast, *_gcn_inputs(nodes, edges, seed), train, f"{nodes} nodes")
    assert _graphs() <= 3


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_automatic_dynamic_recompiles_at_most_once(train):
    model = zoo.make("gcn", "test").model
    fast = torch.compile(model, backend="scorch")  # dynamic=None: static first, dynamic after one change
    for nodes, edges, seed in GRAPHS + [(123, 900, 5)]:
        _check(model, fast, *_gcn_inputs(nodes, edges, seed), train, f"{nodes} nodes")
    assert _graphs() == 2


def test_mark_dynamic_on_the_features_and_the_adjacency():
    model = zoo.make("gcn", "test").model
    fast = torch.compile(model, backend="scorch")

    def mark(x, adj):  # the node count (features, adjacency, row pointers) and the stored entries
        for t in (x, adj, adj.pos1, adj.crd1, adj.stored_values):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(adj, 1)

    for nodes, edges, seed in GRAPHS:
        _check(model, fast, *_gcn_inputs(nodes, edges, seed), True, f"{nodes} nodes", mark)
    assert _graphs() == 1


def test_sparse_operand_gradient_under_dynamic_shapes():
    """A SparseTensor leaf that requires grad: its gradient (at its stored positions) is traced with symbolic
    sizes too, so new graphs need no recompile."""
    def f(x, adj):
        return torch.relu(adj @ x).square().sum()

    fast = torch.compile(f, backend="scorch", dynamic=True)
    for n, seed in ((30, 0), (41, 1), (57, 2)):
        g = torch.Generator().manual_seed(seed)
        dense = torch.rand(n, n, generator=g)
        dense[dense < 0.8] = 0
        x = torch.randn(n, 8, generator=g)
        a, b = sb.sparse(dense, "csr").requires_grad_(), sb.sparse(dense, "csr").requires_grad_()
        fast(x, a).backward()
        f(x, b).backward()
        assert isinstance(a.grad, sb.SparseTensor) and a.grad.nnz == a.nnz
        torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(), rtol=1e-4, atol=1e-5)
    assert _graphs() == 1


def test_pyg_gcnconv_with_a_scorch_adj_t_compiles_once():
    pytest.importorskip("torch_geometric", reason="torch_geometric is in the test extra")
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    layer = GCNConv(32, 16, normalize=False, add_self_loops=False)
    ref = GCNConv(32, 16, normalize=False, add_self_loops=False)
    ref.load_state_dict(layer.state_dict())
    fast = torch.compile(layer, backend="scorch", dynamic=True, fullgraph=True)
    for nodes, edges, seed in GRAPHS:
        x, adj = _gcn_inputs(nodes, edges, seed)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = fast(x1, adj)
        out.square().sum().backward()
        coo = adj.to_torch(torch.sparse_coo).coalesce()
        expect = ref(x2, coo.indices().flip(0), coo.values())  # PyG's edge-index path, eagerly
        expect.square().sum().backward()
        torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(layer.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        layer.zero_grad()
        ref.zero_grad()
    assert _graphs() == 1


def test_no_size_constant_left_in_the_traced_kernel_calls():
    """The traced graph hands the kernel op symbolic sizes: the example's node count must not appear as a
    constant among them (it did: a no_grad graph then ran a larger graph with the example's sizes)."""
    from torch._subclasses.fake_tensor import is_fake

    from scorch_backend.tensors import frontend

    seen = []
    real = frontend._kernel_below_autograd

    def spy(spec, inputs, sizes, threads):
        if any(is_fake(t) for t in inputs):  # traced (the backend's example run has real tensors)
            seen.append(list(sizes))
        return real(spec, inputs, sizes, threads)

    frontend._kernel_below_autograd = spy
    try:
        model = zoo.make("gcn", "test").model
        fast = torch.compile(model, backend="scorch", dynamic=True)
        with torch.no_grad():
            fast(*_gcn_inputs(300, 3000, 0))
    finally:
        frontend._kernel_below_autograd = real
    assert seen
    for sizes in seen:
        assert 300 not in [s for s in sizes if isinstance(s, int)], sizes
        assert any(isinstance(s, torch.SymInt) for s in sizes), sizes


def _random_sparse(n: int, m: int, seed: int, fmt: str = "csr", grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, m, generator=g) * (torch.rand(n, m, generator=g) < 0.4)
    extra = {"blocksize": (2, 2)} if fmt == "bsr" else {}
    return dense, sb.sparse(dense, fmt, **extra).requires_grad_(grad)


@pytest.mark.parametrize("body", ["to_dense", "coordinates"])
@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsr", "bsr"])
def test_format_ops_keep_symbolic_sizes(body, fmt):
    """to_dense() and coordinates() inside a dynamic compile: the format ops take SymInt[] sizes, so one graph
    serves every shape (with int[] each new shape specialized the sizes and compiled again). Duck shaping is off:
    it gives equal sizes one symbol, and a DCSR operand whose stored-row count equals its row count by chance
    then recompiles for the next shape (a guard of PyTorch's, not of these ops)."""
    def f(A, x):
        if body == "to_dense":
            return A.to_dense() @ x
        return A.coordinates().to(x.dtype).sum() + x.sum()

    from torch.fx.experimental import _config as fx_config

    fast = torch.compile(f, backend="scorch", dynamic=True)
    with fx_config.patch(use_duck_shape=False):
        for k, n in enumerate((6, 10, 14, 18)):
            _, A = _random_sparse(n, n, k, fmt)
            x = torch.randn(n)
            torch.testing.assert_close(fast(A, x), f(A, x), rtol=1e-5, atol=1e-5)
    assert _graphs() == 1


@pytest.mark.parametrize("backend", ["scorch", "aot_eager"])
def test_sparse_result_that_requires_grad_under_dynamic_shapes(backend):
    """A product of two SparseTensors (a sparse result) whose operand requires grad, densified, under
    dynamic=True: the traced graph returned None for the result's sizes and the call raised 'sizes must be
    integers, got None'. Now outputs and gradients match eager for every shape."""
    def f(A, B):
        return (A * B).to_dense()

    fast = torch.compile(f, backend=backend, dynamic=True)
    for k, (n, m) in enumerate(((6, 5), (9, 7), (13, 11))):
        Ad, A = _random_sparse(n, m, 2 * k, grad=True)
        Bd, B = _random_sparse(n, m, 2 * k + 1)
        out = fast(A, B)
        torch.testing.assert_close(out, Ad * Bd)
        out.square().sum().backward()
        expect = (2 * Ad * Bd * Bd) * (Ad != 0)
        torch.testing.assert_close(A.grad.to_dense(), expect, rtol=1e-5, atol=1e-6)


def test_inductor_cache_keys_carry_scorch_op_schemas(monkeypatch):
    """Inductor's and AOTAutograd's cache keys hold a graph's code, not the schemas of the custom ops it calls:
    after a schema change (the format ops' sizes int[] -> SymInt[]) a warm cache returned graphs traced against
    the old one, and the test above failed again on a machine with such entries. Nor what the ops' C++ side
    writes while the backward is traced: after the gradient programs changed layout, a warm cache returned the
    old backward graph (test_backend_training's embedding gradient kept failing). The backend compiles with a
    cache tag naming a digest of Scorch's op schemas and native libraries, after any tag of the user's."""
    from scorch_backend.compiler import backend

    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, *args, **kwargs):
        seen.append(torch.compiler.config.cache_key_tag)
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    for user_tag in ("", "mine"):
        torch._dynamo.reset()
        with torch.compiler.config.patch(cache_key_tag=user_tag):
            torch.compile(lambda x: torch.relu(x) * 2, backend="scorch")(torch.randn(4))
            assert torch.compiler.config.cache_key_tag == user_tag  # (put back after the compile)
        assert seen, "the backend did not hand the graph to Inductor"
        prefix = f"{user_tag}|scorch-" if user_tag else "scorch-"
        assert seen[-1] == prefix + backend._native_digest(), seen[-1]
    # The digest covers the libraries' bytes: another build gives another tag.
    backend._native_digest.cache_clear()
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (
        __import__("io").BytesIO(b"another build") if str(path).endswith(".so") else real_open(path, *a, **k)))
    assert backend._native_digest() != seen[-1][len(prefix):]
    backend._native_digest.cache_clear()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("body", ["times_two", "with_values"])
def test_compiled_sparse_result_takes_a_dense_gradient(body, dynamic):
    """A compiled function returning a SparseTensor that requires grad, the loss taken after it by ordinary ops:
    the gradient reaching the graph is dense, and AOTAutograd wanted a SparseTensor ("Expected a SparseTensor
    tangent but got a plain Tensor", helper-65). Gradients match eager, at the stored positions."""
    def f(A):
        return A * 2.0 if body == "times_two" else A.with_values(A.stored_values * 2)

    fast = torch.compile(f, backend="scorch", dynamic=dynamic)
    for k, (n, m) in enumerate(((6, 5), (9, 7))):
        _, a = _random_sparse(n, m, k, grad=True)
        _, b = _random_sparse(n, m, k, grad=True)
        out = fast(a)
        assert isinstance(out, sb.SparseTensor) and out.requires_grad
        out.square().sum().backward()
        f(b).square().sum().backward()
        torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense())


@pytest.mark.parametrize("fmt", ["dcsr", "csr"])
def test_compiled_product_with_a_sparse_intermediate_trains(fmt):
    """A DCSR matrix with few stored values times a vector is stored as a sparse vector, the graph breaks after
    it, and the next graph's dense gradient met the SparseTensor output of the first (helper-65), at nnz 0 too."""
    fast = torch.compile(lambda A, x: (A @ x).square().sum(), backend="scorch", dynamic=True)
    for dense in (torch.eye(6), torch.zeros(8, 8), torch.eye(6) * 3, torch.ones(1, 1)):
        A = sb.sparse(dense, fmt).requires_grad_()
        x = torch.randn(dense.shape[1], requires_grad=True)
        fast(A, x).backward()
        expect = 2 * torch.outer(dense @ x.detach(), x.detach()) * (dense != 0)
        torch.testing.assert_close(A.grad.to_dense(), expect)
        torch.testing.assert_close(x.grad, 2 * dense.T @ (dense @ x.detach()))


def test_einsum_under_fullgraph_names_the_way_out():
    """sb.einsum and sb.compute run between graphs (Dynamo cannot trace the planner): under fullgraph=True the
    error said only that Dynamo cannot trace a pybind11 builtin. It now says what to write instead, and the
    same product written with torch ops compiles whole."""
    dense = torch.eye(6, 5)
    A, x = sb.sparse(dense, "csr"), torch.randn(5)
    for f in (lambda A, x: sb.einsum("ij,j->i", A, x), lambda A, x: sb.compute("y(i) = A(i,j) * x(j)", A=A, x=x)):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"runs between compiled graphs .* torch ops on SparseTensors"):
            torch.compile(f, backend="scorch", fullgraph=True)(A, x)
    torch._dynamo.reset()
    out = torch.compile(lambda A, x: torch.einsum("ij,j->i", A, x), backend="scorch", fullgraph=True)(A, x)
    torch.testing.assert_close(out, dense @ x)
    # Without fullgraph the call is one break: Dynamo used to trace into sb.einsum and break at each pybind11
    # call in resume frames (3 graphs here, and ~15x the eager time per call).
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(lambda A, x: sb.einsum("ij,j->i", A, x).relu() + 1, backend="scorch")(A, x)
    torch.testing.assert_close(out, (dense @ x).relu() + 1)
    assert _graphs() == 1
