"""Train a 2-layer GCN (Kipf & Welling) whose edge weights are learnable SparseTensor values.

    python examples/train_gcn.py                      # Cora from ../shared/data (a generated graph if absent)
    python examples/train_gcn.py --dataset citeseer --epochs 200
    python examples/train_gcn.py --bench              # forward+backward time against torch.sparse COO and CSR

Every sparse product (features @ W, A @ H) is a compiled Scorch kernel; their gradients, including those
of the edge weights (computed only at the graph's edges), are compiled kernels too.
"""

import argparse
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import scorch_backend as sb
from scorch_backend.tools import datasets
from scorch_backend.tools.timing import measure
# The Planetoid loaders moved to the model zoo; they stay importable from here (benchmarks/gcn.py uses them).
from scorch_backend.tools.zoo import generated_graph, load_planetoid, normalized_adjacency  # noqa: F401


def glorot(rows, cols, g):
    bound = (6.0 / (rows + cols)) ** 0.5
    return (torch.rand(rows, cols, generator=g) * 2 - 1) * bound


class ScorchGCN(nn.Module):
    """GCN on Scorch kernels; the normalized adjacency's values are a learnable parameter."""

    def __init__(self, adj: sb.SparseTensor, nfeat, nhid, nclass, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.pattern = adj
        self.edge_weight = nn.Parameter(adj.stored_values.clone())
        self.w1 = nn.Parameter(glorot(nfeat, nhid, g))
        self.w2 = nn.Parameter(glorot(nhid, nclass, g))

    def forward(self, x):
        a = self.pattern.with_values(self.edge_weight)
        h = sb.einsum("ij,jk->ik", x, self.w1)           # sparse features @ W1
        h = F.dropout(F.relu(sb.einsum("ij,jk->ik", a, h)), 0.5, self.training)
        return sb.einsum("ij,jk->ik", a, h @ self.w2)      # A @ (H W2)


class TorchSparseGCN(nn.Module):
    """The same model on torch.sparse (layout torch.sparse_coo or torch.sparse_csr)."""

    def __init__(self, adj: sb.SparseTensor, nfeat, nhid, nclass, layout, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        coo = adj.to_torch(torch.sparse_coo)
        self.layout = layout
        self.indices = coo.indices()
        self.shape = coo.shape
        self.edge_weight = nn.Parameter(coo.values().clone())
        self.w1 = nn.Parameter(glorot(nfeat, nhid, g))
        self.w2 = nn.Parameter(glorot(nhid, nclass, g))

    def adjacency(self):
        a = torch.sparse_coo_tensor(self.indices, self.edge_weight, self.shape, is_coalesced=True,
                                    check_invariants=False)
        return a if self.layout == torch.sparse_coo else a.to_sparse_csr()

    def forward(self, x):
        a = self.adjacency()
        h = torch.sparse.mm(x, self.w1)
        h = F.dropout(F.relu(torch.sparse.mm(a, h)), 0.5, self.training)
        return torch.sparse.mm(a, h @ self.w2)


def train(model, x, labels, train_idx, val_idx, test_idx, epochs, log=True):
    # Kipf's settings for the weights; the edge weights learn slowly and without decay, so that they refine
    # the normalized adjacency instead of overfitting 140 labels.
    opt = torch.optim.Adam([{"params": [model.w1], "weight_decay": 5e-4}, {"params": [model.w2]},
                            {"params": [model.edge_weight], "lr": 1e-3}], lr=0.01)
    losses = []
    for epoch in range(epochs):
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(x)[train_idx], labels[train_idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log and (epoch % 20 == 0 or epoch == epochs - 1):
            model.eval()
            with torch.no_grad():
                pred = model(x).argmax(1)
            val = (pred[val_idx] == labels[val_idx]).float().mean().item()
            print(f"epoch {epoch:4d}  loss {loss.item():.4f}  val acc {val:.3f}")
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(1)
    return losses, (pred[test_idx] == labels[test_idx]).float().mean().item()


def bench(models, x_of, labels, train_idx, repeats=20):
    """Median forward+backward time of each model (same thread count), warm-ups first."""
    out = {}
    for name, m in models.items():
        x = x_of[name]
        def step():
            m.zero_grad()
            F.cross_entropy(m(x)[train_idx], labels[train_idx]).backward()
        out[name] = measure(step, warmup=3, repeat=repeats).median
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="data folder (default ../shared/data)")
    ap.add_argument("--dataset", default="cora", choices=["cora", "citeseer"])
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="time forward+backward against torch.sparse COO and CSR")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    loaded = load_planetoid(datasets.data_dir(args.data), args.dataset)
    if loaded is None:
        print("data folder not found: training on a generated graph (stochastic block model)")
        loaded = generated_graph()
        name = "generated SBM"
    else:
        name = args.dataset
    adj, feats, labels, train_idx, val_idx, test_idx = loaded
    a = sb.sparse(normalized_adjacency(adj), "csr")
    rows = np.asarray(feats.sum(1)).ravel()
    rows[rows == 0] = 1
    import scipy.sparse as sp

    x = sb.sparse((sp.diags(1.0 / rows) @ feats).tocsr().astype(np.float32), "csr")  # row-normalized, as Kipf
    nclass = int(labels.max()) + 1
    print(f"{name}: {a.shape[0]} nodes, {a.nnz} adjacency entries (with self-loops), "
          f"{x.shape[1]} features ({x.nnz} nonzeros), {nclass} classes, {args.threads} threads")

    model = ScorchGCN(a, x.shape[1], args.hidden, nclass)
    t0 = time.perf_counter()
    losses, acc = train(model, x, labels, train_idx, val_idx, test_idx, args.epochs)
    print(f"trained {args.epochs} epochs in {time.perf_counter() - t0:.1f} s: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}, test accuracy {acc:.3f}")
    moved = (model.edge_weight.detach() - a.stored_values).abs().max().item()
    print(f"edge weights learned: largest change {moved:.4f} over {a.nnz} edges")

    if args.bench:
        feats_coo = x.to_torch(torch.sparse_coo)
        models = {"scorch": ScorchGCN(a, x.shape[1], args.hidden, nclass),
                  "torch.sparse COO": TorchSparseGCN(a, x.shape[1], args.hidden, nclass, torch.sparse_coo)}
        x_of = {"scorch": x, "torch.sparse COO": feats_coo}
        try:
            csr = TorchSparseGCN(a, x.shape[1], args.hidden, nclass, torch.sparse_csr)
            F.cross_entropy(csr(x.to_torch(torch.sparse_csr))[train_idx], labels[train_idx]).backward()
            models["torch.sparse CSR"] = csr
            x_of["torch.sparse CSR"] = x.to_torch(torch.sparse_csr)
        except RuntimeError as e:
            print(f"torch.sparse CSR cannot train this model: {str(e).splitlines()[0]}")
        times = bench(models, x_of, labels, train_idx)
        print(f"\nforward+backward, median of 20 after 3 warm-ups, {args.threads} threads, {name}:")
        for k, t in times.items():
            print(f"  {k:18s} {t * 1e3:8.2f} ms   (scorch speedup {t / times['scorch']:.2f}x)")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
