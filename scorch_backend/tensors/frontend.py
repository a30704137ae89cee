"""Eager front ends of the sparse compiler: `einsum` and `compute` on any mix of SparseTensors and dense tensors.

A call is handed whole to the C++ executor (`_C.einsum`, `_C.compute`; csrc/torch/executor.h): it plans (parse,
size checks, operand conversions, output format; cached), makes the dense-or-sparse choice and runs the kernel
through `torch.ops.scorch.kernel`, whose autograd is C++ too. Python steps in only where the executor cannot
take the operands as they are: while torch.compile traces (fake tensors, symbolic sizes), for Python numbers,
and for a dense run whose result must be stored sparse (its gradients are gathered here); those calls take
the path below, which plans through the same C++ planner.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from dataclasses import dataclass

import torch

from .. import _C, config, cost_model, log
from .._native import ops
from .format import Format, make_format
from .sparse_tensor import SparseTensor, in_level_order
from torch.fx.experimental.symbolic_shapes import statically_known_true
from .convert import sparse

_COMPUTE_DTYPES = {torch.float64: torch.float64, torch.float32: torch.float32,
                   torch.bfloat16: torch.float32, torch.float16: torch.float32}
_INT32_MAX = 2**31 - 1


@dataclass
class _Operand:
    tensor: torch.Tensor  # SparseTensor or dense
    sparse: bool
    number: bool = False  # a Python number (held as a float64 0-d tensor)

    def desc(self):
        t = self.tensor
        shape = [_concrete(s) for s in t.shape]
        if self.sparse:
            return (t.format.canonical, shape, _concrete(t.nnz))
        return ("strided", shape, math.prod(shape))


def _operand(x, where: str) -> _Operand:
    if isinstance(x, SparseTensor):
        return _Operand(x, True)
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{where} is a torch.sparse tensor ({x.layout}); wrap it with scorch_backend.sparse()")
        if x.device.type != "cpu":
            raise ValueError(f"{where} is on {x.device}; Scorch runs on the CPU")
        if not x.is_floating_point():
            raise TypeError(f"{where} has dtype {x.dtype}; Scorch computes with floating-point values")
        return _Operand(x, False)
    if isinstance(x, numbers.Real):
        return _Operand(torch.tensor(float(x), dtype=torch.float64), False, number=True)
    raise TypeError(f"{where} must be a SparseTensor or a torch.Tensor, got {type(x).__name__}")


def _out_format_text(out_format, rank: int) -> str:
    if out_format is None:
        return ""
    if out_format == "dense" or out_format == "strided" or out_format is torch.strided:
        return "strided"
    return make_format(out_format, rank).canonical


def _result_dtype(operands) -> torch.dtype:
    """torch's rule (all operands are floating point): the operands with dimensions decide; 0-d tensors only
    when there are none; Python numbers only when there is no tensor (then the default dtype). A named scalar
    `s=2.0` promoted a float16 product to float32 where the literal `2 *` did not, and a float64 0-d tensor
    a float32 one to float64 (helper-53)."""
    tiers = ([o for o in operands if not o.number and o.tensor.dim() > 0],
             [o for o in operands if not o.number and o.tensor.dim() == 0])
    for tier in tiers:
        if tier:
            dtype = tier[0].tensor.dtype
            for o in tier[1:]:
                dtype = torch.promote_types(dtype, o.tensor.dtype)
            return dtype
    return torch.get_default_dtype()


def _run(plan: dict, operands: list[_Operand], result_dtype: torch.dtype, idx_dtype: torch.dtype):
    compute = _COMPUTE_DTYPES[result_dtype]
    inputs, layout = [], []
    for o, conv in zip(operands, plan["convert"]):
        t = o.tensor
        if conv == "strided":
            t = t.to_dense() if isinstance(t, SparseTensor) else t
        elif conv:
            t = t.to_format(Format(conv, t.dim()))
        if isinstance(t, SparseTensor):
            t.check_unchanged()
            inputs.extend(b.to(idx_dtype) for b in t.level_buffers.values())
            inputs.append(t.differentiable_values().to(compute))  # gradients flow to the values (and t)
            layout.append((t.format, tuple(t.shape), len(t.format.buffer_names)))
        else:
            inputs.append(t.to(compute))
            layout.append((None, tuple(t.shape), 0))
    if _traced(inputs):
        values, buffers, shape = _run_traced(plan, inputs, layout)
    else:
        values, buffers = ops.kernel(plan["spec"], inputs, plan["var_sizes"], torch.get_num_threads())
        shape = plan["out_shape"]
    if plan["out_format"] == "strided":
        return values.to(result_dtype)
    fmt = Format(plan["out_format"], len(shape))
    values = values.to(result_dtype)
    if values.requires_grad:  # (the result requires grad itself: SparseTensor.with_values)
        return SparseTensor(fmt, shape, buffers, values.detach(), validate=False).with_values(values)
    return SparseTensor(fmt, shape, buffers, values, validate=False)


# --- calls traced by torch.compile, with symbolic sizes ---------------------------------------------------------
# A plan is made from concrete sizes (a symbolic size's hint). The sizes handed to the kernel op must stay
# symbolic, or the traced graph would carry the example's sizes as constants: a graph of another size would
# then run with the wrong sizes (no guard would catch it). So each index variable takes its size from an
# operand dimension it indexes. The op is called below autograd: its C++ autograd takes concrete sizes, so a
# traced call that needs gradients goes through _TracedKernel, whose backward runs the same gradient statements
# (lower/differentiate) as the C++ one, traced with symbolic sizes too.

def _traced(inputs) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in inputs)


@functools.lru_cache(maxsize=4096)
def _statement_info(statement: str, num_tensors: int) -> dict:
    return _C.statement_info(statement, num_tensors)


def _symbolic_sizes(spec: str, planned, shapes) -> list:
    """The plan's index sizes, each replaced by an operand's (symbolic) dimension it indexes where one has the
    same hint. Hints are read without guards."""
    info = _statement_info(spec.split(";", 1)[0], len(shapes))
    sizes = list(planned)
    for vars_, shape in zip(info["tensor_vars"], shapes):
        for v, s in zip(vars_, shape):
            if isinstance(s, torch.SymInt) and not isinstance(sizes[v], torch.SymInt) and _concrete(s) == sizes[v]:
                sizes[v] = s
    return sizes


def _kernel_below_autograd(spec, inputs, sizes, threads):
    with torch._C._AutoDispatchBelowAutograd():
        return ops.kernel(spec, list(inputs), sizes, threads)


def _run_traced(plan: dict, inputs, layout):
    spec = plan["spec"]
    sizes = _symbolic_sizes(spec, plan["var_sizes"], [shape for _, shape, _ in layout])
    out_shape = [sizes[v] for v in _spec_out_vars(spec)]
    threads = torch.get_num_threads()
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out = _TracedKernel.apply(spec, sizes, threads, tuple(layout), plan["out_format"], out_shape, *inputs)
        return out[0], list(out[1:]), out_shape
    values, buffers = _kernel_below_autograd(spec, inputs, sizes, threads)
    return values, list(buffers), out_shape


@functools.lru_cache(maxsize=4096)
def _spec_out_vars(spec: str):
    return tuple(_C.spec_info(spec)["out_vars"])


def _operands_of(layout, tensors) -> list:
    """The kernel's operands again (SparseTensors from their buffers and values), from its flat inputs."""
    out, at = [], 0
    for fmt, shape, nb in layout:
        if fmt is None:
            out.append(tensors[at])
        else:
            out.append(SparseTensor(fmt, shape, list(tensors[at:at + nb]), tensors[at + nb], validate=False))
        at += nb + 1
    return out


def _compute_traced(text: str, operands, out_text: str):
    """Run a canonical statement over t0, t1, ... (a gradient statement) on traced operands, without autograd.
    An operand the statement does not read (a gradient often skips the operand it is for) is passed as a
    0-dimensional zero: the kernel checks each operand against its accesses."""
    rhs = text.split("=", 1)[1]
    operands = [o if re.search(rf"\bt{k}\b", rhs) else torch.zeros((), dtype=o.dtype)
                for k, o in enumerate(operands)]
    ops_ = [_Operand(o, isinstance(o, SparseTensor)) for o in operands]
    dtype = _result_dtype(ops_)
    idx = _index_dtype(ops_)
    names = tuple(f"t{k}" for k in range(len(ops_)))
    plan = _plan_compute_cached(text, names, _frozen(o.desc() for o in ops_), out_text,
                                _COMPUTE_DTYPES[dtype] == torch.float64, idx == torch.int64)
    return _run(plan, ops_, dtype, idx)


class _TracedKernel(torch.autograd.Function):
    """scorch::kernel with symbolic sizes and its gradients, for graphs traced by torch.compile."""

    @staticmethod
    def forward(ctx, spec, sizes, threads, layout, out_format, out_shape, *inputs):
        values, buffers = _kernel_below_autograd(spec, inputs, sizes, threads)
        buffers = list(buffers)
        ctx.spec, ctx.layout, ctx.out_format, ctx.out_shape = spec, layout, out_format, out_shape
        ctx.n_in = len(inputs)
        ctx.out_values_shape = values.shape
        ctx.save_for_backward(*inputs, *buffers)
        ctx.mark_non_differentiable(*buffers)
        return (values, *buffers)

    @staticmethod
    def backward(ctx, grad, *_buffer_grads):
        saved = ctx.saved_tensors
        inputs, out_buffers = saved[:ctx.n_in], list(saved[ctx.n_in:])
        operands = _operands_of(ctx.layout, inputs)
        statement = ctx.spec.split(";", 1)[0]
        n = len(operands)
        if ctx.out_format == "strided":
            grad_out = grad if grad is not None else inputs[-1].new_zeros(ctx.out_shape)
        else:
            fmt = Format(ctx.out_format, len(ctx.out_shape))
            if grad is None:
                grad = inputs[-1].new_zeros(ctx.out_values_shape)
            grad_out = SparseTensor(fmt, ctx.out_shape, out_buffers, grad, validate=False)
        result = [None] * (6 + ctx.n_in)  # spec, sizes, threads, layout, out_format, out_shape, inputs
        at = 0
        for k, (op, (fmt, _shape, nb)) in enumerate(zip(operands, ctx.layout)):
            slot = at + nb
            at = slot + 1
            if not ctx.needs_input_grad[6 + slot]:
                continue
            sparse_op = isinstance(op, SparseTensor)
            values = op.stored_values if sparse_op else op
            g_text = _C.differentiate(statement, n, k, sparse_op)
            if g_text is None:
                result[6 + slot] = torch.zeros_like(values)
                continue
            if not sparse_op:
                g = _compute_traced(g_text, operands + [grad_out], "strided")
                result[6 + slot] = g.to(values.dtype).reshape(values.shape)
                continue
            # Sampled at the operand's pattern and stored in its format, then aligned with its values by a
            # union with explicit zeros (the C++ backward's sparse_gradient, traced).
            pattern = op.with_values(torch.ones_like(values))
            g = _compute_traced(g_text, operands + [grad_out, pattern], fmt.canonical)
            if not isinstance(g, SparseTensor):
                g = SparseTensor(fmt, op.shape, op._buffer_list(), g.reshape(values.shape), validate=False)
            if statically_known_true(g.stored_values.shape[0] == values.shape[0]):
                # a sampled kernel wrote it at the pattern operand's positions: aligned already
                result[6 + slot] = g.stored_values.to(values.dtype)
                continue
            letters = ",".join(f"i{d}" for d in range(op.dim()))
            union = f"g({letters}) = t0({letters}) + t1({letters})" if letters else "g = t0 + t1"
            aligned = _compute_traced(union, [op.with_values(torch.zeros_like(values)), g], fmt.canonical)
            v = aligned.stored_values if isinstance(aligned, SparseTensor) else aligned.reshape(-1)
            torch._check(v.shape[0] == values.shape[0])  # the union of a subset with the pattern is the pattern
            result[6 + slot] = v.to(values.dtype)
        return tuple(result)


@functools.lru_cache(maxsize=4096)
def _plan_einsum_cached(equation, descs, out_text, f64, idx64):
    return _C.plan_einsum(equation, [(f, list(shape), nnz) for f, shape, nnz in descs], out_text, f64, idx64)


@functools.lru_cache(maxsize=4096)
def _plan_compute_cached(text, names, descs, out_text, f64, idx64):
    return _C.plan_compute(text, list(names), [(f, list(shape), nnz) for f, shape, nnz in descs], out_text, f64, idx64)


@functools.lru_cache(maxsize=1024)
def _split_cached(expression, names, shapes):
    return _C.split_compute(expression, list(names), [list(s) for s in shapes])


@functools.lru_cache(maxsize=1024)
def _split_einsum_cached(equation, shapes):
    return _C.split_compute(equation, [], [list(s) for s in shapes], True)


def _frozen(descs):
    return tuple((f, tuple(shape), nnz) for f, shape, nnz in descs)


def _concrete(n) -> int:
    """An int for planning: symbolic sizes (under torch.compile) give their hint, unbacked ones 0."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else 0
    return int(n)


def _index_dtype(operands) -> torch.dtype:
    for o in operands:
        t = o.tensor
        if isinstance(t, SparseTensor) and (t.index_dtype == torch.int64 or _concrete(t.nnz) > _INT32_MAX):
            return torch.int64
        if any(_concrete(s) > _INT32_MAX for s in t.shape):
            return torch.int64
    return torch.int32


def plan_einsum(equation: str, *operands, out_format=None) -> dict:
    """What `einsum` would do: the kernel spec, conversions, output format and the reasons."""
    if not isinstance(equation, str):
        raise TypeError(f"plan_einsum: the equation must be a str such as 'ij,jk->ik', got {type(equation).__name__}")
    ops_ = [_operand(x, f"operand {k}") for k, x in enumerate(operands)]
    dtype = _result_dtype(ops_)
    idx = _index_dtype(ops_)
    rank = _output_rank(equation, ops_)
    return _C.plan_einsum(equation, [o.desc() for o in ops_], _out_format_text(out_format, rank),
                          _COMPUTE_DTYPES[dtype] == torch.float64, idx == torch.int64)


def _output_rank(equation: str, ops_) -> int:
    # Only needed to parse an explicit out_format: ask the planner with a dense output.
    if not isinstance(equation, str):
        raise TypeError(f"equation must be a str, got {type(equation).__name__}")
    p = _C.plan_einsum(equation, [o.desc() for o in ops_], "strided", False, False)
    return len(p["out_shape"])


_is_compiling = torch.compiler.is_compiling  # (Dynamo knows the function itself, under any name)
_get_num_threads = torch.get_num_threads


def einsum(equation: str, *operands, out_format=None):
    """Einstein summation over SparseTensors and dense tensors, compiled to a sparse kernel.

    `equation` is a torch.einsum equation ("ij,jk->ik", implicit output allowed, "..." for leading
    dimensions). The result is a SparseTensor when the computation is sparse (a product with a sparse factor,
    a sum of sparse terms), else a dense tensor; `out_format` ("dense", a preset or format text) overrides it.
    """
    if type(equation) is str and out_format is None and operands and not _is_compiling():
        # The common call goes straight to the executor: every Python step on this path is paid on every call,
        # and after a long kernel each is paid again in cache misses (docs/seam.md, "After a kernel").
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
            if not operands:
                raise ValueError("einsum needs at least one operand")
        result, why, plan = _C.einsum(equation, operands, "", _get_num_threads(), False, True)
        if result is not None:
            if why:  # SCORCH_DEBUG >= 1
                _explain(equation, why, plan if why.startswith("sparse") else None)
            return result
        return _einsum_python(equation, operands, None, True, executor_chose_dense=why != "python")
    if torch.compiler.is_dynamo_compiling():  # (after the fast path: eager calls do not ask)
        return _einsum_between_graphs(equation, *operands, out_format=out_format)
    if not isinstance(equation, str):
        raise TypeError(f"einsum: the equation must be a str such as 'ij,jk->ik', got {type(equation).__name__}")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not 1 <= len(operands):
        raise ValueError("einsum needs at least one operand")
    return _einsum(equation, operands, out_format, choose=True)


# Dynamo cannot trace the planner (C++ through pybind11). Traced, sb.einsum and sb.compute call themselves
# through torch.compiler.disable: one graph break at the call, then the eager fast path. Dynamo used to trace
# into them and break at every pybind11 call in resume frames (185 us a call against 12 us eager, helper-66),
# and under fullgraph=True its error named only a pybind11 function; it now quotes the reason below. (Eager
# calls do not go through the disabled wrapper, which costs about 0.5 us, nor ask whether Dynamo traces them.)
_NOT_ONE_GRAPH = ("{} runs between compiled graphs (Dynamo cannot trace Scorch's planner): under "
                  "fullgraph=True write the product with torch ops on SparseTensors (A @ x, A * B, torch.einsum), "
                  "which torch.compile traces whole, or compile without fullgraph")
_EINSUM_NOT_ONE_GRAPH = _NOT_ONE_GRAPH.format("sb.einsum")
_COMPUTE_NOT_ONE_GRAPH = _NOT_ONE_GRAPH.format("sb.compute")


def _fast_out_text(out_format):
    """The executor's output format text, or None when only the Python path takes this out_format."""
    if out_format is None:
        return ""
    if out_format in ("dense", "strided") or out_format is torch.strided:
        return "strided"
    if isinstance(out_format, Format):
        return out_format.canonical
    return None  # presets and text need the rank, mode orders and block sizes: the Python path resolves them


def _calibrate(threads: int) -> None:
    """Measure (or load) this machine's crossover for the thread count and target, and hand it to C++ (the
    executor calls this the first time a thread count and target need it)."""
    _C.set_calibrated_crossover(threads, _C.target_name(),
                                float(cost_model.calibration(threads)["dense_crossover_density"]))


_C.set_calibration_hook(_calibrate)


def _einsum(equation: str, operands, out_format, choose: bool):
    """einsum; `choose=False` runs the sparse kernel without asking the cost model (the caller decided)."""
    if isinstance(equation, str) and not torch.compiler.is_compiling():
        out_text = _fast_out_text(out_format)
        if out_text is not None:
            threads = torch.get_num_threads()
            # (SCORCH_DEBUG >= 1 makes the executor explain itself: `why` is then non-empty)
            result, why, plan = _C.einsum(equation, operands, out_text, threads, False, choose)
            if result is not None:
                if why:  # SCORCH_DEBUG >= 1
                    _explain(equation, why, plan if why.startswith("sparse") else None)
                return result
            return _einsum_python(equation, operands, out_format, choose, executor_chose_dense=why != "python")
    return _einsum_python(equation, operands, out_format, choose)


def _einsum_python(equation: str, operands, out_format, choose: bool, executor_chose_dense: bool = False):
    """The call in Python. `executor_chose_dense`: the executor chose the dense path (by its rule or by a
    measurement) for a result stored sparse, which Python converts: deciding again by the density rule alone
    would undo a measured choice (at 0.5-0.8 an SpGEMM ran the kernel 1.2-3.5x slower)."""
    ops_ = _broadcast(equation, [_operand(x, f"operand {k}") for k, x in enumerate(operands)])
    dtype = _result_dtype(ops_)
    idx = _index_dtype(ops_)
    if out_format is None:
        out_text = ""
    elif out_format in ("dense", "strided") or out_format is torch.strided:
        out_text = "strided"  # no rank needed: skip the planner call that finds it
    else:
        out_text = _out_format_text(out_format, _output_rank(equation, ops_))
    # Plans depend only on the equation and the operands' formats, shapes and sizes: cached.
    plan = _plan_einsum_cached(equation, _frozen(o.desc() for o in ops_), out_text,
                               _COMPUTE_DTYPES[dtype] == torch.float64, idx == torch.int64)
    dense, why = False, "the caller chose the sparse kernel"
    if choose and torch.compiler.is_compiling():
        # Dynamo runs this on fake tensors only for the result's shape and dtype, which both paths share; the
        # choice is made when the graph runs (by this function again, or by the region op the backend puts
        # there). Deciding here would read a density that may be symbolic (a guard on the number of stored
        # entries, or an error formatting it).
        choose, why = False, "traced: the choice is made when the graph runs"
    if choose and plan["out_format"] != "strided" and config.dispatch_mode() == "auto":
        # (as the executor: an elementwise or a sampled product with a sparse result visits only stored entries)
        if len(plan["var_sizes"]) == len(plan["out_shape"]):
            choose, why = False, "an elementwise product with a sparse result: the kernel visits only stored entries"
        elif _sampled_by_a_factor(equation, ops_):
            choose, why = False, "a sampled product (its result within a sparse factor's entries): the kernel"
    if choose and executor_chose_dense:
        dense, why = True, "the executor chose the dense path"
    elif choose:
        dense, why = cost_model.choose_dense([o.tensor.density for o in ops_ if o.sparse],
                                             sum(math.prod(o.tensor.shape) for o in ops_))
        if dense and not _all_finite(ops_):
            dense, why = False, ("an operand holds inf or NaN: unstored entries are never multiplied, which only "
                                 "the kernel keeps (a dense product would make 0 * inf = NaN)")
    if _debug_level() >= 1:
        _explain(equation, f"{'dense ATen' if dense else 'sparse kernel'} ({why})", None if dense else plan)
    if dense:
        return _run_dense(equation, ops_, plan, dtype)
    if "." not in equation and len(ops_) >= 2:
        # (as the executor: an index used by one factor only is summed over it first when the rest varies)
        steps = _split_einsum_cached(equation, tuple(tuple(_concrete(d) for d in o.tensor.shape) for o in ops_))
        if len(steps) > 1:
            return _run_steps(equation, steps, ops_, plan["out_format"])  # (in the format planned)
    out = _run(plan, ops_, dtype, idx)
    if _debug_level() >= 1:
        log.drain()
    return out


def _broadcast(equation, ops_: list) -> list:
    """The operands under torch.einsum's broadcasting: a dense operand's dimension of size 1 stretches to its
    index's size elsewhere, and one whose "..." covers fewer dimensions gains leading ones (the executor does
    the same in C++). A sparse operand that would have to change raises ValueError."""
    shapes = [list(o.tensor.shape) for o in ops_]
    if isinstance(equation, str) and not any(isinstance(d, torch.SymInt) for s in shapes for d in s):
        to = _C.broadcast_shapes(equation, shapes, [o.sparse for o in ops_])
        if to:
            return [o if list(t) == s else _Operand(o.tensor.reshape([1] * (len(t) - len(s)) + s).expand(t), False)
                    for o, s, t in zip(ops_, shapes, to)]
    return ops_


def _all_finite(ops_) -> bool:
    """Do all operands hold only finite values (a sparse operand: its stored values)? A sum per operand, so
    one read of the data: a non-finite element makes it inf or NaN (an overflowing sum of finite values
    only sends the call to the kernel, which is right too). Operands without data (fake tensors under
    tracing) count as finite."""
    from torch._subclasses.fake_tensor import is_fake

    for o in ops_:
        t = o.tensor.stored_values if o.sparse else o.tensor
        if t.numel() == 0 or is_fake(t):
            continue
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        if not bool(torch.isfinite(t.detach().sum(dtype=acc))):
            return False
    return True


def _sampled_by_a_factor(equation: str, ops_) -> bool:
    """Whether a stored sparse operand's term holds exactly the output's letters (executor.cpp's rule of the
    same name): every einsum operand is a factor, so the result lies within that operand's entries."""
    if "->" not in equation or "." in equation:
        return False
    lhs, out = "".join(equation.split()).split("->")
    if not out or len(set(out)) != len(out):
        return False
    return any(o.sparse and sorted(term) == sorted(out) for term, o in zip(lhs.split(","), ops_))


def _pairwise_einsum(equation: str, factors: list) -> torch.Tensor:
    """torch.einsum with three or more factors contracted a pair at a time, the pair with the smallest result
    first, the rule of the executor's csrc/torch/dense_einsum.cpp: torch.einsum goes left to right without
    opt_einsum, and an SDDMM "ij,ik,jk->ij" then formed the (i, j, k) product of S and X (helper-75: 160 ms
    against 1.1 ms). Written again here, not called, because this path also runs while Dynamo traces."""
    if len(factors) < 3 or "->" not in equation or "." in equation:
        return torch.einsum(equation, *factors)
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    size = {c: n for t, f in zip(terms, factors) for c, n in zip(t, f.shape)}
    terms, factors = list(terms), list(factors)
    while len(factors) > 2:
        best = None
        for a in range(len(terms)):
            for b in range(a + 1, len(terms)):
                rest = set(out).union(*(set(terms[c]) for c in range(len(terms)) if c not in (a, b)))
                keep = "".join(dict.fromkeys(c for c in terms[a] + terms[b] if c in rest))
                n = math.prod(size[c] for c in keep)
                if best is None or n < best[0]:
                    best = (n, a, b, keep)
        _, a, b, keep = best
        t = torch.einsum(f"{terms[a]},{terms[b]}->{keep}", factors[a], factors[b])
        terms = [x for c, x in enumerate(terms) if c not in (a, b)] + [keep]
        factors = [x for c, x in enumerate(factors) if c not in (a, b)] + [t]
    return torch.einsum(f"{terms[0]},{terms[1]}->{out}", *factors)


def _run_dense(equation: str, ops_, plan: dict, dtype: torch.dtype):
    """torch.einsum on dense copies; a result the plan would store sparse is converted back to its format.

    When the result carries an autograd graph, the SparseTensor's values are gathered from the dense result
    (so gradients reach every operand) at the positions the kernel could write: the structural support of
    the product, where no sparse factor is unstored. Entries there that happen to be 0 keep their gradient."""
    equation = "".join(equation.split())  # torch.einsum takes spaces between subscripts, not tabs or newlines
    # (float16 multiplied in float32, as the executor does: ATen's float16 products on a CPU are scalar loops)
    as_ = torch.float32 if dtype == torch.float16 else dtype
    out = _pairwise_einsum(equation, [(o.tensor.to_dense() if o.sparse else o.tensor).to(as_) for o in ops_]).to(dtype)
    if plan["out_format"] == "strided":
        return out
    fmt = Format(plan["out_format"], out.dim())
    if not out.requires_grad:
        return sparse(out, fmt)
    if fmt.all_dense:
        return SparseTensor(fmt, out.shape, [], in_level_order(out, fmt), validate=False)
    with torch.no_grad():
        support = _pairwise_einsum(equation, [_indicator(o) for o in ops_]) != 0
        pattern = sparse(support.to(out.dtype), fmt)
    return pattern.with_values(out[tuple(pattern.coordinates())])


def _indicator(o: _Operand) -> torch.Tensor:
    """1 where an operand may be nonzero: a sparse operand's stored positions, all of a dense operand."""
    if o.sparse:
        t = o.tensor
        return t.with_values(torch.ones_like(t.stored_values, dtype=torch.float32)).to_dense()
    return torch.ones((), dtype=torch.float32).expand(o.tensor.shape)


def compute(expression: str, out_format=None, **operands):
    """Evaluate tensor index notation, e.g. compute("y(i) = A(i,j) * x(j) + b(i)", A=A, x=x, b=b).

    `+` and `-` of sparse terms co-iterate their union, `*` the intersection; numbers are constants; an index
    absent from the left side is summed over the smallest term holding all its uses (so the example is
    A @ x + b). Operands are SparseTensors, dense tensors or Python numbers (0-dimensional: written without
    parentheses).
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a str, got {type(expression).__name__}")
    names = list(operands)
    if _debug_level() == 0 and not torch.compiler.is_compiling():
        out_text = _fast_out_text(out_format)
        if out_text is not None:
            result = _C.compute(expression, names, [operands[n] for n in names], out_text, torch.get_num_threads())
            if result is not None:
                return result
    elif torch.compiler.is_dynamo_compiling():  # (after the fast path: eager calls do not ask)
        return _compute_between_graphs(expression, out_format, **operands)
    ops_ = [_operand(operands[n], f"operand '{n}'") for n in names]
    steps = _split_cached(expression, tuple(names), tuple(tuple(_concrete(d) for d in o.tensor.shape) for o in ops_))
    return _run_steps(expression, steps, ops_, out_format)


def _run_steps(what: str, steps, ops_: list, out_format):
    """Runs a statement's steps (`_C.split_compute`), each step's result an operand of the later ones; the
    last one's result is stored in `out_format`."""
    ops_ = list(ops_)
    dtype = _result_dtype(ops_)
    f64 = _COMPUTE_DTYPES[dtype] == torch.float64
    result = None
    for k, (text, global_ids) in enumerate(steps):
        step_ops = [ops_[g] for g in global_ids]
        local = [f"t{j}" for j in range(len(step_ops))]
        descs = [o.desc() for o in step_ops]
        idx = _index_dtype(step_ops)
        out_text = ""
        if out_format is not None and k == len(steps) - 1:
            rank = len(_C.plan_compute(text, local, descs, "strided", False, False)["out_shape"])
            out_text = _out_format_text(out_format, rank)
        plan = _plan_compute_cached(text, tuple(local), _frozen(descs), out_text, f64, idx == torch.int64)
        _debug(what if len(steps) == 1 else f"{what}  [step {k + 1}/{len(steps)}: {text}]", plan)
        result = _run(plan, step_ops, dtype, idx)
        ops_.append(_Operand(result, isinstance(result, SparseTensor)))
    return result


def _debug_level() -> int:
    return config.debug_level()


_log = log.get("eager")


def _plan_lines(what: str, plan: dict) -> str:
    lines = [what, f"  kernel spec: {plan['spec']}"]
    lines += [f"    - {r}" for r in plan["reasons"]]
    return "\n".join(lines)


def _explain(equation: str, why: str, plan: dict | None) -> None:
    """An eager call's decision (and its kernel's plan): at INFO once per equation, plan and decision, then
    at DEBUG on every call (SCORCH_DEBUG=2)."""
    log.sync()
    msg = f"einsum {equation}: {why}"
    if plan is not None:
        msg += "\n" + _plan_lines(f"einsum {equation}: {plan['statement']}", plan)
    if not log.once(_log, (equation, why, plan["spec"] if plan else ""), msg):
        _log.debug(msg)
    log.drain()  # the kernel's own lines (compiled or loaded), from the C++ runtime


def _debug(what: str, plan: dict) -> None:
    if _debug_level() >= 1:
        log.sync()
        msg = _plan_lines(what, plan)
        if not log.once(_log, (what, plan["spec"]), msg):
            _log.debug(msg)


def precompile(specs, workers: int = 2) -> None:
    """Compile kernels (specs from plan_einsum: one spec or a list of them) ahead of use, `workers` compilers
    at a time."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    bad = [type(x).__name__ for x in specs if not isinstance(x, str)]
    if bad:
        raise TypeError(f"precompile takes kernel specs (str, from plan_einsum(...)['spec']); got {bad[0]}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"precompile: workers must be an int >= 1, got {workers!r}")
    _C.compile_kernels(specs, workers)


def kernel_info(spec: str) -> dict:
    """Compile (or load) the kernel of a spec and describe it: schedule, reasons, loop IR, source path."""
    return _C.kernel_info(spec)


_einsum_between_graphs = torch.compiler.disable(einsum, reason=_EINSUM_NOT_ONE_GRAPH)
_compute_between_graphs = torch.compiler.disable(compute, reason=_COMPUTE_NOT_ONE_GRAPH)
