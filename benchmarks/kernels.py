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
the median of --repeats calls (time.perf_counter) after --warmup calls; a ratio is contender time / Scorch
time, so a ratio above 1 means Scorch is faster. Each Scorch result is checked once against the torch CSR
result.

Memory traffic model (bytes a kernel must move at least): every buffer of every operand read once (a sparse
operand's index buffers and values as Scorch stores them, a dense operand's elements) plus the result written
once (a sparse result's index buffers and values, a dense result's elements). Achieved GB/s = bytes / median
time, reported as a fraction of a STREAM triad (a = b + s*c on 2^25-element tensors, median of 10 runs,
counting 3 arrays of traffic, the larger of float32 and float64) measured in the same run with the same
thread count.

JIT times are measured in subprocesses: a fresh SCORCH_CACHE_DIR gives the cold time (code generation and
compilation) of the first call of each kernel; a second subprocess on the same directory gives the time of the
first call when the kernel comes from the disk cache.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np
import scipy.sparse as sp
import torch

# The targets are about the compiled kernels: keep the run-time dense/sparse cost model out of the timings
# (subprocesses for the JIT times inherit this too).
os.environ.setdefault("SCORCH_DISPATCH", "sparse")

import scorch_backend as sb  # noqa: E402
from scorch_backend.tools import datasets  # noqa: E402
from scorch_backend.tools.timing import measure, stream_triad  # noqa: E402
from scorch_backend.tools.timing import fmt_ratio, fmt_time, save_json  # noqa: E402

KERNELS = ("spmv", "spmm", "sddmm", "spgemm", "spadd", "mttkrp", "ttm", "bsr", "nm")
N_SPMM = 128
K_SDDMM = 128
RANK_MTTKRP = 32

# Geometric mean of (torch CSR time / Scorch time) that each kernel should reach, and JIT limits in seconds.
TARGETS = {"spmm": 1.5, "spmv": 1.2, "sddmm": 3.0, "spgemm": 2.0, "spadd": 2.0, "bsr": 1.0}
# bsr: the native block kernel against Scorch's CSR kernel on the same weights (the "torch_coo" slot).
BSR_TARGET_VS_SCORCH_CSR = 2.0
# nm: 2:4 weights, the native n:m kernel against dense torch.mm on the same (dense) weights.
NM_TARGET_VS_DENSE = 1.6
TENSOR3_TARGET = 10.0  # MTTKRP and TTM on 3-D CSF: against dense einsum and the COO emulation (issue 12)
JIT_COLD_TARGET_S = 1.0
JIT_DISK_TARGET_S = 0.010

EQUATIONS = {
    "spmv": "sb.einsum('ij,j->i', A, x)",
    "spmm": "sb.einsum('ij,jk->ik', A, B)",
    "sddmm": "sb.einsum('ij,ik,jk->ij', S, P, Q)",
    "spgemm": "sb.einsum('ij,jk->ik', A, At)",
    "spadd": "sb.compute('C(i,j) = A(i,j) + B(i,j)', A=A, B=At)",
    "mttkrp": "sb.einsum('ikl,kj,lj->ij', T, B, C)",
    "ttm": "sb.einsum('ijk,kr->ijr', T, U)",
    "bsr": "sb.einsum('ij,jk->ik', A, B), A in BSR",
    "nm": "sb.einsum('ij,jk->ik', A, B), A in nm(n,m)",
}
TORCH_OPS = {
    "spmv": {"torch_csr": "A_csr @ x", "torch_coo": "torch.mv(A_coo, x)", "dense": "A_dense @ x"},
    "spmm": {"torch_csr": "A_csr @ B", "torch_coo": "torch.sparse.mm(A_coo, B)", "dense": "A_dense @ B"},
    "sddmm": {"torch_csr": "torch.sparse.sampled_addmm(S_csr, P, Q.T, beta=0)",
              "torch_coo": "(P[row] * Q[col]).sum(1) * vals (gather, COO coordinates)",
              "dense": "(P @ Q.T) * S_dense"},
    "spgemm": {"torch_csr": "torch.sparse.mm(A_csr, At_csr)", "torch_coo": "torch.sparse.mm(A_coo, At_coo)",
               "dense": "A_dense @ At_dense"},
    "spadd": {"torch_csr": "A_csr + At_csr", "torch_coo": "(A_coo + At_coo).coalesce()",
              "dense": "A_dense + At_dense"},
    "mttkrp": {"torch_csr": "T_(1) CSR (I x K*L) @ khatri_rao(B, C)",
               "torch_coo": "zeros(I,R).index_add_(0, i, v * B[k] * C[l])",
               "dense": "torch.einsum('ikl,kj,lj->ij', T_dense, B, C)"},
    "ttm": {"torch_csr": "T_(12) CSR (I*J x K) @ U, reshaped to (I, J, R)",
            "torch_coo": "zeros(I*J,R).index_add_(0, i*J+j, v * U[k]), reshaped",
            "dense": "torch.einsum('ijk,kr->ijr', T_dense, U)"},
    "bsr": {"torch_csr": "A_torch_bsr @ B (torch.sparse_bsr: torch's BSR mm)",
            "torch_coo": "sb.einsum('ij,jk->ik', A_csr, B): Scorch's CSR kernel on the same weights",
            "dense": "A_dense @ B"},
    "nm": {"torch_csr": "A_csr @ B (torch.sparse_csr on the same weights)",
           "torch_coo": "sb.einsum('ij,jk->ik', A_csr, B): Scorch's CSR kernel on the same weights",
           "dense": "torch.mm(A_dense, B)"},
}
CONTENDERS = ("torch_csr", "torch_coo", "dense")


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------------------
# timing and helpers


def bench(fn, warmup: int, repeats: int, budget: float) -> dict:
    """Median of at least `repeats` timed calls after `warmup` calls; slow calls shorten the run (at least 3
    samples, or 1 when a single call takes longer than twice the budget); fast calls get more samples (up to
    50x, for at least a tenth of the budget) to steady the median."""
    return measure(fn, warmup=warmup, repeat=repeats, min_time=budget / 10, max_repeat=50 * repeats,
                   budget=budget, min_samples=3).to_dict()


def nbytes(x) -> int:
    """Bytes of a tensor's storage as the kernel sees it (see the traffic model in the module docstring)."""
    if isinstance(x, sb.SparseTensor):
        return sum(b.numel() * b.element_size() for b in x.level_buffers.values()) + \
            x.stored_values.numel() * x.stored_values.element_size()
    return x.numel() * x.element_size()


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def scipy_of_torch(t: torch.Tensor) -> sp.csr_array:
    if t.layout == torch.sparse_csr:
        return sp.csr_array((t.values().numpy(), t.col_indices().numpy(), t.crow_indices().numpy()),
                            shape=tuple(t.shape))
    t = t.coalesce()
    i = t.indices().numpy()
    return sp.csr_array((t.values().numpy(), (i[0], i[1])), shape=tuple(t.shape))


def torch_csr(m: sp.csr_array) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)),
                                   torch.from_numpy(m.indices.astype(np.int64)),
                                   torch.from_numpy(m.data), size=m.shape, check_invariants=False)


def torch_coo(m: sp.csr_array) -> torch.Tensor:
    c = m.tocoo()
    idx = torch.from_numpy(np.stack([c.row.astype(np.int64), c.col.astype(np.int64)]))
    t = torch.sparse_coo_tensor(idx, torch.from_numpy(c.data), size=m.shape, check_invariants=False)
    return t.coalesce()


# ----------------------------------------------------------------------------------------------------------
# correctness checks (once per kernel and matrix, outside the timings)

RTOL = 1e-3


def check_dense(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    if tuple(got.shape) != tuple(ref.shape):
        return False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if ref.numel() > (1 << 24):  # compare a sample of rows and the total for big outputs
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(0, ref.shape[0], (2048,), generator=g)
        got_s, ref_s = got[rows], ref[rows]
        what = "2048 sampled rows"
        total = (float(got.double().sum()), float(ref.double().sum()))
    else:
        got_s, ref_s = got, ref
        what = "all entries"
        total = None
    scale = float(ref_s.abs().max()) if ref_s.numel() else 0.0
    err = float((got_s - ref_s).abs().max()) if ref_s.numel() else 0.0
    ok = err <= RTOL * max(scale, 1e-6)
    msg = f"max|diff| {err:.3g} vs max|ref| {scale:.3g} ({what})"
    if total is not None:
        ok = ok and abs(total[0] - total[1]) <= 1e-3 * max(abs(total[1]), 1.0) + 1e-6 * ref.numel()
        msg += f", sums {total[0]:.6g} / {total[1]:.6g}"
    return ok, msg


def check_sparse(got: sb.SparseTensor, ref: sp.csr_array) -> tuple[bool, str]:
    if tuple(got.shape) != tuple(ref.shape):
        return False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    g = got.to_scipy().tocsr()
    g.sum_duplicates()
    ref = ref.tocsr()
    ref.sum_duplicates()
    diff = abs(g.astype(np.float64) - ref.astype(np.float64))
    err = float(diff.max()) if diff.nnz else 0.0
    scale = float(abs(ref).max()) if ref.nnz else 0.0
    ok = err <= RTOL * max(scale, 1e-6)
    nnz_ok = got.nnz == ref.nnz
    msg = f"nnz {got.nnz} vs {ref.nnz}, max|diff| {err:.3g} vs max|ref| {scale:.3g}"
    return ok and nnz_ok, msg


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
# matrices


def pick_spread(items: list, n: int | None) -> list:
    """n items spread evenly over a list sorted by size (the smallest and largest included when n >= 2)."""
    if n is None or n >= len(items):
        return items
    if n <= 0:
        return []
    if n == 1:
        return [items[len(items) // 2]]
    idx = sorted({round(k * (len(items) - 1) / (n - 1)) for k in range(n)})
    return [items[k] for k in idx]


def load_matrices(args) -> list[tuple[str, object]]:
    """(name, loader) pairs; a loader returns a float32 scipy CSR array."""
    mats = []
    root = datasets.data_dir(args.data)
    if root is not None:
        for kind in ("suitesparse", "dlmc", "graphs"):
            found = list(datasets.real_matrices(root, kinds=(kind,)))
            for name, path in pick_spread(found, args.max_matrices):
                mats.append((name, lambda p=path: datasets.read_matrix(p)))
        log(f"data: {root} ({len(mats)} real matrices selected)")
    else:
        log(f"data: folder {args.data or datasets.DEFAULT_DATA} not found; using generated matrices instead")
        gen = [(1024, 1024, 1e-2), (4096, 4096, 2e-3), (8192, 2048, 5e-3)]
        for rows, cols, dens in gen[: (1 if args.quick else max(args.max_matrices or 3, 1))]:
            def gen(r=rows, c=cols, d=dens):
                return sp.csr_array(datasets.random_matrix(r, c, d).numpy())
            mats.append((f"generated/random_{rows}x{cols}_d{dens:g}", gen))
    if args.rmat_scale > 0:
        def rmat(scale=args.rmat_scale, ef=args.rmat_edge_factor):
            idx, vals, shape = datasets.rmat(scale, ef, seed=0)
            i = idx.numpy()
            m = sp.csr_array((vals.numpy(), (i[0], i[1])), shape=shape)
            m.sum_duplicates()
            return m
        mats.append((f"generated/rmat_s{args.rmat_scale}_ef{args.rmat_edge_factor}", rmat))
    return mats


def random_tensor3(dims, density, seed=0):
    """(indices (3, nnz) int64, values float32, shape) of a uniformly random 3-D sparse tensor."""
    rng = np.random.default_rng(seed)
    total = int(np.prod(dims))
    nnz = int(round(total * density))
    lin = np.unique(rng.integers(0, total, size=nnz, dtype=np.int64))
    idx = np.stack(np.unravel_index(lin, dims)).astype(np.int64)
    signs = rng.choice(np.array([-1, 1], np.float32), lin.size)
    vals = (rng.random(lin.size, dtype=np.float32) + 0.5) * signs
    return torch.from_numpy(idx), torch.from_numpy(vals), tuple(dims)


# ----------------------------------------------------------------------------------------------------------
# one kernel on one matrix


class Skip(Exception):
    pass


def dense_ok(args, dense_bytes: float, dense_flops: float) -> str | None:
    if dense_bytes > args.dense_limit_gb * 1e9:
        return f"dense operands {dense_bytes / 1e9:.2f} GB > --dense-limit-gb {args.dense_limit_gb}"
    if dense_flops > args.dense_max_gflop * 1e9:
        return f"dense work {dense_flops / 1e9:.0f} GFLOP > --dense-max-gflop {args.dense_max_gflop}"
    return None


def setup_case(kernel: str, m: sp.csr_array, ctx: dict, args) -> dict:
    """Operands, the Scorch call, the contenders and the reference for one kernel on matrix m (scipy CSR)."""
    rows, cols = m.shape
    g = torch.Generator().manual_seed(0)
    A = ctx["A"]
    case = {"contenders": {}, "skipped": {}}
    dense_bytes_A = rows * cols * 4

    def add(name, fn, skip_reason=None):
        if skip_reason:
            case["skipped"][name] = skip_reason
        else:
            case["contenders"][name] = fn

    if kernel == "spmv":
        x = torch.randn(cols, generator=g)
        Ac, Ao = ctx["A_csr"](), ctx["A_coo"]()
        case["scorch"] = lambda: sb.einsum("ij,j->i", A, x)
        case["inputs"] = [A, x]
        add("torch_csr", lambda: Ac @ x)
        add("torch_coo", lambda: torch.mv(Ao, x))
        why = dense_ok(args, dense_bytes_A, 2.0 * rows * cols)
        Ad = ctx["A_dense"]() if why is None else None
        add("dense", lambda: Ad @ x, why)
    elif kernel == "spmm":
        B = torch.randn(cols, N_SPMM, generator=g)
        Ac, Ao = ctx["A_csr"](), ctx["A_coo"]()
        case["scorch"] = lambda: sb.einsum("ij,jk->ik", A, B)
        case["inputs"] = [A, B]
        add("torch_csr", lambda: Ac @ B)
        add("torch_coo", lambda: torch.sparse.mm(Ao, B))
        why = dense_ok(args, dense_bytes_A, 2.0 * rows * cols * N_SPMM)
        Ad = ctx["A_dense"]() if why is None else None
        add("dense", lambda: Ad @ B, why)
    elif kernel == "sddmm":
        P = torch.randn(rows, K_SDDMM, generator=g)
        Q = torch.randn(cols, K_SDDMM, generator=g)
        Ac = ctx["A_csr"]()
        Qt = Q.t()
        case["scorch"] = lambda: sb.einsum("ij,ik,jk->ij", A, P, Q)
        case["inputs"] = [A, P, Q]
        add("torch_csr", lambda: torch.sparse.sampled_addmm(Ac, P, Qt, beta=0.0))
        coo = m.tocoo()
        r_, c_ = torch.from_numpy(coo.row.astype(np.int64)), torch.from_numpy(coo.col.astype(np.int64))
        v_ = torch.from_numpy(coo.data)
        gather_bytes = 2.0 * m.nnz * K_SDDMM * 4
        add("torch_coo", lambda: (P[r_] * Q[c_]).sum(1) * v_,
            None if gather_bytes <= args.dense_limit_gb * 1e9 else
            f"gather temporaries {gather_bytes / 1e9:.1f} GB > --dense-limit-gb {args.dense_limit_gb}")
        why = dense_ok(args, 2 * dense_bytes_A, 2.0 * rows * cols * K_SDDMM)
        Ad = ctx["A_dense"]() if why is None else None
        add("dense", lambda: (P @ Qt) * Ad, why)
        # sampled_addmm does not scale by S's values (and keeps S's pattern): the reference is its result with
        # the values multiplied by S's.
        case["ref_transform"] = lambda t: _scaled(scipy_of_torch(t), m)
    elif kernel == "spgemm":
        flops = ctx["spgemm_flops"]
        if flops > args.spgemm_max_flops:
            raise Skip(f"A*A^T needs {flops:.3g} multiply-adds > --spgemm-max-flops "
                       f"{args.spgemm_max_flops:g}")
        At = ctx["At"]()
        Ac, Atc, Ao, Ato = ctx["A_csr"](), ctx["At_csr"](), ctx["A_coo"](), ctx["At_coo"]()
        case["scorch"] = lambda: sb.einsum("ij,jk->ik", A, At)
        case["inputs"] = [A, At]
        add("torch_csr", lambda: torch.sparse.mm(Ac, Atc))
        add("torch_coo", lambda: torch.sparse.mm(Ao, Ato))
        why = dense_ok(args, 3.0 * rows * max(rows, cols) * 4, 2.0 * rows * rows * cols)
        Ad = ctx["A_dense"]() if why is None else None
        Atd = Ad.t().contiguous() if why is None else None
        add("dense", lambda: Ad @ Atd, why)
    elif kernel == "spadd":
        if rows != cols:
            raise Skip("A + A^T needs a square matrix")
        At = ctx["At"]()
        Ac, Atc, Ao, Ato = ctx["A_csr"](), ctx["At_csr"](), ctx["A_coo"](), ctx["At_coo"]()
        case["scorch"] = lambda: sb.compute("C(i,j) = A(i,j) + B(i,j)", A=A, B=At)
        case["inputs"] = [A, At]
        add("torch_csr", lambda: Ac + Atc)
        add("torch_coo", lambda: (Ao + Ato).coalesce())
        why = dense_ok(args, 3.0 * dense_bytes_A, 1.0 * rows * cols)
        Ad = ctx["A_dense"]() if why is None else None
        Atd = Ad.t().contiguous() if why is None else None
        add("dense", lambda: Ad + Atd, why)
    else:
        raise ValueError(kernel)
    return case


def _scaled(r: sp.csr_array, m: sp.csr_array) -> sp.csr_array:
    if r.nnz != m.nnz or not np.array_equal(r.indices, m.indices) or not np.array_equal(r.indptr, m.indptr):
        raise ValueError("sampled_addmm's result does not have the pattern of its input")
    return sp.csr_array((r.data * m.data, r.indices, r.indptr), shape=r.shape)


def setup_mttkrp(name, idx, vals, shape, args) -> dict:
    I, K, L = shape
    g = torch.Generator().manual_seed(0)
    B = torch.randn(K, RANK_MTTKRP, generator=g)
    C = torch.randn(L, RANK_MTTKRP, generator=g)
    T = sb.from_coordinates(idx, vals, shape, "csf")
    i, k, l = idx
    lin = k * L + l
    Tm = torch.sparse_coo_tensor(torch.stack([i, lin]), vals, (I, K * L), check_invariants=False)
    Tm = Tm.coalesce().to_sparse_csr()
    case = {"contenders": {}, "skipped": {}, "inputs": [T, B, C]}
    case["scorch"] = lambda: sb.einsum("ikl,kj,lj->ij", T, B, C)
    case["contenders"]["torch_csr"] = lambda: Tm @ (B[:, None, :] * C[None, :, :]).reshape(K * L, RANK_MTTKRP)
    case["contenders"]["torch_coo"] = lambda: torch.zeros(I, RANK_MTTKRP).index_add_(
        0, i, vals[:, None] * B[k] * C[l])
    why = dense_ok(args, I * K * L * 4.0, 2.0 * I * K * L * RANK_MTTKRP)
    if why:
        case["skipped"]["dense"] = why
    else:
        Td = torch.zeros(shape)
        Td[i, k, l] = vals
        case["contenders"]["dense"] = lambda: torch.einsum("ikl,kj,lj->ij", Td, B, C)
    return case


def setup_ttm(name, idx, vals, shape, args) -> dict:
    """Tensor-times-matrix along the last mode: Y(i,j,r) = sum_k T(i,j,k) U(k,r). Scorch's Y is stored as T's
    (i, j) fibers with R values each (the planner's output format); every contender's Y is dense (I, J, R) (the
    unfolded CSR product and the COO emulation give the same dense array). Checked after to_dense()."""
    I, J, K = shape
    U = torch.randn(K, RANK_MTTKRP, generator=torch.Generator().manual_seed(0))
    T = sb.from_coordinates(idx, vals, shape, "csf")
    i, j, k = idx
    row = i * J + j
    Tm = torch.sparse_coo_tensor(torch.stack([row, k]), vals, (I * J, K), check_invariants=False)
    Tm = Tm.coalesce().to_sparse_csr()
    case = {"contenders": {}, "skipped": {}, "inputs": [T, U]}
    case["scorch"] = lambda: sb.einsum("ijk,kr->ijr", T, U)
    case["contenders"]["torch_csr"] = lambda: (Tm @ U).reshape(I, J, RANK_MTTKRP)
    case["contenders"]["torch_coo"] = lambda: torch.zeros(I * J, RANK_MTTKRP).index_add_(
        0, row, vals[:, None] * U[k]).reshape(I, J, RANK_MTTKRP)
    why = dense_ok(args, I * J * K * 4.0, 2.0 * I * J * K * RANK_MTTKRP)
    if why:
        case["skipped"]["dense"] = why
    else:
        Td = torch.zeros(shape)
        Td[i, j, k] = vals
        case["contenders"]["dense"] = lambda: torch.einsum("ijk,kr->ijr", Td, U)
    return case


def block_pruned(rows: int, cols: int, block, keep: float, seed: int = 0) -> torch.Tensor:
    """A float32 weight whose blocks of `block` are all zero except a random fraction `keep` of them."""
    g = torch.Generator().manual_seed(seed)
    bh, bw = block
    w = torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows // bh, cols // bw, generator=g) < keep).float()
    return w * mask.repeat_interleave(bh, 0).repeat_interleave(bw, 1)


def setup_bsr(w: torch.Tensor, block, args) -> dict:
    g = torch.Generator().manual_seed(0)
    B = torch.randn(w.shape[1], N_SPMM, generator=g)
    A = sb.sparse(w, "bsr", blocksize=block)
    Ac = sb.sparse(w, "csr")
    At = w.to_sparse_bsr(tuple(block))
    case = {"contenders": {}, "skipped": {}, "inputs": [A, B]}
    case["scorch"] = lambda: sb.einsum("ij,jk->ik", A, B)
    case["contenders"]["torch_csr"] = lambda: At @ B
    case["contenders"]["torch_coo"] = lambda: sb.einsum("ij,jk->ik", Ac, B)
    case["contenders"]["dense"] = lambda: w @ B
    return case


NM_RESULTS: list = []  # the nm rows of this run, for the 2:4 target


def nm_pruned(rows: int, cols: int, n: int, m: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight with the n largest magnitudes of every group of m consecutive columns kept."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    groups = w.reshape(rows, cols // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.abs().topk(n, dim=-1).indices, True)
    return (groups * keep).reshape(rows, cols)


def setup_nm(w: torch.Tensor, n: int, m: int, args) -> dict:
    g = torch.Generator().manual_seed(0)
    B = torch.randn(w.shape[1], N_SPMM, generator=g)
    A = sb.sparse(w, f"nm({n},{m})")
    Ac = sb.sparse(w, "csr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        At = w.to_sparse_csr()
    case = {"contenders": {}, "skipped": {}, "inputs": [A, B]}
    case["scorch"] = lambda: sb.einsum("ij,jk->ik", A, B)
    case["contenders"]["torch_csr"] = lambda: At @ B
    case["contenders"]["torch_coo"] = lambda: sb.einsum("ij,jk->ik", Ac, B)
    case["contenders"]["dense"] = lambda: torch.mm(w, B)
    return case


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
    # Scorch: first call (compiles or loads the kernel), then the timings.
    try:
        t = time.perf_counter()
        out = case["scorch"]()
        res["scorch_first_call_s"] = time.perf_counter() - t
        res["scorch"] = bench(case["scorch"], args.warmup, args.repeats, args.budget)
    except Exception as e:  # a Scorch failure is a result, not the end of the run
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"  !! Scorch {kernel} on {name} failed: {res['error']}")
        if args.verbose:
            traceback.print_exc()
        return res
    moved = sum(nbytes(x) for x in case["inputs"]) + nbytes(out)
    res["bytes_moved"] = moved
    res["scorch_gbps"] = moved / res["scorch"]["median_s"] / 1e9
    # Contenders.
    ref = None
    for cname in CONTENDERS:
        fn = case["contenders"].get(cname)
        if fn is None:
            continue
        try:
            r = fn()
            if cname == "torch_csr":
                ref = r
            del r
            b = bench(fn, args.warmup, args.repeats, args.budget)
            b["ratio"] = b["median_s"] / res["scorch"]["median_s"]
            b["op"] = TORCH_OPS[kernel][cname]
            res["contenders"][cname] = b
        except Exception as e:
            res["skipped"][cname] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        gc.collect()
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
# JIT times (subprocesses)

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
    a = p.parse_args(argv)
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
    info = machine_info(args.threads)
    info["kernel_target"] = sb.target_info()
    log(f"Scorch kernel benchmark: torch {info['torch']}, {info['cpu_model']}, {info['cpu_count']} CPUs, "
        f"{args.threads} threads for torch and Scorch (torch.get_num_threads() = {torch.get_num_threads()})")
    log(sb.describe_machine(args.threads))
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
           "stream_triad": triad, "triad_gbps": triad_gbps, "results": results, "summary": summary,
           "jit": jit_summary, "targets": targets, "total_seconds": time.perf_counter() - t_start}
    out = save_json(args.out, doc)
    log(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
