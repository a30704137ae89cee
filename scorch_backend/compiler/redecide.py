"""Graphs compiled on dense weights, decided again when their weights change.

The backend decides which weights are sparse from their values when Dynamo hands it a graph. Dynamo does not
compile again when those values change: weights are graph inputs, guarded by shape and dtype, not by value. So
a model compiled with dense weights and then pruned (a pruned checkpoint loaded with `load_state_dict`), or a
second instance of the same class with pruned weights (Dynamo reuses the first instance's graph), ran the dense
graph for good: 20x slower than the same model compiled after pruning (helper-43 F2).

`Redeciding` wraps the compiled graph. At most every `RECHECK_S` seconds it looks at the weights the graph
took as dense (their identity and version counter: a few attribute reads); when one has changed, it samples
its density, and where a weight has become sparse the graph is compiled again from its original form with
the current inputs as examples (each such set of decisions once: `MAX_VARIANTS` at most). A weight that
becomes dense needs nothing: a region measures its compressed operands at every call and runs dense where they
are not sparse.

Either graph computes the same values; only speed depends on the choice, so a change is seen at most
`RECHECK_S` late. Graphs with symbolic sizes (dynamic shapes) are not wrapped: recompiling them from concrete
inputs would specialise them.
"""

from __future__ import annotations

import copy
import math
import threading
import time

import torch
from torch import fx

from .. import log as _log

RECHECK_S = 0.5  # how often a graph looks at its weights (tests set 0)
MAX_VARIANTS = 4  # sets of decisions compiled per graph
SAMPLE = 4096  # values read to estimate a weight's density


def sampled_density(t: torch.Tensor) -> float:
    """A weight's density from about SAMPLE values, spread with a step coprime with its row length (a step
    that divides the row would read only a few columns, and miss a column-pruned pattern)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0
    step = max(1, n // SAMPLE)
    row = t.shape[-1] if t.dim() else 1
    while step > 1 and math.gcd(step, row) != 1:
        step += 1
    s = flat[::step]
    return float(torch.count_nonzero(s)) / s.numel()


def watched_inputs(gm: fx.GraphModule, example_inputs, attrs: dict) -> list[int]:
    """The graph inputs that are weights the passes measured dense: the ones a later change may make sparse."""
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        return []  # symbolic sizes among the inputs: not wrapped
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for k, (node, value) in enumerate(zip(placeholders, example_inputs)):
        a = attrs.get(node.name)
        if a is None or not getattr(a, "weight", False) or a.sparse:
            continue
        if isinstance(value, torch._subclasses.FakeTensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
            continue
        if value.is_inference():  # no version counter: made under inference mode, not changed in place later
            continue
        if value.dim() >= 2 and value.is_floating_point() and value.layout == torch.strided:
            out.append(k)
    return out


# Every failed recompile's error, in order (results stay right when one fails, so only this and the warning show
# it; the tests read it).
FAILURES: list[str] = []


def pristine_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph (and of its subgraphs: checkpointed blocks) that the passes' in-place rewrite leaves
    as Dynamo gave it; tensors held as attributes are shared, not copied."""
    graph = copy.deepcopy(gm.graph)
    # What Dynamo set on nodes as plain attributes (a placeholder's `_dynamo_source`, which AOTAutograd asserts
    # on when the module has `_param_name_to_source`) is not carried by the deep copy: every recompile under the
    # default fallback failed on it (helper-48).
    for old, new in zip(gm.graph.nodes, graph.nodes):
        for name, value in getattr(old, "__dict__", {}).items():
            if name.startswith("_dynamo") and not hasattr(new, name):
                setattr(new, name, value)
    out = fx.GraphModule(gm, graph)
    out.meta = copy.copy(gm.meta)  # (what Dynamo recorded: AOTAutograd reads it)
    if hasattr(gm, "_param_name_to_source"):
        out._param_name_to_source = gm._param_name_to_source
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            setattr(out, name, pristine_copy(child))
    return out


class Redeciding:
    """The compiled graph, compiled again when a weight it took as dense has become sparse."""

    def __init__(self, compiled, pristine: fx.GraphModule, example_inputs, watch: list[int], threshold: float,
                 compile_again):
        self._current = compiled
        self._pristine = pristine
        self._watch = watch
        self._threshold = threshold
        self._compile_again = compile_again  # (graph module, example inputs) -> compiled callable
        self._variants = {tuple(False for _ in watch): compiled}
        self._seen = [self._identity(example_inputs[k]) for k in watch]
        self._next_check = time.monotonic() + RECHECK_S
        self._lock = threading.Lock()

    @staticmethod
    def _identity(t: torch.Tensor):
        # (an inference tensor has no version counter: another instance's weights made under inference mode)
        return id(t), -1 if t.is_inference() else t._version, t.data_ptr()

    def __call__(self, *args):
        if time.monotonic() >= self._next_check:
            self._check(args)
        return self._current(*args)

    def _check(self, args) -> None:
        # One thread checks (and compiles) at a time; the others go on with the graph they have meanwhile.
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._next_check = time.monotonic() + RECHECK_S
            seen = [self._identity(args[k]) for k in self._watch]
            if seen == self._seen:
                return
            self._seen = seen
            decisions = tuple(sampled_density(args[k]) < self._threshold for k in self._watch)
            fn = self._variants.get(decisions)
            if fn is None:
                if len(self._variants) >= MAX_VARIANTS:
                    return
                _log.get("backend").info("a weight compiled as dense is now sparse: compiling the graph again")
                try:
                    fn = _compile_beside_other_threads(self._compile_again, pristine_copy(self._pristine),
                                                       list(args))
                except Exception as e:  # noqa: BLE001 - the graph in use is still right: keep it, say why
                    FAILURES.append(f"{type(e).__name__}: {e}")
                    del FAILURES[:-100]  # (the last hundred: a long-lived process must not grow it for good)
                    _log.get("backend").warning("compiling the graph again for its sparse weights failed (%s: %s);"
                                                " it keeps its dense decisions", type(e).__name__, e)
                    fn = self._current
                self._variants[decisions] = fn
            self._current = fn
        finally:
            self._lock.release()


def _compile_beside_other_threads(compile_again, gm, args):
    """Compile outside Dynamo while other threads may be running compiled code. AOTAutograd's tracing raises a
    process-wide flag that Dynamo's wrapper reads on every thread: unless a compile session is open (as Dynamo
    opens one for its own compiles), any compiled call starting meanwhile raised "Detected that you are using
    FX to symbolically trace a dynamo-optimized function" (helper-46: 10% of a serving thread pool's calls for
    4 s). The session is torch's private context manager; without it, the compile runs as before. Like any
    Dynamo compile, it makes `torch.compiler.is_compiling()` true on every thread meanwhile, so other threads'
    eager Scorch calls take their traced paths for that time (the kernel without the cost model; a
    SparseTensor's `layout` reads strided): the same values, at another speed (helper-47)."""
    import contextlib

    session = getattr(torch.compiler, "_compile_session_context", None)
    with session() if session is not None else contextlib.nullcontext():
        return compile_again(gm, args)
