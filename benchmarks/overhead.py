#!/usr/bin/env python
"""The fixed cost of a Scorch call: what a whole call costs over the kernel it runs, against torch CSR.

    .venv/bin/python benchmarks/overhead.py                 # 64, 512 and 4096 square matrices, 1 thread
    .venv/bin/python benchmarks/overhead.py --threads 2 --target x86-64-v3

For SpMV (y = A x) and SpMM (C = A B, B with 64 columns) on random CSR matrices (density --density) it times

    kernel     the compiled kernel alone, called from C++ (`_C.time_kernel`: output zero-fill + kernel)
    op         torch.ops.scorch.kernel with prepared inputs (Python op call, checks, output allocation)
    einsum     sb.einsum("ij,j->i", A, x): the whole eager call
    region     torch.ops.scorch.region on that module's region program with the same operands: the region
               call alone (operand cache lookup, choice, kernel call), without the compiled graph around it
    compiled   torch.compile(model, backend="scorch") of a module whose weight is the same matrix stored
               dense (the backend finds it sparse and runs a region)
    torch_csr  A_csr @ x with torch.sparse CSR

Every time is the median of --repeats samples, each the mean of a batch of calls sized to take ~20 ms, after
a warm-up; all contenders run in this process with the same thread count. The kernel benchmark's matrices
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
from scorch_backend.tools import timing  # noqa: E402


def per_call(fn, repeats: int) -> float:
    """Median seconds per call over `repeats` batches (each batch ~20 ms of calls)."""
    for _ in range(20):
        fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-7)
    batch = max(1, min(20000, int(0.02 / one)))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t) / batch)
    return statistics.median(samples)


class _Product(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return self.weight @ x


def run(n: int, kind: str, density: float, threads: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(n)
    dense = torch.rand(n, n, generator=g) * (torch.rand(n, n, generator=g) < density)
    A = sb.sparse(dense, "csr")
    At = dense.to_sparse_csr()
    rhs = torch.randn(n, generator=g) if kind == "spmv" else torch.randn(n, 64, generator=g)
    eq = "ij,j->i" if kind == "spmv" else "ij,jk->ik"
    plan = sb.plan_einsum(eq, A, rhs)
    inputs = [*A.level_buffers.values(), A.stored_values, rhs]
    expect = At @ rhs
    got = sb.einsum(eq, A, rhs)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    weight = dense.clone()
    model = torch.compile(_Product(weight), backend="scorch")
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
    kernel = statistics.median(_C.time_kernel(plan["spec"], inputs, plan["var_sizes"], threads, 200)
                               for _ in range(repeats))
    row = {
        "n": n, "kind": kind, "nnz": A.nnz, "kernel": kernel,
        "op": per_call(lambda: torch.ops.scorch.kernel(plan["spec"], inputs, plan["var_sizes"], threads), repeats),
        "einsum": per_call(lambda: sb.einsum(eq, A, rhs), repeats),
        "region": per_call(lambda: torch.ops.scorch.region(text, operands), repeats),
        "compiled": per_call(lambda: model(rhs), repeats),
        "torch_csr": per_call(lambda: At @ rhs, repeats),
    }
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--target", default=None, help="kernel target (default: SCORCH_TARGET or native)")
    p.add_argument("--out", default=None, help="JSON file for the results (default benchmarks/results/)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    print(sb.describe_machine(args.threads))
    print(f"threads: {args.threads} for every contender; density {args.density}; medians of {args.repeats} batches")
    print(f"{'case':<14}{'nnz':>9}{'kernel':>10}{'op':>10}{'einsum':>10}{'region':>10}{'compiled':>10}"
          f"{'torch CSR':>11}{'einsum-kernel':>15}{'region-kernel':>15}{'compiled-kernel':>17}{'CSR/einsum':>12}")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for kind in ("spmv", "spmm"):
            r = run(n, kind, args.density, args.threads, args.repeats)
            rows.append(r)
            us = {k: r[k] * 1e6 for k in ("kernel", "op", "einsum", "region", "compiled", "torch_csr")}
            print(f"{kind + ' ' + str(n):<14}{r['nnz']:>9}{us['kernel']:>9.1f}u{us['op']:>9.1f}u{us['einsum']:>9.1f}u"
                  f"{us['region']:>9.1f}u{us['compiled']:>9.1f}u{us['torch_csr']:>10.1f}u"
                  f"{us['einsum'] - us['kernel']:>14.1f}u{us['region'] - us['kernel']:>14.1f}u"
                  f"{us['compiled'] - us['kernel']:>16.1f}u{r['torch_csr'] / r['einsum']:>11.2f}x")
            sys.stdout.flush()
    spmv = [r["torch_csr"] / r["einsum"] for r in rows if r["kind"] == "spmv"]
    print(f"SpMV geomean torch CSR / einsum: {statistics.geometric_mean(spmv):.2f}x")
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"overhead_{args.target or sb.target_info()['name']}.json")
    timing.save_json(out, {"machine": sb.describe_machine(args.threads), "threads": args.threads,
                           "density": args.density, "rows": rows})
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
