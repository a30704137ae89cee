"""propagate: carry sparsity attributes forward through the graph, one rule per ATen op.

Rule table (x, y tensors; "support" = the value whose zeros bound this one's, see sparsity/attrs.py):

  op                           result
  ---------------------------  -----------------------------------------------------------------------------
  one_hot(i, n)                sparse, density 1/n, pattern one-hot, its own support
  scatter(zeros_like(x), d,    sparse, density k/n (k = index size along d), pattern k per row, own support
          idx, src)
  masked_fill(x, ~m, 0)        zero where m is: support m         masked_fill(x, ~m, -inf): -inf outside m
  where(m, x, 0)               zero where m is: support m         where(m, x, -inf): -inf outside m
  softmax(x, d)                if x is -inf outside m: zero where m is (support m); else dense
  relu(x)                      zeros of x kept; new zeros measured in the example run
  gelu, tanh, abs, neg,        zeros of x kept (f(0) = 0)
  clone, _to_copy, dropout,
  div(x, c), mul(x, c)
  unsqueeze, transpose,        zeros of x kept, support dimensions moved with the view
  permute, t
  mul(x, y)                    zero where either is: the sparser side's support; density <= min
  add(x, y), sub(x, y)         sparse only if both share a support; density <= dx + dy
  einsum, matmul, mm, bmm,     zero where a sparse operand's support is, if all the support's dimensions
  linear (no bias)             survive in the output (one-hot dispatch "bnd,ndh->bnh"); otherwise dense
  anything else                dense

Backward graphs: a fused region's gradient is the einsum of the output gradient with the other operands,
run by the same `scorch::region` op with the same operand kinds, so a sparse forward operand is sparse in
every gradient that reads it (dx = g W for a pruned W). Values whose support comes from a ReLU, a mask or a
scatter get gradients that the same op (relu, mul by the mask, scatter) zeroes outside the support, which is
why a pattern factor may stand in for them (see passes/fuse.py).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from ... import log as _log
from ..attrs import DENSE, SparsityAttr, Support
from .contraction import CONTRACTIONS, contraction_form, output_dims_of
from .graph import OpView, example, mutated_values, op_of, shape_of

ZERO_PRESERVING = {"aten.relu", "aten.gelu", "aten.tanh", "aten.abs", "aten.neg", "aten.clone",
                   "aten._to_copy", "aten.dropout"}
VIEWS = {"aten.unsqueeze", "aten.transpose", "aten.permute", "aten.t"}


class Context:
    def __init__(self, attrs: dict, measured: dict, threshold: float):
        self.attrs = attrs  # node name -> SparsityAttr
        self.measured = measured  # node name -> density in the example run
        self.threshold = threshold

    def of(self, x) -> SparsityAttr:
        return self.attrs.get(x.name, DENSE) if isinstance(x, fx.Node) else DENSE


def _rank(node) -> int:
    s = shape_of(node)
    return len(s) if s is not None else 0


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _view_map(node: fx.Node, view: OpView):
    """For a view node: a function from an input dimension to the output dimension (None if dropped)."""
    src = view.args[0]
    r_in, r_out = _rank(src), _rank(node)
    if view.name == "aten.unsqueeze":
        d = _norm(view.args[1] if len(view.args) > 1 else view.kwargs.get("dim"), r_out)
        return lambda k: k + (k >= d)
    if view.name == "aten.transpose":
        a = _norm(view.args[1] if len(view.args) > 1 else view.kwargs["dim0"], r_in)
        b = _norm(view.args[2] if len(view.args) > 2 else view.kwargs["dim1"], r_in)
        return lambda k: b if k == a else a if k == b else k
    if view.name == "aten.t":
        return (lambda k: 1 - k) if r_in == 2 else (lambda k: k)
    if view.name == "aten.permute":
        perm = view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (list, tuple)) else view.args[1:]
        perm = [_norm(p, r_in) for p in perm]
        return lambda k: perm.index(k) if k in perm else None
    return None


def _aligned(x, support, result: fx.Node):
    """An operand's support in the dimensions of a broadcast result (operands align from the right), or None
    when it does not carry over: a dimension of the support that the operand has with size 1 is broadcast,
    and the operand's zeros are then spread along it."""
    if support is None or not isinstance(x, fx.Node):
        return None
    sx, sr = shape_of(x), shape_of(result)
    if sx is None or sr is None:
        return None
    shift = len(sr) - len(sx)
    for d in support.dims:
        n, m = sx[d], sr[d + shift]
        if not (n is m or (isinstance(n, int) and isinstance(m, int) and n == m) or
                (not isinstance(n, int) and not isinstance(m, int) and str(n) == str(m))):
            return None
    return Support(support.carrier, tuple(d + shift for d in support.dims))


def _is_zero(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


def _is_neg_inf(v) -> bool:
    return isinstance(v, float) and math.isinf(v) and v < 0


def _kept_where(mask, ctx: Context, out_rank: int):
    """For a bool mask m: the support 'nonzero where m is True', aligned to a result of rank out_rank.
    Returns (support of the kept region, density) or None."""
    if not isinstance(mask, fx.Node):
        return None
    r = _rank(mask)
    shift = out_rank - r
    sup = Support(mask.name, tuple(range(shift, shift + r)))
    d = ctx.measured.get(mask.name)
    return sup, (d if d is not None else 0.5)


def _not_of(mask):
    """m for ~m, else None."""
    if isinstance(mask, fx.Node) and op_of(mask).name == "aten.bitwise_not":
        return mask.args[0]
    return None


def _sparse_attr(ctx: Context, node: fx.Node, density: float, origin: str, pattern: str, support=None, **kw):
    m = ctx.measured.get(node.name)
    d = min(density, m) if m is not None else density
    return SparsityAttr(sparse=d < ctx.threshold, density=d, origin=origin, pattern=pattern, support=support,
                        measured=m, **kw)


def rule(node: fx.Node, ctx: Context) -> SparsityAttr:
    view = op_of(node)
    name = view.name
    args = view.args
    measured = ctx.measured.get(node.name)
    rank = _rank(node)
    if name == "aten.one_hot":
        n = args[1] if len(args) > 1 else view.kwargs.get("num_classes", -1)
        n = n if isinstance(n, int) and n > 0 else (shape_of(node) or (1,))[-1]
        return _sparse_attr(ctx, node, 1.0 / max(int(n), 1), "one_hot", "one-hot",
                            Support(node.name, tuple(range(rank))))
    if name == "aten.scatter" and len(args) >= 4:
        base, dim, index = args[0], args[1], args[2]
        if isinstance(base, fx.Node) and op_of(base).name == "aten.zeros_like" and isinstance(dim, int):
            si, sb = shape_of(index), shape_of(base)
            k, n = si[_norm(dim, len(si))], sb[_norm(dim, len(sb))]
            if isinstance(k, int) and isinstance(n, int) and n > 0:
                return _sparse_attr(ctx, node, k / n, "scatter into zeros", f"{k} per row",
                                    Support(node.name, tuple(range(rank))))
        return DENSE.with_(measured=measured)
    if name == "aten.masked_fill" and len(args) >= 3:
        x, mask, value = args[0], args[1], args[2]
        kept = _not_of(mask)
        if kept is not None and (_is_zero(value) or _is_neg_inf(value)):
            sup, d = _kept_where(kept, ctx, rank)
            if _is_zero(value):
                return _sparse_attr(ctx, node, d, "masked_fill with 0", "masked", sup)
            return ctx.of(x).with_(sparse=False, neg_inf_outside=sup, support=None, density=1.0,
                                   origin="masked_fill with -inf", pattern="masked", measured=measured)
        return DENSE.with_(measured=measured)
    if name == "aten.where" and len(args) == 3:
        cond, x, other = args
        if _is_zero(other) or _is_neg_inf(other):
            sup, d = _kept_where(cond, ctx, rank)
            if _is_zero(other):
                return _sparse_attr(ctx, node, d, "where(m, x, 0)", "masked", sup)
            return SparsityAttr(neg_inf_outside=sup, origin="where(m, x, -inf)", pattern="masked",
                                measured=measured)
        return DENSE.with_(measured=measured)
    if name == "aten.softmax":
        a = ctx.of(args[0])
        if a.neg_inf_outside is not None:
            carrier = ctx.measured.get(a.neg_inf_outside.carrier, 0.5)
            return _sparse_attr(ctx, node, carrier, "softmax of -inf-masked scores", "masked",
                                a.neg_inf_outside)
        return DENSE.with_(measured=measured)
    by_scalar = (name in ("aten.mul", "aten.div") and len(args) == 2 and isinstance(args[0], fx.Node)
                 and isinstance(args[1], (int, float)))
    if name in ZERO_PRESERVING or by_scalar:
        if name == "aten._to_copy" and isinstance(example(node), torch.Tensor) and not example(node).is_floating_point():
            return DENSE.with_(measured=measured)
        a = ctx.of(args[0])
        if name == "aten.relu" and measured is not None and measured < ctx.threshold and a.support is None:
            return _sparse_attr(ctx, node, measured, "relu (measured in the example run)", "unstructured")
        if a.sparse or a.support is not None:
            return a.with_(measured=measured, weight=False, format=None,
                           density=min(a.density, measured) if measured is not None else a.density,
                           origin=a.origin if name != "aten.relu" else f"relu of {a.origin}")
        return DENSE.with_(measured=measured)
    if name in VIEWS:
        a = ctx.of(args[0])
        f = _view_map(node, view)
        if f is None:
            return DENSE.with_(measured=measured)
        kw = {}
        for field in ("support", "neg_inf_outside"):
            s = getattr(a, field)
            kw[field] = s.remap(f) if s is not None else None
        return a.with_(measured=measured, weight=False, format=None, **kw)
    if name == "aten.mul" and len(args) == 2:
        xs = [x for x in args if isinstance(x, fx.Node)]
        best = None
        for x in xs:
            a = ctx.of(x)
            if a.support is None and not a.sparse:
                continue
            sup = _aligned(x, a.support, node)
            if best is None or a.density < best[0].density:
                best = (a, sup)
        if best is None:
            return DENSE.with_(measured=measured)
        a, sup = best
        return _sparse_attr(ctx, node, a.density, f"mul by {a.origin}", a.pattern, sup)
    if name in ("aten.add", "aten.sub") and len(args) == 2 and all(isinstance(x, fx.Node) for x in args):
        a, b = ctx.of(args[0]), ctx.of(args[1])
        sa, sb = _aligned(args[0], a.support, node), _aligned(args[1], b.support, node)
        if sa is not None and sa == sb:
            return _sparse_attr(ctx, node, min(1.0, a.density + b.density), "sum of tensors with one support",
                                a.pattern, sa)
        return DENSE.with_(measured=measured)
    if name in CONTRACTIONS:
        form = contraction_form(view)
        if form is None:
            return DENSE.with_(measured=measured)
        ops, letters, out = form
        if name == "aten.linear" and len(args) > 2 and args[2] is not None:
            return DENSE.with_(measured=measured)
        for k, x in enumerate(ops):
            a = ctx.of(x)
            if a.support is None:
                continue
            dims = output_dims_of(letters, out, k, a.support.dims)
            if dims is not None:
                return _sparse_attr(ctx, node, a.density, f"contraction with {a.origin}", a.pattern,
                                    Support(a.support.carrier, dims))
        return DENSE.with_(measured=measured)
    return DENSE.with_(measured=measured)


def propagate(gm: fx.GraphModule, attrs: dict, measured: dict, threshold: float) -> dict:
    """Fill `attrs` (node name -> SparsityAttr; placeholders already set by discover) for every node.
    Values written in place by the graph (and their aliases) are dense: their zeros may not last."""
    ctx = Context(attrs, measured, threshold)
    mutated = mutated_values(gm)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.name in mutated:
            attrs[node.name] = DENSE.with_(measured=measured.get(node.name), origin="written in place")
        elif node.op != "placeholder":
            attrs[node.name] = rule(node, ctx)
    logger = _log.get("passes.propagate")
    if logger.isEnabledFor(10):
        found = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")
                 and (attrs.get(n.name, DENSE).sparse or attrs.get(n.name, DENSE).support is not None)]
        logger.debug("%d value(s) with known zeros: %s", len(found), ", ".join(found) or "none")
    return attrs
