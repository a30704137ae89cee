"""rewrite: each region becomes one call of `scorch::region`; the rest of the graph is left as it is, for
Inductor (or eager) to compile."""

from __future__ import annotations

import torch
from torch import fx

from ... import log as _log
from ...custom_ops.attention import masked_attention as _attention_op  # noqa: F401  (installs the op's Python hooks)
from ...custom_ops.region import region as _region_op  # noqa: F401  (registers scorch::region)


def _replace(graph, r, out, replaced: dict) -> None:
    root = r.root
    out.meta.update({k: v for k, v in root.meta.items() if k in ("example_value", "val", "stack_trace")})
    root.replace_all_uses_with(out)
    replaced[root] = out
    for m in reversed(r.members):
        if not m.users:
            graph.erase_node(m)


def rewrite(gm: fx.GraphModule, regions) -> fx.GraphModule:
    graph = gm.graph
    replaced: dict = {}  # a region's root -> the node now giving its value (a later region may read it)
    for r in regions:
        root = r.root
        f = r.fused
        if r.chain is not None:  # products joined by elementwise ops, one op call
            leaves = [replaced.get(n, n) for n in r.chain.leaves]
            with graph.inserting_before(root):
                out = graph.call_function(torch.ops.scorch.chain.default, (r.program_text, leaves))
            _replace(graph, r, out, replaced)
            continue
        if f is None:  # masked attention
            q, k, v, mask, scale = r.attention
            with graph.inserting_before(root):
                out = graph.call_function(torch.ops.scorch.masked_attention.default,
                                          tuple(replaced.get(n, n) for n in (q, k, v, mask)) + (scale,))
            _replace(graph, r, out, replaced)
            continue
        leaves = [replaced.get(n, n) for n in f.leaves]
        with graph.inserting_before(root):
            for k, dtype in enumerate(f.casts):
                if dtype is not None:  # a bool mask, read as 0/1 values of the result's dtype
                    leaves[k] = graph.call_function(torch.ops.aten._to_copy.default, (leaves[k],), {"dtype": dtype})
            for k, dims in enumerate(f.squeeze):
                if dims:
                    leaves[k] = graph.call_function(torch.squeeze, (leaves[k], dims))
            out = graph.call_function(torch.ops.scorch.region.default, (r.program_text, leaves))
            for d in f.unit_dims:
                out = graph.call_function(torch.unsqueeze, (out, d))
        _replace(graph, r, out, replaced)
    _log.get("passes.rewrite").debug("%d region(s) replaced by scorch ops", len(regions))
    graph.lint()
    gm.recompile()
    return gm
