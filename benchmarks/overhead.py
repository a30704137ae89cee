#!/usr/bin/env python
"""The fixed cost of a Scorch call: what a whole call costs over the kernel it runs, against torch CSR.

    .venv/bin/python benchmarks/overhead.py                 # 64, 512 and 4096 square matrices, 1 thread
    .venv/bin/python benchmarks/overhead.py --threads 2 --target x86-64-v3

For SpMV (y = A x) and SpMM (C = A B, B with 64 columns) on random CSR matrices (density --density) it times

    kernel     the compiled kernel alone, timed in C++ (`_C.time_kernel`: output zero-fill + kernel)
    op         torch.ops.scorch.kernel with prepared inputs (Python op call, checks, output allocation)
    einsum     sb.einsum("ij,j->i", A, x): the whole eager call
    region     torch.ops.scorch.region on that module's region program with the same operands: the region
               call alone (operand cache lookup, choice, kernel call), without the compiled graph around it
    compiled   torch.compile(model, backend="scorch") of a module whose weight is the same matrix stored
               dense (the backend finds it sparse and runs a region)
    torch_csr  A_csr @ x with torch.sparse CSR
    dense      the same product on the dense matrix, eager (torch.mm / mv)
    inductor   the dense module compiled by torch.compile's default backend: inductor - dense is what
               torch.compile's own wrapper (Dynamo guards, the AOT and Inductor runtime) costs a call, the
               floor under the compiled column

"Around the kernel" is the per-call cost over the kernel, measured on the same calls: each call's time minus
the time it spent in its kernel (`_C.last_kernel_seconds`, read after the call); the medians are printed.
Every absolute time is the median of --repeats samples, each the mean of a batch of calls sized to take ~4 ms (at
least 10 calls), after a warm-up; the contenders' batches alternate (rounds in a rotating order), so load from
another process falls on all of them alike, and the kernel alone is timed by the same statistic (the mean of a batch, timed in C++).
Every batch opens with --batch-warmup untimed calls of its own contender (6): the batch before it streams up to
64 MB, and at 4096 the cost around the kernel takes several calls, not one, to come back down (BATCH_WARMUP's
comment has the measurement). The first of those calls is timed too and printed on its own ("first call of a
batch"): the cost around the kernel in the state another workload leaves.
"Cold calls" times the smallest case again with a buffer twice the last-level cache written before every call:
at 4096 a call follows a kernel that streamed megabytes (and ran long enough for other processes to evict the
caches), so the interpreter's, the dispatcher's and Scorch's own code and data come back from memory; that
section shows what any call, torch's included, costs in that state. "After a kernel" times the smallest case
with the largest SpMM case's kernel run alone (no call around it) before every call, and the same calls warm:
the difference is what a call pays for the state a long kernel leaves (its own traffic, and whatever else ran
on the machine meanwhile), paid by torch's calls as much as by Scorch's.
All contenders run in this process with the same thread count. The kernel benchmark's matrices
(benchmarks/kernels.py) are the place for the kernels' own speed; here the matrices are small on purpose. The
dense/sparse cost model is switched off (SCORCH_DISPATCH=sparse): the subject is the cost of the call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("SCORCH_DISPATCH", "sparse")

import torch  # noqa: E402

import scorch_backend as sb  # noqa: E402
from scorch_backend import _C  # noqa: E402
from scorch_backend.compiler import backend  # noqa: E402
from scorch_backend.custom_ops import region  # noqa: E402
from scorch_backend.tools.timing import OtherLoad, add_baseline_isa_argument, hold_baseline_isa  # noqa: E402
from scorch_backend.tools import timing  # noqa: E402


MIN_CALLS = 10
# Untimed calls that open every batch. The contender before streams up to 64 MB (the dense mm), and the cost
# around a 4096 SpMM kernel comes back down only over several calls after that, not after one: measured call by
# call in a batch (2 threads, Zen 5), 79, 46, 32, 20, 14, 11, 9.4, 8.6, 8.0, 7.7 us after three dense mms,
# 55, 28, 16, 12, 9.7, 8.2, 8.0, 7.6 us after a 64 MB buffer was written, against 6.3 us for every call of a
# batch that follows the same call. The first call after another contender is reported on its own.
BATCH_WARMUP = 6


def per_call(fns: dict, repeats: int, *, batch_s: float = 0.004, warmup: int = BATCH_WARMUP
             ) -> tuple[dict, dict, dict]:
    """({name: median seconds per call}, {name: median seconds per call outside the kernel}, {name: the same for
    the first call of a batch}) for `fns`.

    A fn that takes an int times that many calls itself and returns their mean (the kernel alone, timed in
    C++). Each sample is the mean of a batch of calls sized to take about `batch_s`, after `warmup` untimed calls
    of the same fn; the contenders' batches alternate, `repeats` rounds in a rotating order, so load from another
    process falls on all of them alike and every contender is timed by the same statistic (the median of batch
    means). For a fn marked `split` (it runs one Scorch kernel per call), every timed call's time minus the time
    that same call spent in its kernel (`_C.last_kernel_seconds`) is a sample of the cost around the kernel: the
    kernel's own noise cancels. The first warm-up call of each batch, which follows another contender's batch,
    gives the third dict: the cost around the kernel in the state another workload leaves."""
    names = list(fns)
    batch = {}
    for name, fn in fns.items():
        self_timed = getattr(fn, "self_timed", False)
        for _ in range(20):
            fn(1) if self_timed else fn()
        t = time.perf_counter()
        for _ in range(5):
            fn(1) if self_timed else fn()
        one = max((time.perf_counter() - t) / 5, 1e-7)
        # At least MIN_CALLS calls a batch: the first call of a batch follows another contender's batch (the
        # dense one streams the whole matrix), so with 1-3 calls a batch, as slow cases would get, a third or more
        # of the split samples would be such first calls, a share set by the case's speed rather than the call.
        batch[name] = max(MIN_CALLS, min(20000, int(batch_s / one)))
    samples: dict = {n: [] for n in names}
    around: dict = {n: [] for n in names if getattr(fns[n], "split", False)}
    first: dict = {n: [] for n in around}
    clock = time.perf_counter
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, b = fns[name], batch[name]
            if getattr(fn, "self_timed", False):
                if warmup:
                    fn(warmup)
                samples[name].append(fn(b))
                continue
            split = around.get(name)
            for w in range(warmup):
                t = clock()
                fn()
                d = clock() - t
                if w == 0 and split is not None:
                    first[name].append(d - _C.last_kernel_seconds())
            total = 0.0
            for _ in range(b):
                t = clock()
                fn()
                d = clock() - t
                total += d
                if split is not None:
                    split.append(d - _C.last_kernel_seconds())
            samples[name].append(total / b)
    return ({n: statistics.median(v) for n, v in samples.items()},
            {n: statistics.median(v) for n, v in around.items()},
            {n: statistics.median(v) for n, v in first.items() if v})


def _split(fn):
    fn.split = True
    return fn


class _Product(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return self.weight @ x


def _case(n: int, kind: str, density: float):
    """(dense, A, rhs, equation) of one case, from a generator seeded by its size."""
    g = torch.Generator().manual_seed(n)
    dense = torch.rand(n, n, generator=g) * (torch.rand(n, n, generator=g) < density)
    rhs = torch.randn(n, generator=g) if kind == "spmv" else torch.randn(n, 64, generator=g)
    return dense, sb.sparse(dense, "csr"), rhs, "ij,j->i" if kind == "spmv" else "ij,jk->ik"


def kernel_alone(n: int, kind: str, density: float, threads: int):
    """A function running that case's compiled kernel once, timed in C++ with no call around it: what runs before
    each call of the "after a kernel" section."""
    _, A, rhs, eq = _case(n, kind, density)
    plan = sb.plan_einsum(eq, A, rhs)
    inputs = [*A.level_buffers.values(), A.stored_values, rhs]
    return lambda: _C.time_kernel(plan["spec"], inputs, plan["var_sizes"], threads, 1, warmup=0, mean=True)


def run(n: int, kind: str, density: float, threads: int, repeats: int, cold: bool = False,
        after_kernel=None, warmup: int = BATCH_WARMUP) -> dict:
    # Every case compiles _Product.forward twice (Scorch, Inductor): without a reset Dynamo's recompile limit
    # for that one code object is reached after four cases and the later ones would run uncompiled.
    torch._dynamo.reset()
    dense, A, rhs, eq = _case(n, kind, density)
    At = dense.to_sparse_csr()
    plan = sb.plan_einsum(eq, A, rhs)
    inputs = [*A.level_buffers.values(), A.stored_values, rhs]
    expect = At @ rhs
    got = sb.einsum(eq, A, rhs)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    weight = dense.clone()
    model = torch.compile(_Product(weight), backend="scorch")
    inductor = torch.compile(_Product(dense.clone()))
    torch.testing.assert_close(inductor(rhs), expect, rtol=1e-4, atol=1e-4)
    reports: list = []
    backend._recorders.append(reports)
    try:
        torch.testing.assert_close(model(rhs), expect, rtol=1e-4, atol=1e-4)
    finally:
        backend._recorders.remove(reports)
    text = next(r.program_text for rep in reports for r in rep.regions if r.fused is not None)
    # the program's compressed operand is the weight (the parameter itself, as the compiled graph hands it)
    operands = [model._orig_mod.weight if o.kind != "dense" else rhs for o in region.parse_program(text).operands]
    torch.testing.assert_close(torch.ops.scorch.region(text, operands), expect, rtol=1e-4, atol=1e-4)
    def kernel(calls: int) -> float:
        return _C.time_kernel(plan["spec"], inputs, plan["var_sizes"], threads, calls, warmup=0, mean=True)

    kernel.self_timed = True
    row = {"n": n, "kind": kind, "nnz": A.nnz}
    times, around, first = per_call({
        "kernel": kernel,
        "op": _split(lambda: torch.ops.scorch.kernel(plan["spec"], inputs, plan["var_sizes"], threads)),
        "einsum": _split(lambda: sb.einsum(eq, A, rhs)),
        "region": _split(lambda: torch.ops.scorch.region(text, operands)),
        "compiled": _split(lambda: model(rhs)),
        "torch_csr": lambda: At @ rhs,
        "dense": lambda: dense @ rhs,
        "inductor": lambda: inductor(rhs),
    }, repeats, warmup=warmup)
    row.update(times)
    row["around_kernel"] = around
    row["first_call_around_kernel"] = first
    small = {
        "einsum": _split(lambda: sb.einsum(eq, A, rhs)),
        "region": _split(lambda: torch.ops.scorch.region(text, operands)),
        "torch_csr": lambda: At @ rhs,
        "dense": lambda: dense @ rhs,
        "empty": lambda: torch.empty(1),
    }
    if cold:
        sweep = torch.empty(2 * last_level_cache_bytes() // 4)
        row["cold"] = cold_calls(small, repeats, lambda: sweep.fill_(1.0))
    if after_kernel is not None:
        row["warm"] = cold_calls(small, repeats, lambda: None)
        row["after_kernel"] = cold_calls(small, repeats, after_kernel)
    return row


def last_level_cache_bytes() -> int:
    """The last-level cache's size from sysfs (the highest cache index of cpu0); 32 MiB when it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        sizes = []
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                units = {"K": 2**10, "M": 2**20, "G": 2**30}
                sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        return max(sizes)
    except (OSError, ValueError):
        return 32 * 2**20


def cold_calls(fns: dict, repeats: int, before) -> dict:
    """Per-call times when every call follows `before()`: writing a buffer twice the last-level cache (cold
    caches: the state after a kernel that streamed more than the caches hold), running a large case's kernel
    alone (the state a call of that case is in when its kernel returns), or nothing (warm). For a `split` fn, the
    cost around its kernel; for the others the whole call (their kernels are negligible on the small case this
    is run on). Medians of `repeats` x 5 calls, the contenders interleaved call by call."""
    out: dict = {n: [] for n in fns}
    clock = time.perf_counter
    for fn in fns.values():
        for _ in range(5):
            fn()
    for r in range(repeats * 5):
        for name, fn in fns.items():
            before()
            t = clock()
            fn()
            d = clock() - t
            out[name].append(d - _C.last_kernel_seconds() if getattr(fn, "split", False) else d)
    return {n: statistics.median(v) for n, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--batch-warmup", type=int, default=BATCH_WARMUP,
                   help="untimed calls opening every batch (the first one is reported on its own)")
    p.add_argument("--target", default=None, help="kernel target (default: SCORCH_TARGET or native)")
    p.add_argument("--out", default=None, help="JSON file for the results (default benchmarks/results/)")
    add_baseline_isa_argument(p)
    args = p.parse_args(argv)
    if args.batch_warmup < 0:
        p.error(f"--batch-warmup takes a count of 0 or more, got {args.batch_warmup}")
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=argv is None)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    load = OtherLoad()
    print(sb.describe_machine(args.threads))
    print(baseline_isa)
    print(f"threads: {args.threads} for every contender; density {args.density}; medians of {args.repeats} batches, "
          f"each after {args.batch_warmup} untimed calls")
    print(f"{'case':<14}{'nnz':>9}{'kernel':>10}{'op':>10}{'einsum':>10}{'region':>10}{'compiled':>10}"
          f"{'torch CSR':>11}{'CSR/einsum':>12} | around the kernel: {'op':>7}{'einsum':>9}{'region':>9}"
          f"{'compiled':>10} | first call of a batch: {'einsum':>7}{'region':>9} | torch.compile wrapper "
          f"(inductor - dense)")
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    # The largest SpMM case's kernel, run alone before calls of the smallest case ("after a kernel" below).
    big = kernel_alone(max(sizes), "spmm", args.density, args.threads) if len(sizes) > 1 else None
    for n in sizes:
        for kind in ("spmv", "spmm"):
            r = run(n, kind, args.density, args.threads, args.repeats, cold=n == min(sizes),
                    after_kernel=big if n == min(sizes) else None, warmup=args.batch_warmup)
            rows.append(r)
            us = {k: r[k] * 1e6 for k in ("kernel", "op", "einsum", "region", "compiled", "torch_csr")}
            a = {k: v * 1e6 for k, v in r["around_kernel"].items()}

            def first(k, f=r["first_call_around_kernel"]):
                return f"{f[k] * 1e6:.1f}u" if k in f else "-"
            print(f"{kind + ' ' + str(n):<14}{r['nnz']:>9}{us['kernel']:>9.1f}u{us['op']:>9.1f}u{us['einsum']:>9.1f}u"
                  f"{us['region']:>9.1f}u{us['compiled']:>9.1f}u{us['torch_csr']:>10.1f}u"
                  f"{r['torch_csr'] / r['einsum']:>11.2f}x | {'':>19}{a['op']:>6.1f}u{a['einsum']:>8.1f}u"
                  f"{a['region']:>8.1f}u{a['compiled']:>9.1f}u | {'':>22}{first('einsum'):>7}{first('region'):>9} | "
                  f"{(r['inductor'] - r['dense']) * 1e6:>8.1f}u")
            sys.stdout.flush()
    mb = 2 * last_level_cache_bytes() / 2**20
    print(f"\nCold calls: before each call a {mb:.0f} MB buffer (twice the last-level cache) is written, the state "
          f"a call is in after a kernel that streamed more than the caches hold (the large cases). On the smallest "
          f"case, per call:")
    print(f"{'case':<14}{'einsum around kernel':>22}{'region around kernel':>22}{'torch CSR call':>16}"
          f"{'dense mm call':>15}{'torch.empty(1)':>16}")
    for r in rows:
        if "cold" in r:
            c = {k: v * 1e6 for k, v in r["cold"].items()}
            print(f"{r['kind'] + ' ' + str(r['n']):<14}{c['einsum']:>21.1f}u{c['region']:>21.1f}u"
                  f"{c['torch_csr']:>15.1f}u{c['dense']:>14.1f}u{c['empty']:>15.1f}u")
    if big is not None:
        print(f"\nAfter a kernel: before each call the {max(sizes)}x{max(sizes)} SpMM case's kernel runs alone (no "
              f"call around it), the state the large cases' own calls return in. On the smallest case, per call, "
              f"and what that costs over the same call warm:")
        print(f"{'case':<14}{'einsum around kernel':>22}{'region around kernel':>22}{'torch CSR call':>22}"
              f"{'dense mm call':>22}{'torch.empty(1)':>22}")
        for r in rows:
            if "after_kernel" in r:
                a, w = r["after_kernel"], r["warm"]
                cells = "".join(f"{f'{a[k] * 1e6:.1f}u (+{(a[k] - w[k]) * 1e6:.1f})':>22}"
                                for k in ("einsum", "region", "torch_csr", "dense", "empty"))
                print(f"{r['kind'] + ' ' + str(r['n']):<14}{cells}")
    spmv = [r["torch_csr"] / r["einsum"] for r in rows if r["kind"] == "spmv"]
    print(f"SpMV geomean torch CSR / einsum: {statistics.geometric_mean(spmv):.2f}x")
    print(load.report())
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"overhead_{args.target or sb.target_info()['name']}.json")
    timing.save_json(out, {"machine": sb.describe_machine(args.threads), "baseline_isa": baseline_isa,
                           "threads": args.threads,
                           "density": args.density, "rows": rows, "other_load": load.to_dict()})
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
