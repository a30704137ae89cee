"""Differential fuzzing of the compiler: random einsum equations and index-notation expressions over random
formats, mode orders, densities, dtypes and index widths, compared with torch on dense copies. Formats include
n:m (2:4, 4:8, 1:4, 1:2) and bitmap levels, as presets and mixed with dense and compressed levels in level lists,
in any operand position (an operand with an n:m level is pruned to fit it first).

Seeded and reproducible. SCORCH_FUZZ_CASES sets the number of einsum cases (default 1200; two thirds as many
index-notation cases run too, so 1200 + 800), SCORCH_FUZZ_SEED the seed. A failure prints the case and a
one-line reproducer. The einsum cases run with the kernels forced (SCORCH_DISPATCH=sparse), and the first
SCORCH_FUZZ_AUTO_CASES of them (default 400) again under the default dispatch, where the cost model sends most
of these small problems to dense ATen code: both must agree with torch. (Index notation has no dense path, so
its cases run once.)

Kernels are compiled a block (CHUNK cases) at a time, just before the block runs, two compilers at a time, so a
long run starts at once. A long run (more than ISOLATE_ABOVE cases in all, e.g. SCORCH_FUZZ_CASES=12000 for
12,000 + 8,000) runs its blocks in child processes, each replaced after CASES_PER_PROCESS cases: nearly every
case needs its own kernel, a process keeps every kernel it loads (about five memory mappings each), and Linux
allows 65,530 mappings per process by default, so one process cannot hold the ~17,000 kernels of 20,000 cases.
SCORCH_FUZZ_ISOLATE=1 or 0 forces either way.
"""

import concurrent.futures
import multiprocessing
import os
import random
import time

import pytest
import torch

import scorch_backend as sb
import scorch_backend.tensors.frontend as einsum_module
from scorch_backend import _C
from reference import evaluate

SEED = int(os.environ.get("SCORCH_FUZZ_SEED", "20261121"))
EINSUM_CASES = int(os.environ.get("SCORCH_FUZZ_CASES", "1200"))
COMPUTE_CASES = max(1, EINSUM_CASES * 2 // 3)
CHUNK = 100
AUTO_CASES = min(EINSUM_CASES, int(os.environ.get("SCORCH_FUZZ_AUTO_CASES", "400")))
ISOLATE_ABOVE = 4000
ISOLATE = bool(int(os.environ.get("SCORCH_FUZZ_ISOLATE", str(int(EINSUM_CASES + COMPUTE_CASES > ISOLATE_ABOVE)))))
CASES_PER_PROCESS = 3000
DENSITIES = [0.0, 1e-3, 0.1, 0.9]
NM_SHAPES = [(2, 4), (4, 8), (1, 4), (1, 2)]
LETTERS = "ijklm"

stats = {"einsum sparse": 0, "einsum auto": 0, "compute": 0, "specs": set(),
         "routes": {"einsum sparse": {}, "einsum auto": {}, "compute": {}}}


def random_format(rng: random.Random, rank: int):
    """A preset or a random level list with a random mode order, valid for `rank`."""
    choices = ["coo", "csf", "dense", "levels"]
    if rank >= 2:
        choices += ["csr"]
    if rank == 2:
        choices += ["csc", "dcsr", "dcsc", "bsr"]
    if rank >= 1:
        choices += ["nm", "bitmap"]
    c = rng.choice(choices)
    if c == "levels":
        order = list(range(rank))
        rng.shuffle(order)
        # n:m and bitmap levels mixed in at any level, next to dense and compressed ones.
        kinds = [rng.choice(["dense", "compressed", "compressed", "bitmap", "nm"]) for _ in range(rank)]
        kinds = [f"nm[{':'.join(map(str, rng.choice(NM_SHAPES)))}]" if k == "nm" else k for k in kinds]
        return kinds, order
    if c == "nm":
        return f"nm({','.join(map(str, rng.choice(NM_SHAPES)))})", None
    return c, None


def prune_nm(x: torch.Tensor, order, level: int, n: int, m: int) -> torch.Tensor:
    """x pruned so that an n:m level at `level` of a format with mode order `order` can hold it: under each
    coordinate of the levels above, at most n coordinates in each group of m have anything stored below them
    (those with the largest magnitude below are kept)."""
    if x.numel() == 0:
        return x
    y = x.permute(order)
    lead, size = y.shape[:level], y.shape[level]
    score = y.reshape(*lead, size, -1).abs().sum(-1)
    padded = torch.nn.functional.pad(score, (0, (-size) % m))
    groups = padded.reshape(*lead, -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(n, dim=-1).indices, True)
    keep = keep.reshape(*lead, -1)[..., :size].reshape(*lead, size, *([1] * (y.dim() - level - 1)))
    inverse = [order.index(d) for d in range(len(order))]
    return (y * keep).permute(inverse).contiguous()


def fit_nm(dense: torch.Tensor, fmt, order) -> torch.Tensor:
    """Prunes `dense` for every n:m level of the format (the preset nm(n,m): its last level)."""
    if isinstance(fmt, str) and fmt.startswith("nm("):
        n, m = (int(v) for v in fmt[3:-1].split(","))
        return prune_nm(dense, list(range(dense.dim())), dense.dim() - 1, n, m)
    if isinstance(fmt, list):
        for level, kind in enumerate(fmt):
            if kind.startswith("nm["):
                n, m = (int(v) for v in kind[3:-1].split(":"))
                dense = prune_nm(dense, list(order), level, n, m)
    return dense


def random_operand(rng: random.Random, shape, dtype, index_dtype):
    density = rng.choice(DENSITIES)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    mask = torch.rand(shape, generator=g) < density
    dense = ((torch.rand(shape, generator=g) + 0.5) * (torch.randint(0, 2, shape, generator=g) * 2 - 1) * mask).to(dtype)
    if len(shape) == 0 or rng.random() < 0.25:
        return dense, dense, "strided"
    fmt, order = random_format(rng, len(shape))
    dense = fit_nm(dense, fmt, order)
    if fmt == "bsr":
        bh = rng.choice([d for d in (1, 2, 3) if shape[0] % d == 0])
        bw = rng.choice([d for d in (1, 2, 3) if shape[1] % d == 0])
        x = sb.sparse(dense, "bsr", blocksize=(bh, bw), index_dtype=index_dtype)
    elif order is not None:
        x = sb.sparse(dense, fmt, mode_order=order, index_dtype=index_dtype)
    else:
        x = sb.sparse(dense, fmt, index_dtype=index_dtype)
    return x, dense, str(x.format)


def random_sizes(rng: random.Random):
    return {c: rng.choice([0, 1, 2, 3, 4, 5, 7]) if rng.random() < 0.1 else rng.choice([1, 2, 3, 4, 5, 7])
            for c in LETTERS}


def einsum_case(k: int):
    rng = random.Random(SEED * 7919 + k)
    sizes = random_sizes(rng)
    nops = rng.choice([1, 2, 2, 2, 3, 3])
    subs = []
    for _ in range(nops):
        rank = rng.choice([1, 2, 2, 2, 3]) if rng.random() > 0.03 else 0
        subs.append("".join(rng.sample(LETTERS, rank)))
    used = sorted(set("".join(subs)))
    out = rng.sample(used, rng.randint(0, len(used)))
    eq = ",".join(subs) + "->" + "".join(out)
    dtype = rng.choice([torch.float32, torch.float64])
    index_dtype = rng.choice([torch.int32, torch.int64])
    ops, dense, formats = [], [], []
    for s in subs:
        x, d, f = random_operand(rng, tuple(sizes[c] for c in s), dtype, index_dtype)
        ops.append(x)
        dense.append(d)
        formats.append(f)
    return eq, ops, dense, formats, dtype


def compute_case(k: int):
    """A sum of 1-3 terms, each a product of 1-2 accesses (and maybe a constant), over shared output indices."""
    rng = random.Random(SEED * 104729 + k)
    sizes = random_sizes(rng)
    out = rng.sample(LETTERS[:3], rng.randint(1, 2))
    dtype = rng.choice([torch.float32, torch.float64])
    index_dtype = rng.choice([torch.int32, torch.int64])
    terms, operands, dense, formats = [], {}, {}, []
    for t in range(rng.randint(1, 3)):
        factors = []
        for f in range(rng.choice([1, 1, 2])):
            full = (t == 0 and f == 0) or rng.random() < 0.6  # every output index is used somewhere
            idx = list(out) if full else rng.sample(out, rng.randint(1, len(out)))
            if rng.random() < 0.4:
                idx.append(rng.choice([c for c in LETTERS if c not in out]))
            rng.shuffle(idx)
            name = f"T{t}{f}"
            x, d, fmt = random_operand(rng, tuple(sizes[c] for c in idx), dtype, index_dtype)
            operands[name], dense[name] = x, d
            formats.append(fmt)
            factors.append(f"{name}({','.join(idx)})")
        if rng.random() < 0.3:
            factors.insert(0, rng.choice(["2", "0.5", "3"]))
        terms.append(" * ".join(factors))
    expr = terms[0]
    for t in terms[1:]:
        expr += rng.choice([" + ", " - "]) + t
    if rng.random() < 0.15:
        expr = f"-({expr})"
    text = f"y({','.join(out)}) = {expr}"
    return text, operands, dense, formats, dtype


def tolerance(dtype):
    return (1e-4, 1e-4) if dtype == torch.float32 else (1e-9, 1e-9)


def to_dense(x):
    return x.to_dense() if isinstance(x, sb.SparseTensor) else x


def einsum_spec(eq, ops):
    """The kernel spec `sb.einsum` plans for a case, or None when it plans none (then the call says why)."""
    try:
        return sb.plan_einsum(eq, *ops)["spec"]
    except (ValueError, TypeError, RuntimeError):
        return None


def compute_specs(text, operands):
    """The kernel specs of the steps of `sb.compute(text, **operands)` that read only the operands (a step that
    reads an earlier step's result is planned when that result exists, so its kernel compiles at run time)."""
    names = list(operands)
    try:
        ops_ = [einsum_module._operand(operands[n], n) for n in names]
        f64 = einsum_module._COMPUTE_DTYPES[einsum_module._result_dtype(ops_)] == torch.float64
        specs = []
        for step, ids in _C.split_compute(text, names, [list(o.tensor.shape) for o in ops_]):
            if any(g >= len(names) for g in ids):
                continue
            step_ops = [ops_[g] for g in ids]
            idx64 = einsum_module._index_dtype(step_ops) == torch.int64
            specs.append(_C.plan_compute(step, [f"t{j}" for j in range(len(ids))], [o.desc() for o in step_ops],
                                         "", f64, idx64)["spec"])
        return specs
    except Exception:  # noqa: BLE001 - compiling ahead only saves time; the case itself reports any error
        return []


def precompile(specs) -> float:
    """Compiles (or loads from the disk cache) the kernels a block of cases needs, two compilers at a time
    (cold caches build twice as fast). A kernel that fails to build is left to its case to report."""
    t = time.perf_counter()
    try:
        sb.precompile(sorted(specs), workers=os.cpu_count() or 2)
    except Exception:  # noqa: BLE001
        pass
    return time.perf_counter() - t


def run_einsum_cases(first: int, last: int, dispatch: str) -> dict:
    """Runs einsum cases first..last-1 under SCORCH_DISPATCH=dispatch, their kernels compiled just before (under
    "sparse"; the "auto" run reuses them or compiles on demand). Raises AssertionError on the first mismatch."""
    os.environ["SCORCH_DISPATCH"] = dispatch
    cases = [einsum_case(k) for k in range(first, last)]
    specs = {s for s in (einsum_spec(c[0], c[1]) for c in cases) if s is not None}
    compile_s = precompile(specs) if dispatch == "sparse" else 0.0
    routes = dict(_C.executor_stats())
    for k, (eq, ops, dense, formats, dtype) in zip(range(first, last), cases):
        ref = torch.einsum(eq, *[d.double() for d in dense])
        try:
            got = to_dense(sb.einsum(eq, *ops))
            rtol, atol = tolerance(dtype)
            torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)
            assert got.dtype == dtype
        except Exception as e:
            raise AssertionError(f"einsum case {k} failed (SCORCH_DISPATCH={dispatch}): {eq} "
                                 f"formats={formats} dtype={dtype}\n"
                                 f"reproduce: SCORCH_FUZZ_SEED={SEED} python -c \"import test_fuzz as f; "
                                 f"print(f.einsum_case({k})[:4])\"\n{type(e).__name__}: {e}") from e
    after = _C.executor_stats()
    return {"cases": last - first, "specs": specs, "compile_s": compile_s,
            "routes": {r: after[r] - routes[r] for r in after}}


def run_compute_cases(first: int, last: int, dispatch: str) -> dict:
    """Runs index-notation cases first..last-1 (kernels of their first steps compiled just before)."""
    os.environ["SCORCH_DISPATCH"] = dispatch
    cases = [compute_case(k) for k in range(first, last)]
    specs = {s for c in cases for s in compute_specs(c[0], c[1])}
    compile_s = precompile(specs)
    for k, (text, operands, dense, formats, dtype) in zip(range(first, last), cases):
        ref = evaluate(text, dense)
        try:
            got = to_dense(sb.compute(text, **operands))
            rtol, atol = tolerance(dtype)
            torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)
        except Exception as e:
            raise AssertionError(f"compute case {k} failed: {text} formats={formats} dtype={dtype}\n"
                                 f"reproduce: SCORCH_FUZZ_SEED={SEED} python -c \"import test_fuzz as f; "
                                 f"print(f.compute_case({k})[:4])\"\n{type(e).__name__}: {e}") from e
    return {"cases": last - first, "specs": specs, "compile_s": compile_s, "routes": {}}


_worker = {"pool": None, "cases": 0}


def run_block(fn, *args) -> dict:
    """Runs a block of cases here, or in a child process when ISOLATE (a long run): a process keeps every kernel
    it loads, so children are replaced every CASES_PER_PROCESS cases. A child that dies fails the test."""
    if not ISOLATE:
        return fn(*args)
    if _worker["pool"] is None or _worker["cases"] >= CASES_PER_PROCESS:
        if _worker["pool"] is not None:
            _worker["pool"].shutdown()
        _worker["pool"] = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        _worker["cases"] = 0
    result = _worker["pool"].submit(fn, *args).result()
    _worker["cases"] += result["cases"]
    return result


@pytest.fixture(scope="module", autouse=True)
def worker_processes():
    yield
    if _worker["pool"] is not None:
        _worker["pool"].shutdown()
        _worker["pool"] = None


def record(kind: str, first: int, last: int, result: dict, started: float) -> None:
    stats[kind] += result["cases"]
    stats["specs"] |= result["specs"]
    for r, n in result["routes"].items():
        stats["routes"][kind][r] = stats["routes"][kind].get(r, 0) + n
    print(f"\nfuzz {kind} cases {first}-{last - 1}: ok, {len(result['specs'])} kernels "
          f"({result['compile_s']:.1f} s to compile or load), {time.perf_counter() - started:.1f} s; "
          f"so far {stats['einsum sparse']} einsum (sparse) + {stats['einsum auto']} einsum (auto) + "
          f"{stats['compute']} compute", flush=True)


@pytest.mark.parametrize("chunk,scorch_dispatch",
                         [(c, "sparse") for c in range((EINSUM_CASES + CHUNK - 1) // CHUNK)] +
                         [(c, "auto") for c in range((AUTO_CASES + CHUNK - 1) // CHUNK)], indirect=["scorch_dispatch"])
def test_fuzz_einsum(chunk, scorch_dispatch):
    started = time.perf_counter()
    last = EINSUM_CASES if scorch_dispatch == "sparse" else AUTO_CASES
    first, last = chunk * CHUNK, min((chunk + 1) * CHUNK, last)
    record(f"einsum {scorch_dispatch}", first, last, run_block(run_einsum_cases, first, last, scorch_dispatch), started)


@pytest.mark.parametrize("chunk", range((COMPUTE_CASES + CHUNK - 1) // CHUNK))
def test_fuzz_compute(chunk):
    started = time.perf_counter()
    first, last = chunk * CHUNK, min((chunk + 1) * CHUNK, COMPUTE_CASES)
    dispatch = os.environ.get("SCORCH_DISPATCH", "sparse")
    record("compute", first, last, run_block(run_compute_cases, first, last, dispatch), started)


def test_fuzz_coverage():
    """The default run must cover at least 2,000 cases and 150 distinct kernels."""
    cases = stats["einsum sparse"] + stats["einsum auto"] + stats["compute"]
    print(f"\nfuzz: {stats['einsum sparse']} einsum cases under SCORCH_DISPATCH=sparse (routes "
          f"{stats['routes']['einsum sparse']}), {stats['einsum auto']} under the default dispatch (routes "
          f"{stats['routes']['einsum auto']}), {stats['compute']} index-notation cases: {cases} in all, "
          f"{len(stats['specs'])} distinct kernels compiled ahead (seed {SEED})")
    if EINSUM_CASES + COMPUTE_CASES < 2000 or cases == 0:
        pytest.skip("a reduced fuzz run (SCORCH_FUZZ_CASES) or the fuzz tests were deselected")
    assert cases >= 2000, cases
    assert len(stats["specs"]) >= 150, len(stats["specs"])
