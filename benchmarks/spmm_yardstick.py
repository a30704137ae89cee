#!/usr/bin/env python
"""Generated CSR SpMM against a hand-written register-blocked reference loop of the same instruction set.

    .venv/bin/python benchmarks/spmm_yardstick.py                       # native target, N = 64 and 128
    .venv/bin/python benchmarks/spmm_yardstick.py --target x86-64-v3    # what an AVX2 machine gets

The reference (benchmarks/reference/spmm_reference.cpp, REFERENCE ONLY, never called by the library) is
compiled here with the kernels' compiler and the target's flags; its vector width comes from the target's
instruction-set macros, and the best of its tile widths is kept, so it is a strict yardstick. Both run
from C++ (the generated kernel through its ABI), with the same operands and threads: warm-ups, then the
median of repeats; no Python in the timed loop. Matrices: DLMC (transformer at 90%, ResNet-50 at 80%
magnitude pruning) from --data, spread over their sizes; generated ones when the folder is absent. DLMC files
have no values: random values in [0.5, 1.5) are used. Ratio = reference time / generated time (target: at
least 0.9 for every matrix and N).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

import scorch_backend as sb
from scorch_backend import _C
from scorch_backend.tools import datasets
from scorch_backend.tools.timing import OtherLoad, save_json

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


def build_reference(target: dict, outdir: pathlib.Path) -> ctypes.CDLL:
    cxx = os.environ.get("CXX", "c++").split() or ["c++"]
    lib = outdir / f"spmm_reference_{target['fingerprint'][:12]}.so"
    cmd = [*cxx, "-O3", *target["flags"], "-fopenmp", "-shared", "-fPIC", "-std=c++17",
           f"-I{ROOT / 'csrc'}", "-o", str(lib), str(HERE / "reference" / "spmm_reference.cpp")]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(lib))


def matrices(args):
    root = datasets.data_dir(args.data)
    if root is not None:
        found = []
        for pattern in ("dlmc/transformer/magnitude_pruning/0.9/*.smtx", "dlmc/rn50/magnitude_pruning/0.8/*.smtx"):
            files = sorted(root.glob(pattern), key=lambda p: p.stat().st_size)
            n = args.max_matrices
            idx = sorted({round(k * (len(files) - 1) / max(n - 1, 1)) for k in range(n)}) if files else []
            found += [(f"dlmc/{p.parent.parent.parent.name}/{p.stem}", p) for p in (files[i] for i in idx)]
        for name, p in found:
            m = datasets.read_smtx(p)
            yield name, m
        return
    print(f"data folder not found ({args.data or datasets.DEFAULT_DATA}): generated matrices")
    import scipy.sparse as sp
    for rows, cols, d in [(512, 512, 0.1), (2048, 512, 0.1), (1024, 4096, 0.2)]:
        yield f"generated/{rows}x{cols}_d{d}", sp.csr_array(datasets.random_matrix(rows, cols, d).numpy())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="data folder (default ../shared/data)")
    ap.add_argument("--target", default=None, help="kernel target (default: SCORCH_TARGET or native)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", default="64,128", help="columns of the dense operand")
    ap.add_argument("--max-matrices", type=int, default=5, help="matrices per DLMC model, spread over sizes")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out", default=str(HERE / "results" / "spmm_yardstick.json"))
    args = ap.parse_args(argv)
    if args.target:
        sb.set_target(args.target)
    torch.set_num_threads(args.threads)
    target = sb.target_info()
    load = OtherLoad()
    print(sb.describe_machine(args.threads))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="scorch-yardstick-"))
    ref = build_reference(target, tmp)
    print(f"reference vector width: {ref.ref_vector_bytes()} bytes; generated: {target['vector_bytes']} bytes")
    p_i32, p_f32 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
    ref.compare_spmm.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p_i32, p_i32,
                                 p_f32, p_f32, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double),
                                 ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double)]
    rows_out = []
    print(f"{'matrix':<78} {'shape':>11} {'nnz':>8} {'N':>4} {'generated':>10} {'reference':>10} "
          f"{'ref/gen':>8} {'GFLOP/s':>8}")
    rng = np.random.default_rng(0)
    for name, m in matrices(args):
        pos = np.ascontiguousarray(m.indptr, dtype=np.int32)
        crd = np.ascontiguousarray(m.indices, dtype=np.int32)
        val = (rng.random(m.nnz, dtype=np.float32) + 0.5)
        for n in (int(x) for x in args.n.split(",")):
            B = rng.standard_normal((m.shape[1], n), dtype=np.float32)
            spec = _C.plan_einsum("ij,jk->ik", [("dense(0),compressed(1)", list(m.shape), m.nnz),
                                                ("strided", [m.shape[1], n], 0)], "", False, False)["spec"]
            lib = sb.kernel_info(spec)["library_path"]
            # Tiny cases (a few microseconds, where an OpenMP team's wake-up jitters by as much) get more
            # alternating samples, so their medians are as steady as the large cases'; both sides alike.
            repeats = args.repeats if 2 * m.nnz * n >= 4e6 else args.repeats * 10
            tg, tr, md = ctypes.c_double(), ctypes.c_double(), ctypes.c_double()
            tile = ctypes.c_int()
            rc = ref.compare_spmm(lib.encode(), m.shape[0], m.shape[1], n, pos.ctypes.data_as(p_i32),
                                  crd.ctypes.data_as(p_i32), val.ctypes.data_as(p_f32), B.ctypes.data_as(p_f32),
                                  args.threads, 3, repeats, ctypes.byref(tg), ctypes.byref(tr),
                                  ctypes.byref(tile), ctypes.byref(md))
            if rc != 0:
                print(f"{name}: comparison failed (code {rc})")
                return 1
            scale = max(1.0, float(np.abs(val).max()) * float(np.abs(B).max()) * max(np.diff(pos).max(), 1))
            if md.value > 1e-4 * scale:
                print(f"{name} N={n}: generated and reference differ by {md.value}")
                return 1
            ratio = tr.value / tg.value
            gflops = 2 * m.nnz * n / tg.value / 1e9
            print(f"{name[:78]:<78} {m.shape[0]:>5}x{m.shape[1]:<5} {m.nnz:>8} {n:>4} {tg.value * 1e6:>8.1f}us "
                  f"{tr.value * 1e6:>8.1f}us {ratio:>8.2f} {gflops:>8.1f}")
            rows_out.append({"matrix": name, "shape": list(m.shape), "nnz": int(m.nnz), "n": n,
                             "generated_s": tg.value, "reference_s": tr.value, "reference_tile_vectors": tile.value,
                             "ratio_reference_over_generated": ratio, "generated_gflops": gflops})
    geo = math.exp(statistics.fmean(math.log(r["ratio_reference_over_generated"]) for r in rows_out))
    worst = min(r["ratio_reference_over_generated"] for r in rows_out)
    print(f"geomean reference/generated: {geo:.2f}x; worst {worst:.2f}x (target: >= 0.9 for every case)")
    out = save_json(args.out, {"machine": sb.describe_machine(args.threads), "target": target,
                               "threads": args.threads, "cases": rows_out, "geomean": geo, "worst": worst,
                               "other_load": load.to_dict()})
    print(load.report())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
