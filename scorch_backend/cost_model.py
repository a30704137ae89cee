"""When to run dense: the run-time choice between a sparse kernel and dense ATen code.

A product's sparse work is about the dense work times the density of its sparse factors, and a stored
nonzero costs more than a dense element (indices, irregular access). So sparse pays while the product of the
sparse operands' densities stays under a crossover density. The crossover and the dense rate depend on the
machine, the thread count and the kernels' target, so they are measured where Scorch runs: once, the first
time a decision needs them (`calibrate`, about 0.1-0.3 s, plus compiling the SpMM kernel if the kernel cache
does not have it yet), and stored in the kernel cache directory under a key of the CPU (model and
instruction-set flags), the thread count, the torch version and the kernels' target; later processes read
it. `scorch_backend/calibration.json` (measured by `benchmarks/calibrate.py` on a developer's machine) is only
a fallback for when measuring fails. SCORCH_DENSE_CROSSOVER overrides the crossover, SCORCH_DISPATCH=sparse|
dense forces a side, SCORCH_DEBUG=1 says which calibration was used. Tiny problems, where a dense call is
cheaper than any dispatch, also run dense.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
import stat
import threading
import time

from . import _C, _native, config, log
from .target import target_info

_CALIBRATION = pathlib.Path(__file__).with_name("calibration.json")
_FALLBACK_CROSSOVER = 0.3  # used only when the calibration file is missing and measuring failed
TINY_DENSE_ELEMENTS = 4096  # below this many dense elements in all operands, dense wins on overhead alone
CALIBRATION_VERSION = 1     # bump when the measurement changes: old stored results are then ignored


@functools.lru_cache(maxsize=1)
def _shipped() -> dict:
    """The committed calibration (a fallback only)."""
    try:
        data = json.loads(_CALIBRATION.read_text())
        return {"dense_crossover_density": float(data["dense_crossover_density"]), "dense_rate": None,
                "source": f"fallback: {_CALIBRATION.name} (measured on a developer's machine)"}
    except (OSError, KeyError, ValueError, TypeError):
        return {"dense_crossover_density": _FALLBACK_CROSSOVER, "dense_rate": None,
                "source": "fallback: built-in constant"}


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """The CPU's model name and instruction-set flags (so two CPU kinds never share a calibration)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features", "isa") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    import platform

    return f"{model or platform.processor()}|{platform.machine()}|{flags}"


def machine_key(threads: int) -> dict:
    """What a stored calibration is valid for, and its hash (the file name)."""
    import torch


    fields = {"cpu": _cpu_identity(), "threads": int(threads), "torch": torch.__version__,
              "target": target_info()["fingerprint"], "version": CALIBRATION_VERSION}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return {"fields": fields, "key": digest}


_MAX_CACHE_FILE = 1 << 20  # a calibration document is a few KB


def _read_cache_file(path) -> str:
    """The text of a file in the kernel cache, read only if it is a regular file of at most 1 MB that is not
    a symbolic link: the cache is shared, and what another process left there is not trusted (a FIFO would
    block the read forever, a link could point anywhere). Raises OSError otherwise, as a missing file does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_CACHE_FILE:
            raise OSError(f"{path}: not a regular file of at most {_MAX_CACHE_FILE} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_CACHE_FILE + 1)
        if len(data) > _MAX_CACHE_FILE:
            raise OSError(f"{path}: larger than {_MAX_CACHE_FILE} bytes")
        return data.decode("utf-8")
    finally:
        os.close(fd)


def _calibration_path(key: str) -> pathlib.Path:
    return pathlib.Path(_C.kernel_cache_dir()) / "calibration" / f"{key}.json"


class UnreliableMeasurement(RuntimeError):
    pass


def _best_time(fn, repeat: int, threads: int = 1) -> float:
    """The fastest of `repeat` calls after two warm-ups: another process on a core delays some calls by
    whole scheduler slices, and the fastest call is the one least disturbed. Raises UnreliableMeasurement when
    the process had less than half of the CPU time its `threads` threads could use over the calls: other
    processes held the cores throughout, which the fastest call does not escape (helper-46: four processes
    calibrating at once stored crossovers of 0.01, 0.64 and 1.0 where one alone measured 0.70, and every
    later process read them)."""
    fn()
    fn()
    best = math.inf
    wall = cpu = 0.0
    for _ in range(repeat):
        c, t = time.process_time(), time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        wall, cpu = wall + elapsed, cpu + time.process_time() - c
        best = min(best, elapsed)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    share = cpu / wall if wall > 0 else math.inf
    if wall > 0.002 and share < 0.5 * min(threads, cores):
        raise UnreliableMeasurement(f"this process had {share:.2f} CPUs of the {min(threads, cores)} its threads "
                                    "could use while it measured: the machine is too busy to measure")
    return best


def measure(threads: int) -> dict:
    """Measure the crossover and the dense rate on this machine with `threads` threads.

    Dense: torch.mm of 1024x1024 by 1024x64 float32 (also gives the dense rate, multiply-adds per second).
    Sparse: the compiled CSR SpMM kernel on the same shape at densities 0.05 and 0.4, called through the
    torch op (no Python wrapper: the per-call cost is modelled apart). Its time is close to linear in the
    density, t(d) = a + b d, so the crossover is where that line meets the dense time."""
    import torch


    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        m, k, n = 1024, 1024, 64
        B = torch.randn(k, n, generator=g)
        dense_a = torch.randn(m, k, generator=g)
        t_dense = _best_time(lambda: torch.mm(dense_a, B), 9, threads)
        points = []
        compile_s = 0.0
        for d in (0.05, 0.4):
            A = (dense_a * (torch.rand(m, k, generator=g) < d)).to_sparse_csr()
            pos, crd, vals = A.crow_indices().int(), A.col_indices().int(), A.values()  # int32, the default
            csr = _C.format_info("csr", 2)["canonical"]
            plan = _C.plan_einsum("ij,jk->ik", [(csr, [m, k], vals.numel()), ("strided", [k, n], k * n)],
                                  "strided", False, False)
            inputs = [pos, crd, vals, B]
            spec, sizes = plan["spec"], plan["var_sizes"]
            run = lambda: _native.ops.kernel(spec, inputs, sizes, threads)  # noqa: E731
            t_first = time.perf_counter()
            run()  # compiles (or loads) the kernel: kept out of the measurement's own time
            compile_s += time.perf_counter() - t_first
            points.append((vals.numel() / (m * k), _best_time(run, 9, threads)))
        (d0, t0), (d1, t1) = points
        # Eight times the nonzeros must take clearly longer; if not, the timings measured something else (a
        # busy machine) and are not worth keeping.
        if not t1 > 2 * t0:
            raise UnreliableMeasurement(f"SpMM at density {d1:.2f} took {t1 * 1e3:.2f} ms, at {d0:.2f} "
                                        f"{t0 * 1e3:.2f} ms: the machine is too busy to measure")
        slope = (t1 - t0) / (d1 - d0)
        crossover = (t_dense - (t0 - slope * d0)) / slope
        crossover = min(max(crossover, 0.01), 1.0)
        return {"dense_crossover_density": round(crossover, 4), "dense_rate": m * k * n / t_dense,
                "dense_s": t_dense, "sparse_points": points, "kernel_compile_s": round(compile_s, 3)}
    finally:
        torch.set_num_threads(prev)


_lock = threading.Lock()
_memo: dict = {}


def _valid(doc: dict, key: dict) -> bool:
    try:
        c, r = float(doc["dense_crossover_density"]), float(doc["dense_rate"])
        return doc.get("key") == key["key"] and doc.get("fields") == key["fields"] and 0 < c <= 1 and \
            math.isfinite(r) and r > 0
    except (KeyError, TypeError, ValueError):
        return False


def calibration(threads: int | None = None) -> dict:
    """The crossover density and dense rate for this machine, thread count and target: from this process's
    memo, else the stored measurement in the cache directory (checked against its key), else measured now
    and stored (written atomically; several processes may race, each writes a whole file). Falls back to the
    shipped calibration.json when measuring fails, and says so in "source"."""
    import torch


    threads = threads or torch.get_num_threads()
    fast_key = (threads, _C.target_name())  # a decision per call must not hash the machine each time
    hit = _memo.get(fast_key)
    if hit is not None:
        return hit
    try:
        key = machine_key(threads)  # asks the compiler for the target's fingerprint
    except Exception as e:  # noqa: BLE001 - no compiler (a deployment, SCORCH_JIT=0): the shipped numbers
        result = dict(_shipped())
        result["source"] += f"; no measurement here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        result = _agreed_calibration(threads, result)
        _memo[fast_key] = result
        return result
    with _lock:
        if key["key"] in _memo:
            _memo[fast_key] = _memo[key["key"]]
            return _memo[key["key"]]
        path = _calibration_path(key["key"])
        result = None
        try:
            doc = json.loads(_read_cache_file(path))
            if _valid(doc, key):
                result = dict(doc, source=f"measured on this machine, stored in {path}")
        except (OSError, ValueError):
            pass
        if result is None:
            t = time.perf_counter()
            try:
                doc = dict(measure(threads), key=key["key"], fields=key["fields"])
                doc["measured_s"] = round(time.perf_counter() - t - doc["kernel_compile_s"], 3)
                result = dict(doc, source=f"measured now ({doc['measured_s']:.2f} s, kernel compile "
                                          f"{doc['kernel_compile_s']:.2f} s), stored in {path}")
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
                    tmp.write_text(json.dumps(doc, indent=1))
                    os.replace(tmp, path)
                except OSError as e:
                    result["source"] += f" (could not store it: {e})"
            except Exception as e:  # no compiler, a broken cache, a busy machine: the shipped numbers, for
                result = dict(_shipped())  # this process only (the next one measures again)
                result["source"] += f"; measuring failed: {type(e).__name__}: {e}"
        if config.debug_level() >= 1:
            log.sync()
            log.get("cost_model").info("cost model (%d threads): crossover density %.3g, %s", threads,
                                       result["dense_crossover_density"], result["source"])
        result = _agreed_calibration(threads, result)
        _memo[key["key"]] = _memo[fast_key] = result
        return result


# --- one set of numbers for every rank of a distributed job -------------------------------------------------
# Each rank measures its own machine; ranks whose numbers differ by noise would cut different regions from
# the same graph (a region on one rank, "too small" on another). In a torch.distributed job, every rank uses
# rank 0's numbers, handed over through the process group's store: rank 0 never waits, the others wait a
# bounded time and keep their own numbers (with a warning) if rank 0 never publishes them.
AGREE_TIMEOUT_S = 120.0


def _distributed_rank() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        return None
    return None


# Each name is agreed once per process: the outcome (rank 0's value, or this rank's own after a timeout) is
# kept, so a name rank 0 never publishes costs one bounded wait, not one per call.
_agreed_values: dict[str, float] = {}


def agreed(name: str, value: float) -> float:
    """`value` on rank 0 of a distributed job, rank 0's value everywhere else; `value` outside one. Every rank
    must ask for the same names whatever its own state (a rank whose measurement failed offers a stand-in
    under the same name, _agreed_calibration): a name only one rank asks for is waited on while rank 0 sits
    in the job's next collective (the DDP test under the automatic dispatch stalled 3 x 120 s that way)."""
    ranks = _distributed_rank()
    if ranks is None:
        return value
    if name in _agreed_values:
        return _agreed_values[name]
    import datetime

    import torch.distributed as dist

    key = f"scorch/cost_model/{name}"
    try:
        store = dist.distributed_c10d._get_default_store()
        if ranks[0] == 0:
            store.set(key, repr(float(value)))
        else:
            store.wait([key], datetime.timedelta(seconds=AGREE_TIMEOUT_S))
            value = float(store.get(key).decode())
    except Exception as e:  # noqa: BLE001 - agreement is best effort; the job must go on
        log.get("cost_model").warning("rank %d keeps its own %s (%.4g): rank 0's did not arrive (%s)", ranks[0],
                                      name, value, e)
    _agreed_values[name] = value
    return value


def _agreed_calibration(threads: int, result: dict) -> dict:
    if _distributed_rank() is None:
        return result
    result = dict(result)
    result["dense_crossover_density"] = agreed(f"crossover/{threads}", float(result["dense_crossover_density"]))
    # Always agreed, under one name: a rank on the shipped numbers (its measurement failed) has no dense rate
    # and offers a quick measurement instead, so that it asks for the same names as rank 0.
    rate = result.get("dense_rate") or _quick_dense_rate(threads)
    result["dense_rate"] = agreed(f"dense_rate/{threads}", float(rate))
    result["source"] += " (rank 0's numbers, shared by every rank)"
    return result


def crossover_density() -> float:
    env = config.dense_crossover_override()
    return env if env is not None else float(calibration()["dense_crossover_density"])


def choose_dense(densities: list[float], dense_elements: int) -> tuple[bool, str]:
    """(run dense?, why) for a product whose sparse operands have these densities.

    SCORCH_DISPATCH=sparse (or dense) forces one side, e.g. to test the kernels themselves."""
    forced = config.dispatch_mode()
    if forced in ("sparse", "dense"):
        return forced == "dense", f"SCORCH_DISPATCH={forced}"
    if not densities:
        return True, "no sparse operand: dense ATen code"
    combined = math.prod(densities)
    threshold = crossover_density()
    if dense_elements <= TINY_DENSE_ELEMENTS:
        # (as the executor's `choose`: densifying a stored sparse operand costs more than the kernel there)
        return False, (f"tiny problem ({dense_elements} dense elements) with a stored sparse operand: the kernel, "
                       "without densifying it")
    if combined >= threshold:
        return True, (f"sparse operands' combined density {combined:.3g} >= crossover {threshold:.3g} "
                      "(measured on this machine): dense is faster")
    return False, f"combined density {combined:.3g} < crossover {threshold:.3g}: sparse kernel"


def dense_rate(threads: int) -> float:
    """Multiply-adds per second of a dense float32 matmul on this machine with `threads` threads (from the
    calibration; a quick 384^3 measurement when it has none)."""
    rate = calibration(threads).get("dense_rate")  # always there in a distributed job (_agreed_calibration)
    return float(rate) if rate else _quick_dense_rate(threads)


@functools.lru_cache(maxsize=8)
def _quick_dense_rate(threads: int) -> float:
    import torch

    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return 384**3 / max(_best_time(lambda: a @ b, 3), 1e-9)
    finally:
        torch.set_num_threads(prev)
