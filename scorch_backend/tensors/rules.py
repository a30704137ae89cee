"""ATen ops on SparseTensors that run as compiled Scorch kernels (eager mode), and the layout ops (transpose,
permute) that only reorder a format's levels.

Registered into SparseTensor's dispatch table on import. Each rule returns NotImplemented where it does not
apply (broadcasting, unsupported arguments), and the op then runs on dense copies with a warning.
"""

from __future__ import annotations

import torch

from .convert import sparse
from . import frontend
from .frontend import compute, einsum
from .pattern_ops import _sparse_mm_reduce, outside_inference
from .sparse_tensor import _TORCH_FUNCTION_RULES, SparseTensor, _rule, _shares_pattern

aten = torch.ops.aten
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


# --- layout: transposes and permutations (the format's level order permuted; no data moves) ----------------
def _permuted(x: SparseTensor, perm) -> SparseTensor:
    shape = [x.shape[p] for p in perm]
    with outside_inference(x):  # a view: not an inference tensor unless x is one
        return SparseTensor(x.format.permute_dims(perm), shape, x._buffer_list(), x._values, validate=False)


@_rule(aten.t.default)
def _t(x):
    if x.dim() < 2:
        return x
    return _permuted(x, [1, 0])


def _wrap_dim(d: int, ndim: int) -> int:
    """A dimension index as torch reads it (negative from the end), or IndexError as torch raises."""
    n = max(ndim, 1)  # a 0-d tensor takes dimension 0 or -1, as in torch
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {d})")
    return d % n


@_rule(aten.transpose.int)
def _transpose(x, d0, d1):
    perm = list(range(x.dim()))
    d0, d1 = _wrap_dim(d0, x.dim()), _wrap_dim(d1, x.dim())
    if not perm:
        return x
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(x, perm)


@_rule(aten.permute.default)
def _permute(x, dims):
    perm = [_wrap_dim(d, x.dim()) for d in dims]
    if len(perm) != x.dim() or sorted(perm) != list(range(x.dim())):
        raise RuntimeError(f"permute(): the dimensions {list(dims)} are not a permutation of the tensor's "
                           f"{x.dim()} dimensions")
    return _permuted(x, perm)


# --- products and sums as kernels ---------------------------------------------------------------------------
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
        if (isinstance(x, SparseTensor) and isinstance(y, SparseTensor) and x.dtype == y.dtype
                and _shares_pattern(x, y)):
            # The same pattern (gradients of one leaf, say): the values add position by position. A merge would
            # also be right for unique formats, but it sums the duplicates of a non-unique one into every copy:
            # a leaf used twice then got twice its gradient. (The shared buffers are checked: no kernel reads them.)
            x.check_unchanged()
            values = x.stored_values + (sign * alpha) * y.stored_values
            return SparseTensor(x.format, x.shape, x._buffer_list(), values, validate=False)
        idx = ",".join(_LETTERS[: x.dim()])
        acc = f"({idx})" if x.dim() else ""
        out = compute(f"out{acc} = X{acc} + a * Y{acc}", X=x, Y=y, a=sign * float(alpha))
        # (the scalar `a` is a float32 operand: the result of two half-precision terms is brought back to theirs)
        want = torch.promote_types(x.dtype, y.dtype)
        if out.dtype == want:
            return out
        if isinstance(out, SparseTensor):  # (below autograd here: the values are cast, the pattern kept)
            return SparseTensor(out.format, out.shape, out._buffer_list(), out.stored_values.to(want), validate=False)
        return out.to(want)

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
    # An empty list sums every dimension, as torch's sum does (helper-68).
    wrapped = [_wrap_dim(d, x.dim()) for d in (dims if dims else range(x.dim()))]
    dims = set(wrapped)
    if len(dims) != len(wrapped):  # as torch: a repeated dimension is an error, not summed once (helper-56)
        raise RuntimeError(f"dim {next(d for d in wrapped if wrapped.count(d) > 1)} appears multiple times in the "
                           "list of dims")
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
    x._pattern_changed()
    return x


# --- in place on the stored values: what training utilities do to gradients ----------------------------------
# clip_grad_norm_ scales each gradient (mul_ by a 0-d tensor), clip_grad_value_ clamps it, zero_grad(set_to_none=
# False) zeroes it, each in place: on a SparseTensor they act on its stored values, which gives the dense result
# wherever the unstored zeros stay zero (a clamp whose range excludes zero would make them nonzero: not here).
def _scalar(v) -> bool:
    return not isinstance(v, torch.Tensor) or (v.dim() == 0 and not isinstance(v, SparseTensor))


def _nan(v) -> bool:
    return v is not None and bool(torch.as_tensor(v).isnan().any())


@_rule(aten.mul_.Tensor)
@_rule(aten.mul_.Scalar)
def _mul_inplace(x, other):
    if not isinstance(x, SparseTensor) or not _scalar(other):
        return NotImplemented
    if not bool(torch.as_tensor(other).isfinite().all()):
        # 0 * inf is NaN: the unstored zeros would become NaN, which a SparseTensor cannot hold in place (A * inf,
        # out of place, gives a dense result). Scaling only the stored values was silently wrong (helper-68).
        return NotImplemented
    x._values.mul_(other)
    return x


@_rule(aten.zero_.default)
def _zero_inplace(x):
    if not isinstance(x, SparseTensor):
        return NotImplemented
    x._values.zero_()
    return x


@_rule(aten.clamp_.default)
def _clamp_inplace(x, min=None, max=None):  # noqa: A002 - aten's argument names
    if not isinstance(x, SparseTensor) or (min is not None and min > 0) or (max is not None and max < 0):
        return NotImplemented
    if _nan(min) or _nan(max):  # torch makes every element NaN, the unstored zeros too
        return NotImplemented
    x._values.clamp_(min, max)
    return x


def _each(single):
    """A foreach op over a list: the single-tensor op on each (a SparseTensor's by the rules above)."""
    def apply(tensors, *args):
        if not any(isinstance(t, SparseTensor) for t in tensors):
            return NotImplemented
        if not args:  # (zero_)
            for t in tensors:
                single(t)
            return None
        each = args[0] if isinstance(args[0], (list, tuple)) else [args[0]] * len(tensors)
        for t, a in zip(tensors, each):
            single(t, a)
        return None
    return apply


_rule(aten._foreach_mul_.Scalar)(_each(aten.mul_.Scalar))
_rule(aten._foreach_mul_.Tensor)(_each(aten.mul_.Tensor))
_rule(aten._foreach_mul_.ScalarList)(_each(aten.mul_.Scalar))
_rule(aten._foreach_zero_.default)(_each(aten.zero_.default))
_rule(aten._foreach_clamp_min_.Scalar)(_each(lambda t, v: aten.clamp_.default(t, v, None)))
_rule(aten._foreach_clamp_max_.Scalar)(_each(lambda t, v: aten.clamp_.default(t, None, v)))


# --- `.data =` and share_memory_ (torch functions, caught above autograd) -------------------------------------
def _set_data(x, src):
    """`x.data = src` (vector_to_parameters, prune.remove): torch would swap the wrapper's impl and leave the
    buffers and values held in Python alone, silently. Take src's pattern and values in x's format, as copy_."""
    if not isinstance(x, SparseTensor):
        return NotImplemented
    if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(x.shape) or src.dtype != x.dtype:
        raise NotImplementedError(
            f"scorch: `.data =` on a SparseTensor takes a tensor of the same shape {tuple(x.shape)} and dtype "
            f"{x.dtype}, got {type(src).__name__} {tuple(getattr(src, 'shape', ()))} "
            f"{getattr(src, 'dtype', None)}; assign a new Parameter instead")
    with torch.no_grad():
        torch.ops.aten.copy_.default(x, src.detach())


def _share_memory(x):
    """Tensor.share_memory_(): torch's own reads the wrapper's (absent) storage and crashes (SIGSEGV)."""
    if not isinstance(x, SparseTensor):
        return NotImplemented
    for b in x._buffer_list():
        b.share_memory_()
    x._values.share_memory_()
    return x


_TORCH_FUNCTION_RULES[torch.Tensor.data.__set__] = _set_data
_TORCH_FUNCTION_RULES[torch.Tensor.share_memory_] = _share_memory


# --- copy_ into a SparseTensor ---------------------------------------------------------------------------
@_rule(aten.copy_.default)
def _copy_into(x, src, non_blocking=False):  # noqa: ARG001
    """x.copy_(src) into a SparseTensor (load_state_dict does this): x takes src's pattern and values, in x's
    format and dtype; the values are copied in place when the pattern is the same."""
    if not isinstance(x, SparseTensor):
        return NotImplemented
    if tuple(src.shape) != tuple(x.shape):
        raise RuntimeError(f"copy_: a SparseTensor of shape {tuple(x.shape)} cannot take a tensor of shape "
                           f"{tuple(src.shape)}")
    src = sparse(src.detach() if not isinstance(src, SparseTensor) else src, x.format, index_dtype=x.index_dtype)
    same = src.format == x.format and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(src._buffer_list(), x._buffer_list()))
    if same:
        x._values.copy_(src._values)
        return x
    for name, b in zip(src._buffer_names, src._buffer_list()):
        setattr(x, name, b.clone())
    x._values = src._values.to(x.dtype, copy=True)
    x._pattern_changed()
    return x


# --- torch functions caught above autograd (SparseTensor.__torch_function__) ---------------------------------
# (These look einsum up in frontend at each call, so a wrapper installed there (a counting test, a profiler)
# sees every product they route.)
# Products caught above autograd, so they run through einsum/compute, whose gradients for a sparse operand are
# taken at its stored positions (as torch.sparse's are); below autograd, ATen's formulas for mm/addmm would
# hand a SparseTensor leaf a dense gradient.
_PRODUCT_EQUATIONS = {(2, 2): "ij,jk->ik", (2, 1): "ij,j->i", (1, 2): "j,jk->k"}


def _product(a, b, *, only_2d: bool = False):
    if not (isinstance(a, SparseTensor) or isinstance(b, SparseTensor)):
        return NotImplemented
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    eq = _PRODUCT_EQUATIONS.get((a.dim(), b.dim()))
    if eq is None or (only_2d and (a.dim(), b.dim()) != (2, 2)):
        return NotImplemented
    return frontend.einsum(eq, a, b)


def _mm_above_autograd(a, b, *args, **kwargs):
    if args or kwargs:
        return NotImplemented
    return _product(a, b, only_2d=True)


def _matmul_above_autograd(a, b, *args, **kwargs):
    if args or kwargs:
        return NotImplemented
    return _product(a, b)


def _sparse_mm_above_autograd(a, b, reduce=None):
    if reduce is not None:
        return _sparse_mm_reduce(a, b, reduce)
    return _product(a, b, only_2d=True)


def _addmm_above_autograd(bias, a, b, *args, beta=1, alpha=1, out=None):
    """beta * bias + alpha * (a @ b) (torch.addmm, torch.sparse.addmm, Tensor.addmm)."""
    if args or out is not None or not isinstance(bias, torch.Tensor):
        return NotImplemented
    if not (isinstance(a, SparseTensor) or isinstance(b, SparseTensor)):
        return NotImplemented
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        return NotImplemented
    product = _product(a, b, only_2d=True)
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # torch ignores the bias then (NaN in it too)
        return product
    if isinstance(product, SparseTensor) or isinstance(bias, SparseTensor):
        return NotImplemented  # a sparse sum: the ATen rule (compute) keeps it sparse
    return product + (bias if beta == 1 else bias * beta)


def _linear_above_autograd(x, weight, bias=None):
    """F.linear with a SparseTensor weight (STen and torch.sparse models hold such weights): x @ weight^T."""
    if not isinstance(weight, SparseTensor) or isinstance(x, SparseTensor) or weight.dim() != 2:
        return NotImplemented
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or isinstance(bias, SparseTensor):
        return NotImplemented
    out = frontend.einsum("...k,nk->...n", x, weight)
    return out if bias is None else out + bias


def _einsum_whole(*args, **kwargs):
    return frontend.einsum(*args, **kwargs)


def _torch_sparse_sum(input, dim=None, dtype=None):
    """torch.sparse.sum over a SparseTensor (the way GCN code gets degrees): its stored entries summed, as an
    einsum; torch's own reached ATen's COO internals and raised a dispatch error."""
    if not isinstance(input, SparseTensor):
        return NotImplemented
    x = input if dtype is None else input.with_values(input.differentiable_values().to(dtype))
    if dim is None:
        return _sum(x)
    return _sum_dims(x, [dim] if isinstance(dim, int) else list(dim))


def _torch_sparse_softmax(log: bool):
    def apply(input, dim, dtype=None):
        """torch.sparse.softmax / log_softmax over a SparseTensor: along `dim`, over the stored entries only
        (unstored ones count as -inf, as torch.sparse's do); the result has input's pattern."""
        if not isinstance(input, SparseTensor):
            return NotImplemented
        if not all(lv["unique"] for lv in input.format.levels):
            input = input.to_format("coo")  # (a non-unique format's duplicates summed first, as torch coalesces)
        d = _wrap_dim(dim, input.dim())
        v = input.differentiable_values()
        v = v if dtype is None else v.to(dtype)
        coords = input.coordinates()
        key = torch.zeros_like(coords[0])
        for k in range(input.dim()):  # the entry's coordinates along every other dimension, as one number
            if k != d:
                key = key * input.shape[k] + coords[k]
        _, group = torch.unique(key, return_inverse=True)
        groups = int(group.max()) + 1 if group.numel() else 0
        top = torch.full((groups,), -torch.inf, dtype=v.dtype).scatter_reduce(0, group, v.detach(), "amax")
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        shifted = v - top[group]
        total = torch.zeros(groups, dtype=v.dtype).index_add(0, group, shifted.exp())
        out = shifted - total.log()[group] if log else shifted.exp() / total[group]
        return input.with_values(out)

    return apply


def _not_for_sparse_tensors(name: str, instead: str):
    def refuse(*args, **kwargs):
        if not any(isinstance(a, SparseTensor) for a in args):
            return NotImplemented
        raise NotImplementedError(f"scorch: {name} has no SparseTensor form (its result is torch.sparse's own "
                                  f"layout): {instead}, or call it on x.to_torch()")
    return refuse


_TORCH_FUNCTION_RULES.update({
    # (they reached ATen's sparse kernels with a wrapper and raised its dispatch errors, helper-48)
    torch.smm: _not_for_sparse_tensors("torch.smm", "use A @ B for the product (a SparseTensor when B is sparse)"),
    torch.hspmm: _not_for_sparse_tensors("torch.hspmm", "use A @ B for the product"),
    torch.sspaddmm: _not_for_sparse_tensors("torch.sspaddmm", "use beta * C + alpha * (A @ B)"),
    torch.Tensor.sspaddmm: _not_for_sparse_tensors("Tensor.sspaddmm", "use beta * C + alpha * (A @ B)"),
    torch._sparse_sum: _torch_sparse_sum,  # (what torch.sparse.sum calls)
    torch.sparse.softmax: _torch_sparse_softmax(False),
    torch.sparse.log_softmax: _torch_sparse_softmax(True),
})


_TORCH_FUNCTION_RULES.update({
    # torch.einsum is decomposed before it reaches __torch_dispatch__; caught here, whole.
    torch.einsum: _einsum_whole,
    torch.functional.einsum: _einsum_whole,
    torch.nn.functional.linear: _linear_above_autograd,
    torch.sparse.mm: _sparse_mm_above_autograd,
    torch.mm: _mm_above_autograd,
    torch.Tensor.mm: _mm_above_autograd,
    torch.matmul: _matmul_above_autograd,
    torch.Tensor.matmul: _matmul_above_autograd,
    torch.Tensor.__matmul__: _matmul_above_autograd,
    torch.addmm: _addmm_above_autograd,
    torch.Tensor.addmm: _addmm_above_autograd,
    torch.sparse.addmm: _addmm_above_autograd,
})


# --- torch.sparse.mm / torch.sparse.addmm on SparseTensors ---------------------------------------------------

@_rule(aten._sparse_addmm.default)
def _sparse_addmm(bias, a, b, *, beta=1, alpha=1):
    """beta * bias + alpha * (a @ b): what torch.sparse.mm (beta = 0) and torch.sparse.addmm call."""
    if not (isinstance(a, SparseTensor) or isinstance(b, SparseTensor)) or a.dim() != 2 or b.dim() != 2:
        return NotImplemented
    if beta == 0:  # torch.sparse.mm: the bias is a zero placeholder and never read (NaN in it is ignored)
        out = frontend.einsum("ij,jk->ik", a, b)
        return out if alpha == 1 else out * alpha
    return _addmm(bias, a, b, beta=beta, alpha=alpha)
