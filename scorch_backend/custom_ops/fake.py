"""Fake (meta) implementations of the scorch ops, for torch.compile and torch.library.opcheck.

Sizes that depend on the data (the stored entries of a sparse result, the coordinates of a packed tensor)
are unbacked symbolic sizes from the fake-tensor context; everything else follows from the arguments.
"""

from __future__ import annotations

import functools
import re

import torch

from .. import _C
from ..tensors.format import Format



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


@functools.lru_cache(maxsize=4096)
def _sampled_slots(spec: str):
    """For a kernel whose sparse output is sampled (written at a sparse operand's positions, sharing its index
    buffers; the compiler's schedule says so), the slots of that operand's buffers and values among the
    kernel's inputs; else None. The kernel is compiled (or loaded) to know: the schedule decides."""
    try:
        info = _C.kernel_info(spec)
    except Exception:  # noqa: BLE001 - no kernel to ask (no compiler here): the size stays data-dependent
        return None
    if "output: sampled" not in info["schedule"]:
        return None
    found = re.search(r"pattern of operand t(\d+)", " ".join(map(str, info["reasons"])))
    if found is None:
        return None
    parts = [p.strip() for p in spec.split(";")]
    formats = [p.split("=", 1)[1] for p in parts[1:] if re.match(r"t\d+=", p)]
    tensor_vars = _C.statement_info(parts[0], len(formats))["tensor_vars"]
    at = 0
    for k, (text, vars_) in enumerate(zip(formats, tensor_vars)):
        nb = 0 if text == "strided" else len(Format(text, len(vars_)).buffer_names)
        if k == int(found.group(1)):
            return at, nb
        at += nb + 1
    return None


@torch.library.register_fake("scorch::kernel")
def _kernel_fake(spec, inputs, sizes, num_threads):
    info = _spec_info(spec)
    out_shape = [sizes[v] for v in info["out_vars"]]
    # (a meta operand among CPU ones makes the dispatcher run this kernel: the result must be meta too, never
    # uninitialized CPU memory handed back as if computed)
    first = inputs[0].device if inputs else torch.device("cpu")
    device = next((t.device for t in inputs if t.device.type == "meta"), first)
    value_dtype = torch.float64 if info["f64"] else torch.float32
    if info["out_format"] == "strided":
        return torch.empty(out_shape, dtype=value_dtype, device=device), []
    sampled = _sampled_slots(spec)
    if sampled is not None:  # the operand's pattern: its sizes, symbolic or not, and no data-dependent size
        at, nb = sampled
        return (inputs[at + nb].new_empty(inputs[at + nb].shape, dtype=value_dtype),
                [torch.empty_like(b) for b in inputs[at:at + nb]])
    index_dtype = torch.int64 if info["idx64"] else torch.int32
    buffers, count = _fake_buffers(Format(info["out_format"], len(out_shape)), out_shape, index_dtype, device)
    return torch.empty(count, dtype=value_dtype, device=device), buffers


@torch.library.register_fake("scorch::pack")
def _pack_fake(indices, values, size, format, index_dtype):
    buffers, count = _fake_buffers(Format(format, len(size)), list(size), index_dtype, values.device)
    return buffers, values.new_empty(count)
