"""The torch.compile backend "scorch".

    model = torch.compile(model, backend="scorch")                      # no import of scorch_backend needed
    model = torch.compile(model, backend="scorch", options={"sparse_threshold": 0.3, "fallback": "eager"})

Dynamo hands over the model's graph with the real example inputs (parameters included). The passes
(scorch_backend/passes) find where the zeros are, carry that through the graph, cut out the regions worth
running sparse and replace each with one `scorch::region` op; the graph then goes to Inductor (or runs as it
is, with fallback "eager"). AOTAutograd traces the regions' gradients, so training works.

Options:
  sparse_threshold  density under which a weight (or any value) counts as sparse; default: the measured
                    dense/sparse crossover (scorch_backend/calibration.json)
  fallback          "inductor" (default) or "eager": what runs the dense rest
  frozen_weights    False (default): compressed weights are rechecked on every call (version counter and a
                    32-entry fingerprint) and recompressed after an update. True: the fingerprint is skipped
                    (the version counter is still checked, so optimizer steps and in-place updates through
                    torch are seen); only writes through .data or numpy would go unseen.
  measure           True (default): run the graph once on the example inputs to measure activation densities
                    (inputs cloned, RNG state restored)
  measure_inputs    True (default): measure the model's data inputs too (bags of words, sparse features);
                    each new input is measured again at run time and runs dense if it is not sparse
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field

import torch
from torch import fx

from . import config, cost_model
from .passes import discover, example_run, partition, propagate, rewrite
from .passes.graph import describe, op_of

DEFAULT_OPTIONS = {"sparse_threshold": None, "fallback": "inductor", "frozen_weights": False, "measure": True,
                   "measure_inputs": True}


@dataclass
class GraphReport:
    """What the backend did with one graph (explain() collects these)."""

    regions: list
    decisions: list
    attrs: dict
    graph_before: str
    graph_after: str
    threshold: float
    options: dict
    dense_ops: list = field(default_factory=list)


_recorders: list[list] = []


def _options(options) -> dict:
    opts = dict(DEFAULT_OPTIONS)
    if options:
        unknown = set(options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ValueError(f"unknown scorch backend option(s) {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
        opts.update(options)
    if opts["fallback"] not in ("inductor", "eager"):
        raise ValueError(f"option 'fallback' must be 'inductor' or 'eager', got {opts['fallback']!r}")
    t = opts["sparse_threshold"]
    if t is None:
        opts["sparse_threshold"] = cost_model.crossover_density()
    elif not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
        raise ValueError(f"option 'sparse_threshold' must be a density in [0, 1], got {t!r}")
    return opts


def _cloned_inputs(example_inputs):
    out = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.layout == torch.strided \
                and type(x) is torch.Tensor:
            x = x.clone()
        out.append(x)
    return out


def _all_cpu(example_inputs) -> bool:
    return all(x.device.type == "cpu" for x in example_inputs if isinstance(x, torch.Tensor))


def transform(gm: fx.GraphModule, example_inputs, opts: dict) -> GraphReport:
    """Run the passes on `gm` in place and say what was done."""
    threshold = float(opts["sparse_threshold"])
    before = str(gm.graph)
    attrs = discover(gm, example_inputs, threshold, bool(opts["measure_inputs"]))
    measured = {}
    if opts["measure"]:
        state = torch.random.get_rng_state()
        try:
            measured = example_run(copy.copy(gm), _cloned_inputs(example_inputs))
        finally:
            torch.random.set_rng_state(state)
    propagate(gm, attrs, measured, threshold)
    # Dynamo compiles separately with and without grad mode: this graph is for training if grad is on now.
    regions, decisions = partition(gm, attrs, threshold, bool(opts["frozen_weights"]), torch.is_grad_enabled())
    in_regions = {m.name for r in regions for m in r.members}
    dense_ops = [describe(n) for n in gm.graph.nodes
                 if n.op in ("call_function", "call_method") and n.name not in in_regions
                 and op_of(n).name != "aten.getitem"]
    rewrite(gm, regions)
    return GraphReport(regions, decisions, attrs, before, str(gm.graph), threshold, opts, dense_ops)


def scorch(gm: fx.GraphModule, example_inputs, options=None, **kwargs):
    """The backend function torch.compile calls (registered as "scorch")."""
    if kwargs.get("mode") not in (None, "default"):
        raise ValueError("the scorch backend takes options=..., not mode=")
    opts = _options(options)
    report = None
    if _all_cpu(example_inputs):
        report = transform(gm, example_inputs, opts)
        for rec in _recorders:
            rec.append(report)
        if config.debug_level() >= 1:
            for r in report.regions:
                what = r.fused.program.equation if r.fused is not None else "masked attention"
                print(f"[scorch] {r.name}: {what}  ops: {'; '.join(r.ops)}", file=sys.stderr)
            for d in report.decisions:
                print(f"[scorch] {d.op}: {d.reason}", file=sys.stderr)
    if opts["fallback"] == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


try:  # also reachable without the entry point (a source checkout that is not installed)
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "scorch" not in _BACKENDS:
        register_backend(name="scorch")(scorch)
except Exception:  # noqa: BLE001 - registration by entry point still works
    pass
