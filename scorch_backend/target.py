"""The target the generated kernels are compiled for.

`native` (the default) compiles for the CPU the process runs on; any compiler architecture name selects
another instruction set, so one machine can measure what another gets: `x86-64-v4` (AVX-512),
`x86-64-v3` (AVX2 + FMA), `x86-64-v2` (SSE4.2), `armv8.2-a`, ...; `generic` is the compiler's baseline and
`scalar` turns Scorch's own vector code off. The environment variable SCORCH_TARGET sets it for a process
(C++ and TorchScript programs included); `set_target` overrides it from Python.

Vector width and register tiles are read from the resolved target, and the kernel cache key includes a hash
of what the compiler enables for it, so kernels for different CPUs never share a cache entry.
"""

from __future__ import annotations

import contextlib
import os
import platform

from . import _C


def set_target(name: str | None) -> None:
    """Compile kernels for `name` from now on in this process (None: back to SCORCH_TARGET or native).
    Raises ValueError for a name the compiler does not accept."""
    _C.set_target(name or "")


def target_name() -> str:
    """The name of the target in effect."""
    return _C.target_name()


def target_info(name: str | None = None) -> dict:
    """The target in effect (or `name`), resolved: flags, arch, ISA features, vector bytes and registers,
    register tile, fingerprint (the cache key's part) and a one-line summary."""
    return _C.target_info(name or "")


# The names torch's own libraries give an instruction set, by the widest vector a target has (x86 only):
# (ATen's CPU capability, MKL's MKL_ENABLE_INSTRUCTIONS, oneDNN's ONEDNN_MAX_CPU_ISA).
# SSE4.2/SSE4.1 are the lowest MKL and oneDNN take, so a plain x86-64 (SSE2) target is held to them.
_TORCH_ISA_NAMES = {32: ("avx2", "AVX2", "AVX2"), 16: ("default", "SSE4_2", "SSE41")}
TORCH_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                       "TORCHINDUCTOR_CPP_MARCH")


def torch_isa_environment(name: str | None = None) -> dict[str, str]:
    """The environment that holds torch's own CPU code to the instruction set of target `name` (default: the
    target in effect), so a benchmark's baseline runs what it would run on a CPU of that kind: ATen's vector
    kernels (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS), oneDNN (ONEDNN_MAX_CPU_ISA) and Inductor's
    generated C++ (its vector ISA follows ATEN_CPU_CAPABILITY, its -march TORCHINDUCTOR_CPP_MARCH).

    Empty when the target's vectors are as wide as this machine's, or off x86. The libraries read these
    variables once, when torch starts: set them before that (`tools.timing.hold_baseline_isa` re-runs a
    benchmark with them)."""
    t, machine = target_info(name), target_info("native")
    if t["arch"] != "x86_64" or t["vector_bytes"] >= machine["vector_bytes"]:
        return {}
    aten, mkl, dnnl = _TORCH_ISA_NAMES.get(t["vector_bytes"], _TORCH_ISA_NAMES[16])
    env = {"ATEN_CPU_CAPABILITY": aten, "MKL_ENABLE_INSTRUCTIONS": mkl, "ONEDNN_MAX_CPU_ISA": dnnl}
    march = [f.split("=", 1)[1] for f in t["flags"] if f.startswith("-march=")]
    if march and march[0] != "native":
        env["TORCHINDUCTOR_CPP_MARCH"] = march[0]
    return env


@contextlib.contextmanager
def using_target(name: str | None):
    """`with sb.using_target("x86-64-v3"): ...` compiles the kernels of the block for that target."""
    before = _C.target_name()
    set_target(name)
    try:
        yield target_info()
    finally:
        set_target(before if before != os.environ.get("SCORCH_TARGET", "native") else None)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(threads: int | None = None) -> str:
    """One line for benchmark output: CPU model, the kernels' target and the thread count."""
    import torch

    t = target_info()
    n = threads if threads is not None else torch.get_num_threads()
    return f"CPU: {cpu_model()} | kernel target: {t['summary']} | threads: {n}"
