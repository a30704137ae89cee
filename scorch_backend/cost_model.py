"""When to run dense: the run-time choice between a sparse kernel and dense ATen code.

A product's sparse work is about the dense work times the density of its sparse factors, and a stored
nonzero costs more than a dense element (indices, irregular access). So sparse pays while the product of the
sparse operands' densities stays under a crossover density. The crossover is measured by
`benchmarks/calibrate.py` (SpMM against dense matmul over sizes and densities, same threads) and stored in
`calibration.json` beside this file; SCORCH_DENSE_CROSSOVER overrides it, SCORCH_DISPATCH=sparse|dense forces
a side. Tiny problems, where a dense call is
cheaper than any dispatch, also run dense.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib

_CALIBRATION = pathlib.Path(__file__).with_name("calibration.json")
_FALLBACK_CROSSOVER = 0.3  # used only when the calibration file is missing
TINY_DENSE_ELEMENTS = 4096  # below this many dense elements in all operands, dense wins on overhead alone


@functools.lru_cache(maxsize=1)
def _calibrated() -> float:
    try:
        return float(json.loads(_CALIBRATION.read_text())["dense_crossover_density"])
    except (OSError, KeyError, ValueError):
        return _FALLBACK_CROSSOVER


def crossover_density() -> float:
    env = os.environ.get("SCORCH_DENSE_CROSSOVER")
    return float(env) if env else _calibrated()


def choose_dense(densities: list[float], dense_elements: int) -> tuple[bool, str]:
    """(run dense?, why) for a product whose sparse operands have these densities.

    SCORCH_DISPATCH=sparse (or dense) forces one side, e.g. to test the kernels themselves."""
    forced = os.environ.get("SCORCH_DISPATCH", "auto")
    if forced in ("sparse", "dense"):
        return forced == "dense", f"SCORCH_DISPATCH={forced}"
    if not densities:
        return False, "no sparse operand"
    combined = math.prod(densities)
    threshold = crossover_density()
    if dense_elements <= TINY_DENSE_ELEMENTS:
        return True, f"tiny problem ({dense_elements} dense elements): dense ATen code has less overhead"
    if combined >= threshold:
        return True, (f"sparse operands' combined density {combined:.3g} >= crossover {threshold:.3g} "
                      "(benchmarks/calibrate.py): dense is faster")
    return False, f"combined density {combined:.3g} < crossover {threshold:.3g}: sparse kernel"


# --- whole regions of a compiled model ------------------------------------------------------------------
REGION_OVERHEAD_S = 150e-6  # one scorch::region call's fixed cost (Python dispatch, autograd wrapper, cache
                            # checks, plan lookups): 100-200 us over the kernel itself on the zoo's pruned MLP


@functools.lru_cache(maxsize=8)
def dense_rate(threads: int) -> float:
    """Multiply-adds per second of a dense float32 matmul on this machine with `threads` threads (measured
    once per process: a 384^3 product after a warm-up)."""
    import time

    import torch

    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 384**3 / max(best, 1e-9)


def region_speedup(dense_fmas: float, density: float, sparse_calls: int = 1, dense_calls: int = 0) -> float:
    """Estimated speedup of a sparse region over the dense products it replaces: the dense time over the
    region's fixed cost per call plus its work, a stored entry costing 1/crossover of a dense multiply-add.
    In training a region also runs its gradients: those that keep a sparse factor (`sparse_calls`, the
    forward one included) and those that do not (`dense_calls`: the gradient of the sparse operand itself)."""
    import torch

    rate = dense_rate(torch.get_num_threads())
    calls = sparse_calls + dense_calls
    t_dense = calls * dense_fmas / rate
    t_sparse = calls * REGION_OVERHEAD_S + sparse_calls * dense_fmas * density / (rate * crossover_density()) \
        + dense_calls * dense_fmas / rate
    return t_dense / t_sparse
