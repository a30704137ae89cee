"""SparseTensor: a torch.Tensor wrapper subclass whose inner tensors are a format's level buffers and values.

It is traceable (`__tensor_flatten__` / `__tensor_unflatten__`), so SparseTensors cross the torch.compile
boundary with their format intact. ATen ops without a sparse rule yet are computed on a dense copy, with a
warning that names the op once per process.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import sys
import warnings
from typing import Sequence

import torch
import torch.autograd.forward_ad as fwAD

from .. import _C
from .._native import ops
from .format import Format, FormatLike, make_format


VALUE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_warned_ops: set[str] = set()
_plain_torch_function = torch._C._disabled_torch_function_impl

# The torch.sparse layout a format is the same storage as (torch.sparse code reads these through .layout).
TORCH_LAYOUT_OF_FORMAT = {"csr": torch.sparse_csr, "csc": torch.sparse_csc, "coo": torch.sparse_coo}


def refuse_dual(t: torch.Tensor) -> None:
    """Forward-mode AD is not derived for sparse tensors: a tangent on their values would be dropped."""
    if fwAD._current_level >= 0 and fwAD.unpack_dual(t).tangent is not None:
        raise NotImplementedError("forward-mode AD (torch.func.jvp, jacfwd, dual tensors) is not supported "
                                  "by Scorch's sparse tensors; use reverse mode (backward(), autograd.grad)")


def coo_like(fmt) -> bool:
    """Whether a format is COO with its dimensions in any order (a compressed non-unique level over the rest
    as singletons, whole dimensions): what `.t()` or `.permute()` of a "coo" tensor gives, without copying.
    torch's own transpose of a COO tensor is a COO tensor too (not coalesced), so these read as sparse_coo."""
    lv = fmt.levels
    return bool(lv) and lv[0]["kind"] == "compressed" and all(x["kind"] == "singleton" for x in lv[1:]) and \
        all(x["part"] == "whole" for x in lv) and (len(lv) == 1 or not lv[0]["unique"])
_specialize_code = None


def _dynamo_specialize_code():
    """The code object of Dynamo's TensorVariable.specialize, which records the attributes (layout among them)
    that code traced by torch.compile sees on a tensor; None when this torch has no such function."""
    global _specialize_code
    if _specialize_code is None:
        try:
            from torch._dynamo.variables.tensor import TensorVariable

            _specialize_code = TensorVariable.specialize.__code__
        except Exception:  # noqa: BLE001 - then traced code sees the storage layout (strided)
            _specialize_code = False
    return _specialize_code or None


def sizes_of(shape) -> tuple:
    """A shape as a tuple of ints; symbolic sizes (tracing with dynamic shapes) stay symbolic, since int()
    would specialize them. Anything that is not an integer (a float, a string) raises TypeError naming it,
    instead of being truncated."""
    shape = tuple(shape)
    try:
        sizes = tuple(s if isinstance(s, torch.SymInt) else operator.index(s) for s in shape)
    except TypeError:
        bad = next((s for s in shape if not isinstance(s, torch.SymInt) and not hasattr(s, "__index__")), shape)
        raise TypeError(f"sizes must be integers, got {bad!r} in shape {shape!r}") from None
    if any(not isinstance(s, torch.SymInt) and not -2**63 <= s < 2**63 for s in sizes):
        raise ValueError(f"sizes must fit in 64 bits, got shape {sizes}")
    if all(not isinstance(s, torch.SymInt) and s >= 0 for s in sizes) and math.prod(sizes) >= 2**63:
        # (torch's tensors count their elements in int64 too: such a shape could not be a tensor)
        raise ValueError(f"a shape's element count must fit in 64 bits: shape {sizes} has {math.prod(sizes)}")
    return sizes


class SparseTensor(torch.Tensor):
    """A sparse tensor in any level format.

    Usually built with `scorch_backend.sparse(...)`. The constructor takes a format (name, text or Format),
    a shape, the index buffers in `format.buffer_names` order and the stored values, and validates them:
    SparseTensor("csr", (2, 3), [pos, crd], values).
    """

    _format: Format
    _buffer_names: tuple[str, ...]
    _values: torch.Tensor

    # Dynamo does not trace the construction (torch._dynamo.disable: a graph break, the constructor run as
    # Python). Traced, it broke the graph at the C++ checks inside and resumed halfway, on an object without
    # its buffers (an internal error under torch.compile(fullgraph=False) for sb.sparse or any sparse result).
    # The wrapper costs about 0.2 us a construction outside torch.compile.
    @staticmethod
    @torch._dynamo.disable
    def __new__(cls, format: Format, shape: Sequence[int], buffers: Sequence[torch.Tensor], values: torch.Tensor,
                *, validate: bool = True, requires_grad: bool = False):
        shape = shape if isinstance(shape, torch.Size) else sizes_of(shape)
        if not isinstance(format, Format):
            format = make_format(format, len(shape))
        if len(shape) != format.ndim:
            raise ValueError(f"format {format} is for {format.ndim}-dimensional tensors, got shape {tuple(shape)}")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a tensor, got {type(values).__name__}")
        if values.dtype not in VALUE_DTYPES:
            raise TypeError(f"values must be float32, float64, bfloat16 or float16, got {values.dtype}")
        refuse_dual(values)
        names = tuple(format.buffer_names)
        buffers = list(buffers)
        if len(buffers) != len(names):
            raise ValueError(f"format {format} stores {len(names)} index buffers {list(names)}, got {len(buffers)}")
        for name, b in zip(names, buffers):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"index buffer '{name}' must be a tensor, got {type(b).__name__}")
            if b.dtype not in INDEX_DTYPES:
                raise TypeError(f"index buffer '{name}' must be int32 or int64, got {b.dtype}")
        if validate:
            # Checked data must be CPU data: a meta tensor has no values to check, and reading it gives garbage.
            for what, t in [("values", values), *((f"index buffer '{n}'", b) for n, b in zip(names, buffers))]:
                if t.device.type != "cpu":
                    raise ValueError(f"{what} is on the {t.device} device; Scorch's sparse tensors hold CPU tensors")
            ops.validate(buffers, values, _op_sizes(shape), format.canonical)
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=values.dtype, device=values.device,
                                                requires_grad=requires_grad)
        r._format = format
        r._buffer_names = names
        for name, b in zip(names, buffers):
            setattr(r, name, b)
        r._values = values
        r._checked_versions = r._buffer_versions()
        if requires_grad:
            r._project_grads()
        return r

    def requires_grad_(self, requires_grad: bool = True) -> "SparseTensor":
        super().requires_grad_(requires_grad)
        if requires_grad:
            self._project_grads()
        return self

    def _project_grads(self) -> None:
        """A leaf's gradient is kept on its own pattern, aligned with its values (what an optimizer step on the
        values needs): an op's formula can give another one (`A * B` gives A the gradient `g * B`, in B's
        pattern and format), so each gradient reaching the leaf is read at its stored positions first."""
        if self.is_leaf and not getattr(self, "_projecting", False):
            self._projecting = True
            # (the pattern, not the tensor: torch.utils.swap_tensors refuses a tensor with weak references and
            # moves the hook with the tensor's data, away from the Python object)
            holder = [SparseTensor(self._format, self.shape, self._buffer_list(), self._values.detach(),
                                   validate=False)]
            self._grad_pattern = holder
            self.register_hook(functools.partial(_onto_held_pattern, holder))

    def _pattern_changed(self) -> None:
        """Called by rules that give this tensor new buffers in place (copy_, add_): the gradient hook of a
        leaf then projects onto the new pattern."""
        self._checked_versions = self._buffer_versions()
        holder = getattr(self, "_grad_pattern", None)
        if holder is not None:
            holder[0] = SparseTensor(self._format, self.shape, self._buffer_list(), self._values.detach(),
                                     validate=False)

    def _buffer_versions(self):
        """The buffers' version counters; -1 for a buffer that has none (an inference tensor, made under
        torch.inference_mode): such a buffer cannot be seen to change, so it counts as changed every time."""
        return tuple(_version_of(getattr(self, n)) for n in self._buffer_names)

    def check_unchanged(self) -> None:
        """Re-validate the index buffers if they were modified in place since they were last checked
        (kernels trust them, so a tampered buffer must not reach one)."""
        if torch._C._functorch.is_functorch_wrapped_tensor(self._values) or not self._buffer_names:
            return
        try:
            versions = self._buffer_versions()
        except RuntimeError:  # fake or functional tensors have no version counter
            return
        if versions != self._checked_versions or -1 in versions:
            ops.validate(self._buffer_list(), self._values, _op_sizes(self.shape), self._format.canonical)
            self._checked_versions = versions

    # --- tracing support -------------------------------------------------------------------------------
    def __tensor_flatten__(self):
        return list(self._buffer_names) + ["_values"], (self._format.canonical, self._format.ndim)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        canonical, ndim = meta
        fmt = Format(canonical, ndim)
        buffers = [inner_tensors[n] for n in fmt.buffer_names]
        return SparseTensor(fmt, outer_size, buffers, inner_tensors["_values"], validate=False)

    def _stable_hash_for_caching(self) -> str:
        # A process-independent key for AOTAutograd's cache: the format and the buffers' metadata.
        meta = (tuple(self.shape), self.requires_grad, self._format.canonical,
                [(n, str(t.dtype), tuple(str(s) for s in t.shape))
                 for n, t in zip(self._buffer_names + ("_values",), self._buffer_list() + [self._values])])
        return hashlib.blake2b(repr(meta).encode(), digest_size=16).hexdigest()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_exporting():
            # Strict export captured the values as a fake constant and the exported program returned a fake
            # tensor (helper-63); non-strict export fails inside torch.sparse. Neither is a program to deploy.
            raise NotImplementedError(
                "scorch: torch.export of a model holding SparseTensors is not supported; export the model that "
                "scorch_backend.jit.rewrite makes of it (its sparse weights are packed buffers; docs/deploy.md)")
        # (torch.einsum is decomposed before __torch_dispatch__: rules.py catches it here, whole)
        special = _TORCH_FUNCTION_RULES.get(func)
        if special is not None:
            out = special(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return _plain_torch_function(func, types, args, kwargs or {})

    # --- the torch.sparse face: what torch.sparse code (PyG, users' models) reads -------------------------
    @property
    def layout(self) -> torch.layout:
        """The torch.sparse layout this tensor's format is stored as (torch.sparse_csr for "csr",
        torch.sparse_csc for "csc", torch.sparse_coo for "coo"; torch.strided for every other format), so code
        written for torch.sparse takes its sparse path; `crow_indices()`, `col_indices()`, `values()` and the
        like answer as torch.sparse's do.

        The tensor's storage is a wrapper (strided to torch's C++ core). While torch.compile works (Dynamo's
        checks, fake tensors, AOTAutograd, Inductor) the property says so, except to the record Dynamo keeps
        of what traced code sees, so a model traced by torch.compile reads the same layout as in eager mode."""
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # (export: its fakes, its raise below)
            code = _dynamo_specialize_code()
            if code is None or sys._getframe(1).f_code is not code:
                return torch.strided
        layout = TORCH_LAYOUT_OF_FORMAT.get(self._format.name)
        if layout is None:
            layout = torch.sparse_coo if coo_like(self._format) else torch.strided
        return layout

    # --- what it holds ---------------------------------------------------------------------------------
    @property
    def format(self) -> Format:
        return self._format

    @property
    def level_buffers(self) -> dict[str, torch.Tensor]:
        """The index buffers by name: "pos1", "crd1" ... (kind + level number)."""
        return {n: getattr(self, n) for n in self._buffer_names}

    @property
    def stored_values(self) -> torch.Tensor:
        """The stored values; connected to this SparseTensor in autograd when it requires grad (a leaf made to
        require grad, or a result of ops on values that do: `with_values(v)`). Such a result is a view that
        autograd tracks: to write the values in place (pruning), do it under torch.no_grad()."""
        return _Values.apply(self) if self.requires_grad and torch.is_grad_enabled() else self._values

    @property
    def index_dtype(self) -> torch.dtype:
        for n in self._buffer_names:
            return getattr(self, n).dtype
        return torch.int64

    @property
    def nnz(self) -> int:
        """Number of stored values (explicit zeros inside stored blocks or dense levels included)."""
        return self._values.numel()

    @property
    def density(self) -> float:
        numel = self.numel()
        return self.nnz / numel if numel else 0.0

    def differentiable_values(self) -> torch.Tensor:
        """The stored values, connected to this SparseTensor in autograd when it requires grad: gradients
        reaching them accumulate in `self.grad` as a SparseTensor with the same pattern."""
        return _Values.apply(self) if self.requires_grad else self._values

    def _buffer_list(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._buffer_names]

    def coordinates(self) -> torch.Tensor:
        """Coordinates of the stored values, shape (ndim, nnz), in storage order."""
        return ops.unpack(self._buffer_list(), self._values, _op_sizes(self.shape), self._format.canonical)

    # --- conversions -----------------------------------------------------------------------------------
    def to_dense(self, dtype=None, *, masked_grad=None) -> torch.Tensor:  # noqa: ARG002 - torch's signature
        out = ops.to_dense(self._buffer_list(), self.differentiable_values(), _op_sizes(self.shape),
                           self._format.canonical)
        return out if dtype is None else out.to(dtype)

    def to_format(self, format, *, mode_order=None, blocksize=None, index_dtype=None) -> "SparseTensor":
        return to_format(self, format, mode_order=mode_order, blocksize=blocksize, index_dtype=index_dtype)

    def to_torch(self, layout=torch.sparse_coo, *, blocksize=None) -> torch.Tensor:
        return to_torch(self, layout, blocksize=blocksize)

    def to_scipy(self):
        return to_scipy(self)

    def with_values(self, values: torch.Tensor) -> "SparseTensor":
        """The same pattern holding other values (same length). With a gradient wanted for `values`, the result
        requires grad and its gradient reaches them (through every op on it, the dispatch rules included)."""
        if values.shape != self._values.shape:
            raise ValueError(f"values must have shape {tuple(self._values.shape)}, got {tuple(values.shape)}")
        if values.device != self._values.device:
            raise ValueError(f"values are on {values.device}, this SparseTensor's on {self._values.device}")
        if values.requires_grad and torch.is_grad_enabled():
            return _FromValues.apply(self, values)
        return SparseTensor(self._format, self.shape, self._buffer_list(), values, validate=False)

    def __repr__(self) -> str:
        return (f"SparseTensor(format={self._format}, shape={tuple(self.shape)}, nnz={self.nnz}, "
                f"dtype={self.dtype}, index_dtype={self.index_dtype})")

    # --- operators ---------------------------------------------------------------------------------------
    # torch.Tensor's operators turn a TypeError into NotImplemented (so Python tries the other operand), which
    # loses the message naming the problem ("operand 1 has dtype torch.int64"): these call the op itself.
    __matmul__, __rmatmul__ = (lambda s, o: torch.matmul(s, o)), (lambda s, o: torch.matmul(o, s))
    __mul__, __rmul__ = (lambda s, o: torch.mul(s, o)), (lambda s, o: torch.mul(o, s))
    __add__, __radd__ = (lambda s, o: torch.add(s, o)), (lambda s, o: torch.add(o, s))
    __sub__, __rsub__ = (lambda s, o: torch.sub(s, o)), (lambda s, o: torch.sub(o, s))

    # --- ATen dispatch ---------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            out = rule(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _densify_and_run(func, args, kwargs)


class _Values(torch.autograd.Function):
    """SparseTensor -> its values, with the gradient going back as a SparseTensor of the same pattern."""

    @staticmethod
    def forward(ctx, x):
        ctx.pattern = x
        return x._values.detach().view_as(x._values)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.pattern
        if grad.requires_grad and torch.is_grad_enabled():  # create_graph: keep the gradient's own history
            return _FromValues.apply(x, grad)
        return SparseTensor(x.format, x.shape, x._buffer_list(), grad, validate=False)


def _shares_pattern(a: "SparseTensor", b: "SparseTensor") -> bool:
    """The same format and the same index buffer objects (by identity: a comparison of values would stop the
    tracer of a compiled backward, and the gradients of pattern-keeping ops share their input's buffers)."""
    return a.format == b.format and all(x is y for x, y in zip(a._buffer_list(), b._buffer_list()))


def _values_on(pattern: "SparseTensor", grad: torch.Tensor) -> torch.Tensor:
    """`grad` (a SparseTensor of any pattern, or dense) read at `pattern`'s stored positions."""
    if isinstance(grad, SparseTensor):
        if grad.requires_grad and torch.is_grad_enabled():  # create_graph: read its values through autograd
            if _shares_pattern(grad, pattern):
                return grad.stored_values
            return grad.to_dense()[tuple(pattern.coordinates())].reshape(pattern._values.shape)
        if _shares_pattern(grad, pattern):
            return grad._values
        got = _C.values_at(grad, pattern.coordinates())
        if got is not None:
            return got.to(grad.dtype).reshape(pattern._values.shape)
        grad = grad.to_dense()
    return grad[tuple(pattern.coordinates())].reshape(pattern._values.shape)


def _onto_held_pattern(holder, grad):
    return _onto_pattern(holder[0], grad)


def _onto_pattern(x, grad):
    if isinstance(grad, SparseTensor) and _shares_pattern(grad, x):
        return grad
    return SparseTensor(x.format, x.shape, x._buffer_list(), _values_on(x, grad).to(x.dtype), validate=False)


class _FromValues(torch.autograd.Function):
    """(pattern, values) -> a SparseTensor of that pattern holding the values, its gradient going back to the
    values at the pattern's positions (a gradient of another pattern, or dense, is read there)."""

    @staticmethod
    def forward(ctx, pattern, values):
        ctx.pattern = pattern
        return SparseTensor(pattern.format, pattern.shape, pattern._buffer_list(), values.detach(), validate=False)

    @staticmethod
    def backward(ctx, grad):
        return None, _values_on(ctx.pattern, grad)


def _mutated_sparse_argument(func, args, kwargs) -> str | None:
    """The name of an argument `func` writes into that is a SparseTensor (computing on a dense copy would
    leave it unchanged, a silently wrong result), else None."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return None
    for k, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[k] if k < len(args) else kwargs.get(a.name)
        if isinstance(value, SparseTensor) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, SparseTensor) for v in value)):
            return a.name
    return None


def _densify_and_run(func, args, kwargs):
    name = str(func)
    written = _mutated_sparse_argument(func, args, kwargs)
    if written is not None:
        raise NotImplementedError(
            f"scorch: {name} would write into a SparseTensor ('{written}'), which it cannot do in place; "
            "compute out of place (e.g. x = x * 2 rather than x.mul_(2)), or on x.to_dense()")
    if name not in _warned_ops:
        _warned_ops.add(name)
        warnings.warn(f"scorch: {name} has no sparse implementation yet; it runs on a dense copy of its "
                      "SparseTensor arguments", stacklevel=3)

    def dense(x):
        return x.to_dense() if isinstance(x, SparseTensor) else x

    args = torch.utils._pytree.tree_map(dense, args)
    kwargs = torch.utils._pytree.tree_map(dense, kwargs)
    return func(*args, **kwargs)


# --- rules: ops that keep the sparsity pattern and work on values or on the format alone ------------------
_RULES: dict = {}


def _rule(*funcs):
    """Register fn for these ops. A rule returns NotImplemented where it does not apply; when an op already
    has a rule, the earlier one is tried first and fn only when it declines."""
    def register(fn):
        for f in funcs:
            previous = _RULES.get(f)

            def chained(*args, _fn=fn, _previous=previous, **kwargs):
                out = _previous(*args, **kwargs)
                return _fn(*args, **kwargs) if out is NotImplemented else out

            _RULES[f] = chained if previous is not None else fn
        return fn

    return register


def rebuild_sparse_tensor(canonical: str, ndim: int, shape, buffers, values, requires_grad: bool):
    """Unpickling (torch.load, copy): the SparseTensor again, its buffers validated (a file is only data)."""
    if _legacy_load_in_progress():
        # torch's legacy (non-zipfile) loader fills the storages only after unpickling: what is read here is
        # not the file's data yet (a check of it failed at random, helper-64). Built unchecked, with versions
        # no buffer has, so the first use checks the buffers (SparseTensor.check_unchanged, the C++ side).
        # What can be checked without the data is checked here.
        if not all(isinstance(s, int) and s >= 0 for s in shape) or any(
                not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in [values, *buffers]):
            raise ValueError("a saved SparseTensor has a negative or non-integer size, or data not on the CPU")
        out = SparseTensor(Format(canonical, ndim), shape, buffers, values, validate=False)
        out._checked_versions = tuple(-2 for _ in out._buffer_names)
    else:
        out = SparseTensor(Format(canonical, ndim), shape, buffers, values)
    return out.requires_grad_() if requires_grad else out


def _legacy_load_in_progress() -> bool:
    """Whether torch.load's legacy (non-zipfile) loader is unpickling this (its frame is on the stack)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_legacy_load" and f.f_globals.get("__name__") == "torch.serialization":
            return True
        f = f.f_back
    return False


def _reduce_ex(x, proto):
    """Pickling as a SparseTensor (torch's own path would read the torch.sparse layout this tensor reports
    and rebuild a torch.sparse tensor from a wrapper that has no storage)."""
    if not isinstance(x, SparseTensor):
        return NotImplemented
    return (rebuild_sparse_tensor, (x._format.canonical, x._format.ndim, tuple(int(s) for s in x.shape),
                                    [b.detach() for b in x._buffer_list()], x._values.detach(), x.requires_grad))


torch.serialization.add_safe_globals([rebuild_sparse_tensor])  # it validates what it reads


# Torch functions a SparseTensor answers above autograd (pattern_ops.py adds the torch.sparse accessors,
# rules.py `.data =` and share_memory_).
_TORCH_FUNCTION_RULES = {torch.Tensor.__reduce_ex__: _reduce_ex}


# --- checks and conversions between formats (the methods above; convert.py builds SparseTensors from other
# things) ---------------------------------------------------------------------------------------------------
def _check_index_dtype(index_dtype) -> torch.dtype:
    if index_dtype not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    return index_dtype


def _check_values_dtype(dtype) -> None:
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"Scorch stores float32, float64, bfloat16 or float16 values, got {dtype}; "
                        "convert the input first (e.g. x.float())")


def in_level_order(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The elements of dense x in the order an all-dense format stores them, flat (differentiable in x): its
    levels' dimensions in their order, a blocked dimension (`dense(1/2),dense(1%2)`) split into blocks."""
    sizes, axis = [], {}
    for d in range(x.dim()):
        blocks = {lv["block"] for lv in fmt.levels if lv["dim"] == d and lv["part"] != "whole"}
        if blocks:
            b = blocks.pop()
            if x.shape[d] % b:
                raise ValueError(f"dimension {d} of size {x.shape[d]} is not divisible by its block size {b}")
            sizes += [x.shape[d] // b, b]
            axis[d, "outer"], axis[d, "inner"] = len(sizes) - 2, len(sizes) - 1
        else:
            sizes.append(x.shape[d])
            axis[d, "whole"] = len(sizes) - 1
    return x.reshape(sizes).permute([axis[lv["dim"], lv["part"]] for lv in fmt.levels]).reshape(-1)


@functools.lru_cache(maxsize=16)
def _csr_like_text(ndim: int) -> str:
    """The canonical text of the format _C.compress_rows makes for a tensor of rank `ndim`."""
    return Format("csr", ndim).canonical


def _from_dense(x: torch.Tensor, fmt: Format, index_dtype) -> SparseTensor:
    _check_values_dtype(x.dtype)
    if fmt.all_dense:  # values are the tensor itself, in the format's level order
        return SparseTensor(fmt, x.shape, [], in_level_order(x.detach(), fmt).clone(), validate=False)
    if x.dim() == 0:
        raise ValueError("a 0-dimensional tensor can only be stored in the 'dense' format")
    if x.dim() >= 2 and x.dtype in (torch.float32, torch.float64) and x.is_contiguous() and x.layout == torch.strided \
            and type(x) in (torch.Tensor, torch.nn.Parameter) and fmt.canonical == _csr_like_text(x.dim()):
        # CSR (dense outer levels, the last dimension compressed) straight from the rows: a count and a fill
        # per row, in parallel. The general path (nonzero, gather, a sort in pack) took 68 ms for a dense
        # 1024^2 matrix, this one a tenth of that.
        made = _C.compress_rows(x.detach())
        if made is not None and made[2] == fmt.canonical:
            buffers, values, _ = made
            if index_dtype != torch.int32:
                buffers = [b.to(index_dtype) for b in buffers]
            return SparseTensor(fmt, x.shape, buffers, values, validate=False)
    indices = x.nonzero().t()
    values = x.detach()[tuple(indices)] if x.numel() else x.new_empty(0)
    buffers, vals = ops.pack(indices, values, list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def _coordinates_and_values(x: SparseTensor, drop_padding: bool = True):
    """Coordinates and values of x. Zeros stored only because the format pads them (a dense level, n:m groups)
    are dropped."""
    coords = x.coordinates()
    values = x.stored_values
    if drop_padding and x.format.pads_zeros:
        keep = values != 0
        coords, values = coords[:, keep], values[keep]
    return coords, values


def to_format(x: SparseTensor, format: FormatLike, *, mode_order=None, blocksize=None,
              index_dtype=None) -> SparseTensor:
    """Convert between any two formats (coordinates are re-packed; buffers are shared when nothing changes)."""
    index_dtype = _check_index_dtype(index_dtype or x.index_dtype)
    fmt = make_format(format, x.dim(), mode_order=mode_order, blocksize=blocksize)
    if fmt == x.format and index_dtype == x.index_dtype:
        return x
    # The packing op works on detached values: with a gradient wanted, the result's values are read again from
    # x's through autograd (stored zeros kept: each stored value gets its gradient).
    grad = torch.is_grad_enabled() and (x.requires_grad or x._values.requires_grad)
    if fmt.all_dense:
        if grad:
            return SparseTensor(fmt, x.shape, [], in_level_order(x.to_dense(), fmt).clone(), validate=False)
        return _from_dense(x.to_dense(), fmt, index_dtype)
    coords, values = _coordinates_and_values(x, drop_padding=not grad)
    buffers, vals = ops.pack(coords, values.detach(), list(x.shape), fmt.canonical, index_dtype)
    out = SparseTensor(fmt, x.shape, buffers, vals, validate=False)
    if grad:
        again = _C.values_at(x, out.coordinates())
        if again is not None:
            out = out.with_values(again.to(vals.dtype))
    return out


def to_torch(x: SparseTensor, layout=torch.sparse_coo, *, blocksize=None) -> torch.Tensor:
    """The same tensor as a torch.sparse tensor (COO, CSR, CSC, BSR) or a dense one (torch.strided)."""
    x.check_unchanged()  # (torch's tensors are made unchecked: its kernels trust their indices as Scorch's do)
    if layout == torch.strided:
        return x.to_dense()
    if layout == torch.sparse_coo:
        coords, values = _coordinates_and_values(x)
        return torch.sparse_coo_tensor(coords, values, tuple(x.shape), check_invariants=False).coalesce()
    if x.dim() != 2:
        raise ValueError(f"torch layout {layout} needs a 2-D tensor here, got {x.dim()} dimensions")
    if layout in (torch.sparse_csr, torch.sparse_csc):
        name = "csr" if layout == torch.sparse_csr else "csc"
        y = to_format(x, name)
        pos, crd = y.level_buffers["pos1"], y.level_buffers["crd1"]
        make = torch.sparse_csr_tensor if name == "csr" else torch.sparse_csc_tensor
        with warnings.catch_warnings():  # torch's "CSR support is in beta" notice, once per process
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            return make(pos, crd, y.stored_values, tuple(x.shape), check_invariants=False)
    if layout == torch.sparse_bsr:
        blocksize = tuple(blocksize or x.format.blocksize or ())
        if len(blocksize) != 2:
            raise ValueError("converting to torch.sparse_bsr needs blocksize=(rows, cols)")
        y = to_format(x, "bsr", blocksize=blocksize)
        bh, bw = blocksize
        pos, crd = y.level_buffers["pos1"], y.level_buffers["crd1"]
        return torch.sparse_bsr_tensor(pos, crd, y.stored_values.reshape(-1, bh, bw), tuple(x.shape),
                                       check_invariants=False)
    raise ValueError(f"unsupported torch layout {layout}")


def to_scipy(x: SparseTensor):
    """A scipy.sparse array: csr/csc/bsr when x is in that format, else COO."""
    x.check_unchanged()
    import scipy.sparse as sp

    if x.dim() != 2:
        raise ValueError(f"scipy.sparse holds 2-D arrays, got {x.dim()} dimensions")
    shape, name, b = tuple(x.shape), x.format.name, x.level_buffers
    values = x.stored_values.detach()
    values = values.float() if values.dtype in (torch.bfloat16, torch.float16) else values
    if name in ("csr", "csc"):
        make = sp.csr_array if name == "csr" else sp.csc_array
        return make((values.numpy(), b["crd1"].numpy(), b["pos1"].numpy()), shape=shape)
    if name.startswith("bsr("):
        bh, bw = x.format.blocksize
        return sp.bsr_array((values.reshape(-1, bh, bw).numpy(), b["crd1"].numpy(), b["pos1"].numpy()), shape=shape)
    coords, vals = _coordinates_and_values(x)
    vals = vals.float() if vals.dtype in (torch.bfloat16, torch.float16) else vals
    return sp.coo_array((vals.numpy(), (coords[0].numpy(), coords[1].numpy())), shape=shape)


# --- the C++ executor's view of this class --------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _format_of(text: str, ndim: int) -> Format:
    return Format(text, ndim)


@functools.lru_cache(maxsize=1024)
def _result_format(text: str, ndim: int) -> tuple[Format, tuple[str, ...]]:
    fmt = _format_of(text, ndim)
    return fmt, tuple(fmt.buffer_names)


def _op_sizes(shape) -> list:
    """A shape as the format ops' SymInt[] sizes. Under torch.jit.trace, sizes read from a traced tensor are
    traced values that torch's tracer cannot record in a SymInt list (an internal assert in TraceTypeManual):
    they go as plain ints, constants of the trace, as when the ops took int[]."""
    return [int(d) for d in shape] if torch.jit.is_tracing() else list(shape)


def _version_of(t: torch.Tensor) -> int:
    """t's version counter, or -1 when it has none (an inference tensor)."""
    return -1 if t.is_inference() else t._version


def _wrap_result(text: str, shape, buffers, values, versions) -> SparseTensor:
    """A sparse result of the executor: its buffers come from a kernel (the format's buffers in order, index
    dtypes, on the values' device), so they are trusted as they are and none of SparseTensor.__new__'s checks
    run again; `versions` are the buffers' version counters, read in C++. This runs on every eager call with
    a sparse result: it sets what __new__ sets and nothing more (about 2 us against 5)."""
    fmt, names = _result_format(text, len(shape))
    r = torch.Tensor._make_wrapper_subclass(SparseTensor, shape, dtype=values.dtype, device=values.device)
    r._format = fmt
    r._buffer_names = names
    for name, b in zip(names, buffers):
        setattr(r, name, b)
    r._checked_versions = versions
    if values.requires_grad:
        # A result with a gradient to carry requires grad itself, as every SparseTensor op's result: its values
        # connected through _FromValues. Its values alone carrying the graph, `result * 2` or `result + x`
        # (torch's dispatch, below autograd) dropped the gradient without a word.
        r._values = values.detach()
        return _FromValues.apply(r, values)
    r._values = values
    return r


# The executor reads SparseTensor operands directly (format, buffers, values, checked versions) and wraps
# sparse results with _wrap_result.
_C.register_python_types(SparseTensor, _wrap_result)
