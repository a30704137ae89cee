"""Autograd of scorch::to_dense. (The kernel op's autograd is C++: csrc/torch/kernel_autograd.cpp, with the
gradient statements derived by the compiler's differentiate step.)"""

from __future__ import annotations

import torch

from .._native import ops


def _to_dense_setup(ctx, inputs, output):
    buffers, values, size, format = inputs
    ctx.size, ctx.format = list(size), format
    ctx.save_for_backward(*buffers, values)


def _to_dense_backward(ctx, grad):
    *buffers, values = ctx.saved_tensors
    coords = ops.unpack(buffers, values, ctx.size, ctx.format)
    g = grad[tuple(coords)] if ctx.size else grad.reshape(1)
    # torch matches the gradients' structure with the inputs': an empty size (0-dimensional) is an empty list
    return [None] * len(buffers), g.to(values.dtype), None if ctx.size else [], None


# Densifying is differentiable too: the gradient of the values is the dense gradient at their coordinates.
torch.library.register_autograd("scorch::to_dense", _to_dense_backward, setup_context=_to_dense_setup)
