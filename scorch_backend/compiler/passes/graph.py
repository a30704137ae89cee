"""A common view of graph nodes for the passes.

Dynamo graphs call torch functions, Tensor methods and Python operators (`torch._C._nn.linear`,
`x.masked_fill(...)`, `operator.mul`). The passes see each node as the ATen operator it stands for
("aten.linear", "aten.masked_fill", "aten.mul") with its tensor arguments (`op_of`, from the op table in
compiler/ops_table.py, which lists every spelling of each op). Nodes calling something not in that table are
"opaque": dense as far as Scorch knows. This module adds what the passes ask of nodes beyond one op: writes in
place and their aliases, and readable names for reports.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

# How nodes are named by their ATen op, and the values Dynamo recorded for them, come with the op table.
from ..ops_table import FUNCTIONS, OpView, example, inplace_by_position, normalized, op_of, shape_of

__all__ = ["ALIASING_FUNCTIONS", "ALIASING_METHODS", "OpView", "Writes", "describe", "example", "is_in_place",
           "mutated_values", "op_of", "shape_of", "source_label"]


_OPERATOR_IN_PLACE = {getattr(operator, n) for n in ("iadd", "iand", "iconcat", "ifloordiv", "ilshift",
                                                       "imatmul", "imod", "imul", "ior", "ipow", "irshift",
                                                       "isub", "itruediv", "ixor", "setitem")}


def is_in_place(node: fx.Node) -> bool:
    """Does the node write into one of its arguments? (x.add_(), x[i] = v, x += y, f(..., out=y),
    F.relu(x, inplace=True))."""
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.startswith("_"):
        return True
    if node.op == "call_function":
        if node.target in _OPERATOR_IN_PLACE:
            return True
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.startswith("_"):
            return True
        name = FUNCTIONS.get(node.target)
        if name is not None:
            args, kwargs = normalized(name, node.args, dict(node.kwargs))
            if kwargs.get("inplace") is True or inplace_by_position(name, args):
                return True
    return "out" in node.kwargs or node.kwargs.get("inplace") is True


def describe(node: fx.Node) -> str:
    """A short readable form of a node for reports: `relu(linear_1)`."""
    view = op_of(node)
    if node.op == "placeholder":
        return f"input {node.target}"
    args = ", ".join(a.name if isinstance(a, fx.Node) else repr(a) for a in view.args)
    name = view.name.split(".", 1)[1] if view.name.startswith("aten.") else str(node.target)
    return f"{name}({args})"


def _module_path(key: str) -> str:
    """Dynamo's name of a module ("L['self'].layers[0].fc1", "L__self___fc1") as the model's attribute path."""
    key = re.sub(r"^L\['self'\]\.?", "", key)
    key = re.sub(r"^L__self___?", "", key)
    return key or "model"


def source_label(root: fx.Node, members) -> str:
    """Where a region comes from, short: the innermost module of its root and its ops ("fc1 (Linear): linear",
    "attn.q (Linear): mul, linear"); the ops alone when the graph does not say."""
    names = []
    for m in members:
        view = op_of(m)
        if view.name.startswith("aten."):
            name = view.name.split(".", 1)[1]
        else:
            name = str(getattr(m.target, "__name__", m.target))
        if name not in names:
            names.append(name)
    ops = ", ".join(names)
    stack = root.meta.get("nn_module_stack") or {}
    if stack:
        key, kind = list(stack.values())[-1][:2]
        kind = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])
        return f"{_module_path(str(key))} ({kind}): {ops}"
    return ops


# Ops whose result may share memory with their first argument: writing into one writes into the other.
ALIASING_METHODS = {"view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "squeeze", "unsqueeze",
                     "transpose", "permute", "t", "narrow", "select", "flatten", "unflatten", "split", "chunk",
                     "unbind", "detach", "as_strided", "movedim", "swapaxes", "diagonal", "contiguous", "to",
                     "type_as", "__getitem__", "data", "float", "double", "type", "view_as_real"}
ALIASING_FUNCTIONS = {operator.getitem, torch.reshape, torch.squeeze, torch.unsqueeze, torch.transpose,
                       torch.permute, torch.t, torch.narrow, torch.select, torch.flatten, torch.split,
                       torch.chunk, torch.unbind, torch.detach, torch.movedim, torch.swapaxes, torch.diagonal}


class Writes:
    """The graph's writes in place, by alias group (a value and every view of it, through the ops above)."""

    def __init__(self, gm: fx.GraphModule):
        self._parent: dict = {}
        self.position = {n: k for k, n in enumerate(gm.graph.nodes)}
        for node in gm.graph.nodes:
            aliasing = (node.op == "call_method" and node.target in ALIASING_METHODS) or \
                       (node.op == "call_function" and node.target in ALIASING_FUNCTIONS)
            if aliasing and node.args and isinstance(node.args[0], fx.Node):
                self._parent[self.group(node)] = self.group(node.args[0])
        self.writes: list = []  # (position, alias group written)
        for node in gm.graph.nodes:
            if is_in_place(node):
                targets = [a for a in node.args[:1] if isinstance(a, fx.Node)]
                out = node.kwargs.get("out")
                targets += [out] if isinstance(out, fx.Node) else list(out) if isinstance(out, (tuple, list)) else []
                for t in [*targets, node]:
                    if isinstance(t, fx.Node):
                        self.writes.append((self.position[node], self.group(t)))
        self._nodes = list(gm.graph.nodes)

    def group(self, node: fx.Node) -> str:
        n = node.name
        while self._parent.get(n, n) != n:
            n = self._parent[n]
        return n

    def mutated(self) -> set:
        """Names of the nodes whose memory some in-place op writes (with every alias of them)."""
        written = {g for _, g in self.writes}
        return {n.name for n in self._nodes if self.group(n) in written}

    def between(self, first: fx.Node, last: fx.Node, values) -> fx.Node | None:
        """The first node strictly between `first` and `last` that writes one of `values` (or an alias), else
        None: a value read at `last` instead of at `first` would then be seen changed."""
        lo, hi = self.position[first], self.position[last]
        groups = {self.group(v) for v in values if isinstance(v, fx.Node)}
        for k, g in self.writes:
            if lo < k < hi and g in groups:
                return self._nodes[k]
        return None


def mutated_values(gm: fx.GraphModule) -> set:
    """Names of the nodes whose memory some in-place op of the graph writes (with every alias of them): their
    zeros when they were made say nothing of what later readers see."""
    return Writes(gm).mutated()
