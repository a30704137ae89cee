"""The ATen ops the backend knows, in one table.

Adding an op to the backend means adding one entry to `OPS` below. Each entry holds what every pass needs to
know about that op:

  functions, methods  how Dynamo graphs call it (`torch.relu`, `F.relu`, `x.relu()`): `op_of` names a node by
                      its ATen op, so the passes match ops by one name whatever the spelling
  params              parameter names in order ("a|b": alternatives), so keyword arguments are moved into place
  inplace_flag        the op has an `inplace` flag as its last parameter (F.relu(x, True) is then opaque)
  rule                propagate: the op's sparsity attribute from its inputs' (`rule(node, view, ctx)`, None for
                      "dense")
  fusible             partition: may the op join a region as a producer of a region's value (True, or a
                      predicate on the node)
  on_result           partition: may the op extend a region downward when applied to a product's result
                      (scalar factors, negation, masks)
  index               fuse: its index form, the op as einsum factors and letters (`index(fuser, node, view)`)
  grad                partition: does the gradient reaching the op's input keep the sparsity of the op's own
                      gradient (`grad(node, view) -> bool`; used to estimate gradient densities in training)
  between             partition: an elementwise op with f(0) = 0 that may sit between two steps of a chain
                      region (custom_ops/region.py runs it on the grouped intermediate)
  zero_grad           fuse: does the op zero its input's gradient wherever its result is zero (ReLU), so a
                      consumer's gradient with respect to its result is needed only at its nonzeros

An op not in the table is "opaque": dense as far as Scorch knows, and never inside a region. The helpers the
rules and index forms share (node values, contraction letters, the symbolic `Term` of a value in a region)
live here too, beside the table that uses them, so the passes import the table and never the other way.

Sparsity rules (x, y tensors; "support" = the value whose zeros bound this one's, see attrs.py):

  op                           result
  ---------------------------  -----------------------------------------------------------------------------
  one_hot(i, n)                sparse, density 1/n, pattern one-hot, its own support
  scatter(zeros_like(x), d,    sparse, density k/n (k = index size along d), pattern k per row, own support
          idx, src)
  masked_fill(x, ~m, 0)        zero where m is: support m         masked_fill(x, ~m, -inf): -inf outside m
  where(m, x, 0)               zero where m is: support m         where(m, x, -inf): -inf outside m
  softmax(x, d)                if x is -inf outside m: zero where m is (support m), where each row of m along d
                               keeps an entry (a region reading it checks at run time); else dense
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
  linear with a bias, addmm    dense (the added term fills the zeros); still a region's product, the term
                               joining it as an addend
  anything else                dense
"""

from __future__ import annotations

import math
import operator
import string
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx

from .attrs import DENSE, SparsityAttr, Support

# --- node values -----------------------------------------------------------------------------------------


def example(node) -> object:
    """The fake (or real) value Dynamo recorded for a node, or None."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node) -> tuple | None:
    v = example(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def rank_of(node) -> int:
    s = shape_of(node)
    return len(s) if s is not None else 0


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _is_one(n) -> bool:
    return isinstance(n, int) and n == 1


def _is_zero(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


def _is_neg_inf(v) -> bool:
    return isinstance(v, float) and math.isinf(v) and v < 0


def is_scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --- the table's record ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    name: str
    params: tuple = ()
    functions: tuple = ()
    methods: tuple = ()
    inplace_flag: bool = False
    rule: Callable | None = None  # (node, view, ctx) -> SparsityAttr | None
    fusible: bool | Callable = False  # (node, view) -> bool
    on_result: bool = False
    index: Callable | None = None  # (fuser, node, view) -> Term
    grad: bool | Callable = False  # (node, view) -> bool
    between: bool = False
    zero_grad: bool | Callable = False  # (node, view) -> bool

    def can_fuse(self, node, view) -> bool:
        return self.fusible(node, view) if callable(self.fusible) else bool(self.fusible)

    def passes_grad(self, node, view) -> bool:
        return self.grad(node, view) if callable(self.grad) else bool(self.grad)

    def zeroes_grad(self, node, view) -> bool:
        return self.zero_grad(node, view) if callable(self.zero_grad) else bool(self.zero_grad)


OPS: dict[str, OpSpec] = {}
FUNCTIONS: dict = {}  # python callable -> op name
METHODS: dict[str, str] = {}  # Tensor method name -> op name


def _op(name: str, params, functions=(), methods=(), **kw) -> None:
    spec = OpSpec(name, tuple(params), tuple(f for f in functions if f is not None), tuple(methods), **kw)
    OPS[name] = spec
    for f in spec.functions:
        FUNCTIONS[f] = name
    for m in spec.methods:
        METHODS[m] = name


def spec_of(name: str) -> OpSpec | None:
    return OPS.get(name)


# --- naming a node by its ATen op ---------------------------------------------------------------------------

# Keyword arguments that leave an op's meaning as the rules assume it, at these values.
_HARMLESS = {"dtype": (None,), "approximate": ("none", "tanh"), "inplace": (False,), "alpha": (1,), "beta": (1,),
             "rounding_mode": (None,), "memory_format": (None, torch.preserve_format, torch.contiguous_format),
             "non_blocking": (False,), "copy": (False,), "sorted": (True,), "largest": (True,),
             "layout": (None,), "device": (None,), "pin_memory": (None, False), "requires_grad": (False,)}


@dataclass
class OpView:
    name: str  # "aten.mul", ... or "opaque" / "placeholder" / "output"
    args: tuple
    kwargs: dict


def normalized(name: str, args: tuple, kwargs: dict):
    """(args, leftover kwargs) with known keyword arguments moved into position."""
    spec = OPS.get(name)
    if spec is None or not kwargs:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for k, alternatives in enumerate(spec.params):
        for p in alternatives.split("|"):
            if p in kwargs:
                if k < len(args):
                    return tuple(args), kwargs  # given twice: leave it to the op to complain
                while len(args) < k:
                    args.append(None)  # an earlier optional parameter left at its default
                args.append(kwargs.pop(p))
                break
    return tuple(args), kwargs


def _harmless(kwargs: dict) -> bool:
    return all(k in _HARMLESS and any(v is h or v == h for h in _HARMLESS[k]) for k, v in kwargs.items())


def inplace_by_position(name: str, args: tuple) -> bool:
    """F.relu(x, True), F.dropout(x, p, training, True): the inplace flag given by position."""
    spec = OPS.get(name)
    return spec is not None and spec.inplace_flag and len(args) == len(spec.params) + 1 and args[-1] is True


def op_of(node: fx.Node) -> OpView:
    """The ATen op a node stands for, keyword arguments moved into place. A node whose other keyword
    arguments change the op's meaning (rounding_mode=, alpha=, out=, inplace=True ...) is "opaque"."""
    if node.op in ("placeholder", "output", "get_attr"):
        return OpView(node.op, node.args, dict(node.kwargs))
    if node.op == "call_function":
        name = FUNCTIONS.get(node.target, "opaque")
    elif node.op == "call_method":
        name = METHODS.get(node.target, "opaque")
    else:
        name = "opaque"
    args, kwargs = normalized(name, node.args, dict(node.kwargs))
    if inplace_by_position(name, args):
        name = "opaque"
    if kwargs and not _harmless(kwargs):
        name = "opaque"
    return OpView(name, args, kwargs)


# --- contractions as einsum letters --------------------------------------------------------------------------

CONTRACTIONS = ("aten.einsum", "aten.matmul", "aten.mm", "aten.bmm", "aten.linear", "aten.addmm")
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
    if view.name == "aten.addmm":  # input + mat1 @ mat2 (beta = alpha = 1: others leave the op opaque)
        a, b = view.args[1], view.args[2]
        sa, sb = shape_of(a), shape_of(b)
        if sa is None or sb is None or len(sa) != 2 or len(sb) != 2:
            return None
        return [a, b], ["ik", "kj"], "ij"
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


def output_dims_of(letters: list[str], out: str, operand: int, dims) -> tuple[int, ...] | None:
    """Where the given dimensions of an operand land in the output, or None if one is summed away."""
    got = []
    for d in dims:
        c = letters[operand][d]
        if c not in out:
            return None
        got.append(out.index(c))
    return tuple(got)


def linear_bias(view: OpView):
    """A linear's bias node (None when it has none), or the term addmm adds to its product (any shape that
    broadcasts to it: it joins the region as an addend)."""
    if view.name == "aten.linear" and len(view.args) > 2 and view.args[2] is not None:
        return view.args[2]
    if view.name == "aten.addmm" and isinstance(view.args[0], fx.Node):
        return view.args[0]
    return None


# --- index forms (fuse): a value inside a region as a product of factors -----------------------------------


class FuseError(Exception):
    pass


@dataclass
class Term:
    factors: list  # (leaf node, [letter per dim, None for a size-1 dim])
    dims: list  # letter per dimension of the value, None for a broadcast dimension of size 1
    coef: float = 1.0


def _index_same(fuser, node, view) -> Term:
    return fuser.term(view.args[0])


def _index_neg(fuser, node, view) -> Term:
    t = fuser.term(view.args[0])
    return Term(t.factors, t.dims, -t.coef)


def _index_mul_div(fuser, node, view) -> Term:
    a, b = view.args[0], view.args[1]
    if not isinstance(a, fx.Node):
        a, b = b, a
    ta = fuser.term(a)
    if is_scalar(b):
        return Term(ta.factors, ta.dims, ta.coef * b if view.name == "aten.mul" else ta.coef / b)
    if view.name == "aten.div":
        raise FuseError("division by a tensor")
    return fuser.mul(ta, fuser.term(b))


def _index_unsqueeze(fuser, node, view) -> Term:
    t = fuser.term(view.args[0])
    d = view.args[1] if len(view.args) > 1 else view.kwargs["dim"]
    d = d + len(t.dims) + 1 if d < 0 else d
    return Term(t.factors, t.dims[:d] + [None] + t.dims[d:], t.coef)


def _index_permutation(fuser, node, view) -> Term:
    args = view.args
    t = fuser.term(args[0])
    r = len(t.dims)
    if view.name == "aten.t":
        perm = [1, 0] if r == 2 else list(range(r))
    elif view.name == "aten.transpose":
        a = args[1] % r if r else 0
        b = args[2] % r if r else 0
        perm = list(range(r))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        perm = [p % r for p in perm]
    return Term(t.factors, [t.dims[p] for p in perm], t.coef)


def _index_contraction(fuser, node, view) -> Term:
    form = contraction_form(view)
    if form is None:
        raise FuseError(f"{node.name}: contraction form not handled")
    ops, letters, out = form
    return fuser.contract([fuser.term(o) for o in ops], letters, out)


# --- sparsity rules (propagate) ------------------------------------------------------------------------------


class Context:
    """What the rules read: attributes found so far, densities of the example run, the sparse threshold."""

    def __init__(self, attrs: dict, measured: dict, threshold: float):
        self.attrs = attrs  # node name -> SparsityAttr
        self.measured = measured  # node name -> density in the example run
        self.threshold = threshold

    def of(self, x) -> SparsityAttr:
        return self.attrs.get(x.name, DENSE) if isinstance(x, fx.Node) else DENSE

    def sparse(self, node: fx.Node, density: float, origin: str, pattern: str, support=None, **kw):
        m = self.measured.get(node.name)
        d = min(density, m) if m is not None else density
        return SparsityAttr(sparse=d < self.threshold, density=d, origin=origin, pattern=pattern, support=support,
                            measured=m, **kw)


def aligned(x, support, result: fx.Node):
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
    return replace(support, dims=tuple(d + shift for d in support.dims))


def _kept_where(mask, ctx: Context, out_rank: int):
    """For a bool mask m: the support 'nonzero where m is True', aligned to a result of rank out_rank.
    Returns (support of the kept region, density) or None."""
    if not isinstance(mask, fx.Node):
        return None
    r = rank_of(mask)
    shift = out_rank - r
    sup = Support(mask.name, tuple(range(shift, shift + r)))
    d = ctx.measured.get(mask.name)
    return sup, (d if d is not None else 0.5)


def negated_mask(mask):
    """m for ~m (logical_not(m)) and for m == 0 (True exactly where m is zero, of any dtype: "mask == 0" is how
    much attention code spells the masked-out positions), else None."""
    if not isinstance(mask, fx.Node):
        return None
    view = op_of(mask)
    if view.name == "aten.bitwise_not":
        return view.args[0]
    if view.name == "aten.eq" and len(view.args) == 2:
        m, zero = view.args
        if isinstance(m, fx.Node) and (_is_zero(zero) or zero is False):
            return m
    return None


def _view_map(node: fx.Node, view: OpView):
    """For a view node: a function from an input dimension to the output dimension (None if dropped)."""
    src = view.args[0]
    r_in, r_out = rank_of(src), rank_of(node)
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


def _rule_one_hot(node, view, ctx):
    args = view.args
    n = args[1] if len(args) > 1 else view.kwargs.get("num_classes", -1)
    n = n if isinstance(n, int) and n > 0 else (shape_of(node) or (1,))[-1]
    return ctx.sparse(node, 1.0 / max(int(n), 1), "one_hot", "one-hot", Support(node.name, tuple(range(rank_of(node)))))


def _rule_scatter(node, view, ctx):
    if len(view.args) < 4:
        return None
    base, dim, index = view.args[0], view.args[1], view.args[2]
    if isinstance(base, fx.Node) and op_of(base).name == "aten.zeros_like" and isinstance(dim, int):
        si, sb = shape_of(index), shape_of(base)
        k, n = si[_norm(dim, len(si))], sb[_norm(dim, len(sb))]
        if isinstance(k, int) and isinstance(n, int) and n > 0:
            return ctx.sparse(node, k / n, "scatter into zeros", f"{k} per row",
                              Support(node.name, tuple(range(rank_of(node)))))
    return None


def _rule_masked_fill(node, view, ctx):
    if len(view.args) < 3:
        return None
    x, mask, value = view.args[0], view.args[1], view.args[2]
    kept = negated_mask(mask)
    if kept is None or not (_is_zero(value) or _is_neg_inf(value)):
        return None
    sup, d = _kept_where(kept, ctx, rank_of(node))
    if _is_zero(value):
        return ctx.sparse(node, d, "masked_fill with 0", "masked", sup)
    return ctx.of(x).with_(sparse=False, neg_inf_outside=sup, support=None, density=1.0,
                           origin="masked_fill with -inf", pattern="masked", measured=ctx.measured.get(node.name))


def _rule_where(node, view, ctx):
    if len(view.args) != 3:
        return None
    cond, x, other = view.args
    if isinstance(other, fx.Node) and op_of(other).name == "aten.zeros_like":
        other = 0.0  # where(m, w, zeros_like(w)): the same zeros
    if not (_is_zero(other) or _is_neg_inf(other)):
        return None
    sup, d = _kept_where(cond, ctx, rank_of(node))
    if _is_zero(other):
        return ctx.sparse(node, d, "where(m, x, 0)", "masked", sup)
    return SparsityAttr(neg_inf_outside=sup, origin="where(m, x, -inf)", pattern="masked",
                        measured=ctx.measured.get(node.name))


def _rule_softmax(node, view, ctx):
    """Zero outside the mask, provided each row along the softmax's dimension keeps an entry: a row of only -inf
    is NaN throughout (eager's answer too). The mask's dimension along the softmax's is recorded, so the region
    reading the result under the mask's pattern can check its rows at run time (attrs.Support.nonempty). A mask
    broadcast along that dimension empties whole rows wherever it is zero: no zeros to claim then."""
    a = ctx.of(view.args[0])
    sup = a.neg_inf_outside
    dim = view.args[1] if len(view.args) > 1 else view.kwargs.get("dim")
    if sup is None or not isinstance(dim, int):
        return None
    d = _norm(dim, rank_of(node))
    if d not in sup.dims:
        return None
    carrier = ctx.measured.get(sup.carrier, 0.5)
    return ctx.sparse(node, carrier, "softmax of -inf-masked scores", "masked",
                      replace(sup, nonempty=sup.dims.index(d)))


def _rule_zero_preserving(node, view, ctx):
    """f(0) = 0 elementwise: the input's zeros (and support) are kept; a ReLU adds the zeros it makes."""
    if view.name == "aten._to_copy" and isinstance(example(node), torch.Tensor) and \
            not example(node).is_floating_point():
        return None
    measured = ctx.measured.get(node.name)
    a = ctx.of(view.args[0])
    if view.name == "aten.relu" and measured is not None and measured < ctx.threshold and a.support is None:
        return ctx.sparse(node, measured, "relu (measured in the example run)", "unstructured")
    if a.sparse or a.support is not None:
        return a.with_(measured=measured, weight=False, format=None,
                       density=min(a.density, measured) if measured is not None else a.density,
                       origin=a.origin if view.name != "aten.relu" else f"relu of {a.origin}")
    return None


def _rule_view(node, view, ctx):
    a = ctx.of(view.args[0])
    f = _view_map(node, view)
    if f is None:
        return None
    kw = {}
    for field in ("support", "neg_inf_outside"):
        s = getattr(a, field)
        kw[field] = s.remap(f) if s is not None else None
    return a.with_(measured=ctx.measured.get(node.name), weight=False, format=None, **kw)


def _by_scalar(view) -> bool:
    return len(view.args) == 2 and isinstance(view.args[0], fx.Node) and is_scalar(view.args[1])


def _rule_mul_div(node, view, ctx):
    if _by_scalar(view):
        return _rule_zero_preserving(node, view, ctx)
    if view.name != "aten.mul" or len(view.args) != 2:
        return None
    best = None
    for x in (x for x in view.args if isinstance(x, fx.Node)):
        a = ctx.of(x)
        if a.support is None and not a.sparse:
            continue
        sup = aligned(x, a.support, node)
        if best is None or a.density < best[0].density:
            best = (a, sup)
    if best is None:
        return None
    a, sup = best
    return ctx.sparse(node, a.density, f"mul by {a.origin}", a.pattern, sup)


def _rule_add_sub(node, view, ctx):
    if len(view.args) != 2 or not all(isinstance(x, fx.Node) for x in view.args):
        return None
    a, b = ctx.of(view.args[0]), ctx.of(view.args[1])
    sa, sb = aligned(view.args[0], a.support, node), aligned(view.args[1], b.support, node)
    if sa is not None and sa == sb:
        return ctx.sparse(node, min(1.0, a.density + b.density), "sum of tensors with one support", a.pattern, sa)
    return None


def _rule_contraction(node, view, ctx):
    form = contraction_form(view)
    if form is None or linear_bias(view) is not None:
        return None
    ops, letters, out = form
    for k, x in enumerate(ops):
        a = ctx.of(x)
        if a.support is None:
            continue
        dims = output_dims_of(letters, out, k, a.support.dims)
        if dims is not None:
            return ctx.sparse(node, a.density, f"contraction with {a.origin}", a.pattern,
                              replace(a.support, dims=dims))
    return None


# --- fusibility predicates (partition) --------------------------------------------------------------------


def _fusible_mul(node, view) -> bool:
    return any(isinstance(a, fx.Node) for a in view.args[:2])


def _fusible_div(node, view) -> bool:
    return len(view.args) > 1 and is_scalar(view.args[1])


def _fusible_cast(node, view) -> bool:
    src, out = example(view.args[0]), example(node)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype


def _grad_by_scalar(node, view) -> bool:
    return len(view.args) > 1 and is_scalar(view.args[1])


def _zero_grad_scatter(node, view) -> bool:
    """zeros_like(p).scatter(d, i, relu(v)) is zero off the scattered positions (no gradient flows there)
    and where relu(v) is."""
    if len(view.args) < 4:
        return False
    base, src = view.args[0], view.args[3]
    return isinstance(base, fx.Node) and op_of(base).name == "aten.zeros_like" and \
        isinstance(src, fx.Node) and op_of(src).name == "aten.relu"


# --- the table -----------------------------------------------------------------------------------------------

X = ("input|self",)  # the one tensor parameter of an elementwise op

# contractions: their own index form; a region starts at one
_op("aten.linear", ["input", "weight", "bias"], [torch._C._nn.linear, F.linear],
    rule=_rule_contraction, index=_index_contraction)
_op("aten.matmul", ["input|self", "other"], [operator.matmul, torch.matmul], ["matmul"],
    rule=_rule_contraction, index=_index_contraction)
_op("aten.mm", ["input|self", "mat2|other"], [torch.mm], ["mm"], rule=_rule_contraction, index=_index_contraction)
# bias + x @ W: transformers' Conv1D (GPT-2's projections) stores its weight (in, out) and calls addmm
_op("aten.addmm", ["input|self", "mat1", "mat2"], [torch.addmm], ["addmm"], rule=_rule_contraction,
    index=_index_contraction)
_op("aten.bmm", ["input|self", "mat2|other"], [torch.bmm], ["bmm"], rule=_rule_contraction,
    index=_index_contraction)
_op("aten.einsum", [], [torch.einsum, torch.functional.einsum], rule=_rule_contraction, index=_index_contraction)

# products and sums
_op("aten.mul", ["input|self", "other"], [operator.mul, torch.mul], ["mul"], rule=_rule_mul_div,
    fusible=_fusible_mul, on_result=True, index=_index_mul_div, grad=_grad_by_scalar)
_op("aten.div", ["input|self", "other"], [operator.truediv, torch.div, torch.true_divide], ["div"],
    rule=_rule_mul_div, fusible=_fusible_div, on_result=True, index=_index_mul_div, grad=_grad_by_scalar)
_op("aten.add", ["input|self", "other"], [operator.add, torch.add], ["add"], rule=_rule_add_sub)
_op("aten.sub", ["input|self", "other"], [operator.sub, torch.sub], ["sub"], rule=_rule_add_sub)

# elementwise with f(0) = 0
_op("aten.neg", X, [operator.neg, torch.neg], ["neg"], rule=_rule_zero_preserving, fusible=True, on_result=True,
    index=_index_neg, grad=True, between=True)
_op("aten.relu", X, [torch.relu, F.relu], ["relu"], inplace_flag=True, rule=_rule_zero_preserving,
    zero_grad=True, between=True)
_op("aten.gelu", X, [F.gelu], rule=_rule_zero_preserving, between=True)
_op("aten.tanh", X, [torch.tanh], ["tanh"], rule=_rule_zero_preserving, between=True)
_op("aten.abs", X, [torch.abs], ["abs"], rule=_rule_zero_preserving, between=True)
_op("aten.clone", X, [], ["contiguous", "clone"], rule=_rule_zero_preserving, fusible=True, index=_index_same,
    grad=True)
# (`dtype` a parameter: torch.nn.utils.prune's hook writes `mask.to(dtype=orig.dtype) * orig`, and a keyword
# not in the table makes a node opaque. `type_as(y)` is `to(y)`.)
_op("aten._to_copy", ["input|self", "dtype"], [], ["to", "float", "double", "type", "type_as"],
    rule=_rule_zero_preserving, fusible=_fusible_cast, index=_index_same, grad=True)
_op("aten.dropout", ["input", "p", "training"], [F.dropout, torch.dropout], inplace_flag=True,
    rule=_rule_zero_preserving, grad=True)
_op("aten.detach", X, [torch.detach], ["detach"], grad=True)

# views
_op("aten.unsqueeze", ["input|self", "dim"], [torch.unsqueeze], ["unsqueeze"], rule=_rule_view, fusible=True,
    index=_index_unsqueeze)
_op("aten.transpose", ["input|self", "dim0", "dim1"], [torch.transpose], ["transpose"], rule=_rule_view,
    fusible=True, index=_index_permutation)
_op("aten.permute", ["input|self", "dims"], [torch.permute], ["permute"], rule=_rule_view, fusible=True,
    index=_index_permutation)
_op("aten.t", X, [torch.t], ["t"], rule=_rule_view, fusible=True, index=_index_permutation)

# ops that make zeros with a known structure
_op("aten.one_hot", ["input|tensor", "num_classes"], [torch._C._nn.one_hot, F.one_hot], rule=_rule_one_hot)
_op("aten.scatter", ["input|self", "dim", "index", "src|value"], [torch.scatter], ["scatter"], rule=_rule_scatter,
    zero_grad=_zero_grad_scatter)
_op("aten.masked_fill", ["input|self", "mask", "value"], [torch.masked_fill], ["masked_fill"],
    rule=_rule_masked_fill)
_op("aten.where", ["condition", "input|self", "other"], [torch.where], rule=_rule_where)
_op("aten.softmax", ["input|self", "dim"], [torch.softmax, F.softmax], ["softmax"], rule=_rule_softmax)

# ops the rules look at, with no rule of their own
_op("aten.bitwise_not", X, [operator.invert, torch.bitwise_not, torch.logical_not], ["logical_not", "bitwise_not"])
_op("aten.eq", ["input|self", "other"], [operator.eq, torch.eq], ["eq"])  # (m == 0: negated_mask)
_op("aten.topk", ["input|self", "k", "dim"], [torch.topk], ["topk"])
_op("aten.zeros_like", X, [torch.zeros_like])
_op("aten.getitem", [], [operator.getitem])
