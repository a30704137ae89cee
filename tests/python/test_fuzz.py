"""Differential fuzzing of the compiler: random einsum equations and index-notation expressions over random
formats, mode orders, densities, dtypes and index widths, compared with torch on dense copies.

Seeded and reproducible. SCORCH_FUZZ_CASES sets the number of cases of each kind (default 1200 einsum + 800
expressions), SCORCH_FUZZ_SEED the seed. A failure prints the case and a one-line reproducer. The einsum cases
run with the kernels forced (SCORCH_DISPATCH=sparse), and the first AUTO_CASES of them again under the default
dispatch, where the cost model sends most of these small problems to dense ATen code: both must agree with
torch. (Index notation has no dense path, so its cases run once.)
"""

import os
import random

import pytest
import torch

import scorch_backend as sb
import scorch_backend.frontend as einsum_module
from reference import evaluate

SEED = int(os.environ.get("SCORCH_FUZZ_SEED", "20261121"))
EINSUM_CASES = int(os.environ.get("SCORCH_FUZZ_CASES", "1200"))
COMPUTE_CASES = max(1, EINSUM_CASES * 2 // 3)
CHUNK = 100
AUTO_CASES = min(EINSUM_CASES, 400)
DENSITIES = [0.0, 1e-3, 0.1, 0.9]
LETTERS = "ijklm"

stats = {"cases": 0, "specs": set()}


class _RecordingOps:
    """Wraps torch.ops.scorch to record the spec of every kernel run."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def kernel(self, spec, *args):
        stats["specs"].add(spec)
        return self._inner.kernel(spec, *args)


@pytest.fixture(autouse=True)
def record_kernels(monkeypatch):
    monkeypatch.setattr(einsum_module, "ops", _RecordingOps(einsum_module.ops))


def random_format(rng: random.Random, rank: int):
    """A preset or a random level list with a random mode order, valid for `rank`."""
    choices = ["coo", "csf", "dense", "levels"]
    if rank >= 2:
        choices += ["csr"]
    if rank == 2:
        choices += ["csc", "dcsr", "dcsc", "bsr"]
    c = rng.choice(choices)
    if c == "levels":
        order = list(range(rank))
        rng.shuffle(order)
        kinds = [rng.choice(["dense", "compressed"]) for _ in range(rank)]
        return kinds, order
    return c, None


def random_operand(rng: random.Random, shape, dtype, index_dtype):
    density = rng.choice(DENSITIES)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    mask = torch.rand(shape, generator=g) < density
    dense = ((torch.rand(shape, generator=g) + 0.5) * (torch.randint(0, 2, shape, generator=g) * 2 - 1) * mask).to(dtype)
    if len(shape) == 0 or rng.random() < 0.25:
        return dense, dense, "strided"
    fmt, order = random_format(rng, len(shape))
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


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile the einsum cases' kernels up front, two compilers at a time (cold caches build twice as fast)."""
    specs = set()
    for k in range(EINSUM_CASES):
        eq, ops, _, _, _ = einsum_case(k)
        try:
            specs.add(sb.plan_einsum(eq, *ops)["spec"])
        except (ValueError, TypeError):
            pass
    sb.precompile(sorted(specs), workers=os.cpu_count() or 2)


@pytest.mark.parametrize("chunk,scorch_dispatch",
                         [(c, "sparse") for c in range((EINSUM_CASES + CHUNK - 1) // CHUNK)] +
                         [(c, "auto") for c in range((AUTO_CASES + CHUNK - 1) // CHUNK)], indirect=["scorch_dispatch"])
def test_fuzz_einsum(chunk, scorch_dispatch):
    last = EINSUM_CASES if scorch_dispatch == "sparse" else AUTO_CASES
    for k in range(chunk * CHUNK, min((chunk + 1) * CHUNK, last)):
        eq, ops, dense, formats, dtype = einsum_case(k)
        ref = torch.einsum(eq, *[d.double() for d in dense])
        try:
            got = to_dense(sb.einsum(eq, *ops))
            rtol, atol = tolerance(dtype)
            torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)
            assert got.dtype == dtype
        except Exception as e:
            raise AssertionError(f"einsum case {k} failed (SCORCH_DISPATCH={scorch_dispatch}): {eq} "
                                 f"formats={formats} dtype={dtype}\n"
                                 f"reproduce: SCORCH_FUZZ_SEED={SEED} python -c \"import test_fuzz as f; "
                                 f"print(f.einsum_case({k})[:4])\"\n{type(e).__name__}: {e}") from e
        stats["cases"] += 1


@pytest.mark.parametrize("chunk", range((COMPUTE_CASES + CHUNK - 1) // CHUNK))
def test_fuzz_compute(chunk):
    for k in range(chunk * CHUNK, min((chunk + 1) * CHUNK, COMPUTE_CASES)):
        text, operands, dense, formats, dtype = compute_case(k)
        ref = evaluate(text, dense)
        try:
            got = to_dense(sb.compute(text, **operands))
            rtol, atol = tolerance(dtype)
            torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)
        except Exception as e:
            raise AssertionError(f"compute case {k} failed: {text} formats={formats} dtype={dtype}\n"
                                 f"{type(e).__name__}: {e}") from e
        stats["cases"] += 1


def test_fuzz_coverage():
    """The default run must cover at least 2,000 cases and 150 distinct kernels."""
    if EINSUM_CASES + COMPUTE_CASES < 2000 or stats["cases"] == 0:
        pytest.skip("a reduced fuzz run (SCORCH_FUZZ_CASES) or the fuzz tests were deselected")
    assert stats["cases"] >= 2000, stats["cases"]
    assert len(stats["specs"]) >= 150, len(stats["specs"])
    print(f"\nfuzz: {stats['cases']} cases, {len(stats['specs'])} distinct kernels")
