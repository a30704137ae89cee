"""The benchmarks' timing helper: contenders timed in alternation, failures reported, budgets respected."""

import time

import pytest

from scorch_backend.tools.timing import measure, measure_interleaved


def test_contenders_alternate_and_each_gets_its_samples():
    order = []
    fns = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    timings, failed = measure_interleaved(fns, warmup=1, repeat=5, slice_s=0.0)
    assert failed == {}
    assert set(timings) == {"a", "b", "c"}
    assert all(t.n >= 5 and t.warmup == 1 for t in timings.values())
    timed = order[3:]   # after one warm-up call each
    # One call per round (slice 0): every window of three consecutive timed calls holds each contender once.
    for k in range(0, 15, 3):
        assert sorted(timed[k:k + 3]) == ["a", "b", "c"]
    # The order rotates, so no contender always runs first after another one.
    assert len({tuple(timed[k:k + 3]) for k in range(0, 15, 3)}) > 1


def test_a_failing_contender_is_reported_and_the_others_still_timed():
    calls = {"ok": 0, "bad": 0}

    def ok():
        calls["ok"] += 1

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 2:
            raise RuntimeError("boom")

    timings, failed = measure_interleaved({"ok": ok, "bad": bad}, warmup=1, repeat=4, slice_s=0.0)
    assert set(failed) == {"bad"} and "boom" in str(failed["bad"])
    assert "bad" not in timings and timings["ok"].n >= 4


def test_fast_contender_fills_its_slice_and_slow_one_is_cut_by_the_budget():
    fast = {"n": 0}

    def f():
        fast["n"] += 1

    def slow():
        time.sleep(0.03)

    timings, failed = measure_interleaved({"fast": f, "slow": slow}, warmup=0, repeat=3, budget=0.05,
                                          min_samples=2, slice_s=0.01, max_repeat=1000)
    assert failed == {}
    assert 2 <= timings["slow"].n <= 3           # stops once 2 samples spent more than the budget
    assert timings["fast"].n > timings["slow"].n  # many calls per 10 ms slice
    assert timings["slow"].median >= 0.03


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="repeat"):
        measure_interleaved({"a": lambda: None}, repeat=0)
    with pytest.raises(ValueError, match="repeat"):
        measure(lambda: None, repeat=0)
