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

from ._native import _C


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
    return int(torch.ops.scorch.load_kernels(os.fspath(path)))


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


__all__ = ["build_bundle", "load_bundle", "bundle_info", "used_kernel_specs", "bundled_kernels"]
