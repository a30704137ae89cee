#!/usr/bin/env python
"""Scorch's compiled sparse kernels against PyTorch, on real and generated sparse matrices.

    .venv/bin/python benchmarks/kernels.py            # default run: a few minutes
    .venv/bin/python benchmarks/kernels.py --quick    # smoke run: under a minute

Kernels (float32 values, int32 Scorch indices):
    spmv    y = A x                          sb.einsum("ij,j->i", A, x)
    spmm    C = A B, B dense (cols x 128)    sb.einsum("ij,jk->ik", A, B)
    sddmm   C = S .* (P Q^T), K = 128        sb.einsum("ij,ik,jk->ij", S, P, Q)      (sparse output)
    spgemm  C = A A^T                        sb.einsum("ij,jk->ik", A, At)          (sparse output)
    spadd   C = A + A^T (square A only)      sb.compute("C(i,j) = A(i,j) + B(i,j)", A=A, B=At)
    mttkrp  M = T_(1) (B kr C), rank 32      sb.einsum("ikl,kj,lj->ij", T, B, C), T in CSF (generated)
    ttm     Y = T x_3 U, rank 32             sb.einsum("ijk,kr->ijr", T, U), T in CSF (generated); Scorch's Y
            shares T's (i, j) fibers with a dense r below each (no value where T has no fiber), the contenders'
            Y is a dense I x J x R array (their COO emulation has nowhere else to put it)
    bsr     C = A B, A block-pruned (90%)    sb.einsum("ij,jk->ik", A, B), A stored BSR 4x4 / 16x16 (generated,
            DLMC-sized 512x512 and 1024x1024 weights, B 128 columns); the block kernel runs natively. Its
            columns differ: "torch CSR" is torch's BSR mm (torch.sparse_bsr @ B), "torch COO" is Scorch's own
            CSR kernel on the same weights (the native blocks should be >= 2x it), "dense" is A_dense @ B.
    nm      C = A B, A n:m-pruned            sb.einsum("ij,jk->ik", A, B), A stored nm(2,4) (512, 1024, 2048
            square) and nm(4,8) / nm(1,4) (1024), B 128 columns; the n:m kernel runs natively on the groups'
            masks. "torch CSR" is torch's CSR mm on the same weights, "torch COO" Scorch's own CSR kernel on
            them, "dense" is torch.mm(A_dense, B): 2:4 should be >= 1.6x dense (issue 12).

Contenders, all in this process with the same thread count: torch.sparse CSR, torch.sparse COO and dense torch
(when the dense operands fit under --dense-limit-gb and the dense work under --dense-max-gflop). Every time is
the median of at least --repeats calls (time.perf_counter) after --warmup calls, Scorch and its contenders
timed in alternation (rounds in a rotating order, tools/timing.measure_interleaved), so that another process's
load falls on all of them alike; a ratio is contender time / Scorch time, so a ratio above 1 means Scorch is
faster. Each Scorch result is checked once against the torch CSR result.

Memory traffic model (bytes a kernel must move at least): every buffer of every operand read once (a sparse
operand's index buffers and values as Scorch stores them, a dense operand's elements) plus the result written
once (a sparse result's index buffers and values, a dense result's elements). Achieved GB/s = bytes / median
time, reported as a fraction of a STREAM triad (a = b + s*c on 2^25-element tensors, median of 10 runs,
counting 3 arrays of traffic, the larger of float32 and float64) measured in the same run with the same
thread count. The compute ceiling is measured too (runtime/fma_probe.h: independent chains of multiply-adds at
the target's vector width, the same threads): the BSR cases are printed as fractions of it, with the ratio over
Scorch's CSR kernel the peak would allow. SDDMM cases get a floor of their own: Q's rows read at the stored
entries and summed (sb.einsum('ij,jk->k', S, Q)), which any SDDMM on that pattern must at least do.

JIT times are measured in subprocesses: a fresh SCORCH_CACHE_DIR gives the cold time (code generation and
compilation) of the first call of each kernel; a second subprocess on the same directory gives the time of the
first call when the kernel comes from the disk cache.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import pathlib
import platform
import sys
import time
import traceback
import warnings

import numpy as np
import torch

# The targets are about the compiled kernels: keep the run-time dense/sparse cost model out of the timings
# (subprocesses for the JIT times inherit this too).
os.environ.setdefault("SCORCH_DISPATCH", "sparse")

import scorch_backend as sb  # noqa: E402
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa  # noqa: E402
from scorch_backend.tools import datasets  # noqa: E402
from scorch_backend.tools.timing import fma_peak, measure_interleaved, stream_triad  # noqa: E402
from scorch_backend.tools.timing import OtherLoad, fmt_ratio, fmt_time, save_json  # noqa: E402
from kernel_cases import (CONTENDERS, EQUATIONS, K_SDDMM, KERNELS, N_SPMM, RANK_MTTKRP, RTOL,  # noqa: E402
                          TORCH_OPS, Skip, block_pruned, check_dense, check_sparse, load_matrices, log,
                          nm_pruned, random_tensor3, scipy_of_torch, setup_bsr, setup_case, setup_mttkrp,
                          setup_nm, setup_ttm, torch_coo, torch_csr)
from kernel_jit import JIT_COLD_TARGET_S, JIT_DISK_TARGET_S, jit_times, summarize_jit  # noqa: E402
from kernel_ceilings import report_compute_bound, report_sddmm_floor  # noqa: E402


# Geometric mean of (torch CSR time / Scorch time) that each kernel should reach, and JIT limits in seconds.
TARGETS = {"spmm": 1.5, "spmv": 1.2, "sddmm": 3.0, "spgemm": 2.0, "spadd": 2.0, "bsr": 1.0}
# bsr: the native block kernel against Scorch's CSR kernel on the same weights (the "torch_coo" slot).
BSR_TARGET_VS_SCORCH_CSR = 2.0
# nm: 2:4 weights, the native n:m kernel against dense torch.mm on the same (dense) weights.
NM_TARGET_VS_DENSE = 1.6
TENSOR3_TARGET = 10.0  # MTTKRP and TTM on 3-D CSF: against dense einsum and the COO emulation (issue 12)


# ----------------------------------------------------------------------------------------------------------
# timing and helpers


def nbytes(x) -> int:
    """Bytes of a tensor's storage as the kernel sees it (see the traffic model in the module docstring)."""
    if isinstance(x, sb.SparseTensor):
        return sum(b.numel() * b.element_size() for b in x.level_buffers.values()) + \
            x.stored_values.numel() * x.stored_values.element_size()
    return x.numel() * x.element_size()


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ----------------------------------------------------------------------------------------------------------
# contention probe (the STREAM triad is scorch_backend.tools.timing.stream_triad)


_PROBE: dict = {}


def contention_probe() -> dict:
    """Median time of a small parallel torch op and a small Scorch SpMV. On an idle machine both take tens
    of microseconds; when another process holds a core, every parallel region waits for the scheduler
    (several ms) and all multi-threaded timings are quantized by it."""
    if not _PROBE:
        _PROBE.update(x=torch.rand(1 << 18), y=torch.rand(1 << 18), z=torch.empty(1 << 18),
                      A=sb.sparse(datasets.random_matrix(4096, 4096, 1e-3), "csr"), v=torch.rand(4096))
    x, y, z, A, v = (_PROBE[k] for k in "xyzAv")
    out = {}
    for name, fn in (("torch_add_2^18", lambda: torch.add(x, y, out=z)),
                     ("scorch_spmv_4096", lambda: sb.einsum("ij,j->i", A, v))):
        fn()
        ts = []
        for _ in range(40):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[name + "_median_s"] = ts[len(ts) // 2]
    out["worst_s"] = max(out.values())
    out["contended"] = out["worst_s"] > 1e-3
    return out


# ----------------------------------------------------------------------------------------------------------
# one kernel on one matrix


NM_RESULTS: list = []  # the nm rows of this run, for the 2:4 target


def run_nm(args, triad_gbps, results):
    for n, m, size in [(2, 4, 512), (2, 4, 1024), (2, 4, 2048), (4, 8, 1024), (1, 4, 1024)]:
        name = f"generated/nm_pruned_{size}x{size}_{n}of{m}"
        w = nm_pruned(size, size, n, m)
        log(f"\n{name}: {int((w != 0).sum())} stored values, {n} of every {m} columns")
        try:
            case = setup_nm(w, n, m, args)
        except Exception as e:
            results.append({"kernel": "nm", "matrix": name, "shape": [size, size], "nnz": int((w != 0).sum()),
                            "error": f"setup: {type(e).__name__}: {e}"})
            log(f"  !! nm setup failed: {type(e).__name__}: {e}")
            continue
        r = run_case("nm", name, (size, size), int((w != 0).sum()), case, args)
        results.append(r)
        if "scorch" in r:
            log(case_line(r, triad_gbps))


def run_bsr(args, triad_gbps, results):
    sizes = [512, 1024]
    blocks = [(4, 4), (16, 16)]
    for n in sizes:
        for block in blocks:
            name = f"generated/block_pruned_{n}x{n}_b{block[0]}x{block[1]}_d0.1"
            w = block_pruned(n, n, block, 0.1)
            log(f"\n{name}: {int((w != 0).sum())} stored values in {block[0]}x{block[1]} blocks")
            try:
                case = setup_bsr(w, block, args)
            except Exception as e:
                results.append({"kernel": "bsr", "matrix": name, "shape": [n, n], "nnz": int((w != 0).sum()),
                                "error": f"setup: {type(e).__name__}: {e}"})
                log(f"  !! bsr setup failed: {type(e).__name__}: {e}")
                continue
            r = run_case("bsr", name, (n, n), int((w != 0).sum()), case, args)
            results.append(r)
            if "scorch" in r:
                log(case_line(r, triad_gbps))


def run_case(kernel: str, name: str, shape, nnz: int, case: dict, args) -> dict:
    res = {"kernel": kernel, "matrix": name, "shape": list(shape), "nnz": int(nnz),
           "scorch_call": EQUATIONS[kernel], "contenders": {}, "skipped": dict(case["skipped"])}
    # Scorch's first call (compiles or loads the kernel), and each contender's (the torch CSR result is the
    # reference), outside the timings.
    try:
        t = time.perf_counter()
        out = case["scorch"]()
        res["scorch_first_call_s"] = time.perf_counter() - t
    except Exception as e:  # a Scorch failure is a result, not the end of the run
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"  !! Scorch {kernel} on {name} failed: {res['error']}")
        if args.verbose:
            traceback.print_exc()
        return res
    moved = sum(nbytes(x) for x in case["inputs"]) + nbytes(out)
    ref = None
    timed = {"scorch": case["scorch"]}
    for cname in CONTENDERS:
        fn = case["contenders"].get(cname)
        if fn is None:
            continue
        try:
            r = fn()
        except Exception as e:
            res["skipped"][cname] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        if cname == "torch_csr":
            ref = r
        del r
        timed[cname] = fn
    gc.collect()
    if "floor" in case:
        timed["floor"] = case["floor"]
    # Scorch and the contenders timed in alternation (rounds in a rotating order), so that load from another
    # process falls on all of them alike instead of on whichever was being timed (measure_interleaved).
    times, failed = measure_interleaved(timed, warmup=args.warmup, repeat=args.repeats, min_time=args.budget / 10,
                                        max_repeat=50 * args.repeats, budget=args.budget, min_samples=3)
    if "scorch" in failed:
        e = failed["scorch"]
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"  !! Scorch {kernel} on {name} failed: {res['error']}")
        return res
    res["scorch"] = times["scorch"].to_dict()
    if kernel in FMA_KERNELS:  # one multiply-add per stored entry and column of B
        res["flop"] = 2 * int(nnz) * N_SPMM
    res["bytes_moved"] = moved
    res["scorch_gbps"] = moved / res["scorch"]["median_s"] / 1e9
    for cname, e in failed.items():
        res["skipped"][cname] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "floor" in times:
        res["floor"] = times["floor"].to_dict()
    for cname in timed:
        if cname in ("scorch", "floor") or cname not in times:
            continue
        b = times[cname].to_dict()
        b["ratio"] = b["median_s"] / res["scorch"]["median_s"]
        b["op"] = TORCH_OPS[kernel][cname]
        res["contenders"][cname] = b
    # Check against the torch CSR result (SDDMM: sampled_addmm's, scaled by S's values).
    try:
        if ref is None:
            ok, msg = None, "no torch CSR result to compare with"
        elif isinstance(out, sb.SparseTensor) and not ref.is_sparse and ref.layout == torch.strided:
            ok, msg = check_dense(out.to_dense(), ref)  # a sparse result of a dense contender (TTM's fibers)
        elif isinstance(out, sb.SparseTensor):
            ok, msg = check_sparse(out, case.get("ref_transform", scipy_of_torch)(ref))
        else:
            ok, msg = check_dense(out, ref)
    except Exception as e:
        ok, msg = False, f"check failed: {type(e).__name__}: {e}"
    res["check"] = {"ok": ok, "detail": msg}
    if ok is False:
        log(f"  WARNING: Scorch {kernel} on {name} disagrees with torch: {msg}")
    del out, ref
    return res


# ----------------------------------------------------------------------------------------------------------
# command line, machine, report


def machine_info(threads: int) -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {"torch": torch.__version__, "scorch": sb.__version__, "python": platform.python_version(),
            "numpy": np.__version__, "scipy": __import__("scipy").__version__,
            "platform": platform.platform(),
            "cpu_model": cpu, "cpu_count": os.cpu_count(), "cpus_available": affinity, "memory_bytes": mem,
            "threads": threads, "torch_num_threads": torch.get_num_threads(),
            "torch_parallel_info": torch.__config__.parallel_info().splitlines()[:6],
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def parse_args(argv=None):
    here = pathlib.Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="benchmarks/README.md and the module docstring say what is measured.")
    p.add_argument("--data", default=None,
                   help="folder of real matrices (default: $SCORCH_DATA or "
                        f"{datasets.DEFAULT_DATA.resolve()})")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and Scorch (default 2)")
    p.add_argument("--target", default=None,
                   help="instruction-set target of the kernels: native (default, or SCORCH_TARGET), x86-64-v3, ...")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per measurement (default 7, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2, quick 1)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per measurement after which repeats stop early, once 3 were taken "
                        "(default 2, quick 0.5)")
    p.add_argument("--out", default=str(here / "results" / "kernels.json"), help="JSON output path")
    p.add_argument("--quick", action="store_true", help="small subset for a fast smoke run")
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--max-matrices", type=int, default=None,
                   help="real matrices per kind (suitesparse, dlmc, graphs), spread over their sizes "
                        "(default 3, quick 1)")
    p.add_argument("--rmat-scale", type=int, default=None,
                   help="R-MAT graph with 2^scale nodes (default 20, quick 16; 0 leaves it out)")
    p.add_argument("--rmat-edge-factor", type=int, default=16, help="R-MAT edges per node (default 16)")
    p.add_argument("--dense-limit-gb", type=float, default=2.0,
                   help="skip dense contenders whose operands exceed this many GB (default 2)")
    p.add_argument("--dense-max-gflop", type=float, default=20.0,
                   help="skip dense contenders that need more GFLOP than this (default 20)")
    p.add_argument("--spgemm-max-flops", type=float, default=3e8,
                   help="skip SpGEMM when A*A^T needs more multiply-adds than this (default 3e8)")
    p.add_argument("--no-jit", action="store_true", help="skip the JIT time measurement")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    add_baseline_isa_argument(p)
    a = p.parse_args(argv)
    a.baseline_isa_note = hold_baseline_isa(a.target, a.baseline_isa, reexec=argv is None)
    a.repeats = a.repeats if a.repeats is not None else (3 if a.quick else 7)
    a.warmup = a.warmup if a.warmup is not None else 1 if a.quick else 2
    a.budget = a.budget if a.budget is not None else 0.5 if a.quick else 2.0
    a.max_matrices = a.max_matrices if a.max_matrices is not None else (1 if a.quick else 3)
    a.rmat_scale = a.rmat_scale if a.rmat_scale is not None else (16 if a.quick else 20)
    a.kernels = [k.strip().lower() for k in a.kernels.split(",") if k.strip()]
    bad = [k for k in a.kernels if k not in KERNELS]
    if bad:
        p.error(f"unknown kernels {bad}; choose from {','.join(KERNELS)}")
    if a.threads < 1 or a.repeats < 1 or a.warmup < 0:
        p.error("--threads and --repeats must be >= 1, --warmup >= 0")
    return a


def case_line(r: dict, triad_gbps: float) -> str:
    parts = [f"{c} {fmt_ratio(b['ratio'])}" for c, b in r["contenders"].items()]
    return (f"  {r['kernel']:<7} scorch {fmt_time(r['scorch']['median_s']):>9}  " + ", ".join(parts) +
            f"  ({r['scorch_gbps']:.1f} GB/s, {100 * r['scorch_gbps'] / triad_gbps:.0f}% of triad)")


def print_results(results, triad_gbps):
    hdr = (f"{'kernel':<7} {'matrix':<44} {'shape':>15} {'nnz':>9} {'scorch':>9} {'torch CSR':>18} "
           f"{'torch COO':>18} {'dense':>18} {'GB/s':>6} {'%triad':>6} check")
    log(hdr)
    log("-" * len(hdr))
    for r in results:
        shape = "x".join(str(s) for s in r["shape"])
        name = r["matrix"] if len(r["matrix"]) <= 44 else r["matrix"][:41] + "..."
        head = f"{r['kernel']:<7} {name:<44} {shape:>15} {r['nnz']:>9}"
        if "scorch" not in r:
            why = r.get("error") or r.get("skip", "")
            log(f"{head} {'FAILED' if 'error' in r else 'skipped'}: {why[:120]}")
            continue
        cols = []
        for c in CONTENDERS:
            b = r["contenders"].get(c)
            cols.append(f"{fmt_time(b['median_s'])} ({fmt_ratio(b['ratio'])})" if b else "-")
        chk = r.get("check", {}).get("ok")
        chk = "ok" if chk else "n/a" if chk is None else "MISMATCH"
        if r.get("contended"):
            chk += " *contended"
        log(f"{head} {fmt_time(r['scorch']['median_s']):>9} {cols[0]:>18} {cols[1]:>18} {cols[2]:>18} "
            f"{r['scorch_gbps']:>6.1f} {100 * r['scorch_gbps'] / triad_gbps:>5.0f}% {chk}")


def summarize(results, kernels, threads, triad_gbps) -> dict:
    log(f"\nGeometric means over the cases of contender time / Scorch time ({threads} threads; >1: Scorch "
        "faster)")
    log(f"{'kernel':<8} {'cases':>5} {'vs torch CSR':>13} {'vs torch COO':>13} {'vs dense':>9} "
        f"{'GB/s':>6} {'%triad':>7} {'target':>7}  reached")
    summary = {}
    for k in kernels:
        rs = [r for r in results if r["kernel"] == k and "scorch" in r]
        s = {"cases": len(rs),
             "failed": [r["matrix"] for r in results if r["kernel"] == k and "error" in r],
             "skipped": [r["matrix"] for r in results if r["kernel"] == k and "skip" in r],
             "mismatches": [r["matrix"] for r in rs if r.get("check", {}).get("ok") is False],
             "contended": [r["matrix"] for r in rs if r.get("contended")]}
        for c in CONTENDERS:
            with_c = [r for r in rs if c in r["contenders"]]
            s[f"geomean_ratio_{c}"] = geomean([r["contenders"][c]["ratio"] for r in with_c])
            s[f"cases_{c}"] = len(with_c)
        s["geomean_gbps"] = geomean([r["scorch_gbps"] for r in rs])
        s["geomean_triad_fraction"] = s["geomean_gbps"] / triad_gbps if s["geomean_gbps"] else None
        tgt = TARGETS.get(k)
        g = s["geomean_ratio_torch_csr"]
        s["target_vs_torch_csr"] = tgt
        s["target_reached"] = None if tgt is None or g is None else bool(g >= tgt and not s["failed"])
        summary[k] = s
        reached = "-" if tgt is None else ("n/a" if g is None else ("YES" if s["target_reached"] else "no"))
        if s["failed"]:
            reached += f" ({len(s['failed'])} failed)"
        if s["mismatches"]:
            reached += f" ({len(s['mismatches'])} mismatches)"
        if s["contended"]:
            reached += f" ({len(s['contended'])} cases contended)"
        log(f"{k:<8} {len(rs):>5} {fmt_ratio(g):>13} {fmt_ratio(s['geomean_ratio_torch_coo']):>13} "
            f"{fmt_ratio(s['geomean_ratio_dense']):>9} {(s['geomean_gbps'] or 0):>6.1f} "
            f"{100 * (s['geomean_triad_fraction'] or 0):>6.0f}% {(f'>={tgt:g}x' if tgt else '-'):>7}  "
            f"{reached}")
    return summary


def report_targets(summary, jit_summary) -> dict:
    log("\nTargets")
    targets = {}
    for k, tgt in TARGETS.items():
        if k not in summary:
            continue
        g = summary[k]["geomean_ratio_torch_csr"]
        targets[k] = {"target": f"geomean(torch CSR time / Scorch time) >= {tgt:g}", "value": g,
                      "reached": summary[k]["target_reached"]}
        state = "not measured" if g is None else "REACHED" if summary[k]["target_reached"] else "not reached"
        extra = f" ({len(summary[k]['failed'])} cases failed)" if summary[k]["failed"] else ""
        log(f"  {k:<9} {fmt_ratio(g):>8} vs torch {'BSR mm' if k == 'bsr' else 'CSR'}, target >= {tgt:g}x: "
            f"{state}{extra}")
        if k == "bsr":
            c = summary[k]["geomean_ratio_torch_coo"]
            ok = None if c is None else bool(c >= BSR_TARGET_VS_SCORCH_CSR)
            targets["bsr_vs_scorch_csr"] = {"target": f"geomean(Scorch CSR time / Scorch BSR time) >= "
                                                      f"{BSR_TARGET_VS_SCORCH_CSR:g}", "value": c, "reached": ok}
            log(f"  {'bsr':<9} {fmt_ratio(c):>8} vs Scorch's CSR kernel, target >= {BSR_TARGET_VS_SCORCH_CSR:g}x: "
                f"{'not measured' if ok is None else 'REACHED' if ok else 'not reached'}")
    if "nm" in summary:
        two_four = [r["contenders"]["dense"]["ratio"] for r in NM_RESULTS
                    if "_2of4" in r["matrix"] and "dense" in r.get("contenders", {})]
        g = math.exp(sum(math.log(x) for x in two_four) / len(two_four)) if two_four else None
        ok = None if g is None else bool(g >= NM_TARGET_VS_DENSE)
        targets["nm_2of4_vs_dense"] = {"target": f"geomean(dense torch.mm time / Scorch 2:4 time) >= "
                                                 f"{NM_TARGET_VS_DENSE:g}", "value": g, "reached": ok}
        log(f"  {'nm 2:4':<9} {fmt_ratio(g):>8} vs dense torch.mm, target >= {NM_TARGET_VS_DENSE:g}x: "
            f"{'not measured' if ok is None else 'REACHED' if ok else 'not reached'}")
    for k in ("mttkrp", "ttm"):
        if k not in summary:
            continue
        for contender, label in (("dense", "dense einsum"), ("torch_coo", "COO emulation")):
            g = summary[k][f"geomean_ratio_{contender}"]
            ok = None if g is None else bool(g >= TENSOR3_TARGET)
            targets[f"{k}_vs_{contender}"] = {"target": f"geomean({label} time / Scorch time) >= {TENSOR3_TARGET:g}",
                                              "value": g, "reached": ok}
            log(f"  {k:<9} {fmt_ratio(g):>8} vs {label}, target >= {TENSOR3_TARGET:g}x: "
                f"{'not measured' if ok is None else 'REACHED' if ok else 'not reached'}")
    if jit_summary is not None:
        for phase, tgt in (("cold", JIT_COLD_TARGET_S), ("disk", JIT_DISK_TARGET_S)):
            v = jit_summary[f"max_{phase}_first_call_s"]
            ok = jit_summary[f"{phase}_reached"]
            targets[f"jit_{phase}"] = {"target": f"slowest first call ({phase} cache) <= {tgt:g} s",
                                       "value": v, "reached": ok}
            log(f"  jit {phase:<5} slowest first call {fmt_time(v):>8}, target <= {fmt_time(tgt)}: "
                f"{'REACHED' if ok else 'not reached'}")
    return targets


FMA_KERNELS = ("spmm", "bsr", "nm")  # whose work is counted in multiply-adds (2 * nnz * N_SPMM FLOP)


# ----------------------------------------------------------------------------------------------------------
# main


@contextlib.contextmanager
def contention_watch(what: str, results: list):
    """Probe for CPU contention before and after a group of cases and mark the cases it produced."""
    before = contention_probe()
    first = len(results)
    yield
    after = contention_probe()
    if before["contended"] or after["contended"]:
        for r in results[first:]:
            r["contended"] = True
        log(f"  WARNING: CPU contention detected around {what} (probe before: {fmt_time(before['worst_s'])}, "
            f"after: {fmt_time(after['worst_s'])}); its timings are marked *contended and are not reliable")


def run_matrix(name, loader, kernels, args, triad_gbps, results):
    t = time.perf_counter()
    m = loader().astype(np.float32)
    m.sum_duplicates()
    m.sort_indices()
    rows, cols = m.shape
    log(f"\n{name}: {rows}x{cols}, nnz {m.nnz} (loaded in {time.perf_counter() - t:.1f} s)")
    A = sb.sparse(m, "csr")
    cache = {}

    def lazy(key, make):
        def get():
            if key not in cache:
                cache[key] = make()
            return cache[key]
        return get

    mT = lazy("mT", lambda: m.T.tocsr().sorted_indices())
    colcount = np.bincount(m.indices, minlength=cols).astype(np.float64)
    ctx = {"A": A,
           "A_csr": lazy("A_csr", lambda: torch_csr(m)),
           "A_coo": lazy("A_coo", lambda: torch_coo(m)),
           "At": lazy("At", lambda: A.t().to_format("csr")),
           "At_csr": lazy("At_csr", lambda: torch_csr(mT())),
           "At_coo": lazy("At_coo", lambda: torch_coo(mT())),
           "A_dense": lazy("A_dense", lambda: torch.from_numpy(m.toarray())),
           "spgemm_flops": float((colcount ** 2).sum())}
    base = {"matrix": name, "shape": [rows, cols], "nnz": int(m.nnz)}
    for kernel in kernels:
        try:
            case = setup_case(kernel, m, ctx, args)
        except Skip as s:
            results.append({"kernel": kernel, **base, "skip": str(s)})
            log(f"  {kernel:<7} skipped: {s}")
            continue
        except Exception as e:
            results.append({"kernel": kernel, **base, "error": f"setup: {type(e).__name__}: {e}"})
            log(f"  !! {kernel} setup failed on {name}: {type(e).__name__}: {e}")
            if args.verbose:
                traceback.print_exc()
            continue
        r = run_case(kernel, name, (rows, cols), m.nnz, case, args)
        results.append(r)
        if "scorch" in r:
            log(case_line(r, triad_gbps))
        del case
        gc.collect()
    cache.clear()
    gc.collect()


def run_tensor3(kernel: str, args, triad_gbps, results):
    setup = {"mttkrp": setup_mttkrp, "ttm": setup_ttm}[kernel]
    tensors = [((200, 200, 200), 1e-3)]
    if not args.quick:
        tensors.append(((1000, 1000, 1000), 1e-4))
    for dims, dens in tensors:
        idx, vals, shape = random_tensor3(dims, dens)
        name = f"generated/tensor3_{'x'.join(map(str, dims))}_d{dens:g}"
        log(f"\n{name}: nnz {vals.numel()}, rank {RANK_MTTKRP}")
        try:
            case = setup(name, idx, vals, shape, args)
        except Exception as e:
            results.append({"kernel": kernel, "matrix": name, "shape": list(shape),
                            "nnz": int(vals.numel()), "error": f"setup: {type(e).__name__}: {e}"})
            log(f"  !! {kernel} setup failed: {type(e).__name__}: {e}")
            continue
        r = run_case(kernel, name, shape, vals.numel(), case, args)
        results.append(r)
        if "scorch" in r:
            log(case_line(r, triad_gbps))


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
        os.environ["SCORCH_TARGET"] = args.target  # the JIT-time subprocesses use it too
    t_start = time.perf_counter()
    load = OtherLoad()
    info = machine_info(args.threads)
    info["kernel_target"] = sb.target_info()
    log(f"Scorch kernel benchmark: torch {info['torch']}, {info['cpu_model']}, {info['cpu_count']} CPUs, "
        f"{args.threads} threads for torch and Scorch (torch.get_num_threads() = {torch.get_num_threads()})")
    log(sb.describe_machine(args.threads))
    log(args.baseline_isa_note)
    info["baseline_isa"] = args.baseline_isa_note
    log(f"median of {args.repeats} calls after {args.warmup} warm-up calls (fewer past {args.budget:g} s); "
        "ratio = torch time / Scorch time (>1: Scorch faster)")

    probe = contention_probe()
    info["contention_probe"] = probe
    if probe["contended"]:
        log(f"WARNING: CPU contention: a small parallel torch add takes "
            f"{fmt_time(probe['torch_add_2^18_median_s'])} and a small Scorch SpMV "
            f"{fmt_time(probe['scorch_spmv_4096_median_s'])} (tens of us when idle). Another process is "
            f"using the cores, so timings with {args.threads} threads are quantized by the scheduler; rerun "
            "on an idle machine (or with fewer --threads) for meaningful numbers.")
    triad = stream_triad(args.threads)
    # The reference is the larger median of the two (the best run is prone to outliers on virtual machines).
    triad_gbps = max(triad["float32"]["median_gbps"], triad["float64"]["median_gbps"])
    triad["reference_gbps"] = triad_gbps
    log(f"STREAM triad (a = b + s*c, 2^25 elements, {args.threads} threads, median of 10): float32 "
        f"{triad['float32']['median_gbps']:.1f} GB/s, float64 {triad['float64']['median_gbps']:.1f} GB/s "
        f"(best {triad['float32']['best_gbps']:.1f} / {triad['float64']['best_gbps']:.1f}); reference "
        f"{triad_gbps:.1f} GB/s")

    peak = fma_peak(args.threads)
    log(f"FMA peak ({peak['vector_bytes']}-byte float32 vectors, {args.threads} threads, best of 5): "
        + (f"{peak['gflops']:.0f} GFLOP/s" if peak["gflops"] else "n/a (no such instructions)"))

    jit = None
    if not args.no_jit:
        log("JIT: timing first calls in subprocesses (fresh cache, then the same cache from disk) ...")
        jit = jit_times(args.kernels, args.threads)

    results = []
    mat_kernels = [k for k in args.kernels if k not in ("mttkrp", "ttm", "bsr", "nm")]
    if mat_kernels:
        for name, loader in load_matrices(args):
            with contention_watch(name, results):
                run_matrix(name, loader, mat_kernels, args, triad_gbps, results)
    for kernel in ("mttkrp", "ttm"):
        if kernel in args.kernels:
            with contention_watch(f"{kernel} tensors", results):
                run_tensor3(kernel, args, triad_gbps, results)
    if "bsr" in args.kernels:
        with contention_watch("block-pruned weights", results):
            run_bsr(args, triad_gbps, results)
    if "nm" in args.kernels:
        with contention_watch("n:m-pruned weights", results):
            run_nm(args, triad_gbps, results)
        NM_RESULTS.extend(r for r in results if r.get("kernel") == "nm")

    log("\n" + "=" * 100)
    log(f"Results ({args.threads} threads; median times, ratio = contender / Scorch; GB/s from the traffic "
        f"model, % of the triad's {triad_gbps:.1f} GB/s)")
    print_results(results, triad_gbps)
    summary = summarize(results, args.kernels, args.threads, triad_gbps)
    jit_summary = summarize_jit(jit, args.kernels) if jit is not None else None
    targets = report_targets(summary, jit_summary)
    report_compute_bound(results, peak, BSR_TARGET_VS_SCORCH_CSR)
    report_sddmm_floor(results, TARGETS["sddmm"])

    mism = [f"{r['kernel']}/{r['matrix']}" for r in results if r.get("check", {}).get("ok") is False]
    fails = [f"{r['kernel']}/{r['matrix']}: {r['error']}" for r in results if "error" in r]
    if mism:
        log(f"\nWARNING: {len(mism)} Scorch results disagree with torch: {', '.join(mism)}")
    if fails:
        log(f"\nWARNING: {len(fails)} Scorch failures:")
        for f in fails:
            log(f"  {f[:300]}")
    contended = sorted({r["matrix"] for r in results if r.get("contended")})
    if contended:
        log(f"\nWARNING: CPU contention during the cases of {len(contended)} matrices "
            f"({', '.join(contended)}): another process was using the cores, so their timings (marked "
            "*contended) are quantized by the scheduler; rerun on an idle machine.")
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["contention_probe_end"] = contention_probe()
    if probe["contended"] or info["contention_probe_end"]["contended"]:
        log("\nWARNING: CPU contention was detected at the start or the end of the run "
            "(machine.contention_probe in the JSON): the timings above are not reliable.")

    doc = {"benchmark": "scorch kernels vs torch", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "args": vars(args), "machine": info, "threads": args.threads,
           "settings": {"spmm_n": N_SPMM, "sddmm_k": K_SDDMM, "mttkrp_rank": RANK_MTTKRP, "dtype": "float32",
                        "scorch_index_dtype": "int32", "torch_index_dtype": "int64", "check_rtol": RTOL,
                        "bytes_model": "every operand buffer read once + the result's buffers written once",
                        "ratio": "contender median time / Scorch median time (>1: Scorch faster)",
                        "torch_ops": TORCH_OPS, "scorch_calls": EQUATIONS},
           "stream_triad": triad, "triad_gbps": triad_gbps, "fma_peak": peak, "results": results, "summary": summary,
           "jit": jit_summary, "targets": targets, "total_seconds": time.perf_counter() - t_start,
           "other_load": load.to_dict()}
    log(load.report())
    out = save_json(args.out, doc)
    log(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
