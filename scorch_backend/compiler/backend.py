"""The torch.compile backend "scorch".

    model = torch.compile(model, backend="scorch")                      # no import of scorch_backend needed
    model = torch.compile(model, backend="scorch", options={"sparse_threshold": 0.3, "fallback": "eager"})

Dynamo hands over the model's graph with the real example inputs (parameters included). The passes
(scorch_backend/compiler/passes) find where the zeros are, carry that through the graph, cut out the regions worth
running sparse and replace each with one `scorch::region` op; the graph then goes to Inductor (or runs as it
is, with fallback "eager"). AOTAutograd traces the regions' gradients, so training works.

Options:
  sparse_threshold  density under which a weight (or any value) counts as sparse; default: the measured
                    dense/sparse crossover (scorch_backend/calibration.json)
  fallback          "inductor" (default) or "eager": what runs the dense rest
  frozen_weights    False (default): compressed weights are rechecked on every call (version counter and a
                    fingerprint of spread entries and nonzeros) and recompressed after an update. True: the
                    fingerprint is skipped and only the version counter is checked, for weights that do not
                    train: in-place updates through torch ops are seen, a fused optimizer step (which does not
                    move the counter) and writes through .data or numpy are not.
  measure           True (default): run the graph once on the example inputs to measure activation densities
                    (inputs cloned, RNG state restored)
  measure_inputs    True (default): measure the model's data inputs too (bags of words, sparse features);
                    each new input is measured again at run time and runs dense if it is not sparse
  chains            "direct" (default) | "inference" | "always" | "never": where products joined by elementwise
                    ops and sharing a sparse factor run as one chain region (docs/backend.md, "Chains")
  sequences         True (default): where chains are on, a product left dense joins the region that reads its
                    ReLU output compressed (linear -> ReLU -> linear as one chain)
  redecide          True (default): a graph that took weights as dense looks at them again now and then (at
                    most every 0.5 s) and compiles again where one has become sparse: a pruned checkpoint
                    loaded after torch.compile, another instance of the class with pruned weights
                    (compiler/redecide.py)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import os
import time
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import _C, config, cost_model
from .. import log as _log
from . import redecide
from ..custom_ops import attention, region
from .passes import discover, example_run, partition, propagate, rewrite
from .passes.partition import grad_density
from .passes.graph import describe, example, op_of
from .sparse_calls import route_sparse_calls
from ..tensors.sparse_tensor import SparseTensor, _onto_pattern, _wrap_result

DEFAULT_OPTIONS = {"sparse_threshold": None, "fallback": "inductor", "frozen_weights": False, "measure": True,
                   "measure_inputs": True, "chains": "direct", "sequences": True, "redecide": True}
# "chains": where products joined by elementwise ops run as one chain region (passes/partition.py): "direct"
# (graphs compiled without grad, and training graphs whose every chain gets its gradient directly as grouped
# products: csrc/torch/grouped_backward.cpp, the mixture of experts), "inference" (graphs compiled without grad
# only), "always", or "never". Any other chain's gradient runs the chain again under autograd, which costs more
# than the separate regions' own gradient programs; so such training graphs keep them separate.
# "sequences": also join a product left dense with the region reading its ReLU output compressed (linear ->
# bias -> ReLU -> linear) where chains are on. The dense product then runs through the generated grouped product
# kernel with its bias and the ReLU in its last pass, its weight stored once in the kernel's panels
# (csrc/torch/chain_program.cpp: linear_step); where that kernel cannot be had, ATen's addmm and an in-place ReLU.


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
    kernels: list = field(default_factory=list)  # specs of the kernels compiled ahead of the first call
    grad_densities: dict = field(default_factory=dict)  # training: region name -> its output gradient's density


_recorders: list[list] = []
_graph_numbers = _log.graph_numbers


def _options(options) -> dict:
    opts = dict(DEFAULT_OPTIONS)
    if options:
        unknown = set(options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ValueError(f"unknown scorch backend option(s) {sorted(unknown)}; known: {sorted(DEFAULT_OPTIONS)}")
        opts.update(options)
    if opts["fallback"] not in ("inductor", "eager"):
        raise ValueError(f"option 'fallback' must be 'inductor' or 'eager', got {opts['fallback']!r}")
    for key in ("sequences", "redecide"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"option '{key}' must be True or False, got {opts[key]!r}")
    if opts["chains"] not in ("direct", "inference", "always", "never"):
        raise ValueError(f"option 'chains' must be 'direct', 'inference', 'always' or 'never', got {opts['chains']!r}")
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


# --- dumps (SCORCH_DEBUG=2): the graph and the attribute table after each pass ----------------------------

def attribute_table(gm: fx.GraphModule, attrs: dict, measured: dict | None = None) -> str:
    """One line per graph node: name, what it computes, shape, sparsity attribute (and the example run's
    density when known); then attributes of values no longer in the graph."""
    rows = []
    seen = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        seen.add(n.name)
        v = example(n)
        shape = "x".join(str(d) for d in v.shape) if isinstance(v, torch.Tensor) else "-"
        a = attrs.get(n.name)
        what = a.describe() if a is not None else "-"
        if measured and n.name in measured:
            what += f"  [example run: density {measured[n.name]:.3g}]"
        rows.append((n.name, describe(n) if n.op != "placeholder" else f"input {n.target}", shape, what))
    gone = [(name, "(not in the graph now)", "", a.describe()) for name, a in attrs.items() if name not in seen]
    rows += gone
    w0 = max((len(r[0]) for r in rows), default=4)
    w1 = min(max((len(r[1]) for r in rows), default=2), 60)
    w2 = max((len(r[2]) for r in rows), default=5)
    lines = [f"{'node':<{w0}}  {'op':<{w1}}  {'shape':<{w2}}  sparsity"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c:<{w2}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def _graph_and_table(title: str, gm: fx.GraphModule, attrs: dict, measured: dict | None = None) -> str:
    return f"# {title}\n\n## graph\n{gm.graph}\n\n## sparsity attributes\n{attribute_table(gm, attrs, measured)}\n"


def _region_lines(regions, decisions) -> list[str]:
    lines = []
    for r in regions:
        if r.chain is not None:
            what = "chain " + " -> ".join(f.program.equation for f in r.chain.steps)
        else:
            what = r.fused.program.equation if r.fused is not None else "masked attention"
        kinds = f" [{', '.join(o.kind for o in r.fused.program.operands)}]" if r.fused is not None else ""
        lines.append(f"{r.title}: {what}{kinds}, estimated speedup {r.estimated_speedup:.2f}x; "
                     f"ops: {'; '.join(r.ops)}")
    for d in decisions:
        lines.append(f"{d.node} = {d.op}: {d.reason}")
    return lines


def transform(gm: fx.GraphModule, example_inputs, opts: dict, dump: "_log.GraphDump | None" = None, *,
              attention: bool = True, chains: bool = True, name_prefix: str = "") -> GraphReport:
    """Run the passes on `gm` in place and say what was done; with `dump`, write the graph after each pass.
    `attention` False leaves masked attention to the model's own code; `chains` False keeps every product a
    region of its own (the TorchScript rewrite asks for that: chain programs in rewritten models are not
    tested yet, although `scorch::chain` is a C++ op)."""
    threshold = float(opts["sparse_threshold"])
    before = str(gm.graph)
    if dump:
        dump.write("input", f"# the graph as Dynamo gave it\n\n{before}\n")
    attrs = discover(gm, example_inputs, threshold, bool(opts["measure_inputs"]))
    if dump:
        dump.write("discover", _graph_and_table("after discover: inputs measured", gm, attrs))
    measured = {}
    if opts["measure"]:
        state = torch.random.get_rng_state()
        try:
            measured = example_run(copy.copy(gm), _cloned_inputs(example_inputs))
        finally:
            torch.random.set_rng_state(state)
        if dump:
            dump.write("example_run", _graph_and_table("after the example run: densities measured", gm, attrs,
                                                       measured))
    propagate(gm, attrs, measured, threshold)
    if dump:
        dump.write("propagate", _graph_and_table("after propagate", gm, attrs, measured))
    # Dynamo compiles separately with and without grad mode: this graph is for training if grad is on now.
    training = torch.is_grad_enabled()
    mode = opts["chains"]
    chains = chains and (mode in ("always", "direct") or (mode == "inference" and not training))
    # A sequence has no direct gradient: under "direct" a training graph would form one only to be partitioned
    # again without any chain (taking the mixture of experts' chains with it), so it forms none there.
    sequences = chains and opts["sequences"] and not (training and mode == "direct")
    regions, decisions = partition(gm, attrs, threshold, bool(opts["frozen_weights"]), training, chains,
                                   sequences=sequences, name_prefix=name_prefix)
    if chains and training and mode == "direct" and not all(
            _C.chain_direct_gradient(r.program_text) for r in regions if r.chain is not None):
        regions, decisions = partition(gm, attrs, threshold, bool(opts["frozen_weights"]), training, False,
                                       name_prefix=name_prefix)
    for r in regions:
        if r.chain is not None and training and _C.chain_direct_gradient(r.program_text):
            r.chain.program = dataclasses.replace(r.chain.program, keep=True)
    if not attention:
        regions = [r for r in regions if r.attention is None]
    if dump:
        programs = [f"{r.name}: {r.program_text}" for r in regions if r.attention is None]
        dump.write("partition", _graph_and_table("after partition (and fuse)", gm, attrs, measured)
                   + "\n## regions and decisions\n" + "\n".join(_region_lines(regions, decisions))
                   + "\n\n## region programs\n" + "\n".join(programs))
    in_regions = {m.name for r in regions for m in r.members}
    dense_ops = [describe(n) for n in gm.graph.nodes
                 if n.op in ("call_function", "call_method") and n.name not in in_regions
                 and op_of(n).name != "aten.getitem"]
    # estimated before the rewrite changes the regions' users (the kernels compiled ahead need it)
    grad_densities = {r.name: grad_density(r.root, attrs) for r in regions if r.fused is not None} if training else {}
    rewrite(gm, regions)
    if dump:
        dump.write("rewrite", _graph_and_table("after rewrite: what Inductor (or eager) gets", gm, attrs))
    report = GraphReport(regions, decisions, attrs, before, str(gm.graph), threshold, opts, dense_ops,
                         grad_densities=grad_densities)
    for body, body_inputs in _checkpointed_bodies(gm, example_inputs):
        # A block under torch.utils.checkpoint is a graph of its own, which the HOP runs forward and runs
        # again in the backward pass: its regions are found in it, with the values the block gets.
        sub = transform(body_inputs[0], body_inputs[1], opts, dump, attention=attention, chains=chains,
                        name_prefix=f"{name_prefix}{body}.")
        body_inputs[0].recompile()
        report.regions += sub.regions
        report.decisions += sub.decisions
        report.dense_ops += sub.dense_ops
        report.grad_densities.update(sub.grad_densities)
    return report


def _checkpointed_bodies(gm: fx.GraphModule, example_inputs) -> list:
    """[(name, (body GraphModule, its example inputs))] for each block torch.utils.checkpoint wraps (Dynamo's
    tag_activation_checkpoint calls), its inputs taken from a run of the graph on cloned example inputs (the
    RNG state put back, as for the example run)."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    calls = [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop
             and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
    if not calls:
        return []
    seen: dict = {}

    class Catch(fx.Interpreter):
        def run_node(self, n):
            if n in calls and n.args[0].target not in seen:
                args, _ = self.fetch_args_kwargs_from_env(n)
                seen[n.args[0].target] = [
                    a.detach().clone() if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
                    else a for a in args[1:]]
            return super().run_node(n)

    state = torch.random.get_rng_state()
    try:
        with torch.no_grad():
            Catch(gm).run(*_cloned_inputs(example_inputs))
    finally:
        torch.random.set_rng_state(state)
    return [(name, (getattr(gm, name), inputs)) for name, inputs in seen.items()
            if isinstance(getattr(gm, name, None), fx.GraphModule)]


# --- kernels compiled ahead of the first call, with progress on a terminal ----------------------------------

def _hint(n) -> int:
    if isinstance(n, torch.SymInt):
        return int(n.node.hint) if n.node.hint is not None else 1
    return int(n)


def _region_kernels(r, training: bool, grad_density: float = 1.0) -> list[str]:
    """The specs of the kernels a region will run on its sparse path: its own, and in training its gradient
    programs' (C++ plans them as the calls will, from the estimated densities; `grad_density`: the output
    gradient's)."""
    if r.chain is not None:
        return []  # grouped dense products: no kernel
    if r.fused is None:
        q, k, v, _, _ = r.attention
        shapes = [tuple(_hint(d) for d in example(t).shape) for t in (q, k, v)]
        return attention.kernel_specs(*shapes, example(q).dtype, training)
    f = r.fused
    p = f.program
    text = p.text()
    if region.grouped_plan(p.product()[0].text()) is not None and config.dispatch_mode() != "sparse":
        return []  # likely to run as grouped dense products, no kernel
    values = [example(leaf) for leaf in f.leaves]
    shapes = [tuple(_hint(d) for j, d in enumerate(v.shape) if j not in f.squeeze[k]) for k, v in enumerate(values)]
    dtype = None
    for o, v in zip(p.operands, values):
        if o.kind != "pattern" and v.is_floating_point():
            dtype = v.dtype if dtype is None else torch.promote_types(dtype, v.dtype)
    dtype = dtype or torch.float32
    grads = [training and v.requires_grad and v.is_floating_point() for v in values]
    densities = [min(max(float(d), 0.0), 1.0) for d in f.densities] if len(f.densities) == len(values) else []
    return region.kernel_specs(text, shapes, dtype, grads, densities, grad_density)


def precompile_regions(regions, training: bool, started: float | None = None, grad_densities=None) -> list[str]:
    """Compile (or load from the disk cache) the kernels the regions will need, a few at a time, showing
    "kernels compiled k/n" on a terminal once the compile has taken a second. Returns the specs. A kernel that
    fails to build is only logged here: its first call reports the error."""
    logger = _log.get("backend")
    specs: list[str] = []
    for r in regions:
        try:
            found = _region_kernels(r, training, (grad_densities or {}).get(r.name, 1.0))
        except Exception as e:  # noqa: BLE001 - compiling ahead is an optimization; the calls plan again
            logger.debug("%s: no kernel compiled ahead (%s)", r.title, e)
            continue
        specs += [s for s in found if s not in specs]
    if not specs:
        return specs
    workers = max(1, min(len(specs), os.cpu_count() or 1, 4))
    progress = _log.Progress("kernels compiled", len(specs), started)
    t = time.perf_counter()
    try:
        progress.update(0)
        for i in range(0, len(specs), workers):
            chunk = specs[i:i + workers]
            try:
                _C.compile_kernels(chunk, workers)
            except Exception as e:  # noqa: BLE001
                logger.warning("a kernel failed to compile ahead of use (its first call will say why): %s",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
            progress.update(i + len(chunk))
    finally:
        progress.close()
        _log.drain()  # what the runtime said of each kernel
    logger.debug("%d kernel(s) compiled or loaded in %.2f s", len(specs), time.perf_counter() - t)
    return specs


def _log_report(number: int, report: GraphReport, seconds: float) -> None:
    logger = _log.get("backend")
    if not logger.isEnabledFor(20):
        return
    logger.info("graph %d: %d region(s), %d contraction(s) left dense (threshold %.3g), %.2f s",
                number, len(report.regions), len(report.decisions), report.threshold, seconds)
    for line in _region_lines(report.regions, report.decisions):
        logger.info("  %s", line)


def scorch(gm: fx.GraphModule, example_inputs, options=None, **kwargs):
    """The backend function torch.compile calls (registered as "scorch")."""
    if kwargs.get("mode") not in (None, "default"):
        raise ValueError(f"the scorch backend has no mode {kwargs['mode']!r}: torch.compile's modes set Inductor's "
                         "own options (CUDA graphs, autotuning); leave mode unset, and give Scorch's settings as "
                         f"options={{...}} (keys: {', '.join(DEFAULT_OPTIONS)})")
    opts = _options(options)
    # The graph as Dynamo gave it, kept only where a weight taken as dense may later be sparse (redecide.py).
    pristine = redecide.pristine_copy(gm) if opts["redecide"] and _all_cpu(example_inputs) else None
    compiled, report = _compile(gm, example_inputs, opts)
    watch = redecide.watched_inputs(pristine, example_inputs, report.attrs) if pristine is not None and report else []
    if watch:
        compiled = redecide.Redeciding(compiled, pristine, example_inputs, watch, float(opts["sparse_threshold"]),
                                       lambda g, inputs: _compile(g, inputs, opts)[0])
    return _sparse_gradients_accepted(compiled) if _may_return_sparse(gm) else compiled


class _GradientOntoPattern(torch.autograd.Function):
    """Identity on a SparseTensor that a compiled graph returns with a gradient wanted; its backward hands the
    graph the gradient as a SparseTensor of that pattern. AOTAutograd traces a subclass output's gradient as the
    subclass and cannot take another type at run time, while the gradient that reaches such an output is dense
    whenever the code after the graph is an ordinary op (`out.sum()`, `out.square()`: their formulas give dense
    gradients): `backward()` raised "Expected a SparseTensor tangent but got a plain Tensor" (helper-65). The
    gradient is read at the stored positions, as an eager result's is (_FromValues)."""

    @staticmethod
    def forward(ctx, x):
        ctx.pattern = x
        # (the executor's constructor of results, which trusts the buffers: SparseTensor() costs ~8 us more)
        return _wrap_result(x.format.canonical, x.shape, x._buffer_list(), x._values.detach(), x._checked_versions)

    @staticmethod
    def backward(ctx, grad):
        return _onto_pattern(ctx.pattern, grad)


def _may_return_sparse(gm: fx.GraphModule) -> bool:
    """Whether the graph may return a SparseTensor (by Dynamo's example values; True where one is missing): only
    then is the compiled function wrapped (a dense model's calls pay nothing for it)."""
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if not outputs:
        return True
    nodes: list[fx.Node] = []
    fx.node.map_arg(outputs[0].args, nodes.append)
    for n in nodes:
        v = n.meta.get("example_value", n.meta.get("val"))
        if v is None or isinstance(v, SparseTensor):
            return True
    return False


def _sparse_gradients_accepted(compiled):
    """`compiled`, its SparseTensor outputs that require grad passed through _GradientOntoPattern."""
    def run(*args):
        out = compiled(*args)
        if not isinstance(out, (tuple, list)):
            return out
        wrapped = None
        for k, o in enumerate(out):
            # (type() first: a SparseTensor's attributes go through __torch_function__, about 0.7 us each)
            if type(o) is SparseTensor and o.requires_grad:
                wrapped = list(out) if wrapped is None else wrapped
                wrapped[k] = _GradientOntoPattern.apply(o)
        return out if wrapped is None else type(out)(wrapped)

    return run


def _compile(gm: fx.GraphModule, example_inputs, opts: dict):
    """The compiled graph and what the passes did (None when they did not run)."""
    started = time.perf_counter()
    debug = _log.sync()
    report = None
    if _all_cpu(example_inputs):
        dump = None
        if debug >= 2:
            try:
                dump = _log.GraphDump()
            except OSError as e:  # an unwritable dump folder must not stop the compile
                _log.get("backend").warning("no graph dumps: %s", e)
        report = transform(gm, example_inputs, opts, dump)
        for rec in _recorders:
            rec.append(report)
        number = dump.number if dump is not None else next(_graph_numbers)
        _log_report(number, report, time.perf_counter() - started)
        if report.regions and config.dispatch_mode() != "dense":
            report.kernels = precompile_regions(report.regions, torch.is_grad_enabled(), started,
                                                report.grad_densities)
    # SparseTensor products take the eager rules (gradients at stored positions), not ATen's formulas

    route_sparse_calls(gm)
    if opts["fallback"] == "eager":
        return gm.forward, report
    from torch._inductor.compile_fx import compile_fx

    try:
        with torch.compiler.config.patch(cache_key_tag=_cache_key_tag()):
            return compile_fx(gm, example_inputs), report
    except Exception as e:  # noqa: BLE001 - re-raised unless it is the one kind below
        if not _data_dependent(e):
            raise
        # A size only known from data (the entry count of a sparse product) that AOTAutograd's tracing must
        # branch on: training through `torch.sparse.mm(A, B).to_dense()` failed to compile (helper-48), where
        # eager runs it. The graph runs as it stands (its Scorch ops still compiled kernels), as eager would.
        _log.get("backend").warning("Inductor cannot compile this graph (%s: %s); it runs uncompiled around its "
                                    "Scorch ops", type(e).__name__, str(e).splitlines()[0][:200])
        return gm.forward, report


@functools.lru_cache(maxsize=1)
def _native_digest() -> str:
    """A digest of Scorch's op schemas and of its native libraries' bytes (read once a process, ~10 ms)."""
    from scorch_backend import _C
    from scorch_backend._native import ops_library_path

    h = hashlib.sha256()
    h.update("\n".join(sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("scorch::"))).encode())
    for path in (ops_library_path(), _C.__file__):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _cache_key_tag() -> str:
    """The user's cache tag with a digest of Scorch's op schemas and native libraries appended, for the
    Inductor and AOTAutograd caches while this backend compiles. Their keys hold a graph's code, not what the
    custom ops it calls do when traced: after a Scorch upgrade that changed a schema (to_dense's sizes int[] ->
    SymInt[]) a warm cache handed back graphs traced against the old one (sizes specialized to the first
    shape, and the call failed), and after one that changed the gradient programs the C++ side writes while
    AOTAutograd traces the backward, a warm cache handed back the old backward graph."""
    user = torch.compiler.config.cache_key_tag
    return f"{user}|scorch-{_native_digest()}" if user else f"scorch-{_native_digest()}"


def _data_dependent(e: BaseException) -> bool:
    """Whether e, or an exception it came from, is torch's error for a branch on a data-dependent size."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = set()
    while e is not None and id(e) not in seen:
        # Also an op whose output's size depends on the data (aten.nonzero, scorch.pack), met while tracing the
        # backward of a product whose n:m or BSR operand the planner converts (helper-72).
        if isinstance(e, (GuardOnDataDependentSymNode, DynamicOutputShapeException, DataDependentOutputException)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


try:  # also reachable without the entry point (a source checkout that is not installed)
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "scorch" not in _BACKENDS:
        register_backend(name="scorch")(scorch)
except Exception:  # noqa: BLE001 - registration by entry point still works
    pass
