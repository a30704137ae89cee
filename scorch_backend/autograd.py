"""Autograd for scorch::kernel, with derivatives derived by the compiler.

The backward of a kernel for out(O) = e asks the C++ differentiate step for the gradient statement of each
operand that needs one and runs it as another compiled kernel. The gradient with respect to a sparse
operand's values is computed only at its stored positions (the statement is sampled by the operand's
pattern, SDDMM-style) and comes back aligned with its values; for a dense operand it is a dense tensor.
"""

from __future__ import annotations

import torch

from . import _C
from .format import Format
from .tensor import SparseTensor


def _parse_spec(spec: str):
    parts = [p.strip() for p in spec.split(";")]
    statement, storages, out = parts[0], parts[1:-3], parts[-3]
    formats = [s.split("=", 1)[1] for s in storages]
    return statement, formats, out.split("=", 1)[1]


def _setup_context(ctx, inputs, output):
    spec, tensors, sizes, num_threads = inputs
    _, buffers = output
    ctx.spec, ctx.sizes, ctx.num_threads = spec, list(sizes), num_threads
    ctx.n_in = len(tensors)
    ctx.wants = [t.requires_grad for t in tensors]
    ctx.save_for_backward(*tensors, *buffers)


def _operands(statement: str, formats, tensors, sizes):
    """Rebuild the kernel's operands (SparseTensors and dense tensors) from its flat inputs."""
    info = _C.statement_info(statement, len(formats))
    operands, slots, at = [], [], 0
    for t, fmt_text in enumerate(formats):
        shape = [sizes[v] for v in info["tensor_vars"][t]]
        if fmt_text == "strided":
            operands.append(tensors[at])
            slots.append(at)
            at += 1
            continue
        fmt = Format(fmt_text, len(shape))
        nb = len(fmt.buffer_names)
        operands.append(SparseTensor(fmt, shape, list(tensors[at:at + nb]), tensors[at + nb], validate=False))
        slots.append(at + nb)
        at += nb + 1
    return operands, slots, [sizes[v] for v in info["out_vars"]]


def _backward(ctx, grad_result, grad_buffers):
    from .frontend import compute

    saved = ctx.saved_tensors
    tensors, out_buffers = saved[: ctx.n_in], saved[ctx.n_in:]
    statement, formats, out_format = _parse_spec(ctx.spec)
    operands, slots, out_shape = _operands(statement, formats, tensors, ctx.sizes)
    if out_format == "strided":
        grad_out = grad_result
    else:
        grad_out = SparseTensor(Format(out_format, len(out_shape)), out_shape, list(out_buffers), grad_result,
                                validate=False)
    grads = [None] * ctx.n_in
    n = len(operands)
    for t, (op, slot) in enumerate(zip(operands, slots)):
        if not ctx.wants[slot]:
            continue
        sparse = isinstance(op, SparseTensor)
        text = _C.differentiate(statement, n, t, sparse)
        values = op.stored_values if sparse else op
        if text is None:
            grads[slot] = torch.zeros_like(values)
            continue
        names = {f"t{k}": o for k, o in enumerate(operands)}
        names[f"t{n}"] = grad_out
        if sparse:
            names[f"t{n + 1}"] = op.with_values(torch.ones_like(values))
        g = compute(text, **names)
        if sparse:
            # The result lies within the operand's pattern; a union with explicit zeros aligns it with the
            # operand's stored values position by position.
            if not isinstance(g, SparseTensor):
                g = _sample_dense(op, g)
            zero = op.with_values(torch.zeros_like(values))
            g = compute("g = Z + R" if op.dim() == 0 else
                        "g({0}) = Z({0}) + R({0})".format(",".join(f"i{d}" for d in range(op.dim()))),
                        Z=zero, R=g.to_format(op.format))
            # (a 0-dimensional operand's union comes back dense: its one value)
            g = g.stored_values if isinstance(g, SparseTensor) else g.reshape(values.shape)
            grads[slot] = g.to(values.dtype)
        else:
            grads[slot] = (g.to_dense() if isinstance(g, SparseTensor) else g).to(values.dtype).reshape(values.shape)
    return None, grads, None, None


def _sample_dense(op: SparseTensor, dense: torch.Tensor) -> SparseTensor:
    coords = op.coordinates()
    return op.with_values(dense[tuple(coords)] if op.dim() else dense.reshape(1))


torch.library.register_autograd("scorch::kernel", _backward, setup_context=_setup_context)


def _to_dense_setup(ctx, inputs, output):
    buffers, values, size, format = inputs
    ctx.size, ctx.format = list(size), format
    ctx.save_for_backward(*buffers, values)


def _to_dense_backward(ctx, grad):
    *buffers, values = ctx.saved_tensors
    coords = torch.ops.scorch.unpack(buffers, values, ctx.size, ctx.format)
    g = grad[tuple(coords)] if ctx.size else grad.reshape(1)
    # torch matches the gradients' structure with the inputs': an empty size (0-dimensional) is an empty list
    return [None] * len(buffers), g.to(values.dtype), None if ctx.size else [], None


# Densifying is differentiable too: the gradient of the values is the dense gradient at their coordinates.
torch.library.register_autograd("scorch::to_dense", _to_dense_backward, setup_context=_to_dense_setup)
