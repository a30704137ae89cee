"""`scorch::masked_attention`: softmax(mask ? q k^T * scale : -inf) @ v, computed only where the mask is set.

The backend rewrites the dense masked-attention idiom (scores = q @ k^T * c; scores.masked_fill(~mask, -inf);
softmax; @ v) into this op when the mask is sparse. It runs three sparse steps over the mask's pattern
(batched CSR, broadcast over the batch dimensions): the sampled product q k^T at the stored positions
(SDDMM), a softmax over each row's stored scores, and the product of those probabilities with v (SpMM). The
backward pass is sparse as well: dv = P^T g, dP = (g v^T) sampled at the pattern, the softmax backward on the
stored values, then dq = dS k and dk = dS^T q. Where the mask is too dense to pay, the dense formula runs.

A row with no stored position is NaN, as in the dense formula (softmax over only -inf).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from . import _C, cost_model
from . import log as _log
from . import region as _region


def _flat(q, k, v):
    batch = q.shape[:-2]
    nb = math.prod(batch) if len(batch) else 1
    return batch, q.reshape(nb, q.shape[-2], q.shape[-1]), k.reshape(nb, k.shape[-2], k.shape[-1]), \
        v.reshape(nb, v.shape[-2], v.shape[-1])


def _pattern(mask: torch.Tensor, nb: int, dtype: torch.dtype, frozen: bool = False):
    """(density, the mask's pattern compressed and broadcast over nb): masks share the region op's small cache
    of data inputs (C++)."""
    return _C.region_compressed(mask, "aij", "pattern", 1, [nb], dtype, frozen)


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _rows(P) -> tuple[torch.Tensor, torch.Tensor, int]:
    pos = P.level_buffers["pos2"].to(torch.int64)
    counts = pos[1:] - pos[:-1]
    nrows = counts.numel()
    return torch.repeat_interleave(torch.arange(nrows), counts), counts, nrows


_logger = _log.get("region")
_last: list = []  # the probabilities of the last forward pass, for its backward pass (see _probabilities)


@functools.lru_cache(maxsize=8)
def _ramp(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=dtype) / max(n, 1)


def _checksum(t: torch.Tensor) -> tuple:
    flat = t.detach().reshape(-1)
    return float(flat.sum()), float(torch.dot(flat, _ramp(flat.numel(), flat.dtype)))


def _version_key(q, k, mask, scale) -> tuple:
    # Address, layout and version counter, plus checksums of q and k: writes that bypass the version
    # counter (through .data, as gradcheck's perturbations do) change the checksums.
    return tuple((_key(t), t._version) for t in (q, k, mask)) + (scale, _checksum(q), _checksum(k))


def _keep_alive(q, k, mask) -> tuple:
    # Holding aliases keeps the memory from being reused by new tensors while the entry exists, so a key
    # (address, layout, version) cannot match a different tensor.
    return tuple(t.detach() for t in (q, k, mask))


def _probabilities(P, q3, k3, scale: float, key: tuple, alive: tuple):
    """Each stored score's softmax probability within its row, the row of each, and the rows' counts. The
    forward pass keeps its result (one entry: the last call) so that the backward pass, which gets the same
    q, k and mask at the same versions, does not compute the sampled product again."""
    if _last and _last[0][0] == key:
        return _last[0][1]
    s = _kernel("aij,aie,aje->aij", [P, q3, k3], None).stored_values * scale
    row, counts, nrows = _rows(P)
    m = torch.full((nrows,), float("-inf"), dtype=s.dtype).scatter_reduce(0, row, s, "amax", include_self=True)
    e = torch.exp(s - m[row])
    total = torch.segment_reduce(e, "sum", lengths=counts)
    result = (e / total[row], row, counts)
    _last[:] = [(key, result, alive)]
    return result


def _dense_forward(q, k, v, mask, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(mask == 0, float("-inf")), -1) @ v


def _dense_backward(q, k, v, mask, scale, g):
    """The gradients of the dense formula, written out (an op's implementation runs below autograd)."""
    scores = ((q @ k.transpose(-2, -1)) * scale).masked_fill(mask == 0, float("-inf"))
    p = torch.softmax(scores, -1)
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    return [(ds @ k).contiguous(), (ds.transpose(-2, -1) @ q).contiguous(), dv.contiguous()]


def _use_dense(mask, q, k) -> bool:
    density = _C.region_density(mask)
    dense, _ = cost_model.choose_dense([density], q.numel() + k.numel() + mask.numel())
    return dense


def _check(q, k, v, mask):
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"masked_attention: q, k, v must have the same rank >= 2, got {q.dim()}, {k.dim()}, {v.dim()}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"masked_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                         "not agree")
    if tuple(mask.shape) != (q.shape[-2], k.shape[-2]):
        raise ValueError(f"masked_attention: mask of shape {tuple(mask.shape)}, expected "
                         f"{(q.shape[-2], k.shape[-2])}")


# The kernels the sparse path runs: (equation, output format: "" lets the planner choose, "strided" dense).
# Operand letters: a batch, i query rows, j key rows, e the q/k width, f the v width; "aij" is the mask's
# pattern (batched CSR), the others dense.
FORWARD_KERNELS = (("aij,aie,aje->aij", ""), ("aij,ajf->aif", "strided"))
BACKWARD_KERNELS = (("aij,aif->ajf", "strided"), ("aij,aif,ajf->aij", ""), ("aij,aje->aie", "strided"),
                    ("aij,aie->aje", "strided"))


def kernel_specs(q_shape, k_shape, v_shape, dtype: torch.dtype, training: bool) -> list[str]:
    """The specs of the kernels a call on q, k, v of these shapes runs on the sparse path (and its backward
    pass when `training`), found without data: for compiling them ahead of the first call."""
    from . import _C

    nb = math.prod(q_shape[:-2]) if len(q_shape) > 2 else 1
    sizes = {"a": nb, "i": q_shape[-2], "j": k_shape[-2], "e": q_shape[-1], "f": v_shape[-1]}
    pattern = _region._compressed_format(3)
    specs = []
    for eq, out in FORWARD_KERNELS + (BACKWARD_KERNELS if training else ()):
        descs = []
        for k, letters in enumerate(eq.split("->")[0].split(",")):
            shape = [int(sizes[c]) for c in letters]
            descs.append((pattern if k == 0 else "strided", shape, math.prod(shape)))
        specs.append(_C.plan_einsum(eq, descs, out, dtype == torch.float64, False)["spec"])
    return specs


def _kernel(eq: str, args: list, out_format):
    """One sparse step; at SCORCH_DEBUG=2 its loop IR goes to the dump folder (once per kernel)."""
    from .frontend import _einsum

    if _log.dumping():
        _region.note_kernel("masked_attention", eq, args, out_format)
    return _einsum(eq, args, out_format, choose=False)


def capture_key(scale: float) -> str:
    return f"masked_attention scale={scale!r}"


def run(q, k, v, mask, scale: float, force: str | None = None) -> torch.Tensor:
    """The forward pass; `force` ("dense" or "sparse") overrides the run-time choice."""
    _check(q, k, v, mask)
    for rec in _region._captures:
        rec.append((capture_key(scale), [t.detach() for t in (q, k, v, mask)]))
    dense = _use_dense(mask, q, k) if force is None else force == "dense"
    if _logger.isEnabledFor(logging.INFO):
        if not _log.once(_logger, ("masked_attention", tuple(mask.shape), dense),
                         "masked_attention (mask %s) runs %s", tuple(mask.shape),
                         "the dense formula (mask not sparse enough)" if dense else "the sparse kernels"):
            _logger.debug("masked_attention: %s", "dense" if dense else "sparse")
    if dense or q.numel() == 0 or v.numel() == 0:
        return _dense_forward(q, k, v, mask, scale).contiguous()
    batch, q3, k3, v3 = _flat(q, k, v)
    _, P = _pattern(mask, q3.shape[0], q.dtype)
    p, _, counts = _probabilities(P, q3, k3, scale, _version_key(q, k, mask, scale),
                                    _keep_alive(q, k, mask))
    out = _kernel("aij,ajf->aif", [P.with_values(p), v3], "dense")
    out = out.masked_fill((counts == 0).reshape(out.shape[0], out.shape[1], 1), float("nan"))
    return _region._owning(out.reshape(*batch, q.shape[-2], v.shape[-1]))


@torch.library.custom_op("scorch::masked_attention", mutates_args=())
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return run(q, k, v, mask, scale)


@masked_attention.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("scorch::masked_attention_backward", mutates_args=())
def masked_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                              scale: float, grad: torch.Tensor) -> list[torch.Tensor]:
    if _use_dense(mask, q, k) or q.numel() == 0 or v.numel() == 0:
        return _dense_backward(q, k, v, mask, scale, grad)
    batch, q3, k3, v3 = _flat(q, k, v)
    g3 = grad.reshape(q3.shape[0], q3.shape[1], v3.shape[-1])
    _, P = _pattern(mask, q3.shape[0], q.dtype)
    p, row, counts = _probabilities(P, q3, k3, scale, _version_key(q, k, mask, scale),
                                    _keep_alive(q, k, mask))
    A = P.with_values(p)
    dv = _kernel("aij,aif->ajf", [A, g3], "dense")
    dp = _kernel("aij,aif,ajf->aij", [P, g3, v3], None).stored_values
    weighted = torch.segment_reduce(p * dp, "sum", lengths=counts)
    ds = P.with_values(p * (dp - weighted[row]) * scale)
    dq = _kernel("aij,aje->aie", [ds, k3], "dense")
    dk = _kernel("aij,aie->aje", [ds, q3], "dense")
    return [dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)]


@masked_attention_backward.register_fake
def _(q, k, v, mask, scale, grad):
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]  # contiguous, as the real ones


def _setup(ctx, inputs, output):
    q, k, v, mask, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, mask)


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.scorch.masked_attention_backward(q, k, v, mask, ctx.scale, grad.contiguous())
    return dq, dk, dv, None, None


masked_attention.register_autograd(_backward, setup_context=_setup)
