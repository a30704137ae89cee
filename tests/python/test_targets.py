"""Kernels compiled for other instruction-set targets than the default: the same results everywhere.

The default suite runs under the default target (native, or SCORCH_TARGET). Here the named kernels whose code
depends on the vector width (register-tiled SpMM with every kind of remainder, vectorized dense reductions,
SDDMM) and a reduced fuzz run are repeated under x86-64-v3 (AVX2 + FMA), x86-64-v2 (SSE4.2, 16-byte vectors),
and the scalar target (no vector code from Scorch), each when this CPU can run it. SCORCH_TARGET_FUZZ_CASES
sets the fuzz cases per target (default 150).
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import scorch_backend as sb
from scorch_backend import _C
from conftest import random_dense

NATIVE = sb.target_info("native")
FUZZ_CASES = int(os.environ.get("SCORCH_TARGET_FUZZ_CASES", "150"))


def runnable(name: str) -> str | None:
    """Why this CPU cannot run kernels for `name` (None: it can)."""
    try:
        info = sb.target_info(name)
    except ValueError as e:
        return str(e)
    missing = [f for f in info["features"] if f not in NATIVE["features"]]
    return f"this CPU lacks {missing}" if missing else None


TARGETS = [pytest.param(t, marks=pytest.mark.skipif(runnable(t) is not None, reason=str(runnable(t))))
           for t in ("x86-64-v3", "x86-64-v2", "scalar")]


@pytest.fixture(params=TARGETS)
def target(request):
    with sb.using_target(request.param) as info:
        assert info["name"] == request.param
        yield info
    assert sb.target_name() == os.environ.get("SCORCH_TARGET", "native")


@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 16, 31, 33, 64, 65, 100, 128, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spmm_every_remainder(target, n, dtype):
    """Register tiles of the target's width, then passes of half as many vectors, then the scalar rest."""
    A = random_dense((37, 29), 0.2, dtype=dtype, seed=n)
    B = torch.randn(29, n, dtype=dtype)
    got = sb.einsum("ij,jk->ik", sb.sparse(A, "csr"), B)
    torch.testing.assert_close(got, A @ B)
    info = sb.kernel_info(sb.plan_einsum("ij,jk->ik", sb.sparse(A, "csr"), B)["spec"])
    assert info["target"] == target["name"]


@pytest.mark.parametrize("k", [1, 5, 31, 32, 33, 64, 129, 1000])
def test_dense_reductions(target, k):
    """Vectorized reductions along a dense index (four accumulators of the target's width, then a tail)."""
    S = sb.sparse(random_dense((23, 19), 0.3, seed=k), "csr")
    P, Q = torch.randn(23, k), torch.randn(19, k)
    got = sb.einsum("ij,ik,jk->ij", S, P, Q)
    torch.testing.assert_close(got.to_dense(), S.to_dense() * (P @ Q.t()), rtol=1e-4, atol=1e-4)
    x = torch.randn(k, dtype=torch.float64)
    M = torch.randn(7, k, dtype=torch.float64)
    torch.testing.assert_close(sb.compute("y(i) = M(i,k) * x(k)", M=M, x=x), M @ x)


def test_transposed_dense_operand(target):
    """A dense operand whose column index is not contiguous: the array tile, not vector loads."""
    A = random_dense((16, 40), 0.25, seed=3)
    B = torch.randn(70, 40)
    torch.testing.assert_close(sb.einsum("ij,kj->ik", sb.sparse(A, "csr"), B), A @ B.t(), rtol=1e-4, atol=1e-4)


def test_fuzz_under_target(target):
    import test_fuzz as fz

    for k in range(FUZZ_CASES):
        eq, ops, dense, formats, dtype = fz.einsum_case(k)
        ref = torch.einsum(eq, *[d.double() for d in dense])
        got = fz.to_dense(sb.einsum(eq, *ops))
        rtol, atol = fz.tolerance(dtype)
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol,
                                   msg=lambda m: f"case {k} {eq} {formats} under {target['name']}: {m}")


def long_rows(lengths, cols: int, dtype, seed: int) -> torch.Tensor:
    """A dense matrix whose row r has lengths[r % len(lengths)] stored entries at random columns."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(2 * len(lengths)):
        row = torch.zeros(cols, dtype=dtype)
        at = torch.randperm(cols, generator=g)[: lengths[r % len(lengths)]]
        row[at] = torch.randn(len(at), generator=g, dtype=dtype)
        rows.append(row)
    return torch.stack(rows)


GATHER_TARGETS = [pytest.param(t, marks=pytest.mark.skipif(runnable(t) is not None, reason=str(runnable(t))))
                  for t in ("native", "x86-64-v3", "x86-64-v2")]


@pytest.mark.parametrize("gathers", ["hardware", "soft"])
@pytest.mark.parametrize("name", GATHER_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_row_sums_under_both_gathers(monkeypatch, gathers, name, dtype):
    """Rows long enough for the vector sum (its tier starts at 2 or 4 vectors a row on average), of every remainder
    after pairs of vectors: the gather instruction's loop and the one built from scalar loads agree with torch."""
    monkeypatch.setenv("SCORCH_GATHERS", gathers)
    lengths = [64, 65, 79, 80, 95, 96, 97, 100, 127, 128, 129, 200, 33, 150, 0, 1, 5, 17]
    A = long_rows(lengths, 300, dtype, seed=len(lengths))
    x, y = torch.randn(300, dtype=dtype), torch.randn(300, dtype=dtype)
    S = sb.sparse(A, "csr")
    with sb.using_target(name) as info:
        assert info["soft_gathers"] == (gathers == "soft" and info["vector_bytes"] > 0)
        torch.testing.assert_close(sb.einsum("ij,j->i", S, x), A @ x)
        torch.testing.assert_close(sb.einsum("ij,j,j->i", S, x, y), A @ (x * y))  # two gathered operands
        spec = sb.plan_einsum("ij,j->i", S, x)["spec"]
        source = _C.kernel_source(spec)
        assert ("const vec_t g0_0 = {" in source) == info["soft_gathers"]


def test_bad_gathers_setting_is_refused(monkeypatch):
    monkeypatch.setenv("SCORCH_GATHERS", "fast")
    with pytest.raises(ValueError, match="SCORCH_GATHERS='fast'"):
        sb.target_info("native")


def test_two_targets_two_cache_entries():
    A = sb.sparse(random_dense((9, 9), 0.3, seed=1), "csr")
    spec = sb.plan_einsum("ij,jk->ik", A, torch.randn(9, 5))["spec"]
    paths = set()
    for name in ("scalar", "generic"):
        with sb.using_target(name):
            info = sb.kernel_info(spec)
            assert info["target"] == name
            paths.add(info["library_path"])
    assert len(paths) == 2


def test_bad_target_names_are_refused():
    for bad in ("", " ", "x86-64-v3 -O0", "-fplugin=evil", "a" * 65, "x86-64-v3;ls", "no-such-cpu"):
        if bad == "":
            continue  # "" means: back to the default
        with pytest.raises(ValueError):
            sb.set_target(bad)
    assert sb.target_name() == os.environ.get("SCORCH_TARGET", "native")


def refused_in_a_child(target: str, feature: str) -> None:
    """A child process with SCORCH_TARGET=target runs a sparse product: a ValueError naming `feature`, not a
    signal."""
    code = ("import torch, scorch_backend as sb\n"
            "A = sb.sparse(torch.eye(4), 'csr')\n"
            "try:\n    sb.einsum('ij,jk->ik', A, torch.ones(4, 3))\nexcept ValueError as e:\n"
            "    print('refused:', e)\n")
    env = dict(os.environ, SCORCH_TARGET=target, SCORCH_DISPATCH="sparse")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and feature in r.stdout


def test_a_target_this_cpu_cannot_run_is_refused():
    """Kernels for instruction sets the CPU lacks would die of SIGILL: the name is refused up front."""
    if "avx512f" in NATIVE["features"] or NATIVE["arch"] != "x86_64":
        pytest.skip("this CPU runs AVX-512 code (or is not x86-64)")
    with pytest.raises(ValueError, match="does not have"):
        sb.set_target("x86-64-v4")
    # The same through the environment, in a child process: a clear error, not a signal.
    refused_in_a_child("x86-64-v4", "avx512f")


def test_a_target_with_instructions_outside_the_vector_list_is_refused():
    """bdver2 (AMD Piledriver) code uses FMA4 and XOP: not vector-width features, but SIGILL on a CPU without
    them. The full instruction-set list is checked on the CPU, as a kernel bundle's is."""
    if NATIVE["arch"] != "x86_64":
        pytest.skip("x86-64 only")
    cpu_flags = pathlib.Path("/proc/cpuinfo").read_text().split() if pathlib.Path("/proc/cpuinfo").exists() else []
    if "fma4" in cpu_flags:
        pytest.skip("this CPU has FMA4")
    try:
        sb.target_info("bdver2")
    except ValueError:
        pytest.skip("the compiler does not know bdver2")
    with pytest.raises(ValueError, match="fma4"):
        sb.set_target("bdver2")
    refused_in_a_child("bdver2", "fma4")


def test_target_from_the_environment():
    code = "import scorch_backend as sb; i = sb.target_info(); print(i['name'], i['vector_bytes'])"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, SCORCH_TARGET="scalar"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["scalar", "0"]


def test_describe_machine_names_cpu_target_threads():
    line = sb.describe_machine(2)
    assert "CPU:" in line and "kernel target:" in line and "threads: 2" in line


@pytest.mark.parametrize("name", ["native", *TARGETS])
def test_spmm_with_a_dense_operand_larger_than_l2(name):
    """Register tiles prefetch the gathered rows when the dense operand outgrows half of L2: that path only
    runs on big operands (here 70000 x 64 float32, 18 MB), so it is checked on one."""
    with sb.using_target(name):
        g = torch.Generator().manual_seed(5)
        A = random_dense((96, 70000), 0.002, seed=7)
        B = torch.randn(70000, 64, generator=g)
        S = sb.sparse(A, "csr")
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), A @ B, rtol=1e-4, atol=1e-4)
        src = sb.kernel_info(sb.plan_einsum("ij,jk->ik", S, B)["spec"])
        assert "__builtin_prefetch" in open(src["source_path"]).read() or sb.target_info()["vector_bytes"] == 0


_SWITCH = r"""
import os, sys, torch, scorch_backend as sb
torch.set_num_threads(1)
g = torch.Generator().manual_seed(5)
A = torch.randn(40, 500, generator=g) * (torch.rand(40, 500, generator=g) < 0.4)
x = torch.randn(500, generator=g)
S = sb.sparse(A, "csr")
out = []
for mode in sys.argv[1].split(","):
    os.environ["SCORCH_GATHERS"] = mode
    out.append(sb.einsum("ij,j->i", S, x))
torch.save(out, sys.argv[2])
"""


@pytest.mark.skipif(not NATIVE["vector_bytes"], reason="no vector target")
def test_a_new_gather_setting_reaches_kernels_already_in_use(tmp_path):
    """The kernel op keeps its kernels by spec; a changed SCORCH_GATHERS (or target) must reach a spec it has run
    before. Float32 sums in the two forms add in different orders, so each form's bits are known from a process
    that ran only that form."""
    def run(modes):
        path = tmp_path / f"{modes}.pt"
        env = {**os.environ, "SCORCH_DISPATCH": "sparse"}
        r = subprocess.run([sys.executable, "-c", _SWITCH, modes, str(path)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return torch.load(path)

    hardware, soft = run("hardware")[0], run("soft")[0]
    assert not torch.equal(hardware, soft)  # (the test can tell the forms apart)
    switched = run("hardware,soft,hardware")
    assert torch.equal(switched[0], hardware) and torch.equal(switched[1], soft) and torch.equal(switched[2], hardware)
