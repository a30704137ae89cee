"""A common view of graph nodes for the passes.

Dynamo graphs call torch functions, Tensor methods and Python operators (`torch._C._nn.linear`,
`x.masked_fill(...)`, `operator.mul`). The passes see each node as the ATen operator it stands for
("aten.linear", "aten.masked_fill", "aten.mul") with its tensor arguments, so their rule tables are written
once, per ATen op. Nodes calling something not listed here are "opaque": dense as far as Scorch knows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

_FUNCTIONS: dict = {}


def _add(name: str, *fns) -> None:
    for fn in fns:
        if fn is not None:
            _FUNCTIONS[fn] = name


_add("aten.linear", torch._C._nn.linear, F.linear)
_add("aten.matmul", operator.matmul, torch.matmul)
_add("aten.mm", torch.mm)
_add("aten.bmm", torch.bmm)
_add("aten.einsum", torch.einsum, torch.functional.einsum)
_add("aten.mul", operator.mul, torch.mul)
_add("aten.div", operator.truediv, torch.div, torch.true_divide)
_add("aten.add", operator.add, torch.add)
_add("aten.sub", operator.sub, torch.sub)
_add("aten.neg", operator.neg, torch.neg)
_add("aten.relu", torch.relu, F.relu)
_add("aten.gelu", F.gelu)
_add("aten.tanh", torch.tanh)
_add("aten.abs", torch.abs)
_add("aten.one_hot", torch._C._nn.one_hot, F.one_hot)
_add("aten.softmax", torch.softmax, F.softmax)
_add("aten.where", torch.where)
_add("aten.bitwise_not", operator.invert, torch.bitwise_not, torch.logical_not)
_add("aten.topk", torch.topk)
_add("aten.zeros_like", torch.zeros_like)
_add("aten.scatter", torch.scatter)
_add("aten.masked_fill", torch.masked_fill)
_add("aten.dropout", F.dropout, torch.dropout)
_add("aten.transpose", torch.transpose)
_add("aten.permute", torch.permute)
_add("aten.t", torch.t)
_add("aten.unsqueeze", torch.unsqueeze)
_add("aten.getitem", operator.getitem)

_METHODS = {
    "relu": "aten.relu", "to": "aten._to_copy", "float": "aten._to_copy", "double": "aten._to_copy",
    "type": "aten._to_copy", "unsqueeze": "aten.unsqueeze", "transpose": "aten.transpose",
    "permute": "aten.permute", "t": "aten.t", "masked_fill": "aten.masked_fill", "scatter": "aten.scatter",
    "softmax": "aten.softmax", "contiguous": "aten.clone", "clone": "aten.clone", "topk": "aten.topk",
    "mul": "aten.mul", "add": "aten.add", "sub": "aten.sub", "matmul": "aten.matmul", "mm": "aten.mm",
    "bmm": "aten.bmm", "neg": "aten.neg", "tanh": "aten.tanh", "abs": "aten.abs", "div": "aten.div",
    "detach": "aten.clone", "logical_not": "aten.bitwise_not", "bitwise_not": "aten.bitwise_not",
}


@dataclass
class OpView:
    name: str  # "aten.mul", ... or "opaque" / "placeholder" / "output"
    args: tuple
    kwargs: dict


def op_of(node: fx.Node) -> OpView:
    if node.op in ("placeholder", "output", "get_attr"):
        return OpView(node.op, node.args, dict(node.kwargs))
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target, "opaque")
        return OpView(name, node.args, dict(node.kwargs))
    if node.op == "call_method":
        return OpView(_METHODS.get(node.target, "opaque"), node.args, dict(node.kwargs))
    return OpView("opaque", node.args, dict(node.kwargs))


def example(node) -> object:
    """The fake (or real) value Dynamo recorded for a node, or None."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node) -> tuple | None:
    v = example(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def describe(node: fx.Node) -> str:
    """A short readable form of a node for reports: `relu(linear_1)`."""
    view = op_of(node)
    if node.op == "placeholder":
        return f"input {node.target}"
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in view.args)
    name = view.name.split(".", 1)[1] if view.name.startswith("aten.") else str(node.target)
    return f"{name}({args})"
