"""discover: a sparsity attribute for each graph input, and the densities of the example run.

- SparseTensor inputs: sparse, by their format and stored entries.
- Parameters and buffers (they reach the backend as real tensors): measured (fraction of nonzeros, and the
  pattern: unstructured, block, n:m, zero rows or columns). A weight under the sparse threshold is sparse.
- Other inputs (the model's data: features, bags of words): measured too (option measure_inputs). Their zeros
  are not promised to last from one call to the next, so the region op measures each new input again (once per
  tensor version) and runs the dense einsum when it is not sparse enough.

The example run executes the graph once on the real example inputs and records each value's density; rules
that create zeros at run time (ReLU) use it as their estimate. Values produced by one_hot, masks, where,
softmax of masked scores, top-k scatter are found by propagate's rules, not measured.
"""

from __future__ import annotations

import torch
from torch import fx

from ... import cost_model
from ... import log as _log
from ..measure import measure
from ..attrs import DENSE, SparsityAttr
from ...tensors.sparse_tensor import SparseTensor


def is_weight(node: fx.Node, value) -> bool:
    """Whether a placeholder is a module's parameter or buffer (checked by the fingerprint at run time) rather
    than data (checked by a hash of every byte). By where Dynamo found it when it says (`L['self']._buffers['b']`
    against `L['rows_buffers_in']`); by the placeholder's name otherwise (a graph built by hand, a DDP bucket's
    subgraph). The name alone took a forward argument called `rows_buffers_in` for a buffer, and a numpy write
    into it went unseen (helper-59)."""
    if isinstance(value, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    where = getattr(source, "name", None)
    if callable(where):  # (a method in some torch versions, a property in others)
        where = where()
    if isinstance(where, str):
        return "._parameters[" in where or "._buffers[" in where
    name = str(node.target).lower()
    return "_parameters_" in name or "_buffers_" in name


MIN_MEASURED_INPUT = cost_model.TINY_DENSE_ELEMENTS  # smaller inputs are not worth a sparse format


def real_weight(value):
    """The real tensor behind a fake one, when the fake was made from it. Dynamo's DDP graph splitter
    (optimize_ddp) compiles each bucket's subgraph with fake copies of the real parameters; the fake mode's
    converter remembers which real tensor each fake came from, so the weights can still be measured, and every
    rank measures the same (DDP broadcasts them at construction). None when there is no such tensor."""
    if not isinstance(value, torch._subclasses.FakeTensor):
        return value
    try:
        converter = value.fake_mode.fake_tensor_converter
        ids = [k for k, fake in list(converter.tensor_memo.items()) if fake is value]  # describer id -> fake
        if not ids:
            return None
        for real, k in list(converter.meta_converter.describer.lookup_tensor.items()):  # real -> describer id
            if k == ids[0] and not isinstance(real, torch._subclasses.FakeTensor):
                return real
    except Exception:  # noqa: BLE001 - private structures of torch: without them, the weight stays unmeasured
        return None
    return None


def discover(gm: fx.GraphModule, example_inputs, threshold: float, measure_inputs: bool = True) -> dict:
    attrs = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch._subclasses.FakeTensor) and is_weight(node, value):
            value = real_weight(value) if real_weight(value) is not None else value
        if isinstance(value, SparseTensor):
            attrs[node.name] = SparsityAttr(sparse=True, density=value.density, origin="SparseTensor input",
                                            pattern=str(value.format), format=str(value.format))
        elif isinstance(value, torch.Tensor) and is_weight(node, value) and value.numel() > 0 \
                and not isinstance(value, torch._subclasses.FakeTensor):
            m = measure(value.detach() if value.dtype != torch.bool else value, dense_threshold=threshold)
            pattern = m.pattern
            if m.block is not None and pattern == "block":
                pattern = f"block {m.block[0]}x{m.block[1]}"
            elif m.nm is not None and pattern == "n:m":
                pattern = f"n:m {m.nm[0]}:{m.nm[1]}"
            attrs[node.name] = SparsityAttr(sparse=m.density < threshold, density=m.density,
                                            origin="measured " + ("mask" if value.dtype == torch.bool else "weight"),
                                            pattern=pattern, weight=True, measured=m.density)
        elif measure_inputs and isinstance(value, torch.Tensor) and type(value) is torch.Tensor and \
                value.dtype in (torch.float32, torch.float64, torch.bool) and value.numel() >= MIN_MEASURED_INPUT and \
                value.layout == torch.strided:
            # Data: bags of words, one-hot features, masks. Measured now for the partition; the region op
            # measures every new tensor again at run time and runs dense if it is not sparse after all.
            m = measure(value.detach(), dense_threshold=threshold)
            attrs[node.name] = SparsityAttr(sparse=m.density < threshold, density=m.density,
                                            origin="measured input", pattern=m.pattern, measured=m.density) \
                if m.density < threshold else DENSE.with_(measured=m.density)
        else:
            attrs[node.name] = DENSE
    logger = _log.get("passes.discover")
    if logger.isEnabledFor(10):
        for name, a in attrs.items():
            if a is not DENSE:
                logger.debug("%s: %s", name, a.describe())
    return attrs


class _DensityRecorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.densities = {}

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and not isinstance(out, SparseTensor) and out.numel() and \
                out.layout == torch.strided:
            self.densities[n.name] = float(torch.count_nonzero(out)) / out.numel()
        return out


def example_run(gm: fx.GraphModule, example_inputs) -> dict:
    """Densities of every dense value in one run on the example inputs ({} if the run is not possible)."""
    args = []
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            hint = x.node.hint
            if hint is None:
                return {}
            x = int(hint)
        args.append(x)
    rec = _DensityRecorder(gm)
    try:
        with torch.no_grad():
            rec.run(*args)
    except Exception:  # noqa: BLE001 - the run is only for estimates; the passes work without it
        return rec.densities
    return rec.densities
