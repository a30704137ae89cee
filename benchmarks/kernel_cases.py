"""The cases of benchmarks/kernels.py: the kernels, their Scorch calls and torch contenders, the matrices and
3-D tensors they run on, and the checks of Scorch's results against torch's. kernels.py runs and reports them.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.sparse as sp
import torch

import scorch_backend as sb
from scorch_backend.tools import datasets


def log(*a):
    print(*a, flush=True)


KERNELS = ("spmv", "spmm", "sddmm", "spgemm", "spadd", "mttkrp", "ttm", "bsr", "nm")
N_SPMM = 128
K_SDDMM = 128
RANK_MTTKRP = 32

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


# ----------------------------------------------------------------------------------------------------------
# operands in torch's layouts


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
# matrices and 3-D tensors


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
# one kernel on one matrix: operands, the Scorch call and the contenders


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
        # A floor under any SDDMM on this pattern: Q's row read at every stored entry and multiplied by its value,
        # summed into one vector (no P, no dot products, no result per entry), as a Scorch kernel
        case["floor"] = lambda: sb.einsum("ij,jk->k", A, Q)
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


def _dense_tensor3(case: dict, args, idx, vals, shape, equation: str, *factors) -> None:
    """The dense contender of a 3-D tensor kernel: torch.einsum on T stored dense, when it fits."""
    n = shape[0] * shape[1] * shape[2]
    why = dense_ok(args, n * 4.0, 2.0 * n * RANK_MTTKRP)
    if why:
        case["skipped"]["dense"] = why
        return
    Td = torch.zeros(shape)
    Td[idx[0], idx[1], idx[2]] = vals
    case["contenders"]["dense"] = lambda: torch.einsum(equation, Td, *factors)


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
    _dense_tensor3(case, args, idx, vals, shape, "ikl,kj,lj->ij", B, C)
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
    _dense_tensor3(case, args, idx, vals, shape, "ijk,kr->ijr", U)
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

