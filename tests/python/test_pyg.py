"""PyG interop: a Scorch SparseTensor (CSR) as the sparse `adj_t` of torch_geometric layers, eager and compiled
with backend "scorch", against the same layers run eagerly on PyG's edge-index path. The graph is Cora from
the data folder (../shared/data), or a generated graph of its size when the folder is absent."""

import warnings

import pytest
import torch

import scorch_backend as sb
from scorch_backend.tensors import frontend

pyg = pytest.importorskip("torch_geometric", reason="torch_geometric is in the test extra (pip install -e .[test])")
from torch_geometric.nn import GATConv, GCNConv, SAGEConv  # noqa: E402
from torch_geometric.nn.conv.gcn_conv import gcn_norm  # noqa: E402
from torch_geometric.utils import is_sparse, is_torch_sparse_tensor  # noqa: E402

WIDTH = 64  # Cora's first 64 feature columns: the layers' arithmetic is what is checked, not the width


@pytest.fixture(scope="module")
def cora():
    """(x, normalized adjacency as a Scorch CSR SparseTensor, binary adjacency as one, source)."""
    from scorch_backend.tools import zoo

    case = zoo.gcn("bench", dataset="cora")
    x, A = case.inputs
    binary = A.with_values(torch.ones_like(A.stored_values))
    return x[:, :WIDTH].contiguous(), A, binary, case.info["source"]


def _edge_index(A: sb.SparseTensor):
    """PyG's (edge_index, edge_weight) for adj_t = A: an entry A[i, j] is an edge from j to i."""
    coo = A.to_torch(torch.sparse_coo).coalesce()
    return coo.indices().flip(0).clone(), coo.values().clone()


LAYERS = {
    # name: (constructor, uses the adjacency's values as edge weights)
    "GCNConv": (lambda: GCNConv(WIDTH, 16, normalize=False, add_self_loops=False), True),
    "SAGEConv": (lambda: SAGEConv(WIDTH, 16, aggr="mean"), False),
    "GATConv": (lambda: GATConv(WIDTH, 8, heads=2, add_self_loops=False), False),
}


def test_pyg_reads_a_scorch_csr_tensor_as_sparse(cora):
    _, A, _, _ = cora
    assert A.layout == torch.sparse_csr
    assert is_torch_sparse_tensor(A) and is_sparse(A)
    assert not is_torch_sparse_tensor(sb.sparse(torch.eye(3), "dcsr"))  # no torch layout stores it


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pyg_layer_on_cora_matches_edge_index_path(cora, name, compiled, monkeypatch):
    x, A, binary, _ = cora
    make, weighted = LAYERS[name]
    adj = A if weighted else binary
    ei, ew = _edge_index(adj)
    torch.manual_seed(0)
    ref_layer = make()
    torch.manual_seed(0)
    layer = make()
    calls = []
    real = frontend.einsum
    monkeypatch.setattr(frontend, "einsum", lambda *a, **k: calls.append(a[0]) or real(*a, **k))

    ref = ref_layer(x, ei, ew) if weighted else ref_layer(x, ei)
    ref.square().sum().backward()
    torch._dynamo.reset()
    run = torch.compile(layer, backend="scorch", fullgraph=True) if compiled else layer
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="scorch: .* has no sparse implementation")
        out = run(x, adj)
        out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for (pname, p), q in zip(layer.named_parameters(), ref_layer.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name}.{pname}")
    if name != "GATConv":  # GAT's attention runs as PyG's gather/scatter on the indices; no product to fuse
        assert calls, f"{name}'s aggregation did not reach a Scorch kernel"


def test_pyg_gcn_trains_compiled_from_torch_sparse_input(cora):
    """A two-layer PyG GCN that takes a torch.sparse CSR adj_t, compiled with sb.compile (the tensor is
    converted per call), trains like the eager model on the torch.sparse tensor."""
    x, A, _, _ = cora
    adj_t = A.to_torch(torch.sparse_csr)

    class GCN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GCNConv(WIDTH, 16, normalize=False, add_self_loops=False)
            self.conv2 = GCNConv(16, 7, normalize=False, add_self_loops=False)

        def forward(self, x, adj_t):
            return self.conv2(self.conv1(x, adj_t).relu(), adj_t)

    torch.manual_seed(0)
    model = GCN()
    torch.manual_seed(0)
    ref = GCN()
    torch._dynamo.reset()
    fast = sb.compile(model, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    labels = torch.arange(x.shape[0]) % 7
    for _ in range(3):
        for m, o, f in ((model, opt, fast), (ref, opt_ref, ref)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(f(x, adj_t), labels)
            loss.backward()
            o.step()
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=pname)


def test_gcn_normalization_done_once_outside_the_model(cora):
    """GCNConv(normalize=True) builds torch.sparse tensors inside the layer, which torch.compile cannot trace;
    normalizing once with PyG's gcn_norm and converting gives the same layer output compiled."""
    x, _, binary, _ = cora
    torch.manual_seed(0)
    layer = GCNConv(WIDTH, 16)
    ref = layer(x, binary.to_torch(torch.sparse_csr))
    norm, _ = gcn_norm(binary.to_torch(torch.sparse_csr))
    torch.manual_seed(0)
    plain = GCNConv(WIDTH, 16, normalize=False)
    torch._dynamo.reset()
    out = torch.compile(plain, backend="scorch", fullgraph=True)(x, sb.from_torch_sparse(norm))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_pyg_takes_a_scorch_coo_adj_t_eagerly(cora):
    """A COO SparseTensor: PyG converts it to CSR (to_sparse_csr() gives a Scorch CSR) and runs the same SpMM.
    (Compiled with fullgraph, PyG's warning about that conversion stops Dynamo: pass CSR, as PyG advises.)"""
    x, A, _, _ = cora
    torch.manual_seed(0)
    layer = GCNConv(WIDTH, 16, normalize=False, add_self_loops=False)
    ref = layer(x, *_edge_index(A))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Converting sparse tensor to CSR")
        out = layer(x, A.to_format("coo"))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
