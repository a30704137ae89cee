"""partition: the regions of the graph worth running as sparse kernels.

Capabilities: a region starts at a contraction (einsum, matmul, mm, bmm, linear), takes in the scalar factors,
negations and tensor products applied to its result (a linear's bias stops that), and grows upwards over
the ops index notation can express without sums (mul, scalar mul/div, neg, unsqueeze, transpose, permute,
t, clone, same-dtype casts), taking a producer only when all its users are in the region (so nothing is
computed twice). It must read a sparse value: an input compressed at run time, or a pattern factor.
The cost model (scorch_backend/cost_model.py, crossover measured by benchmarks/calibrate.py) then keeps the
region only where the sparse factors' density is under the threshold; its estimated speedup is the dense work
over the sparse work, each sparse entry costing 1/crossover dense ones.

Values that are SparseTensors are not put in regions: their ops already run as Scorch kernels through
SparseTensor's dispatch rules when AOTAutograd traces the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from .. import cost_model
from .contraction import CONTRACTIONS
from .fuse import Fused, FuseError, fuse
from .graph import describe, example, op_of

GROWABLE = {"aten.mul", "aten.div", "aten.neg", "aten.unsqueeze", "aten.transpose", "aten.permute", "aten.t",
            "aten.clone", "aten._to_copy"}


@dataclass
class Region:
    name: str
    root: fx.Node
    members: list  # fx nodes, topological order
    fused: Fused
    estimated_speedup: float
    ops: list = field(default_factory=list)  # readable forms of the members

    @property
    def program_text(self) -> str:
        return self.fused.program.text()


@dataclass
class Decision:
    node: str
    op: str
    reason: str


def _growable(node: fx.Node) -> bool:
    view = op_of(node)
    if view.name not in GROWABLE:
        return False
    if view.name == "aten._to_copy":
        src, out = example(view.args[0]), example(node)
        return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
    if view.name == "aten.div":
        return isinstance(view.args[1], (int, float))
    if view.name == "aten.mul":
        return any(isinstance(a, fx.Node) for a in view.args[:2])
    return True


def _grow(chain: list, taken: set) -> set:
    members = set(chain)
    work = list(chain)
    while work:
        n = work.pop()
        for p in n.all_input_nodes:
            if p in members or p.name in taken or p.op != "call_function" and p.op != "call_method":
                continue
            if not _growable(p):
                continue
            if all(u in members for u in p.users):
                members.add(p)
                work.append(p)
    # A producer whose users joined later: one more sweep until nothing changes.
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


def partition(gm: fx.GraphModule, attrs: dict, threshold: float, frozen: bool):
    """(regions, decisions): regions to rewrite, and why each other contraction stays dense."""
    regions, decisions, taken = [], [], set()
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    crossover = cost_model.crossover_density()
    for node in gm.graph.nodes:
        view = op_of(node)
        if view.name not in CONTRACTIONS or node.name in taken:
            continue
        root, chain = node, [node]
        has_bias = view.name == "aten.linear" and len(view.args) > 2 and view.args[2] is not None
        while not has_bias and len(root.users) == 1:  # scalar factors, negation, masks applied to the result
            user = next(iter(root.users))
            if op_of(user).name not in ("aten.neg", "aten.mul", "aten.div") or not _growable(user):
                break
            root = user
            chain.append(user)
        members = _grow(chain, taken)
        name = f"region{len(regions)}"
        try:
            fused = fuse(root, members, attrs, threshold, frozen, name)
        except FuseError as e:
            decisions.append(Decision(node.name, describe(node), f"left dense: {e}"))
            continue
        if fused.density >= threshold:
            decisions.append(Decision(node.name, describe(node),
                                      f"left dense: density {fused.density:.3g} >= threshold {threshold:.3g}"))
            continue
        est = crossover / max(fused.density, 1e-9)
        ordered = sorted(members, key=order.get)
        regions.append(Region(name, root, ordered, fused, est, [describe(m) for m in ordered]))
        taken.update(m.name for m in members)
    return regions, decisions
