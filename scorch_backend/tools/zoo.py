"""A zoo of ordinary dense PyTorch models with sparsity in them, to test and benchmark torch.compile backends.

    from scorch_backend.tools import zoo
    case = zoo.make("moe")                       # small, fast: for tests
    case = zoo.make("moe", size="bench")         # the benchmark size
    case = zoo.make("gcn", size="bench", dataset="pubmed", data="../shared/data")
    out = case.model(*case.inputs)
    more = case.make_inputs(3)                   # inputs with batch size 3 (make_inputs is None: fixed batch)

Every entry is a factory `f(size="test", **options) -> Case`; `CASES` maps names to factories, and `make(name,
size, **options)` calls one. Everything is seeded (parameters and inputs come from torch.Generators, or, for
transformers' own initialisation, from a forked and seeded global RNG), so two calls build identical cases.

The models are written the way a user writes them: plain nn.Modules with dense tensors and no Scorch call in
`forward`. Their sparsity is in the data: pruned weights (pruned_mlp, bert_encoder), a sparse adjacency passed
in as a Scorch SparseTensor (gcn), one-hot gates (moe), a block mask (block_sparse_attention), top-k
activations (sparse_autoencoder) and ReLU activations that are mostly zeros (relu_mlp_sparse). relu_mlp_dense and
small_cnn have none, as controls.

The Planetoid loaders (`load_planetoid`, `planetoid_graph`, `normalized_adjacency`, `generated_graph`) live
here too; examples/train_gcn.py and benchmarks/gcn.py use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tensors.convert import sparse
from . import datasets
from .sparsify import prune

SIZES = ("test", "bench")


@dataclasses.dataclass
class Case:
    """One zoo model with its inputs.

    name:        the zoo name ("gcn/cora" and the like when an option picks a variant)
    model:       the nn.Module, in the mode it is meant to run in (train mode unless `info["eval"]`)
    inputs:      positional arguments of model.forward
    make_inputs: batch -> inputs of the same kind with another batch size, or None when the batch is fixed
    trainable:   whether forward + backward makes sense (every floating parameter gets a gradient)
    notes:       what is sparse in the model, and how the sizes were chosen
    size:        "test" or "bench"
    info:        facts for benchmarks and reports (sizes, sparsity, experts, dataset, ...)
    """

    name: str
    model: nn.Module
    inputs: tuple
    make_inputs: Callable[[int], tuple] | None
    trainable: bool = True
    notes: str = ""
    size: str = "test"
    info: dict = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{type(t).__name__}{tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
                           for t in self.inputs)
        return f"Case({self.name!r}, size={self.size!r}, {type(self.model).__name__}, inputs=({shapes}))"


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    return size


def _pick(size: str, test, bench, given=None):
    """`given` when not None, else the default of the size."""
    if given is not None:
        return given
    return test if _check_size(size) == "test" else bench


def _seeded_init(module: nn.Module, g: torch.Generator) -> nn.Module:
    """Re-draw the parameters of every Linear and Conv from `g`, with the bound PyTorch uses by default
    (uniform in +-1/sqrt(fan_in)); normalisation layers keep their deterministic ones and zeros."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            fan_in = m.weight[0].numel()
            bound = 1.0 / math.sqrt(fan_in)
            with torch.no_grad():
                m.weight.uniform_(-bound, bound, generator=g)
                if m.bias is not None:
                    m.bias.uniform_(-bound, bound, generator=g)
    return module


def _randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def weight_sparsity(model: nn.Module, types=(nn.Linear,)) -> float:
    """Fraction of zeros over the weights of the modules of `types`."""
    zeros = total = 0
    for m in model.modules():
        if isinstance(m, types):
            zeros += int((m.weight == 0).sum())
            total += m.weight.numel()
    return zeros / total if total else 0.0


# ----------------------------------------------------------------------------------------------------------
# pruned MLP and its dense control


class MLP(nn.Module):
    """Linear -> ReLU -> Linear -> ReLU -> Linear."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def _mlp_case(name, size, d_in, hidden, d_out, batch, seed, sparsity):
    g = torch.Generator().manual_seed(seed)
    model = _seeded_init(MLP(d_in, hidden, d_out), g)
    info = {"d_in": d_in, "hidden": hidden, "d_out": d_out, "batch": batch}
    if sparsity:
        prune(model, "magnitude", sparsity)
        info["sparsity"] = sparsity
        info["measured_sparsity"] = weight_sparsity(model)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, d_in, generator=gx),)

    x = make_inputs(batch)
    return Case(name, model, x, make_inputs, True, "", size, info)


def pruned_mlp(size: str = "test", *, batch: int | None = None, d_in: int = 256, hidden: int = 512,
               d_out: int = 10, sparsity: float = 0.9, seed: int = 0) -> Case:
    """Linear(256->512) ReLU Linear(512->512) ReLU Linear(512->10); every Linear weight magnitude-pruned to
    `sparsity` with scorch_backend.tools.sparsify.prune (zeros stored densely). Input (batch, 256): 8 for tests, 64
    for benchmarks."""
    batch = _pick(size, 8, 64, batch)
    c = _mlp_case("pruned_mlp", size, d_in, hidden, d_out, batch, seed, sparsity)
    c.notes = (f"3 Linear layers {d_in}->{hidden}->{hidden}->{d_out}, weights {sparsity:.0%} "
               "magnitude-pruned (dense tensors with zeros)")
    return c


def relu_mlp_dense(size: str = "test", *, batch: int | None = None, d_in: int = 256, hidden: int = 512,
                   d_out: int = 10, seed: int = 0) -> Case:
    """The pruned MLP's architecture with dense weights: no sparsity to find."""
    batch = _pick(size, 8, 64, batch)
    c = _mlp_case("relu_mlp_dense", size, d_in, hidden, d_out, batch, seed, 0.0)
    c.notes = f"3 dense Linear layers {d_in}->{hidden}->{hidden}->{d_out} (no sparsity: a control)"
    return c


class TwoLayerMLP(nn.Module):
    """Linear -> ReLU -> Linear."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def relu_mlp_sparse(size: str = "test", *, batch: int | None = None, d_in: int | None = None,
                    hidden: int | None = None, d_out: int | None = None, zeros: float = 0.9,
                    seed: int = 0) -> Case:
    """Linear(d_in, hidden) -> ReLU -> Linear(hidden, d_out) with dense weights, whose ReLU output is about
    `zeros` zeros: each hidden unit's bias is shifted down to the `zeros` quantile of its pre-activation over
    a batch drawn like the inputs (a trained network with sparse activations, without the training). Test:
    32 -> 128 -> 16, batch 16; bench: 512 -> 2048 -> 512 (a 4x feed-forward block), batch 256."""
    batch = _pick(size, 16, 256, batch)
    d_in = _pick(size, 32, 512, d_in)
    hidden = _pick(size, 128, 2048, hidden)
    d_out = _pick(size, 16, 512, d_out)
    g = torch.Generator().manual_seed(seed)
    model = _seeded_init(TwoLayerMLP(d_in, hidden, d_out), g)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, d_in, generator=gx),)

    calib = torch.randn(max(batch, 256), d_in, generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        pre = model.fc1(calib)
        model.fc1.bias.sub_(torch.quantile(pre, zeros, dim=0))
    x = make_inputs(batch)
    with torch.no_grad():
        measured = float((torch.relu(model.fc1(x[0])) == 0).float().mean())
    notes = (f"2 dense Linear layers {d_in}->{hidden}->{d_out}, biases shifted so that the ReLU output is about "
             f"{zeros:.0%} zeros ({measured:.1%} on these inputs): the second product's input is sparse")
    return Case("relu_mlp_sparse", model, x, make_inputs, True, notes, size,
                {"d_in": d_in, "hidden": hidden, "d_out": d_out, "batch": batch, "activation_zeros": measured})


# ----------------------------------------------------------------------------------------------------------
# GCN, and the Planetoid graphs

# nodes, adjacency nonzeros (both directions, as stored), feature width, classes
PLANETOID = {"cora": (2708, 10556, 1433, 7), "citeseer": (3327, 9228, 3703, 6),
             "pubmed": (19717, 88651, 500, 3)}


def _planetoid_dir(root) -> str | None:
    if not root:
        return None
    d = os.path.join(str(root), "planetoid", "derived")
    return d if os.path.isdir(d) else None


def load_planetoid(root, name):
    """(adjacency CSR, features CSR, labels, train, val, test index tensors) of Cora or CiteSeer from
    `root`/planetoid/derived, as Kipf's GCN uses them (140/120 training nodes, the next 500 for validation),
    or None when the files are absent. PubMed has no complete feature matrix there, so it gives None too
    (`planetoid_graph` has its adjacency)."""
    import scipy.sparse as sp

    d = _planetoid_dir(root)
    if d is None or not os.path.exists(os.path.join(d, f"{name}_adj.npz")) or \
            not os.path.exists(os.path.join(d, f"{name}_features.npz")):
        return None
    adj = sp.load_npz(os.path.join(d, f"{name}_adj.npz")).tocsr()
    feats = sp.load_npz(os.path.join(d, f"{name}_features.npz")).tocsr()
    labels = np.load(os.path.join(d, f"{name}_labels.npy"), allow_pickle=False).astype(np.int64)
    split = np.load(os.path.join(d, f"{name}_splits_labels_onehot.npz"), allow_pickle=False)
    n_train = split["y"].shape[0]
    train = torch.arange(n_train)
    val = torch.arange(n_train, n_train + 500)
    test = torch.from_numpy(split["test_index"].astype(np.int64))
    return adj, feats, torch.from_numpy(labels), train, val, test


def planetoid_graph(root, name):
    """(adjacency CSR, features CSR or None) of cora, citeseer or pubmed, or None when the adjacency is
    absent. PubMed's features are None: only 1,060 of its 19,717 feature rows are in the data folder."""
    import scipy.sparse as sp

    d = _planetoid_dir(root)
    if d is None or not os.path.exists(os.path.join(d, f"{name}_adj.npz")):
        return None
    adj = sp.load_npz(os.path.join(d, f"{name}_adj.npz")).tocsr()
    fpath = os.path.join(d, f"{name}_features.npz")
    feats = sp.load_npz(fpath).tocsr() if os.path.exists(fpath) else None
    return adj, feats


def generated_graph(n=2708, classes=7, feats=1433, seed=0):
    """A stochastic block model with class-correlated bag-of-words features, shaped like Cora, as (adjacency
    CSR, features CSR, labels, train, val, test): a graph to train on when there is no data folder."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    src = rng.integers(0, n, 6 * n)
    same = rng.random(6 * n) < 0.8  # most edges stay within a class
    dst = np.where(same, rng.permutation(n)[np.searchsorted(np.sort(labels), labels[src]) % n],
                   rng.integers(0, n, 6 * n))
    dst = np.array([rng.choice(np.flatnonzero(labels == labels[s])) if k else d
                    for s, d, k in zip(src[:4 * n], dst[:4 * n], same[:4 * n])] + list(dst[4 * n:]))
    src = src[: dst.size]
    adj = sp.coo_array((np.ones(src.size, np.float32), (src, dst)), shape=(n, n)).tocsr()
    adj = ((adj + adj.T) > 0).astype(np.float32)
    # 18 words per node, drawn so that a word's id modulo `classes` is the node's class.
    words = rng.integers(0, feats, (n, 18)) // classes * classes + labels[:, None]
    words = np.minimum(words, feats - 1)
    x = sp.coo_array((np.ones(words.size, np.float32), (np.repeat(np.arange(n), 18), words.ravel())),
                     shape=(n, feats)).tocsr()
    x.data[:] = 1
    perm = torch.from_numpy(rng.permutation(n))
    return adj, x, torch.from_numpy(labels), perm[:140], perm[140:640], perm[1708:]


def random_graph(n: int, nnz: int, *, seed: int = 0):
    """An undirected graph with n nodes and about `nnz` adjacency nonzeros (each edge stored both ways, no
    self-loops), edges uniformly random: scipy CSR float32 with ones."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    m = max(nnz // 2, 1)
    src = rng.integers(0, n, m)
    dst = (src + rng.integers(1, n, m)) % n  # never src itself
    a = sp.coo_array((np.ones(m, np.float32), (src, dst)), shape=(n, n)).tocsr()
    a = ((a + a.T) > 0).astype(np.float32)
    return a.tocsr()


def random_features(n: int, width: int, density: float, *, seed: int = 0):
    """Nonnegative bag-of-words-like features (scipy CSR float32, about `density` of entries set)."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    per_row = max(1, int(round(density * width)))
    cols = rng.integers(0, width, (n, per_row))
    vals = rng.random((n, per_row), dtype=np.float32) + 0.1
    rows = np.repeat(np.arange(n), per_row)
    x = sp.coo_array((vals.ravel(), (rows, cols.ravel())), shape=(n, width)).tocsr()
    x.sum_duplicates()
    return x


def normalized_adjacency(adj):
    """D^-1/2 (A + I) D^-1/2 of a binary adjacency, as scipy CSR float32 (existing self-loops count once)."""
    import scipy.sparse as sp

    a = (adj + sp.eye(adj.shape[0], dtype=np.float32, format="csr")).tocsr()
    a.data[:] = 1.0
    d = np.asarray(a.sum(1)).ravel() ** -0.5
    return (sp.diags(d) @ a @ sp.diags(d)).tocsr().astype(np.float32)


def row_normalized(feats) -> np.ndarray:
    """Dense float32 features with every nonzero row scaled to sum 1 (Kipf's preprocessing)."""
    x = np.asarray(feats.todense() if hasattr(feats, "todense") else feats, dtype=np.float32)
    s = x.sum(1, keepdims=True)
    s[s == 0] = 1
    return x / s


def _glorot(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    bound = (6.0 / (rows + cols)) ** 0.5
    return (torch.rand(rows, cols, generator=g) * 2 - 1) * bound


class GCN(nn.Module):
    """Two graph convolutions (Kipf & Welling); the normalized adjacency is an input, so any tensor that
    supports `adj @ dense` works: a Scorch SparseTensor, a torch sparse tensor, or a dense matrix."""

    def __init__(self, nfeat: int, nhid: int, nclass: int, g: torch.Generator):
        super().__init__()
        self.w1 = nn.Parameter(_glorot(nfeat, nhid, g))
        self.b1 = nn.Parameter(torch.zeros(nhid))
        self.w2 = nn.Parameter(_glorot(nhid, nclass, g))
        self.b2 = nn.Parameter(torch.zeros(nclass))

    def forward(self, x, adj):
        h = torch.relu(adj @ (x @ self.w1) + self.b1)
        return adj @ (h @ self.w2) + self.b2


def gcn(size: str = "test", *, dataset: str | None = None, data=None, nodes: int = 300, edges: int = 3000,
        features: int = 32, classes: int = 7, hidden: int = 16, seed: int = 0) -> Case:
    """2-layer GCN, inputs (x dense (nodes, features), adj Scorch CSR SparseTensor D^-1/2 (A+I) D^-1/2).

    Test size: a random graph of `nodes` nodes and about `edges` adjacency nonzeros. Bench size, or any size
    with `dataset` given: Cora, CiteSeer or PubMed (default cora) from the data folder `data` (default
    $SCORCH_DATA or ../shared/data); without the data, a random graph with the dataset's node and edge
    counts. Features are the real row-normalized bag of words where the folder has them (PubMed's are
    generated at its width and about its density: the folder has only part of them)."""

    _check_size(size)
    if size == "bench" and dataset is None:
        dataset = "cora"
    info: dict = {"hidden": hidden}
    if dataset is None:
        adj = random_graph(nodes, edges, seed=seed)
        feats = random_features(nodes, features, 0.1, seed=seed + 1)
        source, name = f"random graph, {nodes} nodes", "gcn"
    else:
        dataset = dataset.lower()
        if dataset not in PLANETOID:
            raise ValueError(f"dataset must be one of {sorted(PLANETOID)}, got {dataset!r}")
        n, nnz, width, classes = PLANETOID[dataset]
        loaded = planetoid_graph(datasets.data_dir(data), dataset)
        if loaded is not None:
            adj, feats = loaded
            source = f"{dataset} from the data folder"
            if feats is None:
                feats = random_features(n, width, 0.1, seed=seed + 1)
                source += " (features generated: the folder has only part of them)"
        else:
            adj = random_graph(n, nnz, seed=seed)
            feats = random_features(n, width, 0.013 if dataset == "cora" else 0.01, seed=seed + 1)
            source = f"generated graph of {dataset}'s size (data folder not found)"
        name = f"gcn/{dataset}"
        info["dataset"] = dataset
    a_norm = normalized_adjacency(adj)
    A = sparse(a_norm, "csr")
    x = torch.from_numpy(row_normalized(feats))
    g = torch.Generator().manual_seed(seed)
    model = GCN(x.shape[1], hidden, classes, g)
    info.update(nodes=int(A.shape[0]), adj_nnz=int(A.nnz), features=int(x.shape[1]), classes=classes,
                adj_density=A.nnz / (A.shape[0] * A.shape[1]), source=source)
    notes = (f"relu(A @ (x @ W1) + b1), A @ (h @ W2) + b2 with A a Scorch CSR SparseTensor input "
             f"({A.shape[0]} nodes, {A.nnz} nonzeros); {source}")
    return Case(name, model, (x, A), None, True, notes, size, info)


# ----------------------------------------------------------------------------------------------------------
# mixture of experts with one-hot gates


class OneHotMoE(nn.Module):
    """Top-1 mixture of experts written densely: every token is multiplied by every expert's weights, and a
    one-hot mask zeroes all but the routed expert's result."""

    def __init__(self, d: int, h: int, n: int, g: torch.Generator):
        super().__init__()
        self.n = n
        self.router = _seeded_init(nn.Linear(d, n), g)
        self.w1 = nn.Parameter(_randn(g, n, d, h, scale=d ** -0.5))
        self.w2 = nn.Parameter(_randn(g, n, h, d, scale=h ** -0.5))

    def forward(self, x):
        logits = self.router(x)
        idx = logits.argmax(-1)
        mask = F.one_hot(idx, self.n).to(x.dtype)
        gates = mask * torch.softmax(logits, -1)
        xe = mask.unsqueeze(-1) * x.unsqueeze(1)                     # (b, n, d) dispatch
        hid = torch.relu(torch.einsum("bnd,ndh->bnh", xe, self.w1))
        y = torch.einsum("bnh,nhd->bnd", hid, self.w2)
        return torch.einsum("bnd,bn->bd", y, gates)                   # combine


def moe(size: str = "test", *, d: int | None = None, h: int | None = None, n: int | None = None,
        batch: int | None = None, seed: int = 0) -> Case:
    """One-hot-gated mixture of experts; test d=32, h=64, n=4 experts, batch 16; bench d=512, h=1024, n=8,
    batch 256. Input (batch, d)."""
    d = _pick(size, 32, 512, d)
    h = _pick(size, 64, 1024, h)
    n = _pick(size, 4, 8, n)
    batch = _pick(size, 16, 256, batch)
    g = torch.Generator().manual_seed(seed)
    model = OneHotMoE(d, h, n, g)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, d, generator=gx),)

    notes = (f"top-1 MoE, {n} experts, d={d}, h={h}: dispatch and combine are dense einsums over a one-hot "
             f"mask, so {n - 1} of {n} expert products are multiplications by zero")
    return Case("moe", model, make_inputs(batch), make_inputs, True, notes, size,
                {"d": d, "h": h, "n_experts": n, "batch": batch})


def moe16(size: str = "test", *, n: int = 16, **kw) -> Case:
    """`moe` with 16 experts (test and bench sizes otherwise the same): twice the experts, the same work per
    token, so the dense formulation wastes 15 of 16 expert products."""
    c = moe(size, n=n, **kw)
    c.name = "moe16"
    return c


# ----------------------------------------------------------------------------------------------------------
# block-sparse (BigBird-style) attention


def bigbird_block_mask(seq: int, block: int, sparsity: float, *, seed: int = 0) -> torch.Tensor:
    """A (seq, seq) bool mask, True where attention is allowed, made of block x block tiles: the diagonal
    tiles (local attention), the first tile row and column (a global block), and random tiles (seeded) until
    the allowed fraction reaches 1 - sparsity. When the local and global tiles alone allow more than that,
    no random tile is added (the mask is denser than asked; `mask_sparsity` tells the real figure)."""
    if seq % block:
        raise ValueError(f"seq ({seq}) must be a multiple of block ({block})")
    nb = seq // block
    tiles = torch.eye(nb, dtype=torch.bool)
    tiles[0, :] = True
    tiles[:, 0] = True
    want = int(round((1.0 - sparsity) * nb * nb))
    missing = want - int(tiles.sum())
    if missing > 0:
        g = torch.Generator().manual_seed(seed)
        free = torch.nonzero(~tiles.reshape(-1)).squeeze(1)
        pick = free[torch.randperm(free.numel(), generator=g)[:missing]]
        tiles.view(-1)[pick] = True
    return tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)


def mask_sparsity(mask: torch.Tensor) -> float:
    return 1.0 - float(mask.sum()) / mask.numel()


class BlockSparseSelfAttention(nn.Module):
    """Multi-head self-attention whose scores are masked by a fixed block-sparse pattern (a buffer)."""

    def __init__(self, d_model: int, heads: int, mask: torch.Tensor, g: torch.Generator):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.head_dim = d_model // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        _seeded_init(self, g)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                               # (b, heads, s, head_dim)
        scores = q @ k.transpose(-2, -1) * self.scale
        scores = scores.masked_fill(~self.mask, float("-inf"))
        attn = torch.softmax(scores, -1)
        o = attn @ v
        return self.out(o.transpose(1, 2).reshape(b, s, d))


def block_sparse_attention(size: str = "test", *, seq: int | None = None, block: int | None = None,
                           d_model: int | None = None, heads: int | None = None, batch: int | None = None,
                           sparsity: float | None = None, seed: int = 0) -> Case:
    """BigBird-style block-sparse self-attention (see `bigbird_block_mask`). Test: seq 256, block 16, d_model
    32, 2 heads, batch 2, sparsity 0.8 (sparse enough for the backend to take the masked attention). Bench:
    seq 2048, block 32, d_model 256, 4 heads, batch 1, sparsity 0.95. Input (batch, seq, d_model)."""
    seq = _pick(size, 256, 2048, seq)
    block = _pick(size, 16, 32, block)
    d_model = _pick(size, 32, 256, d_model)
    heads = _pick(size, 2, 4, heads)
    batch = _pick(size, 2, 1, batch)
    sparsity = _pick(size, 0.8, 0.95, sparsity)
    mask = bigbird_block_mask(seq, block, sparsity, seed=seed + 2)
    g = torch.Generator().manual_seed(seed)
    model = BlockSparseSelfAttention(d_model, heads, mask, g)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, seq, d_model, generator=gx),)

    real = mask_sparsity(mask)
    nb = seq // block
    notes = (f"masked_fill(-inf) + softmax over a block mask ({nb}x{nb} tiles of {block}, {real:.1%} "
             "masked): a dense model computes every score and throws most away")
    return Case("block_sparse_attention", model, make_inputs(batch), make_inputs, True, notes, size,
                {"seq": seq, "block": block, "d_model": d_model, "heads": heads, "batch": batch,
                 "target_sparsity": sparsity, "mask_sparsity": real})


# ----------------------------------------------------------------------------------------------------------
# top-k sparse autoencoder


class TopKAutoencoder(nn.Module):
    def __init__(self, d: int, hidden: int, k: int, g: torch.Generator):
        super().__init__()
        self.k = k
        self.encoder = nn.Linear(d, hidden)
        self.decoder = nn.Linear(hidden, d)
        _seeded_init(self, g)

    def forward(self, x):
        pre = self.encoder(x)
        v, i = pre.topk(self.k, -1)
        z = torch.zeros_like(pre).scatter(-1, i, torch.relu(v))
        return self.decoder(z)


def sparse_autoencoder(size: str = "test", *, d: int | None = None, hidden: int | None = None,
                       k: int | None = None, batch: int | None = None, seed: int = 0) -> Case:
    """x -> encoder Linear(d, 8d) -> keep the top k per row (ReLU'd) -> decoder Linear(8d, d). Test d=64,
    k=16, batch 8; bench d=768, k=32, batch 256."""
    d = _pick(size, 64, 768, d)
    hidden = hidden or 8 * d
    k = _pick(size, 16, 32, k)
    batch = _pick(size, 8, 256, batch)
    g = torch.Generator().manual_seed(seed)
    model = TopKAutoencoder(d, hidden, k, g)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, d, generator=gx),)

    notes = (f"top-{k} of {hidden} latent units per row are kept (scatter into zeros): the decoder's input "
             f"is {1 - k / hidden:.1%} zeros")
    return Case("sparse_autoencoder", model, make_inputs(batch), make_inputs, True, notes, size,
                {"d": d, "hidden": hidden, "k": k, "batch": batch, "latent_sparsity": 1 - k / hidden})


# ----------------------------------------------------------------------------------------------------------
# small CNN (control)


class SmallCNN(nn.Module):
    def __init__(self, c1: int, c2: int, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(c2, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def small_cnn(size: str = "test", *, batch: int | None = None, image: int | None = None,
              seed: int = 0) -> Case:
    """Conv-BN-ReLU-MaxPool, Conv-BN-ReLU-AvgPool, Linear; no sparsity (a control). Test: 4 images 3x16x16,
    channels 8/16; bench: 64 images 3x32x32, channels 32/64. In train mode (batch statistics)."""
    batch = _pick(size, 4, 64, batch)
    image = _pick(size, 16, 32, image)
    c1, c2 = (8, 16) if size == "test" else (32, 64)
    g = torch.Generator().manual_seed(seed)
    model = _seeded_init(SmallCNN(c1, c2, 10), g)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randn(b, 3, image, image, generator=gx),)

    notes = (f"2 conv blocks ({c1}, {c2} channels) on {image}x{image} images, BatchNorm in train mode "
             "(no sparsity)")
    return Case("small_cnn", model, make_inputs(batch), make_inputs, True, notes, size,
                {"batch": batch, "image": image, "channels": (c1, c2)})


# ----------------------------------------------------------------------------------------------------------
# BERT-base encoder, 90% pruned (needs transformers)


@contextlib.contextmanager
def _seeded_global_rng(seed: int):
    """transformers initialises weights from the global RNG: seed it inside a fork so the caller's RNG state
    is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def bert_encoder(size: str = "bench", *, batch: int | None = None, seq: int | None = None,
                 sparsity: float = 0.9, attn_implementation: str = "sdpa", seed: int = 0) -> Case:
    """transformers.BertModel(BertConfig()) (BERT-base: 12 layers, hidden 768, random weights) in eval mode,
    every nn.Linear of the encoder magnitude-pruned to `sparsity`; input_ids (1, 128). The model returns
    transformers' output object (last_hidden_state, pooler_output).

    A benchmark entry; size="test" builds a tiny configuration (2 layers, hidden 64, seq 16) for smoke runs.
    Raises ImportError with an explanation when transformers is not installed."""
    _check_size(size)
    try:
        import transformers
    except ImportError as e:
        raise ImportError("bert_encoder needs the transformers package (pip install transformers)") from e
    if size == "bench":
        config = transformers.BertConfig(attn_implementation=attn_implementation)
    else:
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=128, vocab_size=1000, max_position_embeddings=64,
                                         attn_implementation=attn_implementation)
    batch = _pick(size, 1, 1, batch)
    seq = _pick(size, 16, 128, seq)
    with _seeded_global_rng(seed):
        model = transformers.BertModel(config).eval()
    prune(model.encoder, "magnitude", sparsity)
    gx = torch.Generator().manual_seed(seed + 1)

    def make_inputs(b: int) -> tuple:
        return (torch.randint(0, config.vocab_size, (b, seq), generator=gx),)

    notes = (f"BertModel ({config.num_hidden_layers} layers, hidden {config.hidden_size}, random weights, "
             f"{attn_implementation} attention, eval mode), encoder Linear weights {sparsity:.0%} "
             f"magnitude-pruned; input_ids ({batch}, {seq})")
    return Case("bert_encoder", model, make_inputs(batch), make_inputs, True, notes, size,
                {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "batch": batch, "seq": seq,
                 "sparsity": sparsity, "measured_sparsity": weight_sparsity(model.encoder), "eval": True})


# ----------------------------------------------------------------------------------------------------------
# registry

CASES: dict[str, Callable[..., Case]] = {
    "pruned_mlp": pruned_mlp,
    "gcn": gcn,
    "moe": moe,
    "moe16": moe16,
    "block_sparse_attention": block_sparse_attention,
    "sparse_autoencoder": sparse_autoencoder,
    "relu_mlp_dense": relu_mlp_dense,
    "relu_mlp_sparse": relu_mlp_sparse,
    "small_cnn": small_cnn,
    "bert_encoder": bert_encoder,
}

# Entries meant for benchmarks only (too slow to compile in a unit test, or an optional dependency).
BENCH_ONLY = frozenset({"bert_encoder"})
TEST_CASES = tuple(n for n in CASES if n not in BENCH_ONLY)


def make(name: str, size: str = "test", **kw) -> Case:
    """The zoo entry `name` at `size` ("test" or "bench"); keyword options go to its factory."""
    try:
        factory = CASES[name]
    except KeyError:
        raise KeyError(f"no zoo model {name!r}; known: {', '.join(CASES)}") from None
    return factory(_check_size(size), **kw)
