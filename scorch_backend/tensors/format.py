"""Tensor formats as seen from Python: a thin handle on the C++ format layer.

A `Format` is fixed by its canonical text ("dense(0),compressed(1)"); `str()` gives the preset name when it
is one ("csr"). Formats come from preset names, canonical text, or a list of level kinds with a mode order.
"""

from __future__ import annotations

import operator
from functools import lru_cache
from typing import Sequence, Union

from .. import _C

PRESETS = ("dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr", "nm", "bitmap")
LEVEL_KINDS = ("dense", "compressed", "singleton", "bitmap", "nm")


@lru_cache(maxsize=1024)
def _info(spec: str, ndim: int) -> dict:
    return _C.format_info(spec, ndim)


class Format:
    """A storage format for `ndim`-dimensional tensors: an ordered list of levels."""

    __slots__ = ("ndim", "_info")

    def __init__(self, spec: str, ndim: int):
        if not isinstance(spec, str):
            raise TypeError(f"format text must be a str, got {type(spec).__name__}")
        n = None if isinstance(ndim, bool) or not hasattr(ndim, "__index__") else operator.index(ndim)
        if n is None or not 0 <= n <= 1024:
            raise ValueError(f"a format's number of dimensions must be an int in [0, 1024], got {ndim!r}")
        self.ndim = n
        self._info = _info(spec, self.ndim)

    @property
    def canonical(self) -> str:
        return self._info["canonical"]

    @property
    def name(self) -> str:
        """The preset name when the format is one ("csr", "bsr(2,2)"), else the canonical text."""
        return self._info["name"]

    @property
    def levels(self) -> list[dict]:
        return self._info["levels"]

    @property
    def buffer_names(self) -> list[str]:
        return self._info["buffer_names"]

    @property
    def all_dense(self) -> bool:
        return self._info["all_dense"]

    @property
    def blocksize(self) -> tuple[int, ...] | None:
        """Block sizes of blocked dimensions, in dimension order, or None when nothing is blocked."""
        blocks = {lv["dim"]: lv["block"] for lv in self.levels if lv["part"] != "whole"}
        return tuple(blocks.get(d, 1) for d in range(self.ndim)) if blocks else None

    @property
    def last_level_dense(self) -> bool:
        return bool(self.levels) and self.levels[-1]["kind"] == "dense"

    @property
    def pads_zeros(self) -> bool:
        """Whether stored values may hold zeros the format itself pads: a dense last level (blocks), or an n:m
        level (groups with fewer than n nonzeros store zeros to keep n per group)."""
        return self.last_level_dense or any(lv["kind"].startswith("nm[") for lv in self.levels)

    def permute_dims(self, perm: Sequence[int]) -> "Format":
        """The format of the tensor whose dimension d is this tensor's dimension perm[d] (same buffers)."""
        inverse = {old: new for new, old in enumerate(perm)}
        parts = []
        for lv in self.levels:
            props = [p for p, on in (("nonunique", not lv["unique"]), ("unordered", not lv["ordered"])) if on]
            expr = str(inverse[lv["dim"]])
            if lv["part"] == "outer":
                expr += f"/{lv['block']}"
            elif lv["part"] == "inner":
                expr += f"%{lv['block']}"
            parts.append(lv["kind"] + (f"[{','.join(props)}]" if props else "") + f"({expr})")
        return Format(",".join(parts), self.ndim)

    def __eq__(self, other) -> bool:
        return isinstance(other, Format) and other.canonical == self.canonical and other.ndim == self.ndim

    def __hash__(self) -> int:
        return hash((self.canonical, self.ndim))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Format({self.name!r}, ndim={self.ndim})"


FormatLike = Union[str, Format, Sequence[str]]


def make_format(fmt: FormatLike, ndim: int, *, mode_order: Sequence[int] | None = None,
                blocksize: Sequence[int] | None = None) -> Format:
    """Resolve a user's format argument.

    `fmt` is a Format, a preset name ("csr", "coo", "bsr" with `blocksize`, "bsr(2,2)"), canonical text, or a
    list of level kinds (e.g. ["dense", "compressed"]) applied to the dimensions in `mode_order` (default
    0, 1, ...).
    """
    if isinstance(fmt, Format):
        if fmt.ndim != ndim:
            raise ValueError(f"format {fmt} is for {fmt.ndim}-dimensional tensors, got {ndim} dimensions")
        return fmt
    if isinstance(fmt, str):
        if mode_order is not None:
            raise ValueError("mode_order goes with a list of level kinds, not a format name")
        if fmt.strip() == "bsr":
            if blocksize is None or len(blocksize) != 2:
                raise ValueError("format 'bsr' needs blocksize=(rows, cols)")
            if any(isinstance(b, bool) or not hasattr(b, "__index__") for b in blocksize):
                # int() took 2.0 as 2 and True as 1 (helper-72)
                raise TypeError(f"blocksize must be two integers, got {tuple(blocksize)!r}")
            fmt = f"bsr({operator.index(blocksize[0])},{operator.index(blocksize[1])})"
        elif blocksize is not None:
            raise ValueError(f"blocksize only goes with format 'bsr', got format {fmt!r}")
        return Format(fmt, ndim)
    if isinstance(fmt, (list, tuple)):
        kinds = list(fmt)
        if len(kinds) != ndim:
            raise ValueError(f"a list of level kinds needs one kind per dimension ({ndim}), got {len(kinds)}")
        order = list(range(ndim)) if mode_order is None else [int(d) for d in mode_order]
        if sorted(order) != list(range(ndim)):
            raise ValueError(f"mode_order must be a permutation of 0..{ndim - 1}, got {list(order)}")
        for k in kinds:
            if not isinstance(k, str):
                raise TypeError(f"level kinds are strings such as 'dense' or 'compressed', got {k!r}")
        return Format(",".join(f"{k.strip()}({d})" for k, d in zip(kinds, order)), ndim)
    raise TypeError(f"format must be a preset name, format text, Format or list of level kinds, got {type(fmt).__name__}")
