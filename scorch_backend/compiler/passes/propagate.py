"""propagate: carry sparsity attributes forward through the graph, one rule per ATen op.

The rules are the `rule` column of the op table (compiler/ops_table.py, where the rule table is written out).
An op without a rule, or whose rule does not apply to this call, is dense.

Backward graphs: a fused region's gradient is the einsum of the output gradient with the other operands,
run by the same `scorch::region` op with the same operand kinds, so a sparse forward operand is sparse in
every gradient that reads it (dx = g W for a pruned W). Values whose support comes from a ReLU, a mask or a
scatter get gradients that the same op (relu, mul by the mask, scatter) zeroes outside the support, which is
why a pattern factor may stand in for them (see passes/fuse.py).
"""

from __future__ import annotations

from torch import fx

from ... import log as _log
from ..attrs import DENSE, SparsityAttr
from ..ops_table import OPS, Context
from .graph import mutated_values, op_of

__all__ = ["Context", "propagate", "rule"]


def rule(node: fx.Node, ctx: Context) -> SparsityAttr:
    """The attribute of `node` from its inputs' (which `ctx` holds)."""
    view = op_of(node)
    spec = OPS.get(view.name)
    got = spec.rule(node, view, ctx) if spec is not None and spec.rule is not None else None
    return got if got is not None else DENSE.with_(measured=ctx.measured.get(node.name))


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
