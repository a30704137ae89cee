"""The grouped product kernel (codegen/emit_grouped.h, csrc/torch/grouped_kernel.cpp; issue 13): the forward
of a grouped chain's plain products, A[rows of group q] @ W[q] for every group, as one generated kernel that
streams the weights under the arithmetic. Checked against eager at odd sizes (columns not a whole vector,
fewer columns than a vector, more rows than a register tile, one token, experts without tokens, one expert with
most of the tokens: its columns cut among the threads), float32 and float64, on every target this CPU runs
(the tile and vector width come from the target; a target whose tile is too small runs ATen's products), with
1 and 2 threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scorch_backend as sb
import scorch_backend._C as C
from scorch_backend.custom_ops import chain as Ch
from scorch_backend.custom_ops import region as R

P, O = R.Program, R.Operand


def _targets():
    out = []
    for name in ("native", "x86-64-v3", "generic", "scalar"):
        try:
            sb.target_info(name)
        except (ValueError, RuntimeError):  # not run by this CPU; RuntimeError: no compiler to resolve it
            continue
        out.append(name)
    return out


def _tile(target):
    """(rows, vectors, lanes of float32) of the kernel's register tile on `target`, read from its source."""
    info = sb.target_info(target)
    with sb.using_target(target):
        src = C.kernel_source("grouped_product f32")
    line = next(ln for ln in src.splitlines() if ln.startswith("constexpr int kMR"))
    rows = int(line.split("kMR = ")[1].split(",")[0])
    vectors = int(line.split("kNV = ")[1].split(";")[0])
    return rows, vectors, max(1, info["vector_bytes"] // 4)


def _moe(b, n, d, h, experts, dtype, seed=0):
    """relu(S x W1) W2 scattered back as (b, n, d), and the same in eager ATen ops."""
    g = torch.Generator().manual_seed(seed)
    s = F.one_hot(torch.tensor(experts), n).to(dtype)
    x = torch.randn(b, d, dtype=dtype, generator=g)
    w1 = torch.randn(n, d, h, dtype=dtype, generator=g)
    w2 = torch.randn(n, h, d, dtype=dtype, generator=g)
    step0 = Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.relu",))
    step1 = Ch.ChainStep(P((O("abh"), O("bhd"), O("ab", "pattern")), "abd").text(), (-1, 3, 0))
    text = Ch.ChainProgram((step0, step1), "g").text()
    hid = torch.relu(torch.einsum("bnd,ndh->bnh", s.unsqueeze(-1) * x.unsqueeze(1), w1))
    ref = torch.einsum("bnh,nhd->bnd", hid, w2) * (s != 0).unsqueeze(-1)
    return text, [s, x, w1, w2], ref


def _run(text, ops, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), torch.profiler.profile() as prof:
            y = torch.ops.scorch.chain(text, ops)
    finally:
        torch.set_num_threads(old)
    return y, [e.name for e in prof.events()].count("scorch::grouped_product")


SHAPES = {
    "odd": (21, 4, 5, 6, None),                       # 6 and 5 columns: fewer than a vector (f32, 16 or 8 lanes)
    "one_token": (1, 3, 7, 33, [2]),
    "rows_past_tiles": (40, 2, 19, 70, [k % 2 for k in range(40)]),  # 20 rows a group: several row tiles
    "empty_experts": (12, 6, 8, 24, [1, 4, 4, 1, 1, 4, 4, 4, 1, 1, 4, 4]),
    "one_large_expert": (60, 3, 16, 200, [0] * 50 + [1] * 6 + [2] * 4),  # columns cut among the threads
}


@pytest.mark.parametrize("target", _targets())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_grouped_kernel_equals_eager(target, dtype, shape):
    b, n, d, h, experts = SHAPES[shape]
    if experts is None:
        experts = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(1)).tolist()
    text, ops, ref = _moe(b, n, d, h, experts, dtype)
    rows, vectors, lanes = _tile(target)
    # the kernel where its tile holds 64 values or more (grouped_kernel.cpp), ATen's products elsewhere
    taken = rows * vectors * lanes * 4 // dtype.itemsize >= 64
    with sb.using_target(target):
        for threads in (1, 2):
            y, calls = _run(text, ops, threads)
            assert calls == (2 if taken else 0)
            tol = 1e-4 if dtype == torch.float32 else 1e-10
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


def test_grouped_kernel_tile_fits_the_target_registers():
    """The register tile is read from the target: its accumulators, a vector of weights per column vector and the
    broadcast value fit the target's vector registers."""
    for target in _targets():
        info = sb.target_info(target)
        with sb.using_target(target):
            src = C.kernel_source("grouped_product f32")
        assert f"#define SCORCH_VECTOR_BYTES {info['vector_bytes']}" in src
        rows, vectors, _ = _tile(target)
        regs = info["vector_registers"] if info["vector_bytes"] else 16
        assert rows >= 1 and vectors >= 1 and rows * vectors + vectors + 1 <= regs


@pytest.mark.parametrize("spec", ["grouped_product f16", "grouped_product", "grouped_product f32; x"])
def test_grouped_kernel_bad_spec_is_an_error(spec):
    with pytest.raises((ValueError, RuntimeError), match="spec"):
        C.kernel_source(spec)


def test_grouped_kernel_not_taken_for_transposed_weights():
    """W stored (groups, n, k) is not the kernel's layout: ATen's products run, with the same result."""
    g = torch.Generator().manual_seed(2)
    b, n, d, h = 16, 3, 8, 12
    s = F.one_hot(torch.randint(0, n, (b,), generator=g), n).float()
    x = torch.randn(b, d, generator=g)
    w1 = torch.randn(n, h, d, generator=g)  # transposed
    step0 = Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qhd")), "pqh").text(), (0, 1, 2))
    step1 = Ch.ChainStep(P((O("abh"), O("ab", "pattern")), "abh").text(), (-1, 0))
    text = Ch.ChainProgram((step0, step1), "g").text()
    y, calls = _run(text, [s, x, w1], 2)
    assert calls == 0
    ref = torch.einsum("bnd,nhd->bnh", s.unsqueeze(-1) * x.unsqueeze(1), w1)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_grouped_kernel_from_a_bundle_without_the_jit(tmp_path):
    """A deployment without the JIT (SCORCH_JIT=0) runs the kernel from a bundle that holds its spec."""
    from scorch_backend.custom_ops import aot

    path = tmp_path / "grouped.bundle"
    aot.build_bundle(["grouped_product f32"], path)
    out = _moe_in_subprocess({"SCORCH_JIT": "0"}, bundle=path)
    rows, vectors, lanes = _tile(None)
    assert f"calls {2 if rows * vectors * lanes >= 64 else 0}" in out


def _moe_in_subprocess(env: dict, bundle=None) -> str:
    """Run _moe's chain in a fresh process with `env` added (and `bundle` loaded first); its stdout."""
    import os
    import subprocess
    import sys

    load = f"from scorch_backend.custom_ops import aot\nassert aot.load_bundle({str(bundle)!r}) == 1\n" if bundle else ""
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
{load}from test_grouped_kernel import _moe, _run
text, ops, ref = _moe(30, 3, 16, 40, [k % 3 for k in range(30)], torch.float32)
y, calls = _run(text, ops, 2)
torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
print("calls", calls)
"""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("jit", ["0", "1"])
def test_grouped_products_without_a_compiler(tmp_path, jit):
    """No compiler on the machine (a deployment): with the JIT off and no bundle, or with the JIT on and nothing
    in its cache, the mixture of experts still runs, on ATen's products, and right."""
    env = {"CXX": "/nonexistent/c++", "SCORCH_JIT": jit, "SCORCH_CACHE_DIR": str(tmp_path / "cache")}
    assert "calls 0" in _moe_in_subprocess(env)


def test_grouped_kernel_from_a_bundle_without_a_compiler(tmp_path):
    """A bundle that holds the kernel is used with no compiler at all: the register tile comes from the bundle's
    kernel, not from resolving this machine's target (which needs the compiler)."""
    from scorch_backend.custom_ops import aot

    path = tmp_path / "grouped.bundle"
    aot.build_bundle(["grouped_product f32"], path)
    out = _moe_in_subprocess({"CXX": "/nonexistent/c++", "SCORCH_JIT": "0"}, bundle=path)
    rows, vectors, lanes = _tile(None)
    assert f"calls {2 if rows * vectors * lanes >= 64 else 0}" in out


def test_grouped_kernel_with_strided_token_rows():
    """Tokens whose features are strided (every other element of a wider tensor), one token and several: the
    result is the eager one whichever path takes them."""
    for b in (1, 5):
        text, ops, _ = _moe(b, 3, 8, 24, [k % 3 for k in range(b)], torch.float32, seed=4)
        wide = torch.zeros(b, 16)
        wide[:, ::2] = ops[1]
        ops[1] = wide[:, ::2]
        assert ops[1].stride(1) == 2
        s, x, w1, w2 = ops
        hid = torch.relu(torch.einsum("bnd,ndh->bnh", s.unsqueeze(-1) * x.unsqueeze(1), w1))
        ref = torch.einsum("bnh,nhd->bnd", hid, w2) * (s != 0).unsqueeze(-1)
        y, _ = _run(text, ops, 2)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
