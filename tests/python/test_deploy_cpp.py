"""The C++ deployment example (examples/cpp): built with CMake against LibTorch from the torch wheel and the
installed libscorch_ops, it runs TorchScript models calling scorch::kernel, scorch::region and
scorch::masked_attention (a rewritten block-sparse attention) with kernels from a bundle, in a process with no
Python, no compiler (CXX=/nonexistent), no JIT (SCORCH_JIT=0) and an empty kernel cache; its outputs must equal
Python's.

The build goes to build/deploy-example (kept between runs: the first build takes about a minute).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import scorch_backend as sb

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cpp"
BUILD = ROOT / "build" / "deploy-example"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is needed to build the example")


@pytest.fixture(scope="module")
def scorch_deploy() -> pathlib.Path:
    cache = BUILD / "CMakeCache.txt"
    # Configured for this package and this torch (a build tree left by another checkout or venv is redone).
    want = f"SCORCH_OPS_LIBRARY:FILEPATH={sb.ops_library_path()}"
    if not cache.exists() or want not in cache.read_text().splitlines():
        shutil.rmtree(BUILD, ignore_errors=True)
        cmd = ["cmake", "-S", str(EXAMPLE), "-B", str(BUILD), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
               f"-DSCORCH_OPS_LIBRARY={sb.ops_library_path()}"]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        if shutil.which("ccache"):
            cmd += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run(["cmake", "--build", str(BUILD)], capture_output=True, text=True, timeout=1200,
                       env=dict(os.environ, CCACHE_DIR=os.environ.get("CCACHE_DIR", str(ROOT / "build" / "ccache"))))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return BUILD / "scorch_deploy"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> pathlib.Path:
    # A fresh process: its used_kernel_specs() are exactly the example model's.
    out = tmp_path_factory.mktemp("deploy")
    env = dict(os.environ, SCORCH_DISPATCH="sparse")
    r = subprocess.run([sys.executable, str(EXAMPLE / "make_example.py"), str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def deploy_env(cache: pathlib.Path) -> dict:
    cache.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(CXX="/nonexistent/c++", SCORCH_JIT="0", SCORCH_DISPATCH="sparse", SCORCH_CACHE_DIR=str(cache))
    return env


def run(binary, args, env) -> subprocess.CompletedProcess:
    r = subprocess.run([str(binary), *map(str, args)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode >= 0, f"scorch_deploy died of {signal.Signals(-r.returncode).name}\n{r.stderr[-3000:]}"
    return r


def test_cpp_program_matches_python(scorch_deploy, example, tmp_path):
    cache = tmp_path / "empty-cache"
    r = run(scorch_deploy, [example / "model.pt", example / "model.kernels", example / "inputs.pt",
                            tmp_path / "outputs.pt"], deploy_env(cache))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels loaded: 1" in r.stdout, r.stdout
    got = torch.load(tmp_path / "outputs.pt")
    want = torch.load(example / "expected.pt")
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert list(cache.iterdir()) == []  # no kernel compiled or cached


def test_cpp_program_with_the_bundle_inside_the_model(scorch_deploy, example, tmp_path):
    cache = tmp_path / "empty-cache"
    r = run(scorch_deploy, [example / "model_with_kernels.pt", "@", example / "inputs.pt", tmp_path / "outputs.pt"],
            deploy_env(cache))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kernels loaded: 1" in r.stdout, r.stdout
    for g, w in zip(torch.load(tmp_path / "outputs.pt"), torch.load(example / "expected.pt")):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # A model without one says so.
    r = run(scorch_deploy, [example / "model.pt", "@", example / "inputs.pt", tmp_path / "o.pt"], deploy_env(cache))
    assert r.returncode == 1 and "holds no kernel bundle" in r.stderr, r.stderr


def test_cpp_program_with_the_bundle_from_the_environment(scorch_deploy, example, tmp_path):
    env = deploy_env(tmp_path / "cache")
    env["SCORCH_KERNEL_BUNDLES"] = str(example / "model.kernels")
    r = run(scorch_deploy, [example / "model.pt", "-", example / "inputs.pt", tmp_path / "outputs.pt"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    for g, w in zip(torch.load(tmp_path / "outputs.pt"), torch.load(example / "expected.pt")):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_cpp_program_without_the_bundle_names_the_missing_kernel(scorch_deploy, example, tmp_path):
    r = run(scorch_deploy, [example / "model.pt", "-", example / "inputs.pt", tmp_path / "outputs.pt"],
            deploy_env(tmp_path / "cache"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no kernel for spec 'out(i0,i1) = t0(i0,i2) * t1(i2,i1)" in r.stderr, r.stderr
    assert "SCORCH_JIT=0" in r.stderr


def test_cpp_program_refuses_a_damaged_bundle(scorch_deploy, example, tmp_path):
    data = bytearray((example / "model.kernels").read_bytes())
    data[-300] ^= 0x10
    bad = tmp_path / "bad.kernels"
    bad.write_bytes(bytes(data))
    r = run(scorch_deploy, [example / "model.pt", bad, example / "inputs.pt", tmp_path / "outputs.pt"],
            deploy_env(tmp_path / "cache"))
    assert r.returncode == 1 and "refused" in r.stderr and "damaged" in r.stderr, r.stderr
    assert not (tmp_path / "outputs.pt").exists()
    assert "kernels loaded" not in r.stdout, r.stdout  # (said only for a bundle that loaded)


@pytest.mark.parametrize("count", ["abc", "-5", "0", "99999999999999", ""])
def test_cpp_program_refuses_a_bad_repeat_count(scorch_deploy, example, tmp_path, count):
    r = run(scorch_deploy, [example / "model.pt", example / "model.kernels", example / "inputs.pt",
                            tmp_path / "outputs.pt", "--repeat", count], deploy_env(tmp_path / "cache"))
    assert r.returncode == 2 and f"--repeat takes a count from 1 to 1000000, got '{count}'" in r.stderr, r.stderr


def runs_from_bundle_alone(binary, tmp_path, bundle, expected) -> None:
    """tmp_path/model.pt on tmp_path/inputs.pt from C++, under the forced kernels and the automatic dispatch,
    kernels from `bundle` only: its outputs match `expected`, and nothing is compiled or cached."""
    for dispatch in ("sparse", "auto"):
        cache = tmp_path / f"empty-cache-{dispatch}"
        env = deploy_env(cache)
        env["SCORCH_DISPATCH"] = dispatch
        r = run(binary, [tmp_path / "model.pt", bundle, tmp_path / "inputs.pt", tmp_path / f"outputs-{dispatch}.pt"],
                env)
        assert r.returncode == 0, r.stdout + r.stderr
        torch.testing.assert_close(torch.load(tmp_path / f"outputs-{dispatch}.pt"), expected, rtol=1e-4, atol=1e-5)
        assert list(cache.iterdir()) == []  # no kernel compiled or cached


def test_rewritten_model_runs_in_cpp(scorch_deploy, tmp_path):
    """examples/rewrite_and_save.py (scorch_backend.compiler.jit.rewrite + save) then the C++ program: the pruned MLP's
    packed regions run from C++ with kernels from its bundle only, on a batch of another size, and give the
    eager model's output."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "rewrite_and_save.py"), str(out)],
                       env=dict(os.environ, SCORCH_DISPATCH="sparse"), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stored compressed" in r.stdout
    for dispatch in ("sparse", "auto"):
        env = deploy_env(tmp_path / f"empty-cache-{dispatch}")
        env["SCORCH_DISPATCH"] = dispatch
        r = run(scorch_deploy, [out / "model.pt", out / "model.pt.kernels", out / "inputs.pt",
                                tmp_path / f"outputs-{dispatch}.pt"], env)
        assert r.returncode == 0, r.stdout + r.stderr
        got = torch.load(tmp_path / f"outputs-{dispatch}.pt")
        torch.testing.assert_close(got, torch.load(out / "expected.pt"), rtol=1e-4, atol=1e-5)


def test_rewritten_block_sparse_attention_runs_in_cpp(scorch_deploy, tmp_path):
    """The zoo's block-sparse attention, rewritten (its masked attention a scorch::masked_attention call, the
    mask a buffer) and saved with its bundle, runs from C++ with attention's kernels from the bundle only."""
    from scorch_backend.custom_ops import attention
    from scorch_backend.compiler import jit
    from scorch_backend.tools import zoo

    torch._dynamo.reset()
    case = zoo.make("block_sparse_attention", "test")
    model = case.model.eval()
    new = jit.rewrite(model, case.inputs)  # SCORCH_DISPATCH=sparse (the tests' default): the idiom is taken
    torch._dynamo.reset()
    assert "torch.ops.scorch.masked_attention(" in new.code
    info = jit.save(new, tmp_path / "model.pt", case.inputs)
    x = case.make_inputs(3)
    qkv = (2, 2, 256, 16)  # (batch, heads, seq, head_dim): the specs depend on formats and dtypes only
    specs = attention.kernel_specs(qkv, qkv, qkv, torch.float32, False)
    assert len(specs) == 2 and set(specs) == set(info["kernels"]), info["kernels"]
    torch.save(x, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = model(*x)
    runs_from_bundle_alone(scorch_deploy, tmp_path, info["bundle"], expected)
    # Without the bundle, the C++ program names attention's first kernel (the sampled product).
    r = run(scorch_deploy, [tmp_path / "model.pt", "-", tmp_path / "inputs.pt", tmp_path / "o.pt"],
            deploy_env(tmp_path / "cache-none"))
    assert r.returncode == 1 and specs[0] in r.stderr, r.stderr


def test_rewritten_gcn_with_a_sparse_input_runs_in_cpp(scorch_deploy, tmp_path):
    """The zoo GCN, rewritten with its adjacency as an input (a torch.sparse CSR tensor in the signature), runs
    from C++ on a graph of another size, int64 indices, with kernels from its bundle only. The inputs file
    carries the graph as a dict of its CSR parts (C++'s pickle reader has no sparse layouts); the program
    builds the torch.sparse CSR tensor from it, as a C++ caller would."""
    from scorch_backend.compiler import jit
    from scorch_backend.tools import zoo

    torch._dynamo.reset()
    case = zoo.make("gcn", "test")
    model = case.model.eval()
    new = jit.rewrite(model, case.inputs)
    torch._dynamo.reset()
    x, adj = zoo.make("gcn", "test", nodes=257, edges=2000, seed=5).inputs
    t = adj.to_torch(torch.sparse_csr)
    info = jit.save(new, tmp_path / "model.pt", (x, t))  # a consistent example: the module checks sizes
    graph = {"crow_indices": t.crow_indices().long(), "col_indices": t.col_indices().long(), "values": t.values(),
             "size": list(t.shape)}
    torch.save((x, graph), tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = model(x, adj)
    runs_from_bundle_alone(scorch_deploy, tmp_path, info["bundle"], expected)
    # A malformed graph entry is a clear error, not a crash.
    torch.save((x, {"crow_indices": graph["crow_indices"]}), tmp_path / "bad.pt")
    r = run(scorch_deploy, [tmp_path / "model.pt", info["bundle"], tmp_path / "bad.pt", tmp_path / "o.pt"],
            deploy_env(tmp_path / "cache-bad"))
    assert r.returncode == 1 and "lacks 'col_indices'" in r.stderr, r.stderr
