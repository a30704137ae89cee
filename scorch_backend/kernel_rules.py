"""ATen ops on SparseTensors that run as compiled Scorch kernels (eager mode).

Registered into SparseTensor's dispatch table on import. Each rule returns NotImplemented where it does not
apply (broadcasting, unsupported arguments), and the op then runs on dense copies with a warning.
"""

from __future__ import annotations

import torch

from .frontend import compute, einsum
from .tensor import SparseTensor, _rule

aten = torch.ops.aten
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


@_rule(aten.mm.default)
def _mm(a, b):
    return einsum("ij,jk->ik", a, b)


@_rule(aten.mv.default)
def _mv(a, x):
    return einsum("ij,j->i", a, x)


@_rule(aten.bmm.default)
def _bmm(a, b):
    return einsum("bij,bjk->bik", a, b)


@_rule(aten.addmm.default)
def _addmm(bias, a, b, *, beta=1, alpha=1):
    n, k = a.shape[0], b.shape[1]
    if not _tensor(bias):
        return NotImplemented
    if not isinstance(bias, SparseTensor):
        bias = bias.expand(n, k)
    elif tuple(bias.shape) != (n, k):
        return NotImplemented
    return compute("out(i,k) = beta * C(i,k) + alpha * A(i,j) * B(j,k)", C=bias, A=a, B=b,
                   beta=float(beta), alpha=float(alpha))


def _same_shape(x, y) -> bool:
    return _tensor(x) and _tensor(y) and tuple(x.shape) == tuple(y.shape) and x.dim() <= len(_LETTERS)


@_rule(aten.mul.Tensor)
def _mul(x, y):
    if not _same_shape(x, y):
        return NotImplemented
    s = _LETTERS[: x.dim()]
    return einsum(f"{s},{s}->{s}", x, y)


def _add_like(sign):
    def apply(x, y, *, alpha=1):
        if not _same_shape(x, y):
            return NotImplemented
        idx = ",".join(_LETTERS[: x.dim()])
        acc = f"({idx})" if x.dim() else ""
        return compute(f"out{acc} = X{acc} + a * Y{acc}", X=x, Y=y, a=sign * float(alpha))

    return apply


_rule(aten.add.Tensor)(_add_like(1.0))
_rule(aten.sub.Tensor)(_add_like(-1.0))


@_rule(aten.sum.default)
def _sum(x, *, dtype=None):
    if dtype is not None:
        return NotImplemented
    return einsum(f"{_LETTERS[: x.dim()]}->", x)


@_rule(aten.sum.dim_IntList)
def _sum_dims(x, dims, keepdim=False, *, dtype=None):
    if dtype is not None or keepdim:
        return NotImplemented
    dims = {d % x.dim() for d in (dims if dims is not None else range(x.dim()))}
    s = _LETTERS[: x.dim()]
    return einsum(f"{s}->{''.join(c for d, c in enumerate(s) if d not in dims)}", x)


@_rule(aten.add_.Tensor)
def _add_inplace(x, y, *, alpha=1):
    """x += alpha * y for a SparseTensor x, when the sum is sparse in x's format (gradient accumulation):
    x takes the sum's buffers and values."""
    if not isinstance(x, SparseTensor):
        return NotImplemented
    out = _add_like(1.0)(x, y, alpha=alpha)
    if not isinstance(out, SparseTensor):
        return NotImplemented
    if out.format != x.format:
        out = out.to_format(x.format)
    for name, b in out.level_buffers.items():
        setattr(x, name, b)
    x._values = out.stored_values
    x._checked_versions = x._buffer_versions()
    return x
