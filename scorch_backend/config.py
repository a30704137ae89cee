"""The package's environment variables, read in one place and parsed strictly.

Every reader of a SCORCH_* variable in the Python package goes through a function here, so a typo
(`SCORCH_DEBUG=yes`, `SCORCH_DISPATCH=Sparse`, `SCORCH_DENSE_CROSSOVER=abc`) raises a ValueError that names
the variable and the values it accepts, instead of a bare int()/float() error or silently doing the default.
Values are read on every call (tests and users change them at run time); an unset or empty variable means
the default.

    SCORCH_DEBUG            0 (default), 1, 2: the level of the `scorch` logger (scorch_backend/log.py and
                            docs/logging.md). 0: warnings only; 1: INFO, each decision once per compile (regions
                            taken, contractions left dense and why, the run-time path of each region once, each
                            kernel compiled, the cache's decisions); 2: DEBUG, also per-call messages, and dumps:
                            the FX graph and sparsity attributes after every backend pass and the loop IR of
                            every kernel a region uses, written under SCORCH_DUMP_DIR. The C++ runtime reads it
                            too (it prints each kernel it compiles at 1 and more).
    SCORCH_DUMP_DIR         the folder SCORCH_DEBUG=2 writes its dumps to (created if missing); default
                            ./scorch_dump/<date-time>-<pid>/, one per process. The C++ runtime reads it too: the
                            loop IR after each lowering pass goes to $SCORCH_DUMP_DIR/loop_ir (unset: the kernel
                            cache's dumps/loop_ir; docs/loop_ir.md)
    SCORCH_DISPATCH         auto (default) | sparse | dense: the cost model's choice, or one side forced
    SCORCH_DENSE_CROSSOVER  a number in (0, 1]: overrides the calibrated crossover density
    SCORCH_DATA             a folder of real matrices (default ../shared/data beside the checkout)

Read by the C++ runtime (csrc/runtime), which checks its own:

    SCORCH_CACHE_DIR        the kernel and calibration disk cache (default $XDG_CACHE_HOME/scorch, else
                            ~/.cache/scorch)
    SCORCH_TARGET           the CPU kernels are compiled for: native (default), x86-64-v3, scalar, ...
    SCORCH_GATHERS          auto (default) | hardware | soft: how vector loops read elements through an index
                            (x[crd[p]] in a long row's sum): the gather instruction, or vectors built from
                            scalar loads; auto measures both once per process and takes scalar loads where they
                            are 10% faster (runtime/gather_probe.h)
    SCORCH_COMPILE_TIMEOUT  seconds one kernel compile may take (default 300; 0 = no limit)
    SCORCH_SANITIZE         0 (default) | 1: compile kernels with -fsanitize=address,undefined
    SCORCH_THREAD_GRAIN     elements a kernel call must touch per thread it starts (default 2048): small
                            calls run on one thread (an OpenMP team costs more than their work)
    SCORCH_MEASURE          1 (default) | 0: under SCORCH_DISPATCH=auto, a region's first call at each size
                            times its kernel path against the dense one and keeps the faster (logged at INFO);
                            so does an eager einsum's first call whose density is near the crossover
    SCORCH_JIT              1 (default) | 0: with 0 no kernel is compiled or read from the disk cache, only
                            kernels of loaded bundles run (deployment; docs/deploy.md)
    SCORCH_KERNEL_BUNDLES   kernel bundle files separated by ':', loaded at the first kernel no loaded bundle
                            holds (for programs that never call load_kernels; docs/deploy.md)
    CXX                     the C++ compiler kernels are built with (default c++)

Read by the benchmarks and tests only (not by the library):

    SCORCH_FUZZ_AUTO_CASES, SCORCH_FUZZ_ISOLATE, SCORCH_TARGET_FUZZ_CASES, SCORCH_TEST_BACKEND
                            test knobs, each described in the test file that reads it (tests/python)
    SCORCH_SANITIZE_CACHE_DIR
                            the kernel cache scripts/sanitize.sh uses
    SCORCH_BENCH_BASELINE_ISA
                            set by a benchmark when it re-executes itself with torch held to the target's
                            instruction set (scorch_backend/tools/timing.py); not for users
"""

from __future__ import annotations

import math
import os
import re

DISPATCH_MODES = ("auto", "sparse", "dense")


def _raw(name: str) -> str | None:
    v = os.environ.get(name)
    if v is None:
        return None
    v = v.strip(" \t\n\r")  # the blanks settings.cpp strips (str.strip would also take other scripts' spaces)
    return v or None


def debug_level() -> int:
    """SCORCH_DEBUG as a level: 0 (unset, empty, "0") warnings only, 1 each decision once, 2 debug and dumps."""
    v = _raw("SCORCH_DEBUG")
    if v is None:
        return 0
    # ASCII digits only, as the C++ side reads it (settings.cpp): int() also takes "+1", "1_0" and other
    # scripts' digits, which C++ refused at every kernel (helper-55).
    level = int(v) if v.isascii() and v.isdigit() and len(v) <= 9 else -1
    if level < 0:
        raise ValueError(f"SCORCH_DEBUG={os.environ['SCORCH_DEBUG']!r}: expected a non-negative integer "
                         "(0 = quiet, 1 = print decisions and plans, 2 = debug messages and dumps)")
    return level


def dispatch_mode() -> str:
    """SCORCH_DISPATCH: "auto" (the cost model decides, the default), "sparse" or "dense" (forced)."""
    v = _raw("SCORCH_DISPATCH")
    if v is None:
        return "auto"
    if v not in DISPATCH_MODES:
        raise ValueError(f"SCORCH_DISPATCH={os.environ['SCORCH_DISPATCH']!r}: expected one of "
                         f"{', '.join(DISPATCH_MODES)}")
    return v


def dense_crossover_override() -> float | None:
    """SCORCH_DENSE_CROSSOVER as a density in (0, 1], or None when unset (use the calibrated crossover)."""
    v = _raw("SCORCH_DENSE_CROSSOVER")
    if v is None:
        return None
    # Plain decimal notation, the grammar settings.cpp checks too ("0x0.8", "inf", "1_0" are refused by both).
    x = float(v) if re.fullmatch(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", v) else math.nan
    if not (0.0 < x <= 1.0):
        raise ValueError(f"SCORCH_DENSE_CROSSOVER={os.environ['SCORCH_DENSE_CROSSOVER']!r}: expected a density, "
                         "a number greater than 0 and at most 1 (e.g. 0.3)")
    return x


def data_dir_override() -> str | None:
    """SCORCH_DATA: a folder of real matrices, or None when unset."""
    return _raw("SCORCH_DATA")


def dump_dir_override() -> str | None:
    """SCORCH_DUMP_DIR: the folder for SCORCH_DEBUG=2's dumps, or None when unset (the default folder).

    A path that exists and is not a folder is refused (dumps would fail later, mid-compile)."""
    v = _raw("SCORCH_DUMP_DIR")
    if v is None:
        return None
    if os.path.exists(v) and not os.path.isdir(v):
        raise ValueError(f"SCORCH_DUMP_DIR={os.environ['SCORCH_DUMP_DIR']!r}: expected a folder (or a path to "
                         "create one at), found a file")
    return v
