"""What a whole region of a compiled model costs against the dense products it replaces: its fixed cost per
call (measured once per process) plus its work at the measured crossover (cost_model.py). The partitioner
asks these before it cuts a region."""

from __future__ import annotations

import functools

from .. import _C
from ..cost_model import agreed, crossover_density, dense_rate
from ..custom_ops import region as _region  # noqa: F401  (the op's Python hooks, which its calls may use)

REGION_OVERHEAD_FALLBACK_S = 20e-6  # where the probe cannot run: measured 13-18 us on a busy 2-core Zen 3


@functools.lru_cache(maxsize=1)
def region_overhead_s() -> float:
    """One scorch::region call's fixed cost on this machine (dispatch, cache checks, plan lookup, the choice),
    measured once per process: the fastest batch of calls of its kernel path on a 2x2 problem, less a torch.mm call
    of the same size (what the dense product it replaces costs at least)."""
    import json
    import time

    import torch

    text = json.dumps({"operands": [["ab", "dense", False, True, 0, False], ["bc", "sparse", True, True, 0, True]],
                       "out": "ac", "coef": 1.0, "frozen": True, "name": "overhead", "label": "cost model probe"})
    a, b = torch.ones(2, 2), torch.eye(2)

    def per_call(f, n=200) -> float:
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                f()
            samples.append((time.perf_counter() - t) / n)
        return min(samples)  # the least disturbed batch: other processes only ever add time

    def kernel_path():  # the op's C++ path with the kernel forced (no density rule, no timing check)
        return _C.region_run(text, [a, b], "sparse")

    try:
        with torch.no_grad():
            kernel_path()
            total = per_call(kernel_path)
            dense = per_call(lambda: torch.mm(a, b))
    except Exception:  # noqa: BLE001 - no kernel can be had (no compiler): a typical figure (Zen 3, 2 threads)
        return agreed("region_overhead_s", REGION_OVERHEAD_FALLBACK_S)
    return agreed("region_overhead_s", max(total - dense, 1e-6))


def region_speedup(dense_fmas: float, density: float, sparse_calls: int = 1, dense_calls: int = 0) -> float:
    """Estimated speedup of a sparse region over the dense products it replaces: the dense time over the
    region's fixed cost per call plus its work, a stored entry costing 1/crossover of a dense multiply-add.
    In training a region also runs its gradients: those that keep a sparse factor (`sparse_calls`, the
    forward one included) and those that do not (`dense_calls`: the gradient of the sparse operand itself)."""
    import torch

    rate = dense_rate(torch.get_num_threads())
    calls = sparse_calls + dense_calls
    t_dense = calls * dense_fmas / rate
    t_sparse = calls * region_overhead_s() + sparse_calls * dense_fmas * density / (rate * crossover_density()) \
        + dense_calls * dense_fmas / rate
    return t_dense / t_sparse


def calls_speedup(dense_fmas: float, call_densities: list) -> float:
    """Estimated speedup of a region over the dense products it replaces, from the calls it makes per step:
    the forward and, in training, one gradient per operand that needs one. Each call does the same number of
    multiply-adds densely; `call_densities` gives, per call, the density of its sparse factors, or None when
    it has none (it runs dense, at the dense rate, and still pays the region's fixed cost). A call whose
    factors are denser than the crossover is costed dense too: the run-time choice runs it so."""
    import torch

    rate = dense_rate(torch.get_num_threads())
    crossover = crossover_density()
    t_dense = len(call_densities) * dense_fmas / rate
    t_sparse = len(call_densities) * region_overhead_s()
    for d in call_densities:
        t_sparse += dense_fmas / rate * (1.0 if d is None else min(d / crossover, 1.0))
    return t_dense / t_sparse
