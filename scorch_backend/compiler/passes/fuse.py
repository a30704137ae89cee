"""fuse: a region of the graph becomes one einsum (a product of its inputs, summed over the indices that do
not reach the output), run by `scorch::region`.

Each value inside the region is tracked symbolically: a list of factors (region inputs with an index letter
per dimension), the letter of each of its own dimensions (None for a broadcast dimension of size 1) and a
constant coefficient. Views move letters, `mul` unifies the letters of broadcast-aligned dimensions and
multiplies the factor lists, contractions unify the letters their equation shares. What comes out is the
einsum of the whole region. Sums applied to its result (a linear's bias, a residual `y + x`) join it as
addends: operands of kind "add", whose letters are the output's they align with (size-1 dimensions broadcast),
added by the op after the product (custom_ops/region.py).

Then each input is given its kind (scorch_backend/custom_ops/region.py): sparse inputs are compressed; a dense input
whose zeros are carried by another sparse value (its support) gets that value as an extra 0/1 pattern factor.
Multiplying by the pattern changes nothing in the result, since the input is already zero outside it; in
the backward pass it zeroes the gradient of that input outside the support, where the op that made the zeros
(relu, a mask, a scatter) zeroes it anyway, so gradients reaching the model's inputs and weights are the same.
A sparse input made by a ReLU is also marked `masked_grad` (its own gradient is computed only at its
nonzeros, by the same argument), and is cached so the backward pass reuses the forward's compression.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from ...custom_ops.chain import ChainProgram, ChainStep, parse_chain
from ...custom_ops.region import Operand, Program
from ..attrs import DENSE
from ..ops_table import OPS, FuseError, Term, linear_bias
from .graph import ALIASING_FUNCTIONS, ALIASING_METHODS, example, op_of, shape_of

__all__ = ["Chained", "Fused", "FuseError", "Fuser", "chain_of", "fuse", "sequence_of", "zero_grad_outside"]

_CHARS = string.ascii_letters


class _Letters:
    def __init__(self):
        self.parent: list[int] = []
        self.size: list = []

    def new(self, size) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        return len(self.parent) - 1

    def find(self, a: int) -> int:
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a
        return a


_LEAF_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool})


def _is_one(n) -> bool:
    return isinstance(n, int) and n == 1


@dataclass
class Fused:
    program: Program
    leaves: list  # fx nodes, in operand order
    unit_dims: list = field(default_factory=list)  # output dimensions of size 1 to unsqueeze back
    bias: object = None  # (no longer used: a linear's bias is an addend of the program)
    density: float = 1.0  # estimated combined density of the sparse factors
    squeeze: list = field(default_factory=list)  # per leaf: its size-1 dimensions, squeezed before the region
    densities: list = field(default_factory=list)  # per operand: its estimated density (1.0 for dense ones)
    addends: list = field(default_factory=list)  # the leaves added to the product (operands of kind "add")
    # per leaf: the dtype it is cast to before the region (a bool mask, read as 0/1 values), else None
    casts: list = field(default_factory=list)


class Fuser:
    def __init__(self, members: set, attrs: dict):
        self.members = members
        self.attrs = attrs
        self.L = _Letters()

    def term(self, x) -> Term:
        if not isinstance(x, fx.Node):
            raise FuseError(f"unexpected constant {x!r}")
        # Every use gets its own letters (a value used twice is two factors of the product).
        return self._leaf(x) if x not in self.members else self._build(x)

    def _leaf(self, x: fx.Node) -> Term:
        shape = shape_of(x)
        if shape is None:
            raise FuseError(f"{x.name} has no known shape")
        # Dimensions of size 1 broadcast: they are squeezed away before the region (see rewrite).
        dims = [None if _is_one(s) else self.L.new(s) for s in shape]
        return Term([(x, dims)], dims)

    def _build(self, node: fx.Node) -> Term:
        """The index form of a member of the region: the op table's `index` column."""
        view = op_of(node)
        spec = OPS.get(view.name)
        if spec is None or spec.index is None:
            raise FuseError(f"{view.name} cannot be expressed in the region")
        return spec.index(self, node, view)

    def mul(self, a: Term, b: Term) -> Term:
        r = max(len(a.dims), len(b.dims))
        da = [None] * (r - len(a.dims)) + a.dims
        db = [None] * (r - len(b.dims)) + b.dims
        dims = []
        for x, y in zip(da, db):
            if x is not None and y is not None:
                dims.append(self.L.union(x, y))
            else:
                dims.append(x if x is not None else y)
        return Term(a.factors + b.factors, dims, a.coef * b.coef)

    def contract(self, terms, letters, out) -> Term:
        bound: dict = {}
        for t, ls in zip(terms, letters):
            for c, d in zip(ls, t.dims):
                if d is None:
                    continue
                bound[c] = self.L.union(bound[c], d) if c in bound else d
        factors, coef = [], 1.0
        for t in terms:
            factors += t.factors
            coef *= t.coef
        return Term(factors, [bound.get(c) for c in out], coef)


def _broadcast_patterns(operands: list, out: str) -> list:
    """Give a pattern factor the batch letters that the output and every dense operand share (attention
    heads: mask(i, j) for scores(b, i, j)), so the kernel's loops run batch-outermost over the dense operands'
    natural layout instead of transposing them. A pattern has no values: broadcasting it costs only indices."""
    dense = [o.letters for o in operands if o.kind == "dense"]
    if not dense:
        return operands
    common = [c for c in out if all(c in d for d in dense)]
    result = []
    for o in operands:
        lead = "".join(c for c in common if c not in o.letters)
        if o.kind == "pattern" and lead:
            o = replace(o, letters=lead + o.letters, expand=len(lead))  # (a pattern: no gradient, never masked)
        result.append(o)
    return result


_VIEWS = {"view", "view_as"}


# Ops that draw random numbers in the memory order of their input (a `*_like` op keeps its strides): on the
# n-major layout they would give other elements the numbers eager gives (the same draws, a transposed mask;
# helper-42 saw compiled dropout differ from eager's under Inductor's fallback_random).
_RANDOM_IN_MEMORY_ORDER = {"dropout", "dropout_", "native_dropout", "alpha_dropout", "feature_alpha_dropout",
                           "dropout1d", "dropout2d", "dropout3d", "rand_like", "randn_like", "randint_like",
                           "bernoulli", "bernoulli_", "normal_", "uniform_", "exponential_", "empty_like",
                           "multinomial"}


# Ops that add values into a tensor through an index: torch 2.13's Inductor writes wrong values or out of
# bounds (heap corruption) in its vectorized accumulating scatter when the values come from two inputs in the
# n-major layout (a pruned product's result plus another's, then index_add_: docs/backend.md).
_SCATTER_ACCUMULATE = {"index_add", "index_add_", "index_put", "index_put_", "_unsafe_index_put",
                       "_index_put_impl_", "embedding_dense_backward", "put", "put_", "index_reduce",
                       "index_reduce_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}


def _op_name(node: fx.Node) -> str:
    """The name of what a node calls: a method's name, a function's, an ATen op's without its namespace and
    overload (aten.index_add.default -> index_add)."""
    if node.op == "call_method":
        return node.target
    if isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(node.target).split(".")[1]
    return getattr(node.target, "__name__", "")


def _layout_matters(root: fx.Node) -> bool:
    """Must the region's result come back contiguous in its requested order? It is stored in the kernel's loop
    order (a pruned linear's y(b, n) as n-major, handed back as a transposed view), which every op but `view`
    takes as it is. Eager code never sees that layout: a `view` of the result fails, and so does one of a value
    that keeps its layout (a same-shape elementwise op on it, a reshape, unsqueeze or slice of it, any number of
    them), in the graph or in the caller's code after the graph returns it. Nor does a random op's draw order
    (_RANDOM_IN_MEMORY_ORDER). An accumulating scatter of such a value needs it contiguous too: Inductor
    miscompiles it on that layout (_SCATTER_ACCUMULATE)."""
    seen, frontier = {root}, [root]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output":
                return True
            name = _op_name(u)
            if name in _VIEWS or str(u.target).startswith("aten.view") or name in _RANDOM_IN_MEMORY_ORDER \
                    or name in _SCATTER_ACCUMULATE:
                return True
            keeps = (u.op == "call_method" and u.target in ALIASING_METHODS) or \
                    (u.op == "call_function" and u.target in ALIASING_FUNCTIONS) or \
                    (u.op in ("call_function", "call_method") and shape_of(u) == shape_of(n))
            if keeps:
                frontier.append(u)
    return False


def zero_grad_outside(node) -> bool:
    """Does the op that made `node` zero its input's gradient wherever `node` is zero (the op table's
    `zero_grad` column)? Then a consumer's gradient with respect to `node` is needed only at its nonzeros.
    relu(x) is zero exactly where x <= 0, where its backward zeroes the gradient; zeros_like(p).scatter(d, i,
    relu(v)) is zero off the scattered positions (no gradient flows there) and where relu(v) is. Graph inputs
    never qualify: their gradient is what the caller asked for."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    view = op_of(node)
    spec = OPS.get(view.name)
    return spec is not None and spec.zeroes_grad(node, view)


def addend_letters(addend, out_shape, dims) -> tuple | None:
    """How `addend` adds to a product's result of shape `out_shape` whose dimensions have the letters `dims`
    (None: a size-1 dimension): per addend dimension, the output letter it aligns with or None where it
    broadcasts (size 1; squeezed before the region). None when it is not a plain broadcast add to that result
    (it would make the result bigger, or its sizes disagree)."""
    shape = shape_of(addend)
    if shape is None or len(shape) > len(out_shape):
        return None
    got = []
    for d, n in enumerate(shape):
        e = len(out_shape) - len(shape) + d
        if _is_one(n):
            got.append(None)
        elif dims[e] is None or n != out_shape[e]:
            return None
        else:
            got.append(dims[e])
    return tuple(got)


def fuse(root: fx.Node, members: set, attrs: dict, threshold: float, frozen: bool, name: str,
         label: str = "", sparse_grad_out: bool = False, addends: list = (), allow_dense: bool = False) -> Fused:
    """The einsum of the region ending at `root`, with operand kinds; raises FuseError when it has none.
    `sparse_grad_out`: the output's gradient is known to be mostly zeros (training): the gradient programs
    take it compressed, and a region with no sparse operand of its own is then allowed (its forward runs
    dense, its gradients sparse). `addends`: values added to the result (after a linear's own bias), each
    broadcast to it: they join the program as operands of kind "add"."""
    fuser = Fuser(members, attrs)
    view = op_of(root)
    bias = linear_bias(view)
    addends = ([bias] if bias is not None else []) + list(addends)
    term = fuser._build(root)
    # Half precision: a region whose values are all of one half dtype (a bfloat16 model: bfloat16 weights and
    # inputs) computes in float32 and rounds its result once, as eager's products do (they accumulate in
    # float32); eager also rounds after each elementwise op the region joins, a difference of an ulp or two.
    # A product inside an autocast span reads float32 values and computes and rounds in bfloat16, which the
    # kernels cannot repeat (the dtype and the rounding of the result would differ): such a region stays dense.
    floating = {v.dtype for v in (example(n) for n in [root, *members, *(leaf for leaf, _ in term.factors),
                                                       *(a for a in addends if isinstance(a, fx.Node))])
                if isinstance(v, torch.Tensor) and v.is_floating_point()}
    half = floating & {torch.float16, torch.bfloat16}
    if half and len(floating) > 1:
        n = next(m for m in [root, *members] if getattr(example(m), "dtype", None) in half)
        raise FuseError(f"{n.name} computes in {next(iter(half))} from {sorted(map(str, floating - half))} values (an "
                        "autocast span): eager rounds there, the kernels compute in float32")
    L = fuser.L
    chars: dict = {}

    def char(letter: int) -> str:
        r = L.find(letter)
        if r not in chars:
            if len(chars) >= len(_CHARS):
                raise FuseError("more than 52 indices")
            chars[r] = _CHARS[len(chars)]
        return chars[r]

    out = "".join(char(d) for d in term.dims if d is not None)
    unit_dims = [k for k, d in enumerate(term.dims) if d is None]
    operands, leaves, densities, per_operand = [], [], [], []
    have = {}  # (carrier, letters) of the zeros an operand already brings -> that operand's index
    squeeze = []
    for leaf, letters in term.factors:
        text = "".join(char(c) for c in letters if c is not None)
        if len(set(text)) != len(text):
            raise FuseError(f"{leaf.name} would be read along a diagonal")
        a = attrs.get(leaf.name, DENSE)
        v = example(leaf)
        if a.format is not None:
            raise FuseError(f"{leaf.name} is a SparseTensor: runs as a Scorch kernel through SparseTensor's "
                            "dispatch rules")
        if not isinstance(v, torch.Tensor) or v.dtype not in _LEAF_DTYPES:
            raise FuseError(f"{leaf.name} is not a floating-point tensor (or a bool mask)")
        if v.device.type != "cpu":
            raise FuseError(f"{leaf.name} is on {v.device}")
        # A value whose zeros are carried by another one is read densely under that one's pattern (below);
        # compressing it would cost a pass over all of it.
        carried = a.support is not None and a.support.carrier != leaf.name and \
            len(a.support.dims) < len(v.shape)
        kind = "sparse" if a.sparse and a.density < threshold and not carried else "dense"
        # Graph inputs (weights and data) are measured and compressed once per version of the tensor. An
        # activation is not cached: Inductor may reuse its buffer for a later value of the same size, written
        # by its kernels without moving the version counter, and the fingerprint's 32 entries of two mostly
        # zero tensors often agree; so it is compressed on each call that reads it.
        masked = kind == "sparse" and zero_grad_outside(leaf)
        # A bool mask (`w * mask`) is cast to the result's dtype before the region, which reads the cast: a new
        # tensor on each call, so not cached (helper-42: such a product was left dense).
        cached = (a.weight or leaf.op == "placeholder") and v.dtype != torch.bool
        operands.append(Operand(text, kind, cached=cached, weight=a.weight, masked_grad=masked))
        leaves.append(leaf)
        squeeze.append(tuple(d for d, c in enumerate(letters) if c is None))
        per_operand.append(a.density if kind == "sparse" else 1.0)
        if kind == "sparse":
            densities.append(a.density)
            have.setdefault((leaf.name, text), len(operands) - 1)
            if a.support is not None and len(a.support.dims) == len(text):  # same zeros as its carrier
                have.setdefault((a.support.carrier, "".join(text[d] for d in a.support.dims)), len(operands) - 1)
    # Pattern factors for inputs whose zeros another sparse value carries.
    for (leaf, letters), o in zip(list(term.factors), list(operands)):
        a = attrs.get(leaf.name, DENSE)
        if o.kind != "dense" or a.support is None or a.support.carrier == leaf.name:
            continue
        ca = attrs.get(a.support.carrier, DENSE)
        carrier = next((n for n in leaf.graph.nodes if n.name == a.support.carrier), None)
        if carrier is None or ca.density >= threshold:
            continue
        if any(letters[d] is None for d in a.support.dims) or \
                any(_is_one(n) for n in (shape_of(carrier) or (1,))):
            continue
        text = "".join(char(letters[d]) for d in a.support.dims)
        # (a softmax's zeros hold only where every row of the mask keeps an entry: the op checks that)
        nonempty = text[a.support.nonempty] if a.support.nonempty is not None else ""
        if (carrier.name, text) in have:
            # Another operand already brings these zeros (a gate masked like the scores): the check goes on it,
            # which reads its zeros (at least the mask's: a row it keeps nothing of fails, conservatively).
            k = have[carrier.name, text]
            if nonempty and nonempty in operands[k].letters:
                operands[k] = replace(operands[k], nonempty=nonempty)
            continue
        have[carrier.name, text] = len(operands)
        bool_carrier = getattr(example(carrier), "dtype", None) == torch.bool
        operands.append(Operand(text, "pattern", cached=(ca.weight or carrier.op == "placeholder") and not bool_carrier,
                                grad=False, weight=ca.weight, nonempty=nonempty))
        leaves.append(carrier)
        squeeze.append(())
        densities.append(ca.density)
        per_operand.append(ca.density)
    if not densities and not sparse_grad_out and not allow_dense:  # (allow_dense: a chain's dense first step)
        raise FuseError("no sparse operand")
    operands = _broadcast_patterns(operands, out)
    out_shape = shape_of(root)
    result = example(root)
    for a in addends:
        letters = addend_letters(a, out_shape, term.dims) if isinstance(a, fx.Node) and out_shape else None
        v = example(a) if isinstance(a, fx.Node) else None
        if letters is None or not isinstance(v, torch.Tensor) or not isinstance(result, torch.Tensor) \
                or v.dtype != result.dtype or v.device.type != "cpu" or attrs.get(a.name, DENSE).format is not None:
            raise FuseError(f"{getattr(a, 'name', a)} is not a plain addend of the result")
        operands.append(Operand("".join(char(c) for c in letters if c is not None), "add",
                                cached=False, grad=True))
        leaves.append(a)
        squeeze.append(tuple(d for d, c in enumerate(letters) if c is None))
        per_operand.append(1.0)
    # factors' patterns usually coincide (a gate and its pattern): not a product
    density = min(densities) if densities else 1.0
    program = Program(tuple(operands), out, term.coef, frozen, name, label,
                      sparse_grad_out=sparse_grad_out and len(out) >= 2, requested_order=_layout_matters(root))
    casts = [None] * len(leaves)
    for k, leaf in enumerate(leaves):
        if getattr(example(leaf), "dtype", None) == torch.bool:
            if not isinstance(result, torch.Tensor) or result.dtype not in _LEAF_DTYPES - {torch.bool}:
                raise FuseError(f"{leaf.name} is a bool mask of a result that is not floating-point")
            casts[k] = result.dtype
    return Fused(program, leaves, unit_dims, None, density, squeeze, per_operand, list(addends), casts)


@dataclass
class Chained:
    """A chain region: its program (custom_ops/region.py: ChainProgram), the graph values it reads, in operand
    order, and the products it joins."""
    program: ChainProgram
    leaves: list
    steps: list  # Fused, one per step


def chain_of(steps: list, roots: list, betweens: list, name: str) -> Chained:
    """The chain of the products `steps` (each a Fused, ending at the node roots[k]), where step k + 1 reads
    step k's result through the elementwise ops `betweens[k]`. Raises FuseError when it cannot run as a chain
    (custom_ops/region.py says why)."""
    leaves: list = []
    chain_steps = []
    if any(c is not None for f in steps for c in f.casts):
        raise FuseError("a step reads a bool mask (cast before its region)")
    for j, f in enumerate(steps):
        if f.addends or f.unit_dims or any(f.squeeze):
            raise FuseError("a step with a bias (an addend) or broadcast dimensions")
        # the value by which this step reads the one before: the last elementwise op, or the product itself
        carried = (betweens[j - 1][-1] if betweens[j - 1] else roots[j - 1]) if j > 0 else None
        inputs = []
        for leaf in f.leaves:
            if leaf is carried:
                inputs.append(-j)  # step j - 1, as -(k + 1)
                continue
            if leaf not in leaves:
                leaves.append(leaf)
            inputs.append(leaves.index(leaf))
        then = tuple(op_of(b).name for b in betweens[j]) if j < len(betweens) else ()
        chain_steps.append(ChainStep(f.program.text(), tuple(inputs), then))
    program = ChainProgram(tuple(chain_steps), name)
    try:
        parse_chain(program.text())
    except ValueError as e:
        raise FuseError(str(e)) from None
    return Chained(program, leaves, list(steps))


def sequence_of(steps: list, roots: list, betweens: list, name: str) -> Chained:
    """A chain of kind "sequence": step k + 1 reads step k's result (through the elementwise ops
    betweens[k]) as one of its factors; each step runs as a region call. Raises FuseError when it cannot."""
    leaves: list = []
    chain_steps = []
    if any(c is not None for f in steps for c in f.casts):
        raise FuseError("a step reads a bool mask (cast before its region)")
    for j, f in enumerate(steps):
        if f.unit_dims or any(f.squeeze):
            raise FuseError("a step with broadcast dimensions")
        carried = (betweens[j - 1][-1] if betweens[j - 1] else roots[j - 1]) if j > 0 else None
        inputs = []
        for leaf in f.leaves:
            if leaf is carried:
                inputs.append(-j)
                continue
            if leaf not in leaves:
                leaves.append(leaf)
            inputs.append(leaves.index(leaf))
        then = tuple(op_of(b).name for b in betweens[j]) if j < len(betweens) else ()
        chain_steps.append(ChainStep(f.program.text(), tuple(inputs), then))
    program = ChainProgram(tuple(chain_steps), name, kind="sequence")
    try:
        parse_chain(program.text())
    except ValueError as e:
        raise FuseError(str(e)) from None
    return Chained(program, leaves, list(steps))
