"""Several threads calling the region op at once on the same cached weight (a model served from a thread pool):
the cache entry's lazily filled parts (its compressed forms, dense layouts, density and row-major copy) are
filled by one thread at a time, and every call returns the right values. The cache is cleared before each
round, so each round's threads race to fill the same fresh entry."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from conftest import random_dense
from scorch_backend import _C
from scorch_backend.custom_ops import region


def _in_threads(n: int, rounds: int, step) -> None:
    """Runs step(i, round) on n threads, the threads starting each round together; fails on the first error
    any thread raised, or when a thread hangs."""
    errors: list = []
    barrier = threading.Barrier(n)

    def worker(i):
        try:
            for r in range(rounds):
                barrier.wait()
                step(i, r)
        except Exception as e:  # noqa: BLE001 -- reported on the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a caller thread hung"
    assert not errors, errors[0]


def _program(name, weight_kind, weight_letters="bc", col_major=True):
    return json.dumps({"operands": [["ac", "dense", False, False, 0, False],
                                    [weight_letters, weight_kind, col_major, True, 0, True]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": name, "label": "thread test"})


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_threads_share_one_weight_entry(monkeypatch, dispatch):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels themselves single-threaded: the threads here are the callers
    try:
        _share_one_weight_entry(dispatch)
    finally:
        torch.set_num_threads(threads)


def _share_one_weight_entry(dispatch):
    w = random_dense((96, 80), 0.1, seed=11)          # (b, c): read compressed, by rows and by columns
    wt = w.t()                                         # a column-major view of the same memory: rows_of copies
    programs = [(_program(f"thr_rows{dispatch}", "sparse", col_major=False), w),
                (_program(f"thr_cols{dispatch}", "sparse", col_major=True), w),
                (_program(f"thr_pattern{dispatch}", "pattern", col_major=False), w),
                (_program(f"thr_dense{dispatch}", "dense", col_major=False), w),
                (_program(f"thr_t{dispatch}", "sparse", weight_letters="cb", col_major=False), wt)]
    xs = [torch.randn(33, 80, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expect = {}
    for i, x in enumerate(xs):
        for j, (text, weight) in enumerate(programs):
            ref_w = (w != 0).to(w.dtype) if "pattern" in text else w
            expect[i, j] = x @ ref_w.t()

    def step(i, r):
        for j in range(len(programs)):
            jj = (j + i + r) % len(programs)
            text, weight = programs[jj]
            out = torch.ops.scorch.region(text, [xs[i], weight])
            torch.testing.assert_close(out, expect[i, jj], rtol=1e-4, atol=1e-4)
        if i == 0:
            region.clear_cache()

    _in_threads(len(xs), 40, step)
    assert _C.region_stats()["cache_hits"] > 0


@pytest.mark.parametrize("name", ["pruned_mlp", "relu_mlp_sparse", "moe"])
def test_compiled_model_called_from_threads(name):
    """A compiled model, compiled once, then called by four threads at once (each with its own batch), every
    result against the model run eagerly on the same batch."""
    from scorch_backend.tools import zoo

    case = getattr(zoo, name)("test")
    model = case.model.eval()
    compiled = torch.compile(model, backend="scorch")
    batches = [case.make_inputs(7 + i) if case.make_inputs else case.inputs for i in range(4)]
    with torch.no_grad():
        for b in batches:  # compiled here, one thread (a batch size of its own may recompile)
            compiled(*b)
        expect = [model(*b) for b in batches]

    def step(i, r):
        with torch.no_grad():
            torch.testing.assert_close(compiled(*batches[i]), expect[i], rtol=1e-4, atol=1e-4)

    _in_threads(len(batches), 10, step)
