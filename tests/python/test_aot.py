"""Ahead-of-time kernel bundles (scorch_backend.custom_ops.aot, docs/deploy.md).

A bundle built here is loaded in fresh child processes that have no compiler (CXX=/nonexistent), no JIT
(SCORCH_JIT=0) and an empty kernel cache; they must compute what dense torch computes, fail with a clear
exception naming the spec of a kernel the bundle lacks, and end normally (never a signal). Damaged or foreign
bundles are refused with a ValueError saying why, before any of their code is mapped.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import scorch_backend as sb
from scorch_backend.custom_ops import aot

from conftest import fnv128, random_dense

def split(bundle: bytes) -> tuple[list[str], bytes, bytes]:
    nl = bundle.index(b"\n")
    head = bundle[:nl].decode().split()
    m = int(head[2])
    return head, bundle[nl + 1:nl + 1 + m], bundle[nl + 1 + m:]


def reseal(manifest: bytes, library: bytes) -> bytes:
    return (f"SCORCH-KERNEL-BUNDLE 1 {len(manifest)} {len(library)} {fnv128(manifest + library)}\n".encode()
            + manifest + library)


def operands():
    A = sb.sparse(random_dense((40, 30), 0.15, seed=1), "csr")
    B = sb.sparse(random_dense((30, 20), 0.2, seed=2), "csr")
    x = torch.randn(30, generator=torch.Generator().manual_seed(3))
    X = torch.randn(30, 7, generator=torch.Generator().manual_seed(4))
    return A, B, x, X


# The workload the bundle is built for: SpMV, SpMM, SpGEMM (sparse output), and the SpMV's gradients.
CASES = [("ij,j->i", "A x"), ("ij,jk->ik", "A X"), ("ij,jk->ik", "A B")]


def specs_of_workload() -> list[str]:
    A, B, x, X = operands()
    named = {"A": A, "B": B, "x": x, "X": X}
    return [sb.plan_einsum(eq, *(named[n] for n in args.split()))["spec"] for eq, args in CASES]


CHILD = r"""
import json, sys, torch, scorch_backend as sb
from scorch_backend.custom_ops import aot
sys.path.insert(0, sys.argv[2])
from test_aot import operands, CASES
bundle, mode = sys.argv[1], sys.argv[3]
out = {}
if bundle != "-":
    out["loaded"] = aot.load_bundle(bundle)
A, B, x, X = operands()
named = {"A": A, "B": B, "x": x, "X": X}
if mode == "run":
    err = {}
    for eq, args in CASES:
        ops = [named[n] for n in args.split()]
        got = sb.einsum(eq, *ops)
        got = got.to_dense() if isinstance(got, sb.SparseTensor) else got
        want = torch.einsum(eq, *[o.to_dense() if isinstance(o, sb.SparseTensor) else o for o in ops])
        err[eq + " " + args] = (got - want).abs().max().item()
    out["err"] = err
    out["used"] = aot.used_kernel_specs()
    out["bundled"] = [s for s, p in aot.bundled_kernels()]
else:  # a kernel the bundle does not hold: float64
    try:
        sb.einsum("ij,j->i", A.to(torch.float64), x.double())
        out["error"] = None
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def run_child(bundle, mode, cache: pathlib.Path, **env_extra) -> dict:
    env = dict(os.environ)
    for name in ("SCORCH_DEBUG", "SCORCH_SANITIZE", "SCORCH_TARGET", "CXX", "SCORCH_JIT"):
        env.pop(name, None)
    cache.mkdir(exist_ok=True)
    env.update({"SCORCH_CACHE_DIR": str(cache), "SCORCH_DISPATCH": "sparse"})
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", CHILD, str(bundle), str(pathlib.Path(__file__).parent), mode],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (f"child ended with {r.returncode}"
                               f"{' (' + signal.Signals(-r.returncode).name + ')' if r.returncode < 0 else ''}"
                               f"\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


NO_COMPILER = {"CXX": "/nonexistent/c++", "SCORCH_JIT": "0"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("aot") / "workload.kernels"
    info = aot.build_bundle(specs_of_workload(), path)
    assert [k[0] for k in info["kernels"]] == specs_of_workload()
    return path


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_bundle_runs_with_no_compiler(bundle, tmp_path, dispatch):
    # Under "auto" the cost model cannot calibrate (that compiles kernels): a deployment sets
    # SCORCH_DENSE_CROSSOVER (the C++ executor alone falls back to a fixed value; Python's cost model still
    # asks the compiler for the target's fingerprint without it).
    cache = tmp_path / "empty-cache"
    extra = {"SCORCH_DENSE_CROSSOVER": "0.3"} if dispatch == "auto" else {}
    out = run_child(bundle, "run", cache, SCORCH_DISPATCH=dispatch, **extra, **NO_COMPILER)
    assert out["loaded"] == len(CASES)
    for case, err in out["err"].items():
        assert err < 1e-4, case
    if dispatch == "sparse":
        assert sorted(out["used"]) == sorted(specs_of_workload())
    assert sorted(out["bundled"]) == sorted(specs_of_workload())
    # Nothing was compiled or cached: the bundle was mapped from memory.
    assert list(cache.iterdir()) == []


def test_missing_kernel_names_its_spec(bundle, tmp_path):
    A, _, x, _ = operands()
    spec64 = sb.plan_einsum("ij,j->i", A.to(torch.float64), x.double())["spec"]
    out = run_child(bundle, "missing", tmp_path / "c1", **NO_COMPILER)
    kind, msg = out["error"]
    assert kind == "RuntimeError" and spec64 in msg and "SCORCH_JIT=0" in msg, msg
    assert "1 bundle loaded, 3 kernels" in msg, msg
    # No bundle at all, JIT off.
    out = run_child("-", "missing", tmp_path / "c2", **NO_COMPILER)
    kind, msg = out["error"]
    assert kind == "RuntimeError" and spec64 in msg and "no kernel bundle is loaded" in msg, msg
    # JIT allowed but the compiler points nowhere: the compiler's failure, with the spec.
    out = run_child(bundle, "missing", tmp_path / "c3", CXX="/nonexistent/c++")
    kind, msg = out["error"]
    assert kind == "RuntimeError" and msg.startswith("scorch: compiling a kernel failed") and spec64 in msg, msg


def test_bad_jit_setting_is_a_value_error(tmp_path):
    out = run_child("-", "missing", tmp_path / "c", SCORCH_JIT="no")
    kind, msg = out["error"]
    assert kind == "ValueError" and "SCORCH_JIT='no'" in msg, msg


def test_bundle_info_describes_without_loading(bundle):
    info = aot.bundle_info(bundle)
    assert info["target"] == sb.target_name()
    assert info["arch"] in ("x86_64", "aarch64")
    assert [k[0] for k in info["kernels"]] == specs_of_workload()
    assert info["file_bytes"] == bundle.stat().st_size
    assert aot.bundled_kernels() == [] or all(p != str(bundle) for _, p in aot.bundled_kernels())


def refusal(path) -> str:
    with pytest.raises(ValueError) as e:
        aot.load_bundle(path)
    return str(e.value)


def test_tampered_bundles_are_refused(bundle, tmp_path):
    good = bundle.read_bytes()
    head, manifest, library = split(good)
    bad = tmp_path / "bad.kernels"

    def case(data: bytes) -> str:
        bad.write_bytes(data)
        msg = refusal(bad)
        assert "kernel bundle" in msg and str(bad) in msg, msg
        return msg

    # One byte of the library, of the manifest, of the header's hash.
    for at in (len(good) - 200, len(good) - len(library) - 5, good.index(b"\n") - 1):
        flipped = bytearray(good)
        flipped[at] ^= 0x04
        assert "damaged" in case(bytes(flipped)) or "garbled" in case(bytes(flipped))
    assert "truncated" in case(good[:-1])
    assert "truncated" in case(good[: len(good) // 2])
    assert "not a Scorch kernel bundle" in case(b"")
    assert "not a Scorch kernel bundle" in case(library)  # the bare shared library
    assert "format version 7" in case(good.replace(b"SCORCH-KERNEL-BUNDLE 1", b"SCORCH-KERNEL-BUNDLE 7", 1))

    # Well formed, but a spec this Scorch generates other code for (a wrong spec under a kernel's hash).
    A, _, x, _ = operands()
    spec = specs_of_workload()[0]
    other = sb.plan_einsum("ij,j->i", A.to(torch.float64), x.double())["spec"]
    msg = case(reseal(manifest.replace(spec.encode(), other.encode(), 1), library))
    assert "different Scorch version or lowering" in msg and other in msg, msg
    # A source hash from another version.
    src_hash = manifest.split(b"\nkernel 0 ")[1][:32]
    msg = case(reseal(manifest.replace(src_hash, b"0" * 32, 1), library))
    assert "different Scorch version or lowering" in msg, msg
    # An instruction-set feature this CPU lacks (as a bundle built for a bigger CPU records it).
    # (a feature of this CPU's own architecture, which the bundle loader checks: on an AVX-512 machine
    # avx512f is present, so a later AVX-512 extension stands in; a name of another architecture is refused
    # differently, as one it cannot check)
    import platform
    candidates = {"x86_64": ("avx512f", "avx512fp16", "avx512vp2intersect"),
                  "aarch64": ("sve", "sve2")}.get(platform.machine(), ())
    lacking = next((f for f in candidates if f not in sb.target_info("native")["features"]), None)
    if lacking:
        msg = case(reseal(manifest.replace(b"\nisa ", f"\nisa {lacking} ".encode(), 1), library))
        assert lacking in msg and "lacks" in msg, msg
    # Nothing was registered by any of these.
    assert all(p != str(bad) for _, p in aot.bundled_kernels())


def test_library_not_matching_its_manifest_is_refused(tmp_path):
    # Two honest bundles; the first's library under the second's manifest passes every check made before
    # loading (the hash is resealed, the manifest's specs are genuine), and is refused by the index table.
    specs = specs_of_workload()
    a, b = tmp_path / "a.kernels", tmp_path / "b.kernels"
    aot.build_bundle(specs[:1], a)
    aot.build_bundle(specs[1:2], b)
    _, _, lib_a = split(a.read_bytes())
    _, manifest_b, _ = split(b.read_bytes())
    mixed = tmp_path / "mixed.kernels"
    mixed.write_bytes(reseal(manifest_b, lib_a))
    out = subprocess.run([sys.executable, "-c", "import sys, scorch_backend.custom_ops.aot as aot\n"
                          "try:\n    aot.load_bundle(sys.argv[1])\nexcept ValueError as e:\n    print('refused:', e)\n",
                          str(mixed)], env=dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path / "c"), SCORCH_JIT="0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "index" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("library", [b"", b"\x7fELF" + b"\0" * 4000, bytes(range(256)) * 80])
def test_a_library_that_does_not_load_is_refused_without_touching_the_cache(tmp_path, library):
    # A forged library with its hash resealed: refused with the loader's reason. It was loaded a second time
    # from a copy written into the cache directory, which SCORCH_JIT=0 promises to leave alone (helper-41).
    a = tmp_path / "a.kernels"
    aot.build_bundle(specs_of_workload()[:1], a)
    _, manifest, _ = split(a.read_bytes())
    forged = tmp_path / "forged.kernels"
    forged.write_bytes(reseal(manifest, library))
    cache = tmp_path / "c"
    out = subprocess.run([sys.executable, "-c", "import sys, scorch_backend.custom_ops.aot as aot\n"
                          "try:\n    aot.load_bundle(sys.argv[1])\nexcept ValueError as e:\n    print('refused:', e)\n",
                          str(forged)], env=dict(os.environ, SCORCH_CACHE_DIR=str(cache), SCORCH_JIT="0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # (refused before loading when its ELF headers say what is wrong, by the loader otherwise)
    assert "refused:" in out.stdout and ("does not load" in out.stdout or "is damaged" in out.stdout), \
        out.stdout + out.stderr
    assert "private copy" not in out.stdout
    assert not any(p.name.startswith("bundle-") for p in cache.rglob("*")), list(cache.rglob("*"))


@pytest.mark.parametrize("keep", ["half", "no section headers", "headers only"])
def test_a_truncated_library_resealed_is_refused_before_loading(bundle, tmp_path, keep):
    # Its hash made to match: dlopen mapped segments past the end of the bytes and the process (or
    # scorch_deploy, or any process listing it in SCORCH_KERNEL_BUNDLES) died of SIGBUS (helper-49).
    _, manifest, library = split(bundle.read_bytes())
    cut = {"half": len(library) // 2, "no section headers": len(library) - 64, "headers only": 512}[keep]
    forged = tmp_path / "forged.kernels"
    forged.write_bytes(reseal(manifest, library[:cut]))
    with pytest.raises(ValueError, match="its library is damaged: its (segment|section headers|program)"):
        aot.bundle_info(forged)  # describes what loading would check, without loading
    cache = tmp_path / "c"
    out = subprocess.run([sys.executable, "-c", "import sys, scorch_backend.custom_ops.aot as aot\n"
                          "try:\n    aot.load_bundle(sys.argv[1])\nexcept ValueError as e:\n    print('refused:', e)\n",
                          str(forged)], env=dict(os.environ, SCORCH_CACHE_DIR=str(cache), SCORCH_JIT="0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "is damaged" in out.stdout, out.stdout + out.stderr


def test_a_bundle_path_with_a_nul_or_a_split_arch_is_refused(bundle, tmp_path):
    # open() stopped at the NUL and loaded the file named by the part before it (helper-49).
    with pytest.raises(ValueError, match="NUL"):
        aot.load_bundle(str(bundle) + "\x00.other")
    _, manifest, library = split(bundle.read_bytes())
    arch = manifest.split(b"\narch ")[1].split(b"\n")[0]
    spaced = tmp_path / "spaced.kernels"
    spaced.write_bytes(reseal(manifest.replace(b"\narch " + arch + b"\n", b"\narch " + arch + b" \n", 1), library))
    with pytest.raises(ValueError, match="arch .* is not one word"):
        aot.bundle_info(spaced)


def test_bundle_for_a_bigger_cpu_is_refused_here(tmp_path):
    if sb.target_info("native")["arch"] != "x86_64":
        pytest.skip("x86-64 targets")
    if "avx512f" in sb.target_info("native")["features"]:
        pytest.skip("this CPU has AVX-512")
    path = tmp_path / "v4.kernels"
    info = aot.build_bundle(specs_of_workload()[:1], path, target="x86-64-v4")
    assert "avx512f" in info["isa"] and info["vector_bytes"] == 64
    msg = refusal(path)
    assert "avx512f" in msg and "x86-64-v4" in msg, msg


def test_load_kernels_is_a_torchscript_op(bundle, tmp_path):
    @torch.jit.script
    def load(path: str) -> int:
        return torch.ops.scorch.load_kernels(path)

    assert "scorch::load_kernels" in str(load.graph)
    copy = tmp_path / "copy.kernels"
    shutil.copy(bundle, copy)
    load.save(str(tmp_path / "load.pt"))
    out = subprocess.run([sys.executable, "-c",
                          "import sys, torch, scorch_backend\n"
                          "f = torch.jit.load(sys.argv[1])\nprint(f(sys.argv[2]))",
                          str(tmp_path / "load.pt"), str(copy)],
                         env=dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path / "c"), **NO_COMPILER),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(CASES))


def test_build_bundle_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="no kernel specs"):
        aot.build_bundle([], tmp_path / "x")
    with pytest.raises(TypeError):
        aot.build_bundle([1], tmp_path / "x")
    with pytest.raises(ValueError):
        aot.build_bundle(["not a spec"], tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_bundle_inside_a_torchscript_archive(bundle, tmp_path):
    # A scripted SpMV whose CSR operand is buffers, saved with the bundle as an extra file, loaded and run
    # by a child with no compiler.
    A, _, x, _ = operands()
    spec = specs_of_workload()[0]

    class SpMV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pos", A.level_buffers["pos1"])
            self.register_buffer("crd", A.level_buffers["crd1"])
            self.register_buffer("vals", A.stored_values)
            self.spec = spec

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            y, _ = torch.ops.scorch.kernel(self.spec, [self.pos, self.crd, self.vals, v], [40, 30], 1)
            return y

    aot.save_model(torch.jit.script(SpMV()), tmp_path / "spmv.pt", bundle)
    torch.save(x, tmp_path / "x.pt")
    code = ("import sys, torch\nfrom scorch_backend import aot\n"
            "m, n = aot.load_model(sys.argv[1])\nprint(n)\n"
            "torch.save(m(torch.load(sys.argv[2])), sys.argv[3])\n")
    env = dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path / "c"), **NO_COMPILER)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spmv.pt"), str(tmp_path / "x.pt"),
                        str(tmp_path / "y.pt")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(len(CASES))
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), A.to_dense() @ x)


def test_load_kernel_bytes_checks_its_tensor(bundle):
    with pytest.raises(TypeError, match="uint8"):
        torch.ops.scorch.load_kernel_bytes(torch.zeros(4), "x")
    with pytest.raises(ValueError, match="1-D"):
        torch.ops.scorch.load_kernel_bytes(torch.zeros(2, 2, dtype=torch.uint8), "x")
    with pytest.raises(ValueError, match="not a Scorch kernel bundle"):
        aot.load_bundle_bytes(b"", "empty")
    data = bytearray(bundle.read_bytes())
    data[-10] ^= 1
    with pytest.raises(ValueError, match="refused: it is damaged"):
        aot.load_bundle_bytes(bytes(data), "in memory")


def test_bundles_listed_in_the_environment_load_at_the_first_miss(bundle, tmp_path):
    out = run_child("-", "run", tmp_path / "c", SCORCH_KERNEL_BUNDLES=f":{bundle}:", **NO_COMPILER)
    assert all(err < 1e-4 for err in out["err"].values())
    assert sorted(out["bundled"]) == sorted(specs_of_workload())
    # A listed bundle that cannot be loaded: its error, naming the variable, at the first kernel needed.
    out = run_child("-", "missing", tmp_path / "c2", SCORCH_KERNEL_BUNDLES=str(tmp_path / "absent.kernels"),
                    **NO_COMPILER)
    kind, msg = out["error"]
    assert kind == "ValueError" and "absent.kernels" in msg and "SCORCH_KERNEL_BUNDLES" in msg, msg


TRAIN = r"""
import json, sys, torch, scorch_backend as sb
from scorch_backend.custom_ops import aot
if sys.argv[1] != "-":
    aot.load_bundle(sys.argv[1])
g = torch.Generator().manual_seed(5)
dense = torch.randn(24, 16, generator=g) * (torch.rand(24, 16, generator=g) < 0.2)
A = sb.sparse(dense, "csr")
v = A.stored_values.detach().clone().requires_grad_()
W = torch.randn(16, 8, generator=g, requires_grad=True)
y = sb.einsum("ij,jk->ik", A.with_values(v), W)
(y * y).sum().backward()
print(json.dumps({"y": y.tolist(), "gv": v.grad.tolist(), "gW": W.grad.tolist(), "used": aot.used_kernel_specs()}))
"""


def test_training_step_with_no_compiler(tmp_path):
    # Collect the kernels of a forward and backward pass (the values' and W's gradients are kernels of their
    # own), bundle them, and run the same step where nothing can be compiled.
    env = dict(os.environ, SCORCH_DISPATCH="sparse", SCORCH_CACHE_DIR=str(tmp_path / "jit-cache"))
    r = subprocess.run([sys.executable, "-c", TRAIN, "-"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(first["used"]) >= 3, first["used"]  # forward + two gradients
    aot.build_bundle(first["used"], tmp_path / "train.kernels")
    env = dict(env, SCORCH_CACHE_DIR=str(tmp_path / "empty"), **NO_COMPILER)
    r = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path / "train.kernels")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    second = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("y", "gv", "gW"):
        torch.testing.assert_close(torch.tensor(second[name]), torch.tensor(first[name]), rtol=1e-6, atol=1e-6)
    assert sorted(second["used"]) == sorted(first["used"])
