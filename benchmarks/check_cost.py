#!/usr/bin/env python
"""What the generated kernels' index checks cost: CSR SpMV against the same loop with no checks.

    flock /tmp/scorch-heavy.lock .venv/bin/python benchmarks/check_cost.py                 # SpMV, 1 and 2 threads
    flock /tmp/scorch-heavy.lock .venv/bin/python benchmarks/check_cost.py --target x86-64-v3 --compare-lib OLD.so

Generated kernels check every index value they load (coordinates against their extent, pos segments against
the crd buffer; csrc/lower/README.md). This measures what that costs, two ways, with the same operands:

* kernel: the generated kernel (SCORCH_DISPATCH=sparse's kernel, the library the JIT built, called from
  Python through its C ABI with the buffer lengths the op passes) against an UNCHECKED loop of the same
  shape written here (same row split by nonzeros, same per-row accumulation, same compiler and target flags;
  a yardstick only, never used by the library). Calls alternate, one of each per repeat; medians.
* einsum: `sb.einsum` end to end with SCORCH_DISPATCH=sparse (what a user sees; includes the op's own
  checks of buffer lengths and versions), median of repeats.

Default matrix: 400k x 400k, 16 nonzeros in every row (one at a random column of each sixteenth of the
columns; 6.4M in all), float32 values, int32 indices, as in the measurement that motivated the hoisted
checks. --compare-lib times another build of the same kernel in the same alternation (e.g. one compiled from
an older commit's generated source, found in the kernel cache as KEY.cpp) so both see the same machine noise.
(SpMM is left out: its register tiles over a CSR-like operand are checked by chunks of rows as SpMV is, and
what the checks cost it shows on benchmarks/spmm_yardstick.py, where the reference loop has none.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["SCORCH_DISPATCH"] = "sparse"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import scorch_backend as sb  # noqa: E402
from scorch_backend import _C  # noqa: E402
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa  # noqa: E402
from scorch_backend.tools.timing import save_json  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent

# The unchecked yardstick: the loops the generated kernels run, without index checks. f32 values, i32 indices.
UNCHECKED = r"""
#include <omp.h>
#include <algorithm>
#include <cstdint>
namespace {
int64_t split(const int32_t* pos, int64_t m, int t, int nt) {
  if (t <= 0) return 0;
  if (t >= nt) return m;
  const int64_t target = (int64_t)((__int128)pos[m] * t / nt);
  return std::lower_bound(pos, pos + m + 1, (int32_t)target) - pos;
}
}
extern "C" void spmv_unchecked(int64_t m, const int32_t* pos, const int32_t* crd, const float* val,
                               const float* x, float* y, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = split(pos, m, t, nt), hi = split(pos, m, t + 1, nt);
    for (int64_t i = lo; i < hi; ++i) {
      float acc = 0;
      for (int64_t k = pos[i]; k < pos[i + 1]; ++k) acc += val[k] * x[crd[k]];
      y[i] += acc;
    }
  }
}
"""


class KernelArgs(ctypes.Structure):
    _fields_ = [("inputs", ctypes.POINTER(ctypes.c_void_p)), ("sizes", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("out_dense", ctypes.c_void_p),
                ("out_nnz", ctypes.c_int64), ("out_coords", ctypes.POINTER(ctypes.c_int64)),
                ("out_vals", ctypes.c_void_p), ("num_threads", ctypes.c_int32), ("status", ctypes.c_int32),
                ("lengths", ctypes.POINTER(ctypes.c_int64))]


def i64s(*xs):
    return (ctypes.c_int64 * len(xs))(*xs)


def build_unchecked(target: dict, outdir: pathlib.Path) -> ctypes.CDLL:
    src = outdir / "unchecked.cpp"
    src.write_text(UNCHECKED)
    lib = outdir / "unchecked.so"
    cxx = os.environ.get("CXX", "c++").split() or ["c++"]
    subprocess.run([*cxx, "-O3", *target["flags"], "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-o", str(lib),
                    str(src)], check=True)
    return ctypes.CDLL(str(lib))


def random_csr(rows: int, cols: int, per_row: int, seed: int = 0):
    """Every row holds `per_row` distinct sorted columns, one drawn uniformly from each of `per_row` equal
    bands of the columns (so the dense operand is read all over); values in [0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    band = cols // per_row
    crd = (np.arange(per_row, dtype=np.int64) * band)[None, :] + rng.integers(0, band, size=(rows, per_row))
    pos = np.arange(0, rows * per_row + 1, per_row, dtype=np.int32)
    val = (rng.random(rows * per_row, dtype=np.float32) + 0.5)
    return pos, np.ascontiguousarray(crd.reshape(-1), dtype=np.int32), val


def median_interleaved(fns, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        for f in fns:
            f()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for q, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[q].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="kernel target (default: SCORCH_TARGET or native)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--rows", type=int, default=400_000, help="rows = columns of the SpMV matrix (default 400k)")
    ap.add_argument("--per-row", type=int, default=16, help="nonzeros per row (default 16)")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compare-lib", default=None,
                    help="also time this kernel library (e.g. one built from an older commit's source of the same "
                         "spec), interleaved with the others so that machine noise hits all alike")
    ap.add_argument("--out", default=None, help="JSON output (default benchmarks/results/check_cost_<target>.json)")
    add_baseline_isa_argument(ap)
    args = ap.parse_args(argv)
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=argv is None)
    if args.target:
        sb.set_target(args.target)
    target = sb.target_info()
    threads = [int(t) for t in args.threads.split(",")]
    print(sb.describe_machine(max(threads)))
    print(baseline_isa)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="scorch-check-cost-"))
    ref = build_unchecked(target, tmp)
    p_i32, p_f32 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
    rows_out = []
    for kernel in ["spmv"]:
        m = args.rows
        pos, crd, val = random_csr(m, m, args.per_row)
        nnz = int(pos[-1])
        A = sb.SparseTensor("csr", (m, m), [torch.from_numpy(pos), torch.from_numpy(crd)], torch.from_numpy(val))
        rng = np.random.default_rng(1)
        x = rng.standard_normal(m, dtype=np.float32)
        plan = _C.plan_einsum("ij,j->i", [("dense(0),compressed(1)", [m, m], nnz), ("strided", [m], 0)],
                              "", False, False)
        sizes, strides = i64s(m, m), i64s(1)
        lengths = i64s(m + 1, nnz, nnz, m)
        out_shape = (m,)
        eq, dense_in = "ij,j->i", x
        info = sb.kernel_info(plan["spec"])
        fns = []
        for path in [info["library_path"]] + ([args.compare_lib] if args.compare_lib else []):
            f = ctypes.CDLL(path).scorch_kernel
            f.argtypes = [ctypes.POINTER(KernelArgs)]
            f.restype = ctypes.c_int
            fns.append(f)
        inputs = (ctypes.c_void_p * 4)(pos.ctypes.data, crd.ctypes.data, val.ctypes.data, x.ctypes.data)
        y_gens = [np.zeros(out_shape, dtype=np.float32) for _ in fns]
        y_ref = np.zeros(out_shape, dtype=np.float32)
        xt = torch.from_numpy(dense_in)
        for t in threads:
            torch.set_num_threads(t)
            def make(fn, y, t=t):
                a = KernelArgs(inputs, sizes, strides, y.ctypes.data, 0, None, None, t, 0, lengths)

                def gen():
                    rc = fn(ctypes.byref(a))
                    if rc != 0:
                        raise RuntimeError(f"kernel status {rc}")
                return gen

            gens = [make(fn, y) for fn, y in zip(fns, y_gens)]

            ref.spmv_unchecked.argtypes = [ctypes.c_int64, p_i32, p_i32, p_f32, p_f32, p_f32, ctypes.c_int]

            def unchecked(t=t):
                ref.spmv_unchecked(m, pos.ctypes.data_as(p_i32), crd.ctypes.data_as(p_i32),
                                   val.ctypes.data_as(p_f32), x.ctypes.data_as(p_f32), y_ref.ctypes.data_as(p_f32), t)

            y_ref[...] = 0
            unchecked()
            for g, y in zip(gens, y_gens):
                y[...] = 0
                g()
                diff = float(np.abs(y - y_ref).max())
                if diff > 1e-3 * max(1.0, float(np.abs(y_ref).max())):
                    print(f"{kernel}: generated and unchecked differ by {diff}")
                    return 1
            t_gen, t_ref, *t_cmp = median_interleaved([gens[0], unchecked, *gens[1:]], args.repeats, args.warmup)
            (t_einsum,) = median_interleaved([lambda: sb.einsum(eq, A, xt)], args.repeats, args.warmup)
            row = {"kernel": kernel, "shape": [m, m], "nnz": nnz,
                   "threads": t, "generated_s": t_gen, "unchecked_s": t_ref, "einsum_s": t_einsum,
                   "check_cost": t_gen / t_ref - 1}
            if t_cmp:
                row.update(compare_lib_s=t_cmp[0], compare_lib_check_cost=t_cmp[0] / t_ref - 1)
            rows_out.append(row)
            print(f"{kernel} {m}x{m} nnz={nnz} threads={t}: "
                  f"generated kernel {t_gen * 1e3:.2f} ms, unchecked loop {t_ref * 1e3:.2f} ms "
                  f"(checks cost {100 * (t_gen / t_ref - 1):+.1f}%); sb.einsum {t_einsum * 1e3:.2f} ms"
                  + (f"; --compare-lib {t_cmp[0] * 1e3:.2f} ms (checks cost {100 * (t_cmp[0] / t_ref - 1):+.1f}%)"
                     if t_cmp else ""))
    out = args.out or str(HERE / "results" / f"check_cost_{target['name']}.json")
    save_json(out, {"machine": sb.describe_machine(max(threads)), "baseline_isa": baseline_isa,
                    "target": target, "repeats": args.repeats,
                    "compare_lib": args.compare_lib, "cases": rows_out})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
