"""Fake (meta) implementations of the scorch ops, for torch.compile and torch.library.opcheck.

Sizes that depend on the data (the stored entries of a sparse result, the coordinates of a packed tensor)
are unbacked symbolic sizes from the fake-tensor context; everything else follows from the arguments.
"""

from __future__ import annotations

import functools

import torch

from . import _C
from .format import Format



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


@functools.lru_cache(maxsize=4096)
def _spec_info(spec: str) -> dict:
    return _C.spec_info(spec)  # the spec is parsed by the C++ KernelSpec, the one parser of its grammar


@torch.library.register_fake("scorch::kernel")
def _kernel_fake(spec, inputs, sizes, num_threads):
    info = _spec_info(spec)
    out_shape = [sizes[v] for v in info["out_vars"]]
    device = inputs[0].device if inputs else torch.device("cpu")
    value_dtype = torch.float64 if info["f64"] else torch.float32
    if info["out_format"] == "strided":
        return torch.empty(out_shape, dtype=value_dtype, device=device), []
    index_dtype = torch.int64 if info["idx64"] else torch.int32
    buffers, count = _fake_buffers(Format(info["out_format"], len(out_shape)), out_shape, index_dtype, device)
    return torch.empty(count, dtype=value_dtype, device=device), buffers


@torch.library.register_fake("scorch::pack")
def _pack_fake(indices, values, size, format, index_dtype):
    buffers, count = _fake_buffers(Format(format, len(size)), list(size), index_dtype, values.device)
    return buffers, values.new_empty(count)


@torch.library.register_fake("scorch::unpack")
def _unpack_fake(buffers, values, size, format):
    return torch.empty(len(size), values.shape[0], dtype=torch.int64, device=values.device)
