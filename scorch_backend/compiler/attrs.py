"""Sparsity attributes: what the backend knows about the zeros of each value in a graph.

An attribute says whether a value is worth treating as sparse, how dense it is (measured, or derived by a
rule), where that knowledge comes from, and, when the zeros are guaranteed by construction, which other
value carries them: the *support*. `Support("mask", (0, 1))` on a (b, n, h) tensor says: this tensor is zero
at (b, n, :) wherever the graph value `mask` (b, n) is zero. Supports travel through views, zero-preserving
ops and contractions that keep the carrier's dimensions, so a ReLU of a one-hot-gated product, or a softmax of
scores filled with -inf outside a mask, is still known to be zero where the gate or mask is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Support:
    carrier: str  # graph node whose nonzeros bound this value's nonzeros
    dims: tuple[int, ...]  # for each dimension of the carrier, the dimension of this value it lines up with
    # A dimension of the carrier along which the claim holds only where the carrier keeps an entry in every
    # fiber: a softmax of scores filled with -inf outside a mask is zero outside it, except in a row where the
    # mask keeps nothing, which is NaN throughout. The region that reads this value under the carrier's pattern
    # checks that at run time (custom_ops/region.py: Operand.nonempty) and runs dense where it fails.
    nonempty: int | None = None

    def remap(self, new_dim_of) -> "Support | None":
        dims = tuple(new_dim_of(d) for d in self.dims)
        return None if any(d is None for d in dims) else replace(self, dims=dims)


@dataclass(frozen=True)
class SparsityAttr:
    sparse: bool = False
    density: float = 1.0  # fraction of nonzeros: measured, or an estimate from the rule that made it
    origin: str = "dense"  # why: "SparseTensor csr", "measured weight", "one_hot", "relu", ...
    pattern: str = "dense"  # unstructured, block 8x8, n:m 2:4, rows, one-hot, k per row, masked ...
    format: str | None = None  # a SparseTensor's format
    support: Support | None = None  # structural zeros, carried by another value (or itself)
    neg_inf_outside: Support | None = None  # -inf wherever the carrier is zero (masked scores before softmax)
    weight: bool = False  # a parameter or buffer (measured at compile time; may change between calls)
    measured: float | None = None  # density of the value in the example run, when known

    def with_(self, **kw) -> "SparsityAttr":
        return replace(self, **kw)

    def describe(self) -> str:
        if not self.sparse and self.support is None and self.neg_inf_outside is None:
            return "dense" if self.measured is None else f"dense (measured density {self.measured:.2f})"
        parts = [f"density {self.density:.3g}", self.pattern]
        if self.format:
            parts.append(f"format {self.format}")
        if self.support is not None:
            parts.append(f"zero where {self.support.carrier} is")
        if self.neg_inf_outside is not None:
            parts.append(f"-inf where {self.neg_inf_outside.carrier} is zero")
        parts.append(f"from {self.origin}")
        return ", ".join(parts)


DENSE = SparsityAttr()
