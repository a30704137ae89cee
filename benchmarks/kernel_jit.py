"""The JIT times of benchmarks/kernels.py: each kernel's first call in a new process, with an empty kernel
cache (cold: code generation and compilation), then with the cache the first process filled (disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from kernel_cases import log
from scorch_backend.tools.timing import fmt_time

JIT_COLD_TARGET_S = 1.0
JIT_DISK_TARGET_S = 0.010


JIT_PROBE = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
import scorch_backend as sb
kernels = sys.argv[2].split(",")
g = torch.Generator().manual_seed(0)
d = torch.rand(64, 48, generator=g) * (torch.rand(64, 48, generator=g) < 0.1)
A = sb.sparse(d, "csr"); As = sb.sparse(d[:48, :48].contiguous(), "csr")
At = A.t().to_format("csr"); Ast = As.t().to_format("csr")
x = torch.rand(48); B = torch.rand(48, 128); P = torch.rand(64, 128); Q = torch.rand(48, 128)
idx = torch.stack([torch.randint(0, 20, (200,), generator=g) for _ in range(3)])
T = sb.from_coordinates(idx, torch.rand(200), (20, 20, 20), "csf")
Bm = torch.rand(20, 32); Cm = torch.rand(20, 32)
An = sb.sparse(torch.rand(64, 48, generator=g) * (torch.arange(48) % 4 < 2).float(), "nm(2,4)")
Ab = sb.sparse(torch.rand(64, 48, generator=g) * (torch.rand(16, 12, generator=g) < 0.1).float().repeat_interleave(4, 0).repeat_interleave(4, 1), "bsr", blocksize=(4, 4)); Bb = torch.rand(48, 128)
calls = {
    "spmv": lambda: sb.einsum("ij,j->i", A, x),
    "spmm": lambda: sb.einsum("ij,jk->ik", A, B),
    "sddmm": lambda: sb.einsum("ij,ik,jk->ij", A, P, Q),
    "spgemm": lambda: sb.einsum("ij,jk->ik", A, At),
    "spadd": lambda: sb.compute("C(i,j) = A(i,j) + B(i,j)", A=As, B=Ast),
    "mttkrp": lambda: sb.einsum("ikl,kj,lj->ij", T, Bm, Cm),
    "ttm": lambda: sb.einsum("ijk,kr->ijr", T, Bm),
    "bsr": lambda: sb.einsum("ij,jk->ik", Ab, Bb),
    "nm": lambda: sb.einsum("ij,jk->ik", An, Bb),
}
plans = {
    "spmv": lambda: sb.plan_einsum("ij,j->i", A, x),
    "spmm": lambda: sb.plan_einsum("ij,jk->ik", A, B),
    "sddmm": lambda: sb.plan_einsum("ij,ik,jk->ij", A, P, Q),
    "spgemm": lambda: sb.plan_einsum("ij,jk->ik", A, At),
    "mttkrp": lambda: sb.plan_einsum("ikl,kj,lj->ij", T, Bm, Cm),
    "ttm": lambda: sb.plan_einsum("ijk,kr->ijr", T, Bm),
    "bsr": lambda: sb.plan_einsum("ij,jk->ik", Ab, Bb),
    "nm": lambda: sb.plan_einsum("ij,jk->ik", An, Bb),
}
out = {}
# The first kernel of a process pays one-time costs (loading the OpenMP runtime, ...): a row sum, which is
# none of the benchmarked kernels, takes them, and is reported on its own.
t = time.perf_counter(); sb.einsum("ij->i", A); out["_process_first_kernel_s"] = time.perf_counter() - t
for k in kernels:
    r = {}
    try:
        t = time.perf_counter(); calls[k](); r["first_call_s"] = time.perf_counter() - t
        t = time.perf_counter(); calls[k](); r["second_call_s"] = time.perf_counter() - t
        if k in plans:
            spec = plans[k]()["spec"]
            info = sb.kernel_info(spec)  # cached in the process now: says how the kernel was obtained
            r.update(spec=spec, jit_s=info["seconds"], compiled=info["compiled"])
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
    out[k] = r
print("JIT_RESULT " + json.dumps(out))
"""


def jit_times(kernels, threads: int) -> dict:
    """First-call times of each kernel in a new process: with an empty cache ("cold"), then with the cache the
    first process filled ("disk")."""
    res = {}
    with tempfile.TemporaryDirectory(prefix="scorch-jit-bench-") as cache:
        env = dict(os.environ, SCORCH_CACHE_DIR=cache)
        for phase in ("cold", "disk"):
            p = subprocess.run([sys.executable, "-c", JIT_PROBE, str(threads), ",".join(kernels)], env=env,
                               capture_output=True, text=True, timeout=900)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JIT_RESULT ")), None)
            if p.returncode != 0 or line is None:
                res[phase] = {"error": f"probe exited {p.returncode}: {p.stderr.strip()[-2000:]}"}
                continue
            res[phase] = json.loads(line[len("JIT_RESULT "):])
    return res


def summarize_jit(jit: dict, kernels) -> dict:
    log(f"\nJIT: first call of each kernel in a new process (targets: cold cache <= {JIT_COLD_TARGET_S:g} s, "
        f"disk cache <= {JIT_DISK_TARGET_S * 1e3:g} ms)")
    for phase in ("cold", "disk"):
        if "error" in jit.get(phase, {}):
            log(f"  JIT probe ({phase}) failed: {jit[phase]['error'][-1000:]}")
    cold = {} if "error" in jit.get("cold", {"error": 1}) else jit["cold"]
    disk = {} if "error" in jit.get("disk", {"error": 1}) else jit["disk"]
    first = "_process_first_kernel_s"
    log(f"  first kernel of a process (row sum, not benchmarked; one-time costs): cold "
        f"{fmt_time(cold.get(first))}, disk {fmt_time(disk.get(first))}")
    log(f"{'kernel':<8} {'cold 1st call':>14} {'(jit)':>9} {'disk 1st call':>14} {'(load)':>9} "
        f"{'2nd call':>9}  reached")
    out = {"per_kernel": {}, "cold_target_s": JIT_COLD_TARGET_S, "disk_target_s": JIT_DISK_TARGET_S,
           "process_first_kernel_s": {"cold": cold.get("_process_first_kernel_s"),
                                      "disk": disk.get("_process_first_kernel_s")}}
    colds, disks = [], []
    for k in kernels:
        c, d = cold.get(k, {}), disk.get(k, {})
        cf, df = c.get("first_call_s"), d.get("first_call_s")
        ok = None if cf is None or df is None else bool(cf <= JIT_COLD_TARGET_S and df <= JIT_DISK_TARGET_S)
        if cf is not None:
            colds.append(cf)
        if df is not None:
            disks.append(df)
        out["per_kernel"][k] = {"cold": c, "disk": d, "reached": ok}
        err = c.get("error") or d.get("error")
        log(f"{k:<8} {fmt_time(cf):>14} {fmt_time(c.get('jit_s')):>9} {fmt_time(df):>14} "
            f"{fmt_time(d.get('jit_s')):>9} {fmt_time(d.get('second_call_s')):>9}  "
            f"{'n/a' if ok is None else 'YES' if ok else 'no'}" + (f"  error: {err[:100]}" if err else ""))
    out["max_cold_first_call_s"] = max(colds) if colds else None
    out["max_disk_first_call_s"] = max(disks) if disks else None
    complete = len(colds) == len(kernels) and len(disks) == len(kernels)
    out["cold_reached"] = complete and max(colds) <= JIT_COLD_TARGET_S
    out["disk_reached"] = complete and max(disks) <= JIT_DISK_TARGET_S
    out["raw"] = jit
    return out

