"""Contractions (einsum, matmul, mm, bmm, linear) as einsum letters: shared by propagate and fuse."""

from __future__ import annotations

import string

from .graph import OpView, shape_of

CONTRACTIONS = ("aten.einsum", "aten.matmul", "aten.mm", "aten.bmm", "aten.linear")
_BATCH = string.ascii_uppercase  # batch letters, never the lowercase ones of the contraction itself


def _einsum_args(view: OpView):
    eq, *rest = view.args
    ops = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else list(rest)
    return eq, ops


def contraction_form(view: OpView):
    """(tensor arguments, letters of each, output letters) of a contraction, ignoring a linear's bias, or
    None when it has a form we do not handle (ellipsis, implicit output, repeated letters, 0-d operands)."""
    if view.name == "aten.einsum":
        eq, ops = _einsum_args(view)
        if not isinstance(eq, str) or "->" not in eq or "." in eq:
            return None
        lhs, out = eq.replace(" ", "").split("->")
        terms = lhs.split(",")
        if len(terms) != len(ops) or not all(t.isalpha() and len(set(t)) == len(t) for t in terms):
            return None
        if len(set(out)) != len(out) or any(shape_of(o) is None or len(shape_of(o)) != len(t)
                                             for o, t in zip(ops, terms)):
            return None
        return ops, terms, out
    if view.name == "aten.linear":
        x, w = view.args[0], view.args[1]
        sx, sw = shape_of(x), shape_of(w)
        if sx is None or sw is None or len(sw) != 2 or len(sx) < 1 or len(sx) > len(_BATCH):
            return None
        batch = _BATCH[:len(sx) - 1]
        return [x, w], [batch + "k", "ok"], batch + "o"
    if view.name in ("aten.matmul", "aten.mm", "aten.bmm"):
        a, b = view.args[0], view.args[1]
        sa, sb = shape_of(a), shape_of(b)
        if sa is None or sb is None or len(sa) == 0 or len(sb) == 0 or max(len(sa), len(sb)) > len(_BATCH):
            return None
        ra, rb = len(sa), len(sb)
        nbatch = max(max(ra, rb) - 2, 0)
        batch = _BATCH[:nbatch]
        la = (batch[len(batch) - (ra - 2):] if ra > 2 else "") + ("ik" if ra >= 2 else "k")
        lb = (batch[len(batch) - (rb - 2):] if rb > 2 else "") + ("kj" if rb >= 2 else "k")
        out = batch + ("i" if ra >= 2 else "") + ("j" if rb >= 2 else "")
        # batch dimensions broadcast; a size-1 batch dimension against a larger one is not a shared index
        for k in range(nbatch):
            da = ra - 2 - (nbatch - k)
            db = rb - 2 - (nbatch - k)
            if da >= 0 and db >= 0 and _is_one(sa[da]) != _is_one(sb[db]):
                return None
        return [a, b], [la, lb], out
    return None


def _is_one(n) -> bool:
    return isinstance(n, int) and n == 1


def output_dims_of(letters: list[str], out: str, operand: int, dims) -> tuple[int, ...] | None:
    """Where the given dimensions of an operand land in the output, or None if one is summed away."""
    got = []
    for d in dims:
        c = letters[operand][d]
        if c not in out:
            return None
        got.append(out.index(c))
    return tuple(got)
