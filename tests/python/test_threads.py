"""Scorch under threads: a weight written in place while other threads' calls read it, and a graph compiled
again while other threads run it (helper-46). Each test races for a second or two; the races it guards against
showed within that time on a 2-core machine (hundreds of bad calls in 15 s, thousands of failed ones in 4 s)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from scorch_backend import _C
from scorch_backend.compiler import redecide


def _race(readers, writer, seconds: float) -> None:
    stop = time.time() + seconds
    threads = [threading.Thread(target=r, args=(stop,)) for r in readers] + [threading.Thread(target=writer,
                                                                                              args=(stop,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("scorch_dispatch", ["sparse", "auto"], indirect=True)
def test_a_weight_pruned_while_calls_compress_it_gives_no_garbage(scorch_dispatch):
    # Counted in one pass and filled in a second, a row written in between left slots uninitialised: "index
    # buffer crd1 holds coordinate -1076831901", or NaN results. Each result must be the old weight's, the
    # new one's or a mix, as a dense product racing with the write reads.
    torch.manual_seed(0)
    text = json.dumps({"operands": [["ac", "dense", False, False, 0, False], ["bc", "sparse", True, False, 0, True]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": "torn_compress_test", "label": "test"})
    full = torch.randn(512, 512)
    full[torch.rand(512, 512) > 0.2] = 0
    w = full.clone()
    x = torch.randn(16, 512)
    bound = (x.abs().sum(1, keepdim=True) * full.abs().max()).expand(16, 512) * 1.001
    failures, calls = [], [0]

    def reader(stop):
        while time.time() < stop:
            try:
                y = torch.ops.scorch.region(text, [x, w])
                if not torch.isfinite(y).all() or (y.abs() > bound).any():
                    failures.append("garbage")
                calls[0] += 1
            except Exception as e:  # noqa: BLE001 - any exception is a failure here
                failures.append(repr(e)[:200])

    def writer(stop):
        g = torch.Generator().manual_seed(1)
        while time.time() < stop:
            with torch.no_grad():
                w.copy_(full)
                w.mul_(torch.rand(512, 512, generator=g) > 0.5)
            time.sleep(0.0005)

    _race([reader, reader], writer, 2.0)
    assert calls[0] > 0 and not failures, (calls[0], failures[:3])


@pytest.mark.parametrize("scorch_dispatch", ["sparse", "auto"], indirect=True)
def test_a_layout_made_while_its_weight_is_written_is_not_kept(scorch_dispatch):
    # A dense weight's transposed copy is made at its first call; a write landing meanwhile was filed under the
    # new version, and every later call used the old weight.
    text = json.dumps({"operands": [["ac", "dense", False, False, 0, False], ["cb", "dense", True, False, 0, True],
                                    ["bc", "pattern", True, False, 0, True]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": "stale_layout_test", "label": "test"})
    torch.manual_seed(0)
    n = 4096
    x, m = torch.randn(4, n), (torch.rand(n, n) < 0.05).float()
    for delay in (0.005, 0.01, 0.02, 0.03, 0.05):
        w = torch.randn(n, n)
        _C.region_clear_cache()

        def write():
            time.sleep(delay)
            with torch.no_grad():
                w.mul_(0.5)

        t = threading.Thread(target=write)
        t.start()
        torch.ops.scorch.region(text, [x, w, m])
        t.join()
        got = torch.ops.scorch.region(text, [x, w, m])
        torch.testing.assert_close(got, x @ (w.t() * m).t(), rtol=1e-4, atol=1e-3)


def test_a_graph_compiled_again_while_other_threads_run_it(monkeypatch):
    # The recompile of a graph whose weight became sparse (redecide.py) ran AOTAutograd's tracer, whose
    # process-wide flag made every compiled call on another thread raise "Detected that you are using FX to
    # symbolically trace a dynamo-optimized function" meanwhile.
    monkeypatch.setattr(redecide, "RECHECK_S", 0.0)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).eval()
    fast = torch.compile(m, backend="scorch")
    x = torch.randn(32, 256)
    with torch.no_grad():
        fast(x)
    failures, calls = [], [0]

    def serve(stop):
        while time.time() < stop:
            try:
                with torch.no_grad():
                    fast(x)
                calls[0] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e)[:200])

    def prune(stop):
        time.sleep(0.2)
        with torch.no_grad():
            m[0].weight.mul_(torch.rand_like(m[0].weight) < 0.05)

    _race([serve, serve], prune, 3.0)
    torch._dynamo.reset()
    assert calls[0] > 0 and not failures, (calls[0], failures[:3])
    with torch.no_grad():
        torch.testing.assert_close(fast(x), m(x), rtol=1e-4, atol=1e-5)


def test_an_eager_call_that_compiles_lets_other_threads_run(tmp_path):
    # The eager entry points held the GIL for the whole call, a kernel's compile included (a quarter of a
    # second, or a wait for another process's compile): every other Python thread stopped (helper-46: a 5 ms
    # heartbeat's longest gap was the compile's 263 ms). A child process with an empty kernel cache times the
    # longest gap of such a heartbeat during a call that compiles.
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import threading, time, torch, scorch_backend as sb
        A = sb.sparse(torch.randn(40, 30) * (torch.rand(40, 30) < 0.2), "csr")
        gaps, stop = [], [False]
        def beat():
            last = time.perf_counter()
            while not stop[0]:
                time.sleep(0.002); now = time.perf_counter(); gaps.append(now - last); last = now
        t = threading.Thread(target=beat); t.start()
        time.sleep(0.05)
        n0 = len(gaps)
        t0 = time.perf_counter()
        sb.einsum("ij,jk->ik", A, torch.randn(30, 7))  # compiles: the cache is empty
        took = time.perf_counter() - t0
        stop[0] = True; t.join()
        print(took, max(gaps[n0:] or [0.0]))
    """)
    env = dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path / "cache"), SCORCH_DISPATCH="sparse")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    took, gap = (float(v) for v in out.stdout.split()[-2:])
    assert took > 0.05, took  # it compiled
    assert gap < took / 4, (took, gap)


def test_a_child_forked_during_a_compile_holds_no_kernel_cache_lock(tmp_path):
    # A child inherits the descriptors of the key locks its parent holds; one that outlived its killed parent
    # kept the key locked, and every later process waited 2 x SCORCH_COMPILE_TIMEOUT + 10 s (helper-46). The
    # child of a fork during a compile lists its open descriptors: none may be a kernel cache lock.
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, sys, threading, time, torch, scorch_backend as sb
        A = torch.randn(64, 48); A[torch.rand(64, 48) > 0.1] = 0
        spec = sb.plan_einsum("ij,jk->ik", sb.sparse(A, format="csc"), torch.randn(48, 13))["spec"]
        th = threading.Thread(target=lambda: sb.precompile([spec])); th.start()
        time.sleep(0.1)  # the compile holds its key's lock now (it takes a quarter of a second or more)
        def locks():
            out = []
            for f in os.listdir("/proc/self/fd"):
                try:
                    target = os.readlink(f"/proc/self/fd/{f}")
                except OSError:
                    continue
                if target.endswith(".lock"):
                    out.append(target)
            return out
        held = locks()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, repr(locks()).encode()); os._exit(0)
        os.waitpid(pid, 0)
        print("parent held", len(held), "child holds", os.read(r, 65536).decode())
        th.join()
    """)
    env = dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("parent held 1 ") and line.endswith("child holds []"), line


def test_a_child_forked_while_its_parent_waits_for_a_key_lock_holds_none(tmp_path):
    # The parent waits for a key another process is compiling; a child forked meanwhile inherited the open lock
    # descriptor, and once the parent took the lock the child shared it (helper-47: after the parent was
    # killed, the key stayed locked). The test process holds the key's lock; the child lists its descriptors.
    import fcntl
    import glob
    import os
    import subprocess
    import sys
    import textwrap

    cache = tmp_path / "cache"
    env = dict(os.environ, SCORCH_CACHE_DIR=str(cache))
    spec_code = textwrap.dedent("""
        import torch, scorch_backend as sb
        A = torch.randn(64, 48); A[torch.rand(64, 48) > 0.1] = 0
        spec = sb.plan_einsum("ij,jk->ik", sb.sparse(A, format="csc"), torch.randn(48, 13))["spec"]
    """)
    subprocess.run([sys.executable, "-c", spec_code + "sb.precompile([spec])"], env=env, check=True, timeout=300)
    manifests = [p for p in glob.glob(f"{cache}/**/*.json", recursive=True) if "calibration" not in p]
    key = max(manifests, key=os.path.getmtime)[:-5]
    for ext in (".so", ".json", ".cpp"):
        if os.path.exists(key + ext):
            os.unlink(key + ext)
    victim = spec_code + textwrap.dedent("""
        import os, threading, time
        threading.Thread(target=lambda: sb.precompile([spec]), daemon=True).start()
        time.sleep(0.5)  # the thread waits for the key's lock now
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            held = []
            for f in os.listdir("/proc/self/fd"):
                try:
                    held.append(os.readlink(f"/proc/self/fd/{f}"))
                except OSError:
                    pass
            os.write(w, repr([h for h in held if h.endswith(".lock")]).encode()); os._exit(0)
        os.waitpid(pid, 0)
        print("child holds", os.read(r, 65536).decode(), flush=True)
        os._exit(0)
    """)
    with open(key + ".lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        out = subprocess.run([sys.executable, "-c", victim], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "child holds []", out.stdout
