"""`scorch_backend.compile`: torch.compile with the Scorch backend for models that take or hold torch.sparse
tensors (their sparse parameters, buffers and arguments become SparseTensors first)."""

from __future__ import annotations

import functools

import torch

from ..tensors.interop import _InputCache, convert_inputs, convert_module
from . import backend as _backend  # noqa: F401  (registers the backend "scorch" with torch.compile)


def compile(model, *, options: dict | None = None, **torch_compile_kwargs):  # noqa: A001 - as torch.compile
    """torch.compile(model, backend="scorch", ...) for models that take or hold torch.sparse tensors.

    An nn.Module has its sparse parameters and buffers converted in place (`convert_module`) and comes back as
    torch.compile's module, with a pre-hook converting sparse arguments; a function comes back wrapped the
    same way. Other keyword arguments (fullgraph, dynamic, ...) go to torch.compile."""
    backend = torch_compile_kwargs.pop("backend", "scorch")
    if backend != "scorch":
        raise ValueError(f"scorch_backend.compile compiles with backend='scorch', got backend={backend!r}")
    cache = _InputCache()
    if isinstance(model, torch.nn.Module):
        convert_module(model)
        compiled = torch.compile(model, backend="scorch", options=options, **torch_compile_kwargs)

        def convert_call(_module, args, kwargs):
            return convert_inputs(args, kwargs, cache)

        compiled.register_forward_pre_hook(convert_call, with_kwargs=True)
        return compiled
    if not callable(model):
        raise TypeError(f"compile takes an nn.Module or a function, got {type(model).__name__}")
    compiled = torch.compile(model, backend="scorch", options=options, **torch_compile_kwargs)

    @functools.wraps(model)
    def run(*args, **kwargs):
        args, kwargs = convert_inputs(args, kwargs, cache)
        return compiled(*args, **kwargs)

    return run
