"""Fake (meta) implementations of the scorch ops, for torch.compile and torch.library.opcheck.

Sizes that depend on the data (the stored entries of a sparse result, the coordinates of a packed tensor)
are unbacked symbolic sizes from the fake-tensor context; everything else follows from the arguments.
"""

from __future__ import annotations

import torch

from . import _C
from .format import Format

_INDEX = {"i32": torch.int32, "i64": torch.int64}
_VALUE = {"f32": torch.float32, "f64": torch.float64}


def _fake_buffers(fmt: Format, shape, index_dtype, device):
    """Index buffers of `fmt` for `shape`, with an unbacked size wherever the count depends on the data."""
    ctx = torch.library.get_ctx()
    buffers, count = [], 1
    for lv in fmt.levels:
        extent = shape[lv["dim"]] if lv["part"] == "whole" else (
            shape[lv["dim"]] // lv["block"] if lv["part"] == "outer" else lv["block"])
        if lv["kind"] == "dense":
            count = count * extent
        elif lv["kind"] == "compressed":
            buffers.append(torch.empty(count + 1, dtype=index_dtype, device=device))
            count = ctx.new_dynamic_size()
            buffers.append(torch.empty(count, dtype=index_dtype, device=device))
        else:  # singleton and other kinds keep one coordinate per position
            buffers.append(torch.empty(count, dtype=index_dtype, device=device))
    return buffers, count


@torch.library.register_fake("scorch::kernel")
def _kernel_fake(spec, inputs, sizes, num_threads):
    parts = [p.strip() for p in spec.split(";")]
    statement, out, vt, it = parts[0], parts[-3].split("=", 1)[1], parts[-2], parts[-1]
    n = len(parts) - 4
    info = _C.statement_info(statement, n)
    out_shape = [sizes[v] for v in info["out_vars"]]
    device = inputs[0].device if inputs else torch.device("cpu")
    if out == "strided":
        return torch.empty(out_shape, dtype=_VALUE[vt], device=device), []
    buffers, count = _fake_buffers(Format(out, len(out_shape)), out_shape, _INDEX[it], device)
    return torch.empty(count, dtype=_VALUE[vt], device=device), buffers


@torch.library.register_fake("scorch::pack")
def _pack_fake(indices, values, size, format, index_dtype):
    buffers, count = _fake_buffers(Format(format, len(size)), list(size), index_dtype, values.device)
    return buffers, values.new_empty(count)


@torch.library.register_fake("scorch::unpack")
def _unpack_fake(buffers, values, size, format):
    return torch.empty(len(size), values.shape[0], dtype=torch.int64, device=values.device)
