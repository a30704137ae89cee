"""Real sparse matrices from a data folder (default ../shared/data), with generated fallbacks.

Nothing here downloads: a missing folder or file makes `load_*` return None, and callers fall back to the
generators (`random_matrix`, `rmat`, `random_graph`), which are seeded and need no data at all.
"""

from __future__ import annotations

import os
import pathlib
from typing import Iterator

import numpy as np
import torch

from .. import config

DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data"  # the checkout's sibling shared/data


def data_dir(path: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The data folder: `path`, else $SCORCH_DATA, else ../shared/data beside the checkout; None if absent."""
    p = pathlib.Path(path or config.data_dir_override() or DEFAULT_DATA).resolve()
    return p if p.is_dir() else None


def read_smtx(path) -> "scipy.sparse.csr_array":  # noqa: F821
    """A DLMC .smtx file: 'rows, cols, nnz', then row offsets, then column indices; values are set to 1."""
    import scipy.sparse as sp

    with open(path) as f:
        rows, cols, nnz = (int(t) for t in f.readline().replace(",", " ").split())
        indptr = np.array(f.readline().split(), dtype=np.int64)
        indices = np.array(f.readline().split(), dtype=np.int64)
    if indptr.size != rows + 1 or indices.size != nnz:
        raise ValueError(f"{path}: malformed .smtx file (rows={rows}, nnz={nnz})")
    return sp.csr_array((np.ones(nnz, dtype=np.float32), indices, indptr), shape=(rows, cols))


def read_matrix(path) -> "scipy.sparse.csr_array":  # noqa: F821
    """Read .mtx (Matrix Market), .smtx (DLMC) or .npz (scipy.sparse.save_npz) as float32 CSR."""
    import scipy.io
    import scipy.sparse as sp

    path = pathlib.Path(path)
    if path.suffix == ".smtx":
        m = read_smtx(path)
    elif path.suffix == ".mtx":
        m = sp.csr_array(scipy.io.mmread(str(path)))
    elif path.suffix == ".npz":
        m = sp.csr_array(sp.load_npz(str(path)))
    else:
        raise ValueError(f"unknown matrix file type: {path}")
    m = m.astype(np.float32)
    m.sum_duplicates()
    return m


def real_matrices(root=None, *, kinds=("suitesparse", "dlmc", "graphs"), max_per_kind: int | None = None
                  ) -> Iterator[tuple[str, pathlib.Path]]:
    """(name, path) of the real matrices found under the data folder, smallest files first within a kind."""
    root = data_dir(root)
    if root is None:
        return
    globs = {"suitesparse": ["suitesparse_mtx/*.mtx"],
             "dlmc": ["dlmc/transformer/magnitude_pruning/0.9/*.smtx", "dlmc/rn50/magnitude_pruning/0.8/*.smtx"],
             "graphs": ["planetoid/derived/*_adj.npz"]}
    for kind in kinds:
        files = sorted((p for g in globs[kind] for p in root.glob(g)), key=lambda p: p.stat().st_size)
        for p in files[:max_per_kind]:
            yield f"{kind}/{p.stem}", p


def random_matrix(rows: int, cols: int, density: float, *, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A dense tensor with uniformly scattered nonzeros (values in [0.5, 1.5) with random signs)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < density
    vals = (torch.rand(rows, cols, generator=g) + 0.5) * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)
    return (vals * mask).to(dtype)


def rmat(scale: int, edge_factor: int = 16, *, a=0.57, b=0.19, c=0.19, seed: int = 0):
    """An R-MAT graph (power-law degrees) with 2**scale nodes and about edge_factor * 2**scale edges, as
    (indices (2, nnz) int64, values float32, shape), duplicates merged."""
    rng = np.random.default_rng(seed)
    n_edges = edge_factor << scale
    src = np.zeros(n_edges, dtype=np.int64)
    dst = np.zeros(n_edges, dtype=np.int64)
    for bit in range(scale):
        r = rng.random(n_edges)
        down = r >= a + b          # quadrants c, d: source bit set
        right = ((r >= a) & (r < a + b)) | (r >= a + b + c)  # quadrants b, d: destination bit set
        src |= down.astype(np.int64) << bit
        dst |= right.astype(np.int64) << bit
    key = np.unique(src * (1 << scale) + dst)
    idx = torch.from_numpy(np.stack([key >> scale, key & ((1 << scale) - 1)]))
    vals = torch.from_numpy(rng.random(key.size, dtype=np.float32) + 0.5)
    return idx, vals, (1 << scale, 1 << scale)
