"""partition: the regions of the graph worth running as sparse kernels.

Capabilities: a region starts at a contraction (einsum, matmul, mm, bmm, linear), takes in the scalar factors,
negations and tensor products applied to its result (a linear's bias stops that), and grows upwards over
the ops index notation can express without sums (mul, scalar mul/div, neg, unsqueeze, transpose, permute,
t, clone, same-dtype casts), taking a producer only when all its users are in the region (so nothing is
computed twice). Sums applied to its result (a linear's bias, `y + x` with x broadcast to y) end it: they
join as addends, added by the same op call (passes/fuse.py). It must read a sparse value: an input compressed at run time, or a pattern factor.
The cost model (scorch_backend/cost_model.py, crossover measured by benchmarks/calibrate.py) then keeps the
region only where the sparse factors' density is under the threshold and the estimated speedup is over 1: the
dense time (multiply-adds at the machine's measured dense rate) over the region's fixed cost per call plus its
sparse work, each sparse entry costing 1/crossover dense multiply-adds. (SCORCH_DISPATCH=sparse skips the
size test, so tests see regions on small models.)

In training, a contraction whose output's gradient is mostly zeros (it feeds a ReLU or a top-k measured
sparse: `grad_density`) is a region too, even with nothing sparse in its forward product: its gradient
programs take that gradient compressed. The estimate then counts every call of the region in a step.

Values that are SparseTensors are not put in regions: their ops already run as Scorch kernels through
SparseTensor's dispatch rules when AOTAutograd traces the graph.

One idiom is matched whole: softmax(masked_fill(q @ k^T * c, ~mask, -inf)) @ v with a sparse mask becomes a
masked-attention region (scorch_backend/custom_ops/attention.py: sampled scores, sparse softmax, sparse product), since
the softmax between the two products is not index notation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import fx

from ... import config
from .. import region_cost
from ... import log as _log
from ..ops_table import CONTRACTIONS, OPS, is_scalar, linear_bias, negated_mask
from .fuse import Chained, Fused, FuseError, chain_of, fuse, sequence_of
from .graph import Writes, describe, example, op_of, shape_of, source_label


@dataclass(eq=False)  # compared (and hashed) by identity
class Region:
    name: str
    root: fx.Node
    members: list  # fx nodes, topological order
    fused: Fused | None  # the einsum (None for a masked-attention region)
    estimated_speedup: float
    ops: list = field(default_factory=list)  # readable forms of the members
    attention: tuple | None = None  # (q, k, v, mask, scale) of a masked-attention region
    label: str = ""  # where it comes from: "fc1 (Linear): linear" (graph.source_label)
    chain: Chained | None = None  # a chain of products (fused is then None)

    @property
    def title(self) -> str:
        return f"{self.name} {self.label}".strip()

    @property
    def program_text(self) -> str:
        if self.chain is not None:
            return self.chain.program.text()
        return self.fused.program.text() if self.fused is not None else ""

    @property
    def kind(self) -> str:
        """"product" (one einsum), "chain" (products joined by elementwise ops) or "attention"."""
        return "chain" if self.chain is not None else "attention" if self.attention is not None else "product"


def _single_user(n) -> bool:
    return isinstance(n, fx.Node) and len(n.users) == 1


def _last_two_swapped(node: fx.Node) -> bool:
    view = op_of(node)
    r = len(example(node).shape) if isinstance(example(node), torch.Tensor) else 0
    if view.name == "aten.t":
        return r == 2
    if view.name == "aten.transpose" and len(view.args) == 3:
        return {a % r for a in view.args[1:]} == {r - 2, r - 1} if r >= 2 else False
    return False


def _masked_attention(node: fx.Node, attrs: dict, threshold: float):
    """(members, q, k, v, mask, scale) when `node` ends softmax(masked_fill(q @ k^T * c, ~mask, -inf)) @ v
    (or mask == 0 for ~mask: ops_table.negated_mask)."""
    view = op_of(node)
    if view.name != "aten.matmul" or len(view.args) != 2:
        return None
    attn, v = view.args
    if not _single_user(attn) or op_of(attn).name != "aten.softmax":
        return None
    sm = op_of(attn)
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    rank = len(example(attn).shape)
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return None
    filled = sm.args[0]
    if not _single_user(filled) or op_of(filled).name != "aten.masked_fill" or len(filled.args) != 3:
        return None
    x, notmask, value = filled.args
    if not (isinstance(value, float) and math.isinf(value) and value < 0):
        return None
    mask = negated_mask(notmask)
    if mask is None:
        return None
    members, scale = [node, attn, filled], 1.0
    if _single_user(notmask):
        members.append(notmask)
    xv = op_of(x)
    if xv.name in ("aten.mul", "aten.div") and _single_user(x) and is_scalar(xv.args[1]):
        scale = float(xv.args[1]) if xv.name == "aten.mul" else 1.0 / float(xv.args[1])
        members.append(x)
        x = xv.args[0]
    if not _single_user(x) or op_of(x).name != "aten.matmul":
        return None
    q, kt = op_of(x).args[:2]
    if not _single_user(kt) or not _last_two_swapped(kt):
        return None
    members += [x, kt]
    k = op_of(kt).args[0]
    shapes = [tuple(example(t).shape) if isinstance(example(t), torch.Tensor) else None for t in (q, k, v, mask)]
    if any(s is None for s in shapes) or not len(shapes[0]) == len(shapes[1]) == len(shapes[2]) >= 2:
        return None
    sq, sk, sv, sm = shapes
    # the op's contract: same batch dimensions (no broadcasting, e.g. multi-query k/v), a (L, S) mask
    if not (sq[:-2] == sk[:-2] == sv[:-2] and sk[-2] == sv[-2] and sq[-1] == sk[-1] and sm == (sq[-2], sk[-2])):
        return None
    if any(example(t).dtype not in (torch.float32, torch.float64) for t in (q, k, v)):
        return None
    a = attrs.get(mask.name)
    if a is None or a.density >= threshold:
        return None
    return members, q, k, v, mask, scale, a.density


@dataclass
class Decision:
    node: str
    op: str
    reason: str


def _growable(node: fx.Node) -> bool:
    """May the node join a region (the op table's `fusible` column)?"""
    view = op_of(node)
    spec = OPS.get(view.name)
    return spec is not None and spec.can_fuse(node, view)


def _on_result(node: fx.Node) -> bool:
    """May the node extend a region downward from its product (the op table's `on_result` column)?"""
    view = op_of(node)
    spec = OPS.get(view.name)
    return spec is not None and spec.on_result and spec.can_fuse(node, view)


def _grow(chain: list, taken: set) -> set:
    """The chain and every producer above it that is growable and used only inside the region (a fixed point:
    a producer may qualify once its other users have joined)."""
    members = set(chain)
    changed = True
    while changed:
        changed = False
        for n in list(members):
            for p in n.all_input_nodes:
                if p not in members and p.name not in taken and p.op in ("call_function", "call_method") \
                        and _growable(p) and all(u in members for u in p.users):
                    members.add(p)
                    changed = True
    return members


def _hint(n) -> int:
    """An int for estimates: a symbolic size's hint (1024 when it has none)."""
    if isinstance(n, torch.SymInt):
        return int(n.node.hint) if n.node.hint is not None else 1024
    return int(n)


def _dense_fmas(fused: Fused) -> float:
    """Multiply-adds of the dense einsum: the product of every index's extent (size hints when symbolic)."""
    sizes = {}
    for k, (o, leaf) in enumerate(zip(fused.program.operands, fused.leaves)):
        shape = example(leaf).shape
        dims = [d for d in range(len(shape)) if d not in fused.squeeze[k]]
        for c, d in zip(o.tensor_letters, dims):
            sizes[c] = _hint(shape[d])
    return float(math.prod(sizes.values()))


def _call_densities(fused: Fused, training: bool, grad_density: float) -> list:
    """Per call of the region in a step, the density of its sparse factors (None: a dense call): the forward,
    and in training one gradient per operand that requires grad. A gradient program reads the other operands,
    the output's gradient (compressed when the program says so) and, for a masked gradient, the pattern of
    the operand itself. Factors' patterns usually coincide, so the sparsest stands for them (not a product)."""
    ops = fused.program.operands
    dens = fused.densities or [1.0] * len(ops)
    calls = [fused.density if any(o.kind in ("sparse", "pattern") for o in ops) else None]
    if not training:
        return calls
    for k, (o, leaf) in enumerate(zip(ops, fused.leaves)):
        v = example(leaf)
        if o.kind in ("pattern", "add") or not o.grad or not isinstance(v, torch.Tensor) or not v.requires_grad:
            continue  # an addend's gradient is a sum of the output's, no program
        ds = [dens[j] for j, p in enumerate(ops) if j != k and p.kind in ("sparse", "pattern")]
        if o.masked_grad:
            ds.append(dens[k])
        if fused.program.sparse_grad_out:
            ds.append(grad_density)
        calls.append(min(ds) if ds else None)
    return calls


def grad_density(node: fx.Node, attrs: dict, depth: int = 0) -> float:
    """An upper bound of the density of the gradient that reaches `node` in the backward pass, from what its
    users do with it (1.0 when unknown): a ReLU passes its gradient only where its output is nonzero (its
    measured density); a top-k only at the k positions it picked per row; zeros_like(node) none; a clone,
    a cast, a negation, a scalar factor or the addition of a bias pass theirs as it is. Users' gradients add."""
    if depth > 8:
        return 1.0
    total = 0.0
    for u in node.users:
        view = op_of(u)
        first = view.args[0] if view.args else None
        if view.name == "aten.relu" and first is node:
            # Zeros carried by a known support (a one-hot dispatch) are left to the pattern factors that
            # support gives the regions (passes/fuse.py); only zeros the ReLU makes itself count here.
            a = attrs.get(u.name)
            d = a.measured if a is not None and a.measured is not None and a.support is None else 1.0
        elif view.name == "aten.topk" and first is node and len(view.args) >= 2 and isinstance(view.args[1], int):
            shape = shape_of(node)
            dim = view.args[2] if len(view.args) > 2 else view.kwargs.get("dim", -1)
            n = shape[dim] if shape and isinstance(dim, int) and -len(shape) <= dim < len(shape) else None
            d = min(view.args[1] / n, 1.0) if isinstance(n, int) and n > 0 else 1.0
        elif view.name == "aten.zeros_like":
            d = 0.0
        elif first is node and OPS.get(view.name) is not None and OPS[view.name].passes_grad(u, view):
            d = grad_density(u, attrs, depth + 1)  # the op table's `grad` column
        elif view.name in ("aten.add", "aten.sub") and shape_of(u) is not None and shape_of(u) == shape_of(node):
            d = grad_density(u, attrs, depth + 1)  # x + bias: x gets the sum's gradient as it is
        else:
            d = 1.0
        total += d
        if total >= 1.0:
            return 1.0
    return total


_logger = _log.get("passes.partition")


def partition(gm: fx.GraphModule, attrs: dict, threshold: float, frozen: bool, training: bool = False,
              chains: bool | None = None, sequences: bool = False, name_prefix: str = ""):
    """(regions, decisions): regions to rewrite, and why each other contraction stays dense. `chains` False
    keeps every product a region of its own; None (the backend's default) joins chains in inference graphs
    only (a chain's gradient recomputes its forward pass; see _chains). `name_prefix` starts every region's
    name (the regions of a checkpointed block's graph: "wrap_body_0.region0")."""
    if chains is None:
        chains = not training
    regions, decisions = _partition(gm, attrs, threshold, frozen, training, chains, sequences, name_prefix)
    if _logger.isEnabledFor(10):
        for r in regions:
            _logger.debug("%s: %d op(s), estimated speedup %.2fx", r.title, len(r.members), r.estimated_speedup)
        for d in decisions:
            _logger.debug("%s = %s: %s", d.node, d.op, d.reason)
    return regions, decisions


def _partition(gm: fx.GraphModule, attrs: dict, threshold: float, frozen: bool, training: bool, chains: bool,
               sequences: bool = False, name_prefix: str = ""):
    regions, decisions, spares = [], [], []
    writes = Writes(gm)
    taken = writes.mutated()  # values written in place stay where they are
    order = writes.position  # each node's place in the graph
    for node in gm.graph.nodes:  # masked attention first: its value product would otherwise be an einsum
        found = _masked_attention(node, attrs, threshold)
        if found is None or any(m.name in taken for m in found[0]):
            continue
        members, q, k, v, mask, scale, density = found
        sq, sv = example(q).shape, example(v).shape
        fmas = math.prod(_hint(n) for n in sq[:-1]) * _hint(example(k).shape[-2]) * (_hint(sq[-1]) + _hint(sv[-1]))
        est = region_cost.region_speedup(fmas, density, 2 if training else 1)
        if est < 1.0 and config.dispatch_mode() != "sparse":
            decisions.append(Decision(node.name, describe(node), "masked attention left dense: too small to pay "
                                      f"for a call (estimated speedup {est:.2f}x)"))
            continue
        ordered = sorted(members, key=order.get)
        regions.append(Region(f"{name_prefix}region{len(regions)}", node, ordered, None, est,
                              [describe(m) for m in ordered], (q, k, v, mask, scale),
                              source_label(node, ordered)))
        taken.update(m.name for m in members)
    for node in gm.graph.nodes:
        view = op_of(node)
        if view.name not in CONTRACTIONS or node.name in taken:
            continue
        root, chain = node, [node]
        has_bias = linear_bias(view) is not None
        while not has_bias and len(root.users) == 1:  # scalar factors, negation, masks applied to the result
            user = next(iter(root.users))
            if not _on_result(user) or user.name in taken:  # an op on two products' results: the first's
                break
            root = user
            chain.append(user)
        members = _grow(chain, taken)
        # Sums applied to the result (a residual, a bias added by hand) join as addends: the op adds them.
        product_root, addends = root, []
        while len(root.users) == 1:
            user = next(iter(root.users))
            other = _addend_of(user, root, product_root, taken)
            if other is None:
                break
            addends.append(other)
            members.add(user)
            root = user
        name = f"{name_prefix}region{len(regions)}"
        ordered = sorted(members, key=order.get)
        label = source_label(node, ordered)
        # In training, a product whose output's gradient is mostly zeros (it feeds a ReLU or a top-k that
        # leaves most of it zero) runs its gradients on that gradient compressed, even when the forward
        # product has no sparse factor (then it runs dense).
        dg = grad_density(root, attrs) if training else 1.0
        try:
            fused = fuse(product_root, members, attrs, threshold, frozen, name, label,
                         sparse_grad_out=dg < threshold, addends=addends)
        except FuseError as e:
            why = str(e) if "SparseTensor" in str(e) else f"left dense: {e}"
            decisions.append(Decision(node.name, describe(node), why))
            continue
        if fused.density >= threshold and not fused.program.sparse_grad_out:
            decisions.append(Decision(node.name, describe(node),
                                      f"left dense: density {fused.density:.3g} >= threshold {threshold:.3g}"))
            continue
        est = region_cost.calls_speedup(_dense_fmas(fused), _call_densities(fused, training, dg))
        region = Region(name, root, ordered, fused, est, [describe(m) for m in ordered], label=label)
        if est < 1.0 and config.dispatch_mode() != "sparse":
            decisions.append(Decision(node.name, describe(node),
                                      f"left dense: too small to pay for a call (estimated speedup {est:.2f}x)"))
            spares.append((region, decisions[-1]))  # may still join a chain, where it adds no call of its own
            continue
        regions.append(region)
        taken.update(m.name for m in members)
    if chains:
        regions = _chains(regions, spares, decisions, taken, order)
        if sequences:
            regions = _sequences(gm, regions, decisions, taken, order, attrs, threshold, frozen)
    if not training:
        _fold_relus(regions, taken)
    return _reads_in_place(regions, decisions, writes), decisions


def _inputs(r: Region) -> list:
    if r.chain is not None:
        return list(r.chain.leaves)
    if r.fused is not None:
        return list(r.fused.leaves)
    return list(r.attention[:4])  # q, k, v, mask


def _reads_in_place(regions: list, decisions: list, writes: Writes) -> list:
    """The regions whose inputs no op writes in place between the region's first member and its root, where the
    rewrite puts the op (and where it reads them all): a scalar factor, a folded ReLU or an addend would
    otherwise read a value its eager op read before the write. The others stay dense, with a decision."""
    kept = []
    for r in regions:
        first = min(r.members, key=writes.position.get)
        w = writes.between(first, r.root, _inputs(r))
        if w is None:
            kept.append(r)
            continue
        decisions.append(Decision(r.root.name, describe(r.root), f"left dense: {describe(w)} writes an input of "
                                  f"{r.name} in place between its first op and its last"))
    # (the names stay as they were given: a report lists the regions the graph has, by name)
    return kept


def _fold_relus(regions, taken: set) -> None:
    """Inference: a region's compressed operand that is a ReLU's output read by nothing else takes the ReLU's
    input instead, with the operand's `relu` flag: the op applies the ReLU in the passes that measure and
    compress it (csrc/torch/region_compress.cpp), and no ReLU kernel writes the whole activation first only
    for the region to read it again. The ReLU joins the region (its ops, and the members the rewrite removes).
    Training graphs keep the ReLU: autograd saves its output for the backward pass anyway."""
    for r in regions:
        f = r.fused
        if f is None or r.chain is not None:
            continue
        operands = list(f.program.operands)
        for k, (o, leaf) in enumerate(zip(operands, f.leaves)):
            if o.kind != "sparse" or o.cached or o.weight or o.expand or o.packed or o.nonempty or f.squeeze[k] \
                    or not isinstance(leaf, fx.Node) or leaf.name in taken or f.leaves.count(leaf) != 1:
                continue
            view = op_of(leaf)
            if view.name != "aten.relu" or len(view.args) != 1 or view.kwargs \
                    or not isinstance(view.args[0], fx.Node) or any(u not in r.members for u in leaf.users):
                continue
            operands[k] = dataclasses.replace(o, relu=True)
            f.leaves[k] = view.args[0]
            r.members.insert(0, leaf)  # an input of the region: before its members
            r.ops.insert(0, describe(leaf))
            taken.add(leaf.name)
        f.program = dataclasses.replace(f.program, operands=tuple(operands))


def _addend_of(node: fx.Node, value: fx.Node, product: fx.Node, taken: set):
    """The other operand when `node` is `value + other` (either order, no alpha) and `other` broadcasts to the
    product's result without making it bigger, in the same dtype; else None."""
    view = op_of(node)
    if view.name != "aten.add" or len(view.args) != 2 or view.kwargs or node.name in taken:
        return None
    a, b = view.args
    other = b if a is value else a if b is value else None
    if not isinstance(other, fx.Node) or other is value or other.name in taken:
        return None
    so, sr = shape_of(other), shape_of(product)
    vo, vr = example(other), example(product)
    if so is None or sr is None or len(so) > len(sr) or not isinstance(vo, torch.Tensor) \
            or not isinstance(vr, torch.Tensor) or vo.dtype != vr.dtype or shape_of(node) != sr:
        return None
    if any(not (isinstance(n, int) and n == 1) and n != sr[len(sr) - len(so) + d] for d, n in enumerate(so)):
        return None
    return other


def _between_ops(leaf: fx.Node, roots: dict):
    """(the region whose root `leaf` is, or reaches through elementwise ops with f(0) = 0 each used once,
    those ops top-down), or None."""
    between = []
    n = leaf
    while n not in roots:
        view = op_of(n)
        spec = OPS.get(view.name)
        if spec is None or not spec.between or len(view.args) != 1 or view.kwargs or len(n.users) != 1 \
                or not isinstance(view.args[0], fx.Node):
            return None
        between.insert(0, n)
        n = view.args[0]
    return (roots[n], between) if len(n.users) == 1 else None


def _chains(regions: list, spares: list, decisions: list, taken: set, order: dict) -> list:
    """Join regions into chains: a product whose result, through elementwise ops with f(0) = 0, is read once
    by a later product, when both run grouped by the same sparse 2-D factor (one-hot dispatch -> activation
    -> expert -> combine). The intermediates then never exist as dense tensors (custom_ops/region.py: chains).
    A product left dense only for being too small to pay for a call of its own may end a chain."""
    spare_of = {r.root: (r, d) for r, d in spares
                if not any(m.name in taken for m in r.members) and not r.fused.addends}
    candidates = [r for r in regions if r.fused is not None] + [r for r, _ in spare_of.values()]
    roots = {r.root: r for r in candidates if not r.fused.addends and not r.fused.unit_dims}
    link: dict = {}  # region -> (the next region, the elementwise ops between)
    has_pred: set = set()
    for r in sorted(candidates, key=lambda r: order[r.root]):
        for k, leaf in enumerate(r.fused.leaves):
            found = _between_ops(leaf, roots)
            if found is None:
                continue
            src, between = found
            if src is r or src in link or r in has_pred or r.fused.leaves.count(leaf) != 1 or r.fused.squeeze[k]:
                continue
            link[src] = (r, between)
            has_pred.add(r)
    out, used = [], set()
    for r in sorted(candidates, key=lambda r: order[r.root]):
        if r in has_pred or r not in link:
            continue
        seq, betweens = [r], []
        while seq[-1] in link:
            nxt, between = link[seq[-1]]
            seq.append(nxt)
            betweens.append(between)
        while len(seq) >= 2:  # the longest prefix that runs as a chain
            try:
                chained = chain_of([x.fused for x in seq], [x.root for x in seq], betweens[:len(seq) - 1], seq[0].name)
            except FuseError:
                seq.pop()
                continue
            break
        if len(seq) < 2 or all(x.root in spare_of for x in seq):
            continue
        members = sorted({m for x in seq for m in x.members} | {b for bs in betweens[:len(seq) - 1] for b in bs},
                         key=order.get)
        root = seq[-1].root
        label = source_label(root, members)
        est = min(x.estimated_speedup for x in seq if x.root not in spare_of)
        name = next(x.name for x in seq if x.root not in spare_of)
        chained.program = type(chained.program)(chained.program.steps, name, label)
        out.append(Region(name, root, members, None, est, [describe(m) for m in members], label=label,
                          chain=chained))
        used.update(seq)
        for x in seq:
            if x.root in spare_of:
                decisions.remove(spare_of[x.root][1])
                taken.update(m.name for m in x.members)
    kept = [r for r in regions if r not in used] + out
    return sorted(kept, key=lambda r: order[r.root])


def _sequences(gm, regions: list, decisions: list, taken: set, order: dict, attrs: dict, threshold: float,
               frozen: bool) -> list:
    """Join a product left dense with the region that reads its result, through elementwise ops with
    f(0) = 0 used once, as its sparse operand (linear -> bias -> ReLU -> linear whose ReLU output is measured
    sparse): one `scorch::chain` call of kind "sequence" (custom_ops/chain.py). The first product runs dense
    with its bias added by BLAS, the ReLU in place on its result, the second product on the activation
    compressed, with its own bias, all in one call."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = []
    for r in regions:
        f = r.fused
        if f is None or r.chain is not None:
            out.append(r)
            continue
        joined = None
        for k, (o, leaf) in enumerate(zip(f.program.operands, f.leaves)):
            if o.kind != "sparse" or f.squeeze[k] or f.leaves.count(leaf) != 1 or leaf.name in taken:
                continue
            between, n = [], leaf
            while OPS.get(op_of(n).name) is not None and OPS[op_of(n).name].between and len(n.users) == 1 \
                    and len(op_of(n).args) == 1 and not op_of(n).kwargs and isinstance(op_of(n).args[0], fx.Node) \
                    and op_of(n).name in ("aten.relu", "aten.neg", "aten.tanh"):
                between.insert(0, n)
                n = op_of(n).args[0]
            if not between or n.name in taken or len(n.users) != 1 or op_of(n).name not in CONTRACTIONS:
                continue
            members = _grow([n], taken)
            try:
                first = fuse(n, members, attrs, threshold, frozen, r.name, allow_dense=True)
                chained = sequence_of([first, f], [n, r.root], [between], r.name)
            except FuseError:
                continue
            joined = (n, members, between, chained)
            break
        if joined is None:
            out.append(r)
            continue
        n, members, between, chained = joined
        all_members = sorted(set(r.members) | set(members) | set(between), key=order.get)
        label = source_label(r.root, all_members)
        chained.program = type(chained.program)(chained.program.steps, r.name, label, "sequence")
        out.append(Region(r.name, r.root, all_members, None, r.estimated_speedup, [describe(m) for m in all_members],
                          label=label, chain=chained))
        taken.update(m.name for m in all_members)
        decisions[:] = [d for d in decisions if d.node != n.name]
    return out
