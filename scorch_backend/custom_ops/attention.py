"""`scorch::masked_attention`: softmax(mask ? q k^T * scale : -inf) @ v, computed only where the mask is set.

The backend rewrites the dense masked-attention idiom (scores = q @ k^T * c; scores.masked_fill(~mask, -inf);
softmax; @ v) into this op when the mask is sparse. The op is C++ (csrc/torch/attention.cpp: CPU, Meta and
Autograd kernels, and `scorch::masked_attention_backward`); it runs three sparse steps over the mask's pattern
(batched CSR, broadcast over the batch dimensions, compressed once per mask version in the region op's cache):
the sampled product q k^T at the stored positions (SDDMM), a softmax over each row's stored scores, and the
product of those probabilities with v (SpMM). The backward pass is sparse as well: dv = P^T g, dP = (g v^T)
sampled at the pattern, the softmax backward on the stored values, then dq = dS k and dk = dS^T q. Where the
mask is too dense to pay (SCORCH_DISPATCH, the measured crossover), the dense formula runs.

A row with no stored position is NaN, as in the dense formula (softmax over only -inf); its batch entry's dv is
NaN too and dq, dk finite, as torch's gradients of that formula are.

This module keeps what is Python's: the log line of the path taken and explain's recording (hooks the C++ op
calls; neither is needed to run), and the kernel specs for ahead-of-time bundles.
"""

from __future__ import annotations

import math

import torch

from .. import _C
from .. import log as _log
from . import region as _region

masked_attention = torch.ops.scorch.masked_attention  # registered by libscorch_ops (loaded with _C)
masked_attention_backward = torch.ops.scorch.masked_attention_backward

_logger = _log.get("region")


def capture_key(scale: float) -> str:
    return f"masked_attention scale={scale!r}"


def _capture_hook(scale: float, operands) -> None:
    for rec in list(_region._captures):
        rec.append((capture_key(scale), [t.detach() for t in operands]))


def _note_path(path: str, density: float, operands) -> None:
    """The path a call takes (the C++ op calls this while SCORCH_DEBUG >= 1): once per mask shape and path at
    INFO, every call at DEBUG; at SCORCH_DEBUG=2 the sparse kernels' loop IR is dumped (once per kernel)."""
    _log.sync()
    q, k, v, mask = operands
    dense = path == "dense"
    if not dense and _log.dumping():
        nb = math.prod(q.shape[:-2]) if q.dim() > 2 else 1
        _, P = _C.region_compressed(mask, "aij", "pattern", 1, [nb], q.dtype, False)
        q3, k3, v3 = (t.reshape(nb, t.shape[-2], t.shape[-1]) for t in (q, k, v))
        _region.note_kernel("masked_attention", "aij,aie,aje->aij", [P, q3, k3], None)
        _region.note_kernel("masked_attention", "aij,ajf->aif", [P, v3])
    if not _log.once(_logger, ("masked_attention", tuple(mask.shape), dense),
                     "masked_attention (mask %s, density %.3g) runs %s", tuple(mask.shape), density,
                     "the dense formula (mask not sparse enough)" if dense else "the sparse kernels"):
        _logger.debug("masked_attention: %s", path)


_C.install_attention_hooks(_capture_hook, _note_path)


def run(q, k, v, mask, scale: float, force: str | None = None) -> torch.Tensor:
    """The forward pass below autograd; `force` ("dense" or "sparse") overrides the run-time choice."""
    return _C.attention_run(q, k, v, mask, float(scale), force or "")


def _use_dense(mask, q, k) -> bool:
    """Whether a call on these operands runs the dense formula (the C++ op's choice)."""
    return _C.attention_choose(q, k, mask) == "dense"


def stats() -> dict:
    """How many forward and backward calls ran each path since the process started."""
    return _C.attention_stats()


def kernel_specs(q_shape, k_shape, v_shape, dtype: torch.dtype, training: bool) -> list[str]:
    """The specs of the kernels a call on q, k, v of these shapes runs on the sparse path (and its backward
    pass when `training`), found without data: for compiling them ahead of the first call. C++ plans them
    from the same table of kernels the op runs (attention.cpp)."""
    return list(_C.attention_kernel_specs([int(n) for n in q_shape], [int(n) for n in k_shape],
                                          [int(n) for n in v_shape], dtype, bool(training)))
