"""explain(model, *inputs): what the "scorch" backend does with a model, region by region.

    report = scorch_backend.tools.explain(model, x, png="patterns.png")
    print(report)            # regions: ops, sparsity attributes, formats, schedule, estimated/measured speedup
    report.regions[0]        # the same as data

The model is compiled with the scorch backend (the same options as torch.compile's) and run once on the
inputs, under no_grad; each region's sparse kernel and the dense einsum it replaces are then timed on the
operands it received (median of repeats, same thread count). Contractions left dense are listed with the
reason, and so are the other ops, which Inductor (or eager) runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..compiler import backend as _backend
from ..custom_ops import chain as _chain
from ..custom_ops import region as _region
from .timing import measure
from ..custom_ops import attention
from .plot import plot_patterns


@dataclass
class RegionReport:
    name: str
    ops: list
    equation: str
    operands: list  # {"input", "kind", "attr", "shape"}
    formats: list
    schedule: str
    statement: str
    reasons: list
    estimated_speedup: float
    measured_speedup: float | None = None
    sparse_ms: float | None = None
    dense_ms: float | None = None
    path: str = ""  # what runs: "sparse" (the kernel), "grouped" (dense products per group) or "dense"
    label: str = ""  # where the region comes from: "fc1 (Linear): linear"
    gradients: list = field(default_factory=list)  # how its backward pass uses sparsity (train=True)
    after: str = ""  # what is added to its result outside it (a linear's bias)


@dataclass
class Report:
    regions: list = field(default_factory=list)
    left_dense: list = field(default_factory=list)  # (op, reason) for contractions not taken
    dense_ops: list = field(default_factory=list)  # other ops of the graphs, run by the fallback
    graphs: int = 0
    png: str | None = None

    def __str__(self) -> str:
        lines = [f"Scorch: {len(self.regions)} sparse region(s) in {self.graphs} graph(s)"]
        for r in self.regions:
            lines.append(f"\n{r.name}: {r.equation}")
            if r.label:
                lines.append("  from:      " + r.label)
            lines.append("  ops:       " + "; ".join(r.ops))
            if r.after:
                lines.append("  then:      " + r.after)
            for o in r.operands:
                lines.append(f"  {o['kind']:<8}   {o['input']} {tuple(o['shape'])}: {o['attr']}")
            lines.append(f"  formats:   {', '.join(r.formats)}")
            lines.append(f"  kernel:    {r.statement}")
            lines.append(f"  schedule:  {r.schedule}")
            if r.path == "grouped":
                lines.append("  runs as:   grouped dense products (rows of each group gathered, multiplied, scattered)")
            for why in r.reasons:
                lines.append(f"    - {why}")
            meas = (f"{r.measured_speedup:.2f}x ({r.path if r.path != 'dense' else 'sparse'} {r.sparse_ms:.3f} ms, "
                    f"dense {r.dense_ms:.3f} ms)"
                    if r.measured_speedup is not None else "not measured")
            lines.append(f"  speedup:   estimated {r.estimated_speedup:.2f}x, measured {meas}")
            for g in r.gradients:
                lines.append(f"  gradient:  {g}")
        if self.left_dense:
            lines.append("\nContractions not in a region:")
            lines += [f"  {op}: {why}" for op, why in self.left_dense]
        if self.dense_ops:
            lines.append(f"\nOther ops ({len(self.dense_ops)}), run by the fallback (those on SparseTensors as "
                         "Scorch kernels): " + ", ".join(self.dense_ops[:12]) + (" ..." if len(self.dense_ops) > 12 else ""))
        if self.png:
            lines.append(f"\nSparsity patterns: {self.png}")
        return "\n".join(lines)


def _time(fn, repeat: int) -> float:
    return measure(fn, warmup=1, repeat=repeat).median


def _attention_report(r, g, runs, repeat: int, patterns: dict) -> RegionReport:
    q, k, v, mask, scale = r.attention
    ops_desc = []
    for name, node, kind in (("q", q, "dense"), ("k", k, "dense"), ("v", v, "dense"), ("mask", mask, "pattern")):
        attr = g.attrs.get(node.name)
        shape = tuple(node.meta["example_value"].shape) if "example_value" in node.meta else ()
        ops_desc.append({"input": f"{name} = {node.name}", "kind": kind, "shape": shape,
                         "attr": attr.describe() if attr is not None else "dense"})
    rep = RegionReport(r.name, r.ops, f"softmax(q k^T * {scale:.4g} where mask, -inf elsewhere) @ v", ops_desc,
                       ["dense", "dense", "dense", "batched csr (mask pattern)"],
                       "sampled q k^T (SDDMM) -> row softmax of stored scores -> sparse product with v (SpMM)",
                       "masked attention", [], r.estimated_speedup, label=r.label)
    operands = runs.get(attention.capture_key(scale))
    if operands is None:
        rep.reasons = ["the region did not run with these inputs"]
        return rep
    rep.path = "sparse" if not attention._use_dense(operands[3], operands[0], operands[1]) else "dense"
    sparse_s = _time(lambda: attention.run(*operands, scale, force="sparse"), repeat)
    dense_s = _time(lambda: attention.run(*operands, scale, force="dense"), repeat)
    rep.sparse_ms, rep.dense_ms = sparse_s * 1e3, dense_s * 1e3
    rep.measured_speedup = dense_s / sparse_s if sparse_s > 0 else None
    patterns.setdefault(f"{r.name}: {mask.name}", operands[3])
    return rep


def _chain_report(r, g, runs, repeat: int) -> RegionReport:
    """A chain region: its steps, the values it reads, and its grouped run timed against the steps run as
    dense einsums one after the other."""
    ch = r.chain
    kinds = {}
    for f in ch.steps:
        for o, leaf in zip(f.program.operands, f.leaves):
            kinds.setdefault(leaf.name, o.kind)
    ops_desc = []
    for leaf in ch.leaves:
        attr = g.attrs.get(leaf.name)
        shape = tuple(leaf.meta["example_value"].shape) if "example_value" in leaf.meta else ()
        ops_desc.append({"input": leaf.name, "kind": kinds.get(leaf.name, "dense"), "shape": shape,
                         "attr": attr.describe() if attr is not None else "dense"})
    steps = []
    for st, f in zip(ch.program.steps, ch.steps):
        steps.append(f.program.equation + "".join(f" -> {op.split('.', 1)[1]}" for op in st.then))
    sequence = ch.program.kind == "sequence"
    how = ("each step a region call on the one before (its elementwise ops in place): the activation is "
           "compressed once, by the product that reads it" if sequence else
           "grouped by the sparse factor of its first step: every step runs on the gathered rows of "
           "each group; intermediates are kept per group, never as dense tensors")
    rep = RegionReport(r.name, r.ops, "chain: " + " => ".join(steps), ops_desc,
                       ["steps" if sequence else "grouped"] * len(ch.leaves), how,
                       f"{len(steps)} products in one call", [], r.estimated_speedup, label=r.label)
    operands = runs.get(r.program_text)
    if operands is None:
        rep.reasons = ["the region did not run with these inputs"]
        return rep
    rep.path = "sequence" if sequence else "grouped"
    sparse_s = _time(lambda: _chain.run_chain(r.program_text, operands), repeat)
    dense_s = _time(lambda: _chain.run_chain_dense(r.program_text, operands), repeat)
    rep.sparse_ms, rep.dense_ms = sparse_s * 1e3, dense_s * 1e3
    rep.measured_speedup = dense_s / sparse_s if sparse_s > 0 else None
    return rep


def _gradient_notes(prog, leaves) -> list:
    """How a region's gradient programs use sparsity beyond its forward operands (training graphs)."""
    notes = []
    if prog.sparse_grad_out:
        notes.append("its output's gradient is mostly zeros (it feeds a ReLU or top-k measured sparse): the "
                     "gradient programs take it compressed")
    for o, leaf in zip(prog.operands, leaves):
        if o.masked_grad:
            notes.append(f"the gradient of {leaf.name} is computed only where {leaf.name} is nonzero (sampled: "
                         "the op that made its zeros drops the rest)")
    return notes


def explain(model, *inputs, options=None, png: str | None = None, repeat: int = 5, train: bool = False) -> Report:
    """Compile `model` with the scorch backend, run it once on `inputs` and report every region. train=True
    compiles the graph Dynamo makes under grad mode (the training partition: regions may then also use the
    sparsity of their gradients, which the report says) and runs the forward with gradients enabled."""
    reports, captured = [], []
    _backend._recorders.append(reports)
    _region._captures.append(captured)
    try:
        # A backend object of its own: a model already compiled with "scorch" is compiled again (and seen).
        compiled = torch.compile(model, backend=functools.partial(_backend.scorch, options=options))
        with torch.set_grad_enabled(train):
            compiled(*inputs)
    finally:
        _backend._recorders.remove(reports)
        _region._captures.remove(captured)
    runs = {}
    for text, operands in captured:
        runs.setdefault(text, operands)
    out = Report(graphs=len(reports))
    patterns = {}
    for g in reports:
        out.left_dense += [(d.op, d.reason) for d in g.decisions]
        out.dense_ops += g.dense_ops
        for r in g.regions:
            if r.chain is not None:
                out.regions.append(_chain_report(r, g, runs, repeat))
                continue
            if r.fused is None:
                out.regions.append(_attention_report(r, g, runs, repeat, patterns))
                continue
            prog = r.fused.program
            ops_desc = []
            for o, leaf in zip(prog.operands, r.fused.leaves):
                attr = g.attrs.get(leaf.name)
                shape = tuple(leaf.meta["example_value"].shape) if "example_value" in leaf.meta else ()
                what = attr.describe() if attr is not None else "dense"
                if o.relu:  # the graph hands the op the ReLU's input (passes/partition.py: _fold_relus)
                    what = "a ReLU's input: the op applies the ReLU as it measures and compresses it"
                ops_desc.append({"input": f"relu({leaf.name})" if o.relu else leaf.name, "kind": o.kind,
                                 "shape": shape, "attr": what})
            rep = RegionReport(r.name, r.ops, prog.equation, ops_desc, [], "", "", [], r.estimated_speedup,
                               label=r.label, gradients=_gradient_notes(prog, r.fused.leaves))
            operands = runs.get(r.program_text)
            # addends (a linear's bias, a residual) are added by the region op itself: the equation shows them
            if operands is not None and all(o.kind in ("dense", "add") for o in prog.operands):
                rep.path, rep.formats = "dense", ["dense"] * len(prog.operands)
                rep.statement = "the dense einsum (no compressed operand in the forward pass)"
                rep.reasons = ["a region for its gradients: the forward product has nothing sparse and runs dense"]
                rep.dense_ms = _time(lambda: _region.run(r.program_text, operands, force="dense"), repeat) * 1e3
            elif operands is not None:
                plan = _region.sparse_plan(r.program_text, operands)
                rep.formats, rep.schedule = plan["formats"], plan["schedule"]
                rep.statement, rep.reasons = plan["statement"], plan["reasons"]
                rep.path = _region.choose_path(r.program_text, operands)
                if rep.path == "dense":
                    rep.reasons.append("at run time these operands are not sparse enough: the dense einsum runs")
                forced = rep.path if rep.path != "dense" else "sparse"
                sparse_s = _time(lambda: _region.run(r.program_text, operands, force=forced), repeat)
                dense_s = _time(lambda: _region.run(r.program_text, operands, force="dense"), repeat)
                rep.sparse_ms, rep.dense_ms = sparse_s * 1e3, dense_s * 1e3
                rep.measured_speedup = dense_s / sparse_s if sparse_s > 0 else None
                for o, leaf, t in zip(prog.operands, r.fused.leaves, operands):
                    if o.kind in ("sparse", "pattern"):
                        patterns.setdefault(f"{r.name}: {leaf.name}", torch.relu(t) if o.relu else t)
            else:
                rep.reasons = ["the region did not run with these inputs"]
            out.regions.append(rep)
    if png is not None and patterns:
        out.png = plot_patterns(patterns, png)
    return out
