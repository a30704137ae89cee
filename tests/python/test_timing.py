"""The benchmarks' timing helper: contenders timed in alternation, failures reported, budgets respected."""

import os
import subprocess
import sys
import time

import pytest

import scorch_backend as sb
from scorch_backend.tools.timing import OtherLoad, hold_baseline_isa, measure, measure_interleaved


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


# --- the baselines' instruction set (hold_baseline_isa) ---------------------------------------------------------

ISA_VARS = sb.target.TORCH_ISA_VARIABLES
wider_than_avx2 = pytest.mark.skipif(sb.target_info("native")["arch"] != "x86_64"
                                     or sb.target_info("native")["vector_bytes"] <= 32,
                                     reason="needs an x86 CPU with vectors wider than AVX2's")


def test_a_target_as_wide_as_the_machine_holds_nothing():
    assert sb.torch_isa_environment("native") == {}


@wider_than_avx2
def test_avx2_target_names_avx2_for_every_library():
    env = sb.torch_isa_environment("x86-64-v3")
    assert env == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}
    assert sb.torch_isa_environment("x86-64-v2")["ATEN_CPU_CAPABILITY"] == "default"


@wider_than_avx2
def test_hold_without_reexec_says_the_baseline_is_not_held(monkeypatch):
    for k in ISA_VARS:
        monkeypatch.delenv(k, raising=False)
    assert "NOT held" in hold_baseline_isa("x86-64-v3", "target", reexec=False)
    assert "full instruction set" in hold_baseline_isa("x86-64-v3", "machine", reexec=False)
    with pytest.raises(ValueError, match="baseline ISA"):
        hold_baseline_isa("x86-64-v3", "avx2", reexec=False)


@wider_than_avx2
def test_hold_reexecutes_once_with_torch_at_the_target_isa(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(
        "import os, torch\n"
        "from scorch_backend.tools.timing import hold_baseline_isa\n"
        "print('START', flush=True)\n"
        "line = hold_baseline_isa('x86-64-v3', 'target')\n"
        "print(line)\n"
        "print('CAP', torch.backends.cpu.get_cpu_capability(), os.environ['MKL_ENABLE_INSTRUCTIONS'])\n"
        "import sys; print('FLAGS', int(sys.flags.utf8_mode), int('-u' in sys.orig_argv))\n")
    env = {k: v for k, v in os.environ.items() if k not in ISA_VARS and k != "SCORCH_BENCH_BASELINE_ISA"}
    # -u and -X must survive the re-execution (sys.orig_argv), as a profiler's `-m cProfile` would.
    out = subprocess.run([sys.executable, "-u", "-X", "utf8", str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("START") == 2          # the program ran again, once
    assert "CAP AVX2 AVX2" in out.stdout and "held to the target's instruction set" in out.stdout
    assert "FLAGS 1 1" in out.stdout


def test_other_load_counts_other_processes_and_not_this_one(monkeypatch):
    # (total, idle, steal, own) jiffies: 400 in all, 100 idle, 20 stolen, this process 80 of the 280 busy
    readings = iter([(1000, 500, 10, 50), (1400, 600, 30, 130)])
    monkeypatch.setattr(OtherLoad, "_read", staticmethod(lambda: next(readings)))
    load = OtherLoad()
    other, steal = load.shares()
    assert other == pytest.approx(200 / 400) and steal == pytest.approx(20 / 400)
    monkeypatch.setattr(OtherLoad, "_read", staticmethod(lambda: None))
    assert OtherLoad().shares() == (None, None)
    assert "unknown" in OtherLoad().report()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc")
def test_other_load_sees_a_busy_process_and_counts_waited_children_as_own():
    ncpu = os.cpu_count() or 1
    busy = "import time\nt = time.time()\nwhile time.time() - t < {}: pass"
    # A child this process waits for (the JIT's compiler) is its own time (cutime), not another workload's.
    start = OtherLoad._read()
    subprocess.run([sys.executable, "-c", busy.format(1.0)], check=True)
    end = OtherLoad._read()
    elapsed = (end[0] - start[0]) / ncpu  # jiffies of one CPU
    assert end[3] - start[3] >= 0.3 * elapsed, (start, end)
    spinner = subprocess.Popen([sys.executable, "-c", busy.format(5)])
    try:
        load = OtherLoad()
        time.sleep(1.0)
        other, steal = load.shares()
        report = load.report()  # (before the spinner is reaped: a reaped child's time becomes this process's)
    finally:
        spinner.kill()
        spinner.wait()
    assert other >= 0.5 / ncpu, (other, ncpu)
    assert "other processes" in report and (other <= OtherLoad.WARN_SHARE or "shared" in report)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_fma_peak_measures_the_widths_this_cpu_has_and_refuses_the_others():
    from scorch_backend import _C
    from scorch_backend.tools.timing import fma_peak

    flags = _cpu_flags()
    for width, needs in ((32, {"avx2", "fma"}), (64, {"avx512f"})):
        got = _C.fma_peak_gflops(width, 1)
        if needs <= flags:
            assert got > 0 and got == got and got != float("inf"), (width, got)
        else:
            assert got == 0.0, (width, got)
    for width in (0, 16, 48, 128):  # no multiply-add instruction of that width: nothing measured
        assert _C.fma_peak_gflops(width, 2) == 0.0
    peak = fma_peak(1)
    assert peak["vector_bytes"] == sb._C.target_info()["vector_bytes"]
    assert peak["gflops"] is None or peak["gflops"] > 0
