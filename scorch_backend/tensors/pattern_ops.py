"""ATen ops that keep a SparseTensor's pattern and need no kernel: detach and clone, elementwise ops with
f(0) = 0, scalar factors, dtype casts, and torch.sparse's accessors (crow_indices, values, coalesce, ...) for code
written against torch.sparse. Registered into SparseTensor's dispatch table on import (scorch_backend/__init__.py
imports it through rules.py); ops that run as compiled kernels are in rules.py.
"""

from __future__ import annotations

import torch

from .._native import ops
from .sparse_tensor import (_TORCH_FUNCTION_RULES, TORCH_LAYOUT_OF_FORMAT, VALUE_DTYPES, SparseTensor, _rule,
                            coo_like)

aten = torch.ops.aten


def _same_pattern(x: SparseTensor, values: torch.Tensor) -> SparseTensor:
    return SparseTensor(x.format, x.shape, x._buffer_list(), values, validate=False)


def outside_inference(x: SparseTensor):
    """The mode a view of `x` is made in: a view op's result must not be an inference tensor when its input is
    not one, or torch refuses to give it the input's version counter under `torch.inference_mode` ("Cannot
    set version_counter for inference tensor": A.t() of a SparseTensor made before the mode)."""
    return torch.inference_mode(torch.is_inference_mode_enabled() and x.is_inference())


@_rule(aten.detach.default, aten.alias.default)
def _detach(x):
    with outside_inference(x):
        return _same_pattern(x, x._values.detach())


@_rule(aten.clone.default)
def _clone(x, *, memory_format=None):  # noqa: ARG001 - a sparse layout has no memory format
    return SparseTensor(x.format, x.shape, [b.clone() for b in x._buffer_list()], x._values.clone(), validate=False)


def _make_unary(op):
    def apply(x):
        return _same_pattern(x, op(x._values))

    return apply


# Unary ops with f(0) == 0 keep the pattern.
for _f in (aten.neg.default, aten.abs.default, aten.relu.default, aten.sqrt.default, aten.sin.default,
           aten.tanh.default, aten.sgn.default, aten.expm1.default, aten.log1p.default, aten.square.default):
    _rule(_f)(_make_unary(_f))


# Sparse times (or divided by) a scalar keeps the pattern; sparse-sparse and sparse-dense products are the
# compiler's (ops issue) and fall back to dense for now.
def _scalar_op(op):
    is_div = op in (aten.div.Tensor, aten.div.Scalar)

    def keeps_zeros(s) -> bool:  # 0 * s and 0 / s must be 0, or the result is not sparse
        v = complex(s.item() if isinstance(s, torch.Tensor) else s)
        return v == v and abs(v) != float("inf") and not (is_div and v == 0)

    def apply(x, y, *, rounding_mode=None):
        if rounding_mode is not None:
            return NotImplemented
        if isinstance(x, SparseTensor) and (not isinstance(y, torch.Tensor) or
                                            (y.dim() == 0 and not isinstance(y, SparseTensor))):
            if not keeps_zeros(y):
                return NotImplemented
            return _same_pattern(x, op(x._values, y))
        if op is aten.mul.Tensor and isinstance(y, SparseTensor) and (
                not isinstance(x, torch.Tensor) or (x.dim() == 0 and not isinstance(x, SparseTensor))):
            if not keeps_zeros(x):
                return NotImplemented
            return _same_pattern(y, op(x, y._values))
        return NotImplemented

    return apply


for _f in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
    _rule(_f)(_scalar_op(_f))


@_rule(aten._to_copy.default)
def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if layout not in (None, torch.strided) or (device is not None and torch.device(device).type != "cpu"):
        return NotImplemented
    if dtype is not None and dtype not in VALUE_DTYPES:
        raise TypeError(f"a SparseTensor holds float32, float64, bfloat16 or float16 values, not {dtype}")
    return _same_pattern(x, x._values.to(dtype=dtype or x.dtype, copy=True))


# --- torch.sparse's accessors, answered from the level buffers ----------------------------------------------
def _needs_layout(x: SparseTensor, what: str, *names: str) -> None:
    if x.format.name not in names and not ("coo" in names and coo_like(x.format)):
        want = " or ".join(f'"{n}"' for n in names)
        raise RuntimeError(f"{what}() needs a SparseTensor in the {want} format (torch.sparse layout "
                           f"{' or '.join(str(TORCH_LAYOUT_OF_FORMAT[n]) for n in names)}), got format "
                           f"{x.format.name or x.format.canonical}; convert with .to_format()")


def _buffer_view(x: SparseTensor, name: str) -> torch.Tensor:
    """An index buffer as torch.sparse code expects it: int64 (torch's default index type, which code written
    for torch.sparse, PyG's scatter among it, assumes), a view when the buffer is int64 already."""
    b = getattr(x, name)
    return aten.alias.default(b) if b.dtype == torch.int64 else b.to(torch.int64)


# torch's compressed accessors: (op, its name, the layout it needs, the level buffer it reads)
for _op, _name, _layout, _buffer in ((aten.crow_indices.default, "crow_indices", "csr", "pos1"),
                                     (aten.col_indices.default, "col_indices", "csr", "crd1"),
                                     (aten.ccol_indices.default, "ccol_indices", "csc", "pos1"),
                                     (aten.row_indices.default, "row_indices", "csc", "crd1")):
    def _accessor(x, _name=_name, _layout=_layout, _buffer=_buffer):
        _needs_layout(x, _name, _layout)
        return _buffer_view(x, _buffer)

    _rule(_op)(_accessor)


@_rule(aten.values.default, aten._values.default)
def _values_op(x):
    _needs_layout(x, "values", "csr", "csc", "coo")
    return aten.alias.default(x._values)


@_rule(aten.indices.default, aten._indices.default)
def _indices(x):
    _needs_layout(x, "indices", "coo")
    if x.format.name != "coo":  # a permuted COO (x.t()): each stored entry's coordinates, in storage order
        return x.coordinates()
    return torch.stack([getattr(x, f"crd{d}").to(torch.int64) for d in range(x.dim())]) if x.dim() else \
        torch.zeros((0, x.nnz), dtype=torch.int64)


@_rule(aten._nnz.default)
def _nnz(x):
    return x.nnz


@_rule(aten.is_coalesced.default)
def _is_coalesced(x):
    _needs_layout(x, "is_coalesced", "coo")
    # The "coo" format stores each coordinate once, in order (validation refuses duplicates); a permuted one is
    # in another order, as torch's transpose of a coalesced tensor is not coalesced either.
    return x.format.name == "coo"


@_rule(aten.coalesce.default)
def _coalesce(x):
    _needs_layout(x, "coalesce", "coo")
    return x if x.format.name == "coo" else x.to_format("coo")


@_rule(aten._coalesced_.default)
def _mark_coalesced(x, coalesced):
    _needs_layout(x, "_coalesced_", "coo")
    return x  # already true of every "coo" SparseTensor; nothing to record


def _values_with_grad(x, *args, **kwargs):
    """Tensor.values() above autograd: the stored values, connected to x (gradients come back as a
    SparseTensor with x's pattern, as torch.sparse's values() gives a sparse gradient)."""
    if not isinstance(x, SparseTensor) or args or kwargs:
        return NotImplemented
    _needs_layout(x, "values", "csr", "csc", "coo")
    return x.differentiable_values()


def _sparse_mm_reduce(a, b, reduce=None):
    """torch.sparse.mm(A, B, reduce): "sum" and "mean" (over A's stored entries per row) run as Scorch
    kernels; "amax"/"amin"/"max"/"min"/"prod" are not supported (a clear error, never a dense copy). Without
    `reduce` the call goes on to ATen (aten._sparse_addmm, a rule of its own)."""
    if reduce is None or not isinstance(a, SparseTensor):
        return NotImplemented
    if reduce not in ("sum", "mean"):
        raise NotImplementedError(f"scorch: torch.sparse.mm(A, B, reduce={reduce!r}) with a SparseTensor A: "
                                  "only 'sum' and 'mean' are supported")
    _needs_layout(a, f"torch.sparse.mm(..., reduce={reduce!r})", "csr")
    out = a @ b
    if reduce == "mean":
        pos = a.level_buffers["pos1"]
        count = (pos[1:] - pos[:-1]).clamp(min=1).to(out.dtype)
        out = out / count.view(-1, *([1] * (out.dim() - 1)))
    return out


def _to_sparse_as(name: str):
    """Tensor.to_sparse_csr() and the like: the same SparseTensor in that format (itself when it is)."""
    def convert(x, *args, **kwargs):
        if not isinstance(x, SparseTensor) or args or any(v is not None for v in kwargs.values()):
            return NotImplemented
        return x if x.format.name == name else x.to_format(name)

    return convert


def _coalesce_above_autograd(x, *args, **kwargs):
    if not isinstance(x, SparseTensor) or args or kwargs:
        return NotImplemented
    return _coalesce(x)  # torch checks the layout before dispatch; a "coo" SparseTensor is coalesced


_TORCH_FUNCTION_RULES.update({
    torch.Tensor.coalesce: _coalesce_above_autograd,
    torch.Tensor.to_sparse_csr: _to_sparse_as("csr"),
    torch.Tensor.to_sparse_csc: _to_sparse_as("csc"),
    torch.Tensor.to_sparse_coo: _to_sparse_as("coo"),
    torch.Tensor.values: _values_with_grad,
    torch.Tensor._values: _values_with_grad,
})
