"""One timing helper for every benchmark in the project.

    t = measure(fn)                                   # 2 untimed calls, then the median of 7 timed calls
    t = measure(fn, warmup=1, repeat=3, budget=0.5)   # slow calls cut the run short (see `measure`)
    ts, failed = measure_interleaved({"a": f, "b": g})   # contenders alternated: ratios robust to load drift
    t.median, t.min, t.samples, t.to_dict()

`hold_baseline_isa(target, how)` holds torch's own kernels to the kernels' target (a benchmark under x86-64-v3
on an AVX-512 machine then compares AVX2 with AVX2, as on an AVX2 CPU).
`stream_triad()` measures the memory bandwidth a benchmark's achieved GB/s can be compared with.
`OtherLoad()` records how much CPU time other processes took during a run (printed and saved with the results).
Times are wall-clock seconds from time.perf_counter(); nothing here sets thread counts (the caller does, with
torch.set_num_threads, before measuring anything).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Callable

import torch


@dataclasses.dataclass
class Timing:
    """The result of `measure`: every timed call's duration in call order (seconds), and summaries."""

    samples: list[float]
    warmup: int = 0          # untimed calls actually made
    wall: float = 0.0        # seconds spent in `measure`, warm-ups included

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def n(self) -> int:
        return len(self.samples)

    def to_dict(self, *, with_samples: bool = False) -> dict:
        """{"median_s", "min_s", "samples" (how many), "wall_s"} plus "times_s" (every sample) on request."""
        d = {"median_s": self.median, "min_s": self.min, "samples": self.n, "wall_s": self.wall}
        if with_samples:
            d["times_s"] = list(self.samples)
        return d

    def __str__(self) -> str:
        return f"median {self.median * 1e3:.3f} ms over {self.n} calls (min {self.min * 1e3:.3f} ms)"


def measure(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 7, min_time: float = 0.0,
            max_repeat: int | None = None, budget: float | None = None, min_samples: int = 3) -> Timing:
    """Time `fn()`: `warmup` untimed calls, then at least `repeat` timed calls.

    min_time:   keep taking samples (beyond `repeat`, up to `max_repeat`, default 50 * repeat) until the timed
                calls have spent this many seconds; fast functions get a steadier median this way.
    budget:     seconds after which a slow function is cut short: the warm-up stops after a first call that
                took longer than the budget, and the timed calls stop once `min_samples` were taken and the
                budget is spent, or after one sample if that sample alone took more than twice the budget.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError("measure() needs repeat >= 1 and warmup >= 0")
    if max_repeat is None:
        max_repeat = 50 * repeat
    t0 = time.perf_counter()
    done = 0
    for k in range(warmup):
        t = time.perf_counter()
        fn()
        done += 1
        if budget is not None and k == 0 and time.perf_counter() - t > budget:
            break
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeat or (time.perf_counter() - start < min_time and len(samples) < max_repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if budget is not None:
            spent = time.perf_counter() - start
            if (len(samples) >= min_samples and spent > budget) or samples[0] > 2 * budget:
                break
    return Timing(samples, done, time.perf_counter() - t0)


def measure_interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 2, repeat: int = 7,
                        min_time: float = 0.0, max_repeat: int | None = None, budget: float | None = None,
                        min_samples: int = 3, slice_s: float = 0.02) -> tuple[dict[str, Timing], dict]:
    """Time several contenders in alternation, so that a slow phase of a shared machine falls on all of them
    alike and their ratio stays meaningful; `measure` times one after the other, and a neighbour's load that
    comes and goes between two contenders' runs shows up as a false speedup.

    Rounds visit the contenders in an order rotated by one each round. In a round a contender makes enough
    calls to fill about `slice_s` seconds (at least one; every call is a sample), from the median so far. A
    contender stops once it has `repeat` samples and has spent `min_time` seconds in timed calls (or reached
    `max_repeat`), or, with `budget`, once it has `min_samples` and has spent the budget (one sample if it
    alone took more than twice the budget). `warmup` untimed calls each, also alternated, come first.

    Returns ({name: Timing}, {name: exception}) -- a contender that raises is dropped and reported, not fatal.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError("measure_interleaved() needs repeat >= 1 and warmup >= 0")
    if max_repeat is None:
        max_repeat = 50 * repeat
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    spent = dict.fromkeys(names, 0.0)
    warm = dict.fromkeys(names, 0)
    first = dict.fromkeys(names, 0.0)
    failed: dict = {}
    t0 = time.perf_counter()

    def call(name: str) -> float | None:
        t = time.perf_counter()
        try:
            fns[name]()
        except Exception as e:  # noqa: BLE001 -- a contender's failure is its result
            failed[name] = e
            return None
        return time.perf_counter() - t

    for k in range(warmup):
        for n in names:
            if n in failed or (budget is not None and k > 0 and first[n] > budget):
                continue
            d = call(n)
            if d is not None:
                warm[n] += 1
                first[n] = first[n] or d

    def done(n: str) -> bool:
        s = samples[n]
        if n in failed:
            return True
        if budget is not None and s and ((len(s) >= min_samples and spent[n] > budget) or s[0] > 2 * budget):
            return True
        return len(s) >= max_repeat or (len(s) >= repeat and spent[n] >= min_time)

    rnd = 0
    while True:
        live = [n for n in names if not done(n)]
        if not live:
            break
        shift = rnd % len(live)
        for n in live[shift:] + live[:shift]:
            est = statistics.median(samples[n]) if samples[n] else slice_s
            calls = max(1, min(int(slice_s / max(est, 1e-9)), max_repeat - len(samples[n])))
            for _ in range(calls):
                d = call(n)
                if d is None:
                    break
                samples[n].append(d)
                spent[n] += d
        rnd += 1
    wall = time.perf_counter() - t0
    timings = {n: Timing(samples[n], warm[n], wall) for n in names if n not in failed and samples[n]}
    return timings, failed


def stream_triad(threads: int | None = None, log2n: int = 25) -> dict:
    """A STREAM-like triad a = b + s*c on 2**log2n-element tensors, in float32 and float64: per dtype the
    bytes moved (3 arrays), the best and the median of 10 runs (the upper middle sample) after 2 warm-ups,
    as seconds and GB/s. Uses torch's current thread count; `threads` is only recorded."""
    out: dict = {}
    n = 1 << log2n
    for dtype in (torch.float32, torch.float64):
        b = torch.rand(n, dtype=dtype)
        c = torch.rand(n, dtype=dtype)
        a = torch.empty(n, dtype=dtype)

        def triad(a=a, b=b, c=c):
            torch.add(b, c, alpha=3.0, out=a)  # a = b + 3 c, one pass over three arrays

        t = measure(triad, warmup=2, repeat=10, max_repeat=10)
        ordered = sorted(t.samples)
        best, mid = ordered[0], ordered[len(ordered) // 2]
        moved = 3 * n * b.element_size()
        out[str(dtype).replace("torch.", "")] = {
            "elements": n, "bytes": moved, "best_s": best, "median_s": mid,
            "best_gbps": moved / best / 1e9, "median_gbps": moved / mid / 1e9}
        del a, b, c, triad
    out["threads"] = threads if threads is not None else torch.get_num_threads()
    return out


def stream_triad_gbs(threads: int | None = None, log2n: int = 25) -> float:
    """The reference bandwidth in GB/s: the larger of the float32 and float64 triad medians (the best run is
    prone to outliers on virtual machines)."""
    t = stream_triad(threads, log2n)
    return max(t["float32"]["median_gbps"], t["float64"]["median_gbps"])


def fma_peak(threads: int | None = None) -> dict:
    """The float32 multiply-add ceiling of this CPU at the current target's vector width (runtime/fma_probe.h):
    {"vector_bytes", "gflops"} (gflops None where the CPU or build has no such instruction). The ceiling of a
    compute-bound kernel, as the triad is a memory-bound one's.

    Measured in a fresh process: in one that has run parallel torch ops, the thread pool's workers spin for a
    while after each parallel region and take a core from the probe's threads (the kernel benchmark measured
    132 and 301 GFLOP/s where a fresh process measures 248 and 500, and kernels then ran "above the peak")."""
    import subprocess

    from scorch_backend import _C

    width = int(_C.target_info()["vector_bytes"])
    threads = threads if threads is not None else torch.get_num_threads()
    code = ("import sys\nfrom scorch_backend import _C\n"
            "print(max(_C.fma_peak_gflops(int(sys.argv[1]), int(sys.argv[2])) for _ in range(3)))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(width), str(threads)], capture_output=True, text=True,
                             timeout=120, check=True)
        gflops = float(out.stdout.split()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        gflops = _C.fma_peak_gflops(width, threads)  # (where no child process can run: this one, as it is)
    return {"vector_bytes": width, "gflops": gflops or None}


def contention_probe(calls: int = 40, threshold_s: float = 1e-3) -> dict:
    """Median time of a small parallel torch op (an add of 2**18 floats). On an idle machine it takes tens
    of microseconds; when another process holds one of the cores torch uses, every parallel region waits for
    the scheduler (milliseconds) and multi-threaded timings become unreliable.
    Returns {"median_s", "contended"}."""
    x, y, z = torch.rand(1 << 18), torch.rand(1 << 18), torch.empty(1 << 18)
    t = measure(lambda: torch.add(x, y, out=z), warmup=1, repeat=calls, max_repeat=calls)
    return {"median_s": t.median, "contended": t.median > threshold_s}


class OtherLoad:
    """How much CPU time other processes (and the hypervisor) took while a benchmark ran, from /proc/stat
    against this process's own (children included) in /proc/self/stat. A benchmark that shares the machine
    measures the other workload as much as its own code: on this 2-core VM a second process streaming memory
    lifted the cost around a 4096 SpMM call from 7 to 12 us and a region's from 9 to 18 us, torch's calls
    alike. Start it before the timings, print `report()` with the results and save `to_dict()`:

        load = OtherLoad()
        ...
        print(load.report())

    `other_share`: the share of all CPUs' time busy in other processes; `steal_share`: the share the hypervisor
    gave to other guests (steal); both 0-1. Off Linux (no /proc) both are None and the report says so."""

    WARN_SHARE = 0.05  # above this the report says the numbers are not the code's alone

    def __init__(self):
        self._start = self._read()
        self._t0 = time.perf_counter()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                cpu = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            own = sum(int(fields[k]) for k in (11, 12, 13, 14))  # utime stime cutime cstime (fields 14-17)
        except (OSError, ValueError, IndexError):
            return None
        idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle, iowait
        steal = cpu[7] if len(cpu) > 7 else 0
        total = sum(cpu[:8])  # guest time is counted inside user already
        return total, idle, steal, own

    def shares(self) -> tuple:
        """(other_share, steal_share) since the start, or (None, None) without /proc."""
        end = self._read()
        if self._start is None or end is None:
            return None, None
        total, idle, steal, own = (b - a for a, b in zip(self._start, end))
        if total <= 0:
            return 0.0, 0.0
        busy = total - idle - steal
        return max(0.0, busy - own) / total, steal / total

    def to_dict(self) -> dict:
        other, steal = self.shares()
        return {"other_share": other, "steal_share": steal, "seconds": time.perf_counter() - self._t0}

    def report(self) -> str:
        other, steal = self.shares()
        if other is None:
            return "load from other processes: unknown (no /proc/stat)"
        line = (f"load from other processes during the run: {other:.1%} of all CPUs' time, hypervisor steal "
                f"{steal:.1%}")
        if other > self.WARN_SHARE or steal > self.WARN_SHARE:
            line += " -- the machine was shared: these numbers measure the other workload too"
        return line


def fmt_time(s):
    """Seconds as a short human string: 1.23s, 4.56ms, 789us ("-" for None)."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f}ms"
    return f"{s * 1e6:.0f}us"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}x"


def save_json(path, doc: dict) -> pathlib.Path:
    """Write a benchmark's results as JSON (parent folders made); the path written."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    return out


BASELINE_ISA_CHOICES = ("target", "machine")
_REEXEC_MARK = "SCORCH_BENCH_BASELINE_ISA"


def add_baseline_isa_argument(parser) -> None:
    """The `--baseline-isa` option every benchmark with `--target` takes."""
    parser.add_argument("--baseline-isa", choices=BASELINE_ISA_CHOICES, default="target",
                        help="instruction set of the torch baselines (ATen, MKL, oneDNN, Inductor): 'target' (default) "
                             "holds them to --target's, as on a CPU of that kind; 'machine' lets them use all of "
                             "this CPU's")


def hold_baseline_isa(target: str | None, how: str = "target", *, reexec: bool = True) -> str:
    """Make the torch baselines of this benchmark run `target`'s instruction set (how="target") or the whole
    machine's (how="machine"), and return one line saying which, for the output.

    torch's libraries read their ISA variables once at start (`torch_isa_environment`), so when they are
    missing this re-executes the program once with them set (`reexec`; a benchmark's main() called with an
    argument list, as tests do, is not re-executed: the line then says the baseline is not held)."""
    from .. import target as _target

    if how not in BASELINE_ISA_CHOICES:
        raise ValueError(f"baseline ISA must be one of {BASELINE_ISA_CHOICES}, got {how!r}")
    want = _target.torch_isa_environment(target) if how == "target" else {}
    if not want:
        held = {k: os.environ[k] for k in _target.TORCH_ISA_VARIABLES if k in os.environ}
        return ("torch baselines: this CPU's full instruction set"
                + (f" (but the environment sets {held})" if held else ""))
    missing = {k: v for k, v in want.items() if os.environ.get(k) != v}
    if missing and reexec and not os.environ.get(_REEXEC_MARK):
        os.environ.update(want)
        os.environ[_REEXEC_MARK] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        # orig_argv keeps the interpreter's own options (-u, -X, -W) and `-m module` as they were given.
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    if missing:
        return f"torch baselines: NOT held to the target's instruction set (missing {missing})"
    held = ", ".join(f"{k}={v}" for k, v in want.items())
    return (f"torch baselines: held to the target's instruction set ({held}; ATen reports "
            f"{torch.backends.cpu.get_cpu_capability()})")
