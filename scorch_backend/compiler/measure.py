"""Measure a dense tensor's sparsity: how many nonzeros, and which structure they follow.

    from scorch_backend.compiler.measure import measure
    m = measure(weight)           # Measurement(density=0.1, pattern="block", block=(8, 8), ...)
    m.describe()                  # "density 0.10, block 8x8"

A tensor is looked at as a matrix: rows are all leading dimensions flattened, columns the last dimension; 0-D
and 1-D tensors are one row. "Nonzero" means `!= 0`, so NaNs count as nonzeros.

The pattern is decided in this order:
  "empty"         no nonzeros;
  "dense"         density >= dense_threshold (the structure fields below are still filled);
  "n:m"           every group of m entries along the last dimension has at most n nonzeros, for one of
                  NM_CANDIDATES, and the density is at least NM_CLOSENESS * n / m; the tightest is reported;
  "rows"/"cols"   at least half of the rows (columns) are zero and the other rows (columns) are >= 90% full;
  "block"         the largest of BLOCK_CANDIDATES for which less than half of the blocks hold a nonzero and
                  the nonzero blocks are >= 90% full (so magnitude pruning, which scatters nonzeros, is not
                  block);
  "unstructured"  anything else.
"rows"/"cols" are tested before "block" because a matrix of whole zero rows also passes the block test for row
segments such as (1, 8) (and for (2, 2) when its nonzero rows come in pairs), and "rows" says more.
`block` and `nm` report the structure found whatever the pattern. A fully pruned 1:2, 2:4 or 4:8 tensor has
density exactly 0.5, which the default dense_threshold calls "dense" (with nm=(2, 4) etc. still filled in);
pass a higher dense_threshold to get pattern "n:m" for them.

Everything is a handful of vectorised torch ops over a bool copy of the tensor; block counts are built by
halving (counts of 2x4 blocks are sums of two 1x4 counts), and a block shape is only counted when the two
shapes it halves into already passed, so an unstructured matrix is rejected after one or two cheap passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BLOCK_CANDIDATES", "Measurement", "NM_CANDIDATES", "PATTERNS", "as_matrix", "measure"]

PATTERNS = ("dense", "empty", "unstructured", "block", "n:m", "rows", "cols")

# Tightest first: a 1:4 tensor is also 2:8, and a 1:2 tensor is also 2:4 and 4:8; the density check
# (NM_CLOSENESS) keeps a 1:4 tensor from being reported as 1:2.
NM_CANDIDATES = ((1, 4), (2, 8), (1, 2), (2, 4), (4, 8))
NM_CLOSENESS = 0.8

# Largest area first; on equal area, squarer first. All sides are powers of two (the halving scheme needs it).
BLOCK_CANDIDATES = (
    (32, 32),
    (16, 16),
    (8, 8),
    (4, 8),
    (8, 4),
    (4, 4),
    (2, 8),
    (8, 2),
    (1, 16),
    (16, 1),
    (2, 4),
    (4, 2),
    (1, 8),
    (8, 1),
    (2, 2),
    (1, 4),
    (4, 1),
)
BLOCK_MAX_FRACTION = 0.5  # less than this fraction of blocks may hold a nonzero
BLOCK_MIN_FILL = 0.9  # nonzero blocks must be at least this full
LINES_MIN_ZERO = 0.5  # "rows": at least this fraction of rows is all zero ...
LINES_MIN_FILL = 0.9  # ... and the other rows are at least this full


@dataclass(frozen=True)
class Measurement:
    """What `measure` found. Fractions are in [0, 1]; `block` is (rows, cols) of a block, `nm` is (n, m)."""

    density: float
    pattern: str
    block: tuple[int, int] | None = None
    nm: tuple[int, int] | None = None
    zero_rows: float = 0.0
    zero_cols: float = 0.0

    def describe(self) -> str:
        d = self.density
        text = f"density {d:.2f}" if d == 0 or d >= 0.01 else f"density {d:.1e}"
        if self.pattern == "block" and self.block is not None:
            return f"{text}, block {self.block[0]}x{self.block[1]}"
        if self.pattern == "n:m" and self.nm is not None:
            return f"{text}, {self.nm[0]}:{self.nm[1]}"
        if self.pattern == "rows":
            return f"{text}, rows ({self.zero_rows:.2f} of rows zero)"
        if self.pattern == "cols":
            return f"{text}, cols ({self.zero_cols:.2f} of cols zero)"
        if self.pattern == "dense" and self.nm is not None:
            return f"{text}, dense ({self.nm[0]}:{self.nm[1]})"
        return f"{text}, {self.pattern}"


def as_matrix(t) -> torch.Tensor:
    """`t` as a dense, detached 2-D tensor: (product of leading dims, last dim); 0-D and 1-D as one row.

    SparseTensors, torch sparse layouts and other objects with `to_dense()` are densified first.
    """
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter) or (
        t.layout != torch.strided
    ):
        if not hasattr(t, "to_dense"):
            raise TypeError(f"expected a tensor or an object with to_dense(), got {type(t).__name__}")
        t = t.to_dense()
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"to_dense() returned {type(t).__name__}, not a torch.Tensor")
    t = t.detach()
    if t.device.type == "meta":
        raise TypeError("cannot measure a meta tensor: it has no values")
    cols = t.shape[-1] if t.dim() >= 1 else 1
    rows = math.prod(t.shape[:-1]) if t.dim() >= 1 else 1
    return t.reshape(rows, cols)


class _BlockCounts:
    """Nonzero counts per (bh, bw) block of a bool matrix, built by halving and memoised."""

    def __init__(self, nz: torch.Tensor):
        self.nz = nz
        self.rows, self.cols = nz.shape
        self._counts: dict[tuple[int, int], torch.Tensor] = {}
        self._passed: dict[tuple[int, int], bool] = {}
        self.nnz = int(torch.count_nonzero(nz).item())  # count_nonzero is much faster than a bool sum

    def counts(self, bh: int, bw: int) -> torch.Tensor:
        key = (bh, bw)
        c = self._counts.get(key)
        if c is None:
            if key == (1, 1):
                c = self.nz.to(torch.int16)  # 32x32 blocks hold at most 1024 nonzeros
            elif bw > 1:
                half = self.counts(bh, bw // 2)
                c = half[:, 0::2] + half[:, 1::2]
            else:
                half = self.counts(bh // 2, bw)
                c = half[0::2, :] + half[1::2, :]
            self._counts[key] = c
        return c

    def is_block(self, bh: int, bw: int) -> bool:
        """Whether (bh, bw) blocks divide the matrix, < half of them are nonzero and those are >= 90% full."""
        key = (bh, bw)
        if key in self._passed:
            return self._passed[key]
        ok = self.rows % bh == 0 and self.cols % bw == 0 and self.rows * self.cols // (bh * bw) >= 2
        # Halving a passing shape gives passing shapes (nonzero halves are at least as full, and no more of
        # them are nonzero), so a shape whose halves fail cannot pass and is never counted.
        if ok and bw > 1:
            ok = self.is_block(bh, bw // 2)
        if ok and bh > 1:
            ok = self.is_block(bh // 2, bw)
        if ok and (bh, bw) != (1, 1):
            c = self.counts(bh, bw)
            nonzero_blocks = int(torch.count_nonzero(c).item())
            ok = (
                nonzero_blocks < BLOCK_MAX_FRACTION * c.numel()
                and self.nnz >= BLOCK_MIN_FILL * nonzero_blocks * bh * bw
            )
        elif ok:
            ok = self.nnz < BLOCK_MAX_FRACTION * self.nz.numel()
        self._passed[key] = ok
        return ok

    def is_nm(self, n: int, m: int) -> bool:
        if self.cols % m != 0 or self.nnz < NM_CLOSENESS * n / m * self.nz.numel():
            return False
        return int(self.counts(1, m).max().item()) <= n


def measure(t, dense_threshold: float = 0.5) -> Measurement:
    """Measure density and structure of `t` (see the module docstring for the rules)."""
    if isinstance(dense_threshold, bool) or not isinstance(dense_threshold, (int, float)):
        raise TypeError(f"dense_threshold must be a number, got {dense_threshold!r}")
    if not dense_threshold >= 0:  # also rejects NaN; above 1 turns "dense" off
        raise ValueError(f"dense_threshold must be >= 0, got {dense_threshold!r}")
    x = as_matrix(t)
    rows, cols = x.shape
    if x.numel() == 0:
        # No entries: whatever rows (columns) exist hold no nonzero.
        return Measurement(0.0, "empty", None, None, 1.0 if rows else 0.0, 1.0 if cols else 0.0)
    nz = x != 0
    numel = rows * cols

    # amax over the bool bytes is far faster than any() or a sum per line.
    nz8 = nz.view(torch.uint8)
    zero_rows = rows - int(torch.count_nonzero(nz8.amax(dim=1)).item())
    zero_cols = cols - int(torch.count_nonzero(nz8.amax(dim=0)).item())
    zero_rows_frac = zero_rows / rows
    zero_cols_frac = zero_cols / cols

    bc = _BlockCounts(nz)
    nnz = bc.nnz
    density = nnz / numel
    if nnz == 0:
        return Measurement(0.0, "empty", None, None, zero_rows_frac, zero_cols_frac)

    nm = next((c for c in NM_CANDIDATES if bc.is_nm(*c)), None)
    block = next((b for b in BLOCK_CANDIDATES if bc.is_block(*b)), None)

    # A 1-column matrix trivially has "full" nonzero rows, and a 1-row one full nonzero columns: a sparse
    # vector is not a row or column pattern.
    is_rows = (
        cols >= 2
        and zero_rows_frac >= LINES_MIN_ZERO
        and nnz >= LINES_MIN_FILL * (rows - zero_rows) * cols
    )
    is_cols = (
        rows >= 2
        and zero_cols_frac >= LINES_MIN_ZERO
        and nnz >= LINES_MIN_FILL * (cols - zero_cols) * rows
    )

    if density >= dense_threshold:
        pattern = "dense"
    elif nm is not None:
        pattern = "n:m"
    elif is_rows:
        pattern = "rows"
    elif is_cols:
        pattern = "cols"
    elif block is not None:
        pattern = "block"
    else:
        pattern = "unstructured"
    return Measurement(density, pattern, block, nm, zero_rows_frac, zero_cols_frac)
