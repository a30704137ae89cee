"""A common view of graph nodes for the passes.

Dynamo graphs call torch functions, Tensor methods and Python operators (`torch._C._nn.linear`,
`x.masked_fill(...)`, `operator.mul`). The passes see each node as the ATen operator it stands for
("aten.linear", "aten.masked_fill", "aten.mul") with its tensor arguments, so their rule tables are written
once, per ATen op. Nodes calling something not listed here are "opaque": dense as far as Scorch knows.
"""

from __future__ import annotations

import operator
import re
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
    "detach": "aten.detach", "logical_not": "aten.bitwise_not", "bitwise_not": "aten.bitwise_not",
}
_add("aten.detach", torch.detach)

# Parameter names of each op, in order: keyword arguments are moved into their positions, so the rules see
# one form. Alternatives are separated by "|" (torch.mm(input, mat2), Tensor.mm(mat2), operator.mul(a, b)).
_PARAMS = {
    "aten.linear": ["input", "weight", "bias"],
    "aten.matmul": ["input|self", "other"], "aten.mm": ["input|self", "mat2|other"],
    "aten.bmm": ["input|self", "mat2|other"],
    "aten.mul": ["input|self", "other"], "aten.div": ["input|self", "other"],
    "aten.add": ["input|self", "other"], "aten.sub": ["input|self", "other"],
    "aten.transpose": ["input|self", "dim0", "dim1"], "aten.unsqueeze": ["input|self", "dim"],
    "aten.softmax": ["input|self", "dim"], "aten.masked_fill": ["input|self", "mask", "value"],
    "aten.where": ["condition", "input|self", "other"], "aten.one_hot": ["input|tensor", "num_classes"],
    "aten.scatter": ["input|self", "dim", "index", "src|value"], "aten.topk": ["input|self", "k", "dim"],
    "aten.relu": ["input|self"], "aten.gelu": ["input|self"], "aten.tanh": ["input|self"],
    "aten.abs": ["input|self"], "aten.neg": ["input|self"], "aten.t": ["input|self"],
    "aten.clone": ["input|self"], "aten.detach": ["input|self"], "aten._to_copy": ["input|self"],
    "aten.dropout": ["input", "p", "training"], "aten.bitwise_not": ["input|self"],
    "aten.zeros_like": ["input|self"],
}
# Keyword arguments that leave an op's meaning as the rules assume it, at these values.
_HARMLESS = {"dtype": (None,), "approximate": ("none", "tanh"), "inplace": (False,), "alpha": (1,),
             "rounding_mode": (None,), "memory_format": (None, torch.preserve_format, torch.contiguous_format),
             "non_blocking": (False,), "copy": (False,), "sorted": (True,), "largest": (True,),
             "layout": (None,), "device": (None,), "pin_memory": (None, False), "requires_grad": (False,)}
_IN_PLACE = {"aten.relu", "aten.dropout"}  # ops with an inplace flag as their last parameter


def _normalized(name: str, args: tuple, kwargs: dict):
    """(args, leftover kwargs) with known keyword arguments moved into position."""
    params = _PARAMS.get(name)
    if params is None or not kwargs:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for k, alternatives in enumerate(params):
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


@dataclass
class OpView:
    name: str  # "aten.mul", ... or "opaque" / "placeholder" / "output"
    args: tuple
    kwargs: dict


def op_of(node: fx.Node) -> OpView:
    """The ATen op a node stands for, keyword arguments moved into place. A node whose other keyword
    arguments change the op's meaning (rounding_mode=, alpha=, out=, inplace=True ...) is "opaque"."""
    if node.op in ("placeholder", "output", "get_attr"):
        return OpView(node.op, node.args, dict(node.kwargs))
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target, "opaque")
    elif node.op == "call_method":
        name = _METHODS.get(node.target, "opaque")
    else:
        name = "opaque"
    args, kwargs = _normalized(name, node.args, dict(node.kwargs))
    if name in _IN_PLACE and len(args) == len(_PARAMS[name]) + 1 and args[-1] is True:
        name = "opaque"  # F.relu(x, True), F.dropout(x, p, training, True)
    if kwargs and not _harmless(kwargs):
        name = "opaque"
    return OpView(name, args, kwargs)


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
        if _FUNCTIONS.get(node.target) in _IN_PLACE:
            args, kwargs = _normalized(_FUNCTIONS[node.target], node.args, dict(node.kwargs))
            if kwargs.get("inplace") is True or (len(args) == len(_PARAMS[_FUNCTIONS[node.target]]) + 1
                                                 and args[-1] is True):
                return True
    return "out" in node.kwargs or node.kwargs.get("inplace") is True


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
_ALIASING_METHODS = {"view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "squeeze", "unsqueeze",
                     "transpose", "permute", "t", "narrow", "select", "flatten", "unflatten", "split", "chunk",
                     "unbind", "detach", "as_strided", "movedim", "swapaxes", "diagonal", "contiguous", "to",
                     "type_as", "__getitem__", "data", "float", "double", "type", "view_as_real"}
_ALIASING_FUNCTIONS = {operator.getitem, torch.reshape, torch.squeeze, torch.unsqueeze, torch.transpose,
                       torch.permute, torch.t, torch.narrow, torch.select, torch.flatten, torch.split,
                       torch.chunk, torch.unbind, torch.detach, torch.movedim, torch.swapaxes, torch.diagonal}


def mutated_values(gm: fx.GraphModule) -> set:
    """Names of the nodes whose memory some in-place op of the graph writes (with every alias of them): their
    zeros when they were made say nothing of what later readers see."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    for node in gm.graph.nodes:
        aliasing = (node.op == "call_method" and node.target in _ALIASING_METHODS) or \
                   (node.op == "call_function" and node.target in _ALIASING_FUNCTIONS)
        if aliasing and node.args and isinstance(node.args[0], fx.Node):
            parent[find(node.name)] = find(node.args[0].name)
    written = set()
    for node in gm.graph.nodes:
        if is_in_place(node):
            targets = [a for a in node.args[:1] if isinstance(a, fx.Node)]
            out = node.kwargs.get("out")
            targets += [out] if isinstance(out, fx.Node) else list(out) if isinstance(out, (tuple, list)) else []
            written.update(find(t.name) for t in targets if isinstance(t, fx.Node))
            written.add(find(node.name))
    return {n.name for n in gm.graph.nodes if find(n.name) in written}
