"""Products of SparseTensors inside torch.compile's graphs, routed to the rules eager code uses.

AOTAutograd traces Dynamo's graph with __torch_function__ off, so a SparseTensor's products would reach ATen's
autograd formulas (mm, addmm), which hand a sparse operand a dense gradient. The backend routes them to the
same rules as eager code (tensors/rules.py) before tracing.
"""

from __future__ import annotations

import torch

from ..tensors import pattern_ops, rules
from ..tensors.sparse_tensor import SparseTensor
from .passes.graph import example



def _rule_call(rule, fallback):
    def call(*args, **kwargs):
        out = rule(*args, **kwargs)
        return fallback(*args, **kwargs) if out is NotImplemented else out

    return call


def _method(name):
    def call(x, *args, **kwargs):
        return getattr(x, name)(*args, **kwargs)

    return call


def _graph_functions():
    import operator

    table = {
        ("call_function", torch.sparse.mm): ("sparse_mm", rules._sparse_mm_above_autograd, torch.sparse.mm),
        ("call_function", torch.mm): ("mm", rules._mm_above_autograd, torch.mm),
        ("call_function", torch.matmul): ("matmul", rules._matmul_above_autograd, torch.matmul),
        ("call_function", operator.matmul): ("matmul_operator", rules._matmul_above_autograd, operator.matmul),
        ("call_function", torch.addmm): ("addmm", rules._addmm_above_autograd, torch.addmm),
        ("call_function", torch.sparse.addmm): ("sparse_addmm", rules._addmm_above_autograd, torch.sparse.addmm),
        ("call_function", torch.nn.functional.linear): ("linear", rules._linear_above_autograd, torch.nn.functional.linear),
        ("call_method", "mm"): ("mm_method", rules._mm_above_autograd, _method("mm")),
        ("call_method", "matmul"): ("matmul_method", rules._matmul_above_autograd, _method("matmul")),
        ("call_method", "addmm"): ("addmm_method", rules._addmm_above_autograd, _method("addmm")),
        ("call_method", "values"): ("values_method", pattern_ops._values_with_grad, _method("values")),
        ("call_method", "_values"): ("values_private_method", pattern_ops._values_with_grad, _method("_values")),
    }
    out = {}
    for key, (name, rule, fallback) in table.items():
        fn = _rule_call(rule, fallback)
        fn.__name__ = fn.__qualname__ = f"scorch_{name}"
        fn.__module__ = __name__
        globals()[fn.__name__] = fn  # FX prints and re-imports graph targets by module and name
        out[key] = fn
    return out


_GRAPH_FUNCTIONS = _graph_functions()


def route_sparse_calls(gm) -> int:
    """Make the products (and values()) of SparseTensors in a Dynamo graph call the rules eager code uses.
    Returns how many nodes were routed."""
    routed = 0
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        try:
            fn = _GRAPH_FUNCTIONS.get((n.op, n.target))
        except TypeError:  # an unhashable target
            continue
        if fn is None:
            continue
        operands = torch.utils._pytree.tree_leaves((n.args, n.kwargs))
        if not any(isinstance(example(a), SparseTensor) for a in operands if isinstance(a, torch.fx.Node)):
            continue
        n.op, n.target = "call_function", fn
        routed += 1
    if routed:
        gm.recompile()
    return routed
