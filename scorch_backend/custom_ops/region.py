"""`scorch::region`: one fused sparse region of a compiled model, run as a single torch op.

The backend's fuse pass turns a region of a model's graph into one einsum over the region's inputs (dense
tensors in the graph: weights, activations, masks) and says how each input is to be used:

- "dense": as it is;
- "sparse": its zeros are worth skipping: it is compressed (CSR, batched CSR for more dimensions) and the
  product runs as a Scorch kernel that walks only its nonzeros;
- "pattern": only its nonzero pattern matters, as a 0/1 factor. The fuse pass adds such a factor when another
  input is known to be zero wherever this one is (a ReLU of a product with a one-hot mask, a softmax of
  scores filled with -inf outside a mask), so the kernel skips those zeros without compressing the big input;
- "add": not a factor but an addend of the result (a linear's bias, a residual): its letters are output
  letters, it is broadcast along the others and added to the product (after its coefficient) in the same op
  call. Its gradient is the output's, summed along the letters it lacks.

The program is a JSON text built by the fuse pass from the parsed graph (never from user text). At run time
the op measures the densities of its sparse inputs (graph inputs, weights and data, are compressed once per
version of the tensor and checked by a fingerprint, so weights updated in place by an optimizer are
recompressed, never used stale; see the cache below) and runs the sparse kernel, grouped dense products
(one-hot dispatch), or, where the data is not sparse enough to pay, `torch.einsum` on the dense tensors.

Its gradient is the einsum's: the gradient of input k is the einsum of the output gradient with the other
inputs, run through this same op, so sparse inputs stay sparse in the backward pass (for y = x W^T with a
pruned W, dx = g W runs sparse, dW = g^T x dense: W is a dense tensor to autograd, as in eager mode).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .. import _C
from .. import log as _log
from ..tensors.frontend import kernel_info, plan_einsum
from ..tensors.sparse_tensor import SparseTensor

_INDEX_DTYPE = torch.int32


@dataclass(frozen=True)
class Operand:
    letters: str
    kind: str = "dense"  # "dense" | "sparse" | "pattern" | "add" | "mask" (the C++ op's run-time form of a pattern)
    cached: bool = False  # a parameter or buffer: compress once per version of the tensor
    grad: bool = True  # False for pattern factors: the pattern is piecewise constant
    expand: int = 0  # pattern factors: leading letters the tensor does not have (broadcast along them)
    weight: bool = False  # a parameter or buffer: with frozen_weights, checked by version counter only
    # Packed (a rewritten model's weight stored compressed; scorch_backend/compiler/jit.py): (format text, full size).
    # The operand's slot holds the stored values and its index buffers follow all slots.
    packed: tuple | None = None
    # Its gradient is needed only where it is nonzero (a ReLU's output, a top-k scattered into zeros): the
    # gradient program samples it there, the operand itself joining as a pattern factor. Program text:
    # the program's "masked_grads" list.
    masked_grad: bool = False
    # The operand is relu(tensor): the graph hands the op the ReLU's input and the op applies the ReLU in the
    # pass that measures and compresses it (an inference graph's activation that only this region reads;
    # passes/partition.py: _fold_relus). Not cached, packed or broadcast. Program text: the "relu" list.
    relu: bool = False
    # Pattern or sparse factors: a letter along which every fiber of the operand must hold an entry for the zeros
    # it brings to be right (a softmax of scores masked with -inf is zero outside the mask except in a row the mask
    # leaves empty, which is NaN: compiler/attrs.py, Support.nonempty; a sparse factor gets it when it brings the
    # mask's zeros itself, a gate masked like the scores). The op checks it per call (once per version of a cached
    # tensor) and runs the dense path where it fails. Program text: the "nonempty" list of [index, letter].
    nonempty: str = ""

    @property
    def tensor_letters(self) -> str:
        return self.letters[self.expand:]


@dataclass(frozen=True)
class Program:
    operands: tuple[Operand, ...]
    out: str
    coef: float = 1.0
    frozen: bool = False  # weight operands skip the fingerprint check (options={"frozen_weights": True}): for
    # weights that do not train (a fused optimizer step does not move the version counter)
    name: str = ""
    label: str = ""  # where the region comes from, for people: "fc1 (Linear): linear" (logs, profiler rows)
    # The output's gradient is mostly zeros (the region feeds a ReLU or a top-k measured sparse): the gradient
    # programs take it compressed (text: "grad_out": "sparse"). The run-time choice still decides per call.
    sparse_grad_out: bool = False
    # The result comes back contiguous in `out`'s order, not as a permuted view of the kernel's storage order:
    # a `view` reads it, or it leaves the graph (compiler/passes/fuse.py: _layout_matters). Text: "out_order".
    requested_order: bool = False

    @property
    def equation(self) -> str:
        """The product's einsum, then its addends: "ab,cb->ac + c"."""
        factors = ",".join(o.tensor_letters for o in self.operands if o.kind != "add") + "->" + self.out
        return factors + "".join(f" + {o.letters}" for o in self.operands if o.kind == "add")

    @property
    def addends(self) -> tuple[int, ...]:
        """Indices of the operands that are added, not multiplied."""
        return tuple(k for k, o in enumerate(self.operands) if o.kind == "add")

    def product(self) -> tuple["Program", tuple[int, ...]]:
        """The program without its addends, and the indices (here) of the operands it keeps: what the op runs
        and differentiates before it adds them."""
        keep = tuple(k for k, o in enumerate(self.operands) if o.kind != "add")
        if len(keep) == len(self.operands):
            return self, keep
        return Program(tuple(self.operands[k] for k in keep), self.out, self.coef, self.frozen, self.name,
                       self.label, self.sparse_grad_out, self.requested_order), keep

    @property
    def title(self) -> str:
        """The name and label: "region0 fc1 (Linear): linear"."""
        return f"{self.name} {self.label}".strip() or "region"

    def text(self) -> str:
        d = {"operands": [[o.letters, o.kind, o.cached, o.grad, o.expand, o.weight]
                          + ([{"format": o.packed[0], "size": list(o.packed[1])}] if o.packed else [])
                          for o in self.operands],
             "out": self.out, "coef": self.coef, "frozen": self.frozen, "name": self.name}
        if self.label:
            d["label"] = self.label
        if self.sparse_grad_out:
            d["grad_out"] = "sparse"
        if self.requested_order:
            d["out_order"] = "requested"
        masked = [k for k, o in enumerate(self.operands) if o.masked_grad]
        if masked:
            d["masked_grads"] = masked
        relus = [k for k, o in enumerate(self.operands) if o.relu]
        if relus:
            d["relu"] = relus
        nonempty = [[k, o.nonempty] for k, o in enumerate(self.operands) if o.nonempty]
        if nonempty:
            d["nonempty"] = nonempty
        return json.dumps(d, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def parse_program(text: str) -> Program:
    d = json.loads(text)
    masked = set(d.get("masked_grads", ()))
    relus = set(d.get("relu", ()))
    nonempty = {int(k): str(c) for k, c in d.get("nonempty", ())}
    ops = tuple(Operand(o[0], o[1], bool(o[2]), bool(o[3]), int(o[4]), bool(o[5]),
                        (o[6]["format"], tuple(int(n) for n in o[6]["size"])) if len(o) > 6 else None,
                        k in masked, k in relus, nonempty.get(k, ""))
                for k, o in enumerate(d["operands"]))
    prog = Program(ops, d["out"], float(d["coef"]), bool(d["frozen"]), d.get("name", ""), d.get("label", ""),
                   d.get("grad_out", "dense") == "sparse", d.get("out_order", "storage") == "requested")
    _validate(prog)
    return prog


def _validate(p: Program) -> None:
    seen = set()
    for o in p.operands:
        if o.kind not in ("dense", "sparse", "pattern", "add", "mask"):
            raise ValueError(f"scorch::region: unknown operand kind {o.kind!r}")
        if o.kind == "mask" and (o.expand or o.packed or o.masked_grad or o.grad or sorted(o.letters) != sorted(p.out)):
            raise ValueError(f"scorch::region: a mask has the output's letters ({p.out!r}), got {o.letters!r}")
        if o.relu and (o.kind not in ("sparse", "dense") or o.cached or o.expand or o.packed):
            raise ValueError("scorch::region: only a sparse or dense operand that is neither cached, packed nor "
                             "broadcast can be a ReLU's output")
        if o.kind == "add" and (o.expand or o.packed or o.masked_grad or not set(o.letters) <= set(p.out)):
            raise ValueError(f"scorch::region: addend letters {o.letters!r} must be output letters ({p.out!r})")
        if not all(c.isalpha() and c.isascii() for c in o.letters) or len(set(o.letters)) != len(o.letters):
            raise ValueError(f"scorch::region: bad operand letters {o.letters!r}")
        if o.expand and (o.kind != "pattern" or o.expand > len(o.letters)):
            raise ValueError("scorch::region: only pattern operands broadcast")
        if o.nonempty and (o.kind not in ("pattern", "sparse") or o.relu or len(o.nonempty) != 1
                           or o.nonempty not in o.tensor_letters):
            raise ValueError(f"scorch::region: a nonempty letter names one of a pattern's or sparse operand's own "
                             f"letters, got {o.nonempty!r} for {o.kind} operand {o.letters!r}")
        seen.update(o.letters)
    if not set(p.out) <= seen or len(set(p.out)) != len(p.out):
        raise ValueError(f"scorch::region: bad output letters {p.out!r} for {p.equation}")
    if all(o.kind == "add" for o in p.operands):
        raise ValueError("scorch::region: a program of addends only has no product")


# --- layouts ---------------------------------------------------------------------------------------------
# The kernel's loop order puts the compressed operands' dimensions outermost, then the output's in storage
# order; dense operands are laid out in it and the output is stored in it, handed back as a permuted view. The
# C++ op owns that rule (csrc/torch/region.cpp: derive); tools read it from there.

@functools.lru_cache(maxsize=4096)
def layout(text: str) -> dict:
    """The program's loop letters, output storage letters and permutation back, kernel equation and letters."""
    return _C.region_layout(text)


def _out_storage(text: str) -> tuple[str, tuple[int, ...]]:
    lay = layout(text)
    return lay["storage"], tuple(lay["back"])


# --- compressed operands, cached by tensor version ------------------------------------------------------
# Graph inputs (weights, buffers, data) are compressed once per version. The key is the memory and layout
# (data pointer, shape, strides, dtype), not the Python object: AOTAutograd hands the backward pass other
# tensor objects (aliases) for the same weight. An alias shares the version counter, so an in-place update
# through torch is seen. Writes that bypass the counter (through .data, or a numpy view of the memory) are
# caught by a fingerprint checked on every hit: 32 entries spread over the tensor and the first nonzero after
# each. Bulk rewrites (an optimizer step, a pruning pass, a new batch) change it; torch's fused optimizers write
# without moving the version counter, and a masked fine-tune changes only a pruned weight's nonzeros, which is
# why the fingerprint holds some. A rewrite of only a few entries outside the fingerprint through .data would not
# be seen; update tensors through torch ops (or in torch.no_grad()).
# frozen_weights=True skips the fingerprint for weights and checks only the version counter: for weights that do
# not train (a fused optimizer step, .data and numpy writes go unseen there).
# The entry holds the tensor's storage weakly and checks it on every hit: an unrelated tensor that later gets the
# same memory has another storage, and a dropped model's weights are freed (their entries go when the next entry
# is made). It held an alias until 2026-11-29, which kept up to 512 dropped weights in memory.
# Weights keep the MAX_WEIGHTS most recently used entries; data inputs only MAX_INPUTS (a new batch is a new
# tensor: its entry serves the backward pass and repeated calls on the same input, then goes).
# The cache lives in C++ (csrc/torch/region.cpp): 512 weights, 8 data inputs, 32 fingerprint entries.
# An entry keeps the four most recently used of its forms sized by the call (a mask's pattern broadcast over the
# batch, its transpose for the backward): one per batch size met grew without bound (_C.region_cache_sizes()
# counts the forms).


class _Stats(Mapping):
    """Counters of the C++ region op: compressions, cache_hits, sparse_runs, dense_runs, grouped_runs."""

    def __getitem__(self, key):
        return _C.region_stats()[key]

    def __iter__(self):
        return iter(_C.region_stats())

    def __len__(self):
        return len(_C.region_stats())


stats = _Stats()


def kernel_spec(text: str, shapes, dtype: torch.dtype) -> str | None:
    """The spec of the kernel `run` would use on the sparse path for operands of these shapes (as the op
    receives them) and result dtype, found without data: for compiling kernels ahead of the first call.
    None when the program has no compressed operand (it never runs a kernel)."""
    specs = kernel_specs(text, shapes, dtype)
    return specs[0] if specs else None


def kernel_specs(text: str, shapes, dtype: torch.dtype, grads=(), densities=(), grad_density: float = 1.0) -> list[str]:
    """Every kernel spec a call runs on its sparse path: the forward's, and the gradient programs' of the
    operands flagged in `grads` (one bool per operand), as the C++ backward runs them. The run path's own
    planning (csrc/torch/region_kernels.h), so the prediction cannot drift from it. The planner weighs stored
    entries: `densities` (per operand) and `grad_density` (the output gradient's) are the estimates it takes."""
    return _C.region_kernel_specs(text, [[int(n) for n in s] for s in shapes], dtype, [bool(g) for g in grads],
                                  [float(d) for d in densities], float(grad_density))


def grouped_plan(text: str):
    """(index of S, p, q) when the program can run grouped by its sparse 2-D factor S(p, q) (one-hot expert
    dispatch: one dense product per group q over the rows p where S(:, q) is nonzero), else None. The C++ grouped
    runner's own rule (csrc/torch/chain_program.cpp)."""
    return _C.region_grouped_plan(text)


def choose_path(text: str, operands) -> str:
    """The path the op takes for these operands: "dense", "sparse" or "grouped"."""
    return _C.region_choose(text, list(operands))


def run(text: str, operands: list[torch.Tensor], force: str | None = None) -> torch.Tensor:
    """Run a region program (below autograd); `force` ("dense", "sparse" or "grouped") overrides the choice."""
    return _C.region_run(text, list(operands), force or "")


_logger = _log.get("region")
_PATHS = {"sparse": "the sparse kernel", "dense": "the dense einsum (not sparse enough to pay)",
          "grouped": "grouped dense products (one per group of rows)"}


def _log_path(text: str, path: str, densities_, operands) -> None:
    """The run-time path (the C++ op calls this while SCORCH_DEBUG >= 1): once per region and path at INFO (it
    changes only when the data does), every call at DEBUG; at SCORCH_DEBUG=2 the sparse kernel's loop IR is
    dumped (once per kernel)."""
    _log.sync()
    p = parse_program(text)
    if path == "sparse" and _log.dumping():
        eq, args = _C.region_sparse_call(text, list(operands))
        note_kernel(p.title, eq, args)
    densities = ", ".join(f"{d:.3g}" for d in densities_)
    how = _PATHS.get(path, path) if densities else "the dense einsum (no compressed operand)"
    if not _log.once(_logger, (text, path), "%s runs %s%s", p.title, how,
                     f" (densities of its compressed operands: {densities})" if densities else ""):
        _logger.debug("%s: %s, densities %s", p.title, path, densities)
    _log.drain()  # the kernels this path loaded, from the C++ runtime


def note_kernel(user: str, eq: str, args, out_format="dense") -> None:
    """At SCORCH_DEBUG=2, write the loop IR of the kernel that `eq` on `args` runs into the dump folder (once
    per kernel) and log its plan."""

    try:
        plan = plan_einsum(eq, *args, out_format=out_format)
        info = kernel_info(plan["spec"])
        path = _log.dump_kernel(plan["spec"], info, user)
    except Exception as e:  # noqa: BLE001 - a dump must never change what runs; the call itself will report
        _log.get("kernel").warning("could not dump the kernel of %s (%s): %s", user, eq, e)
        return
    if path is not None:
        _log.get("kernel").debug("%s: %s -> %s\n  spec: %s%s", user, eq, plan["statement"], plan["spec"],
                                 "".join(f"\n    - {r}" for r in plan["reasons"]))


def _owning(view: torch.Tensor) -> torch.Tensor:
    """The same memory and strides as a tensor of its own, not a view: autograd forbids in-place updates of a
    custom op's output that is a view (out += b after a region, under the eager fallback)."""
    if view._base is None:
        return view
    out = view.new_empty(0)
    out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return out


def sparse_plan(text: str, operands) -> dict:
    """What the sparse kernel of a region does with these operands: the einsum it runs, the formats, and the
    compiler's plan (kernel spec, reasons) and schedule."""

    p = parse_program(text)
    if p.addends:  # the kernel runs the product; the addends are added after it
        p = p.product()[0]
    eq, args = _C.region_sparse_call(text, list(operands))
    densities = [float(a.density) if isinstance(a, SparseTensor) else 1.0 for a in args]
    plan = plan_einsum(eq, *args, out_format="dense")
    info = kernel_info(plan["spec"])
    return {"equation": eq, "formats": [str(a.format) if hasattr(a, "format") else "dense" for a in args],
            "densities": [d if o.kind != "dense" else 1.0 for d, o in zip(densities, p.operands)],
            "statement": plan["statement"],
            "spec": plan["spec"], "reasons": list(plan["reasons"]) + list(info["reasons"]),
            "schedule": info["schedule"]}


class _Captures(list):
    """Recorders of region operands (explain): the C++ op calls back only while one is registered."""

    def append(self, rec) -> None:
        super().append(rec)
        _C.region_capture(True)

    def remove(self, rec) -> None:
        super().remove(rec)
        _C.region_capture(bool(self))


_captures = _Captures()


def _capture_hook(text: str, operands) -> None:
    for rec in list(_captures):
        rec.append((text, [t.detach() for t in operands]))


# --- the op ----------------------------------------------------------------------------------------------
# scorch::region is a C++ op (csrc/torch/region.cpp): CPU, Meta and Autograd kernels; its gradient is another
# region call; its grouped path is the C++ grouped runner (csrc/torch/grouped.cpp). Python supplies explain's
# recording and the log lines through these hooks.
region = torch.ops.scorch.region


def profile_name(text: str) -> str:
    """The profiler row of a region: "scorch::region region0 fc1 (Linear): linear"."""
    return f"scorch::region {layout(text)['title']}"


def _log_measured(text: str, decision: str, first_ms: float, second_ms: float) -> None:
    """A decision made by timing (the C++ op calls this once per region, size bucket and pair of paths;
    SCORCH_MEASURE). `decision`: the path kept ("sparse", "grouped": against dense), or "winner>loser" for
    "dense>sparse", "dense>grouped" (first_ms is the loser's), "grouped>sparse" and "sparse>grouped" (first_ms
    is grouped's)."""
    p = parse_program(text)
    if decision.startswith("dense>"):
        _logger.info("%s: runs dense at these sizes: measured %.3f ms dense against %.3f ms for %s", p.title,
                     second_ms, first_ms, _PATHS[decision[len("dense>"):]])
    elif decision in ("grouped>sparse", "sparse>grouped"):
        winner = decision.split(">")[0]
        grouped_ms, sparse_ms = first_ms, second_ms
        _logger.info("%s: prefers %s to %s at these sizes: measured %.3f ms grouped against %.3f ms for the "
                     "kernel", p.title, _PATHS[winner], _PATHS["sparse" if winner == "grouped" else "grouped"],
                     grouped_ms, sparse_ms)
    else:
        _logger.info("%s: runs %s at these sizes: measured %.3f ms against %.3f ms dense", p.title,
                     _PATHS[decision], first_ms, second_ms)


_C.install_region_hooks(_capture_hook, _log_path, _log_measured)


def gradient_program(text: str, k: int) -> tuple[str, list[int], str]:
    """The program of d out / d operand k (an einsum of the output gradient and the other operands), the
    operands it takes (indices; -1 is the output gradient) and the letters it produces (the C++ op's own)."""
    g, which, produced = _C.region_gradient(text, k)
    return g, list(which), produced


def clear_cache() -> None:
    """Forget every compressed weight (they are rebuilt on next use)."""
    _C.region_clear_cache()


__all__ = ["Operand", "Program", "parse_program", "region", "run", "stats", "clear_cache"]
