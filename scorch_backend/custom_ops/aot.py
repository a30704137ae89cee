"""Ahead-of-time kernels: compile the kernels a workload needs into one bundle file, and load it where no
compiler exists (docs/deploy.md).

    specs = sb.aot.used_kernel_specs()          # after running the workload once, with the JIT
    sb.aot.build_bundle(specs, "model.kernels")  # compiles for the current target (SCORCH_TARGET rules)
    ...
    sb.aot.load_bundle("model.kernels")          # elsewhere: checks, then registers; no compiler needed

`load_bundle` is `torch.ops.scorch.load_kernels`, which TorchScript and C++ programs call the same way. With
`SCORCH_JIT=0` only loaded bundles provide kernels; a kernel none holds raises a RuntimeError naming its spec.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from .. import log as _log
from .._native import _C


def build_bundle(specs: Iterable[str], path: str | os.PathLike, *, target: str | None = None,
                 workers: int = 2) -> dict:
    """Compile the kernels of `specs` (repeats dropped) into one bundle file at `path`, written atomically.

    `target` is a Scorch target name (docs/targets.md); by default the current one (`sb.set_target`, else
    `SCORCH_TARGET`, else native). A target this CPU cannot run may be named to build for another machine;
    such a bundle is refused when loaded here. Build for the oldest CPU the deployment will meet (for
    example "x86-64-v3") rather than "native". Returns what `bundle_info` returns.
    """
    specs = list(specs)
    if not all(isinstance(s, str) for s in specs):
        raise TypeError("build_bundle: specs must be kernel spec strings")
    if not specs:
        raise ValueError("build_bundle: no kernel specs given")
    return _C.build_kernel_bundle(specs, os.fspath(path), target or "", int(workers))


def load_bundle(path: str | os.PathLike) -> int:
    """Check a bundle and register its kernels in this process; returns how many it holds.

    A bundle that is damaged, truncated, of another format version, built for an instruction set this CPU
    lacks, or made by a Scorch that generates different code for its specs is refused with a ValueError that
    says why; nothing of it is run.
    """
    n = int(torch.ops.scorch.load_kernels(os.fspath(path)))
    _log.drain()  # the runtime's line for the bundle (SCORCH_DEBUG=1), now rather than at exit
    return n


def load_bundle_bytes(data: bytes, name: str = "<memory>") -> int:
    """`load_bundle` for a bundle held in memory (`torch.ops.scorch.load_kernel_bytes`); `name` stands for its
    path in messages."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    n = int(torch.ops.scorch.load_kernel_bytes(t, name))
    _log.drain()
    return n


# The name of the bundle inside a TorchScript archive (an extra file); scorch_deploy reads it too.
EXTRA_FILE = "scorch/kernels"


def save_model(module: torch.jit.ScriptModule, path: str | os.PathLike, bundle: str | os.PathLike | bytes) -> None:
    """`torch.jit.save` with a kernel bundle (a path or its bytes) stored inside the archive as EXTRA_FILE."""
    data = bundle if isinstance(bundle, (bytes, bytearray)) else open(os.fspath(bundle), "rb").read()
    torch.jit.save(module, os.fspath(path), _extra_files={EXTRA_FILE: bytes(data)})


def load_model(path: str | os.PathLike) -> tuple[torch.jit.ScriptModule, int]:
    """`torch.jit.load`, then the kernel bundle stored inside the archive, if any, is checked and loaded.
    Returns the module and the number of kernels its bundle holds (0: it has none)."""
    extra = {EXTRA_FILE: ""}
    module = torch.jit.load(os.fspath(path), _extra_files=extra)
    data = extra[EXTRA_FILE]
    if isinstance(data, str):
        data = data.encode("latin-1")
    return module, (load_bundle_bytes(data, f"{os.fspath(path)}:{EXTRA_FILE}") if data else 0)


def bundle_info(path: str | os.PathLike) -> dict:
    """Check a bundle exactly as loading would (without loading it) and describe it: target, instruction-set
    features, compiler, and (spec, source hash) per kernel. Raises the ValueError loading would raise."""
    return _C.inspect_kernel_bundle(os.fspath(path))


def used_kernel_specs() -> list[str]:
    """Specs of every kernel this process has obtained so far (compiled, from the disk cache, or from a
    bundle), in first-use order: run a workload once (forward and backward if it trains), then bundle these."""
    return list(_C.used_kernel_specs())


def bundled_kernels() -> list[tuple[str, str]]:
    """(spec, bundle path) of every kernel registered by the bundles loaded in this process."""
    return [tuple(x) for x in _C.bundled_kernels()]


__all__ = ["build_bundle", "load_bundle", "load_bundle_bytes", "save_model", "load_model", "EXTRA_FILE", "bundle_info",
           "used_kernel_specs", "bundled_kernels"]
