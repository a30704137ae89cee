"""The kernel cache under hostile conditions (issue 10): every case runs in a child process with a cache of its
own, and must end normally (exit status 0, never a signal) with the right answer.

Damaged entries (a truncated library, another kernel's library under a key, a garbled manifest) are rebuilt,
never loaded; a compile killed mid-way leaves temporaries the next build removes; a hung compiler times out
with a clear error and releases the lock; processes racing on an empty cache build each kernel once.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import fnv128

# SpMV on a 3x3 CSR matrix; prints the result and what the kernel cache did, as one JSON line.
CHILD = r"""
import json, sys, torch, scorch_backend as sb
dt = getattr(torch, sys.argv[1])
A = sb.sparse(torch.tensor([[1., 0, 2], [0, 0, 0], [0, 3, 0]], dtype=dt), "csr")
x = torch.tensor([1., 2, 3], dtype=dt)
try:
    y = sb.einsum("ij,j->i", A, x)
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
    sys.exit(0)
info = sb.kernel_info(sb.plan_einsum("ij,j->i", A, x)["spec"])
print(json.dumps({"y": y.tolist(), "compiled": info["compiled"], "library": info["library_path"]}))
"""
EXPECTED = [7.0, 0.0, 6.0]


def child_env(cache: pathlib.Path, **extra: str) -> dict:
    env = dict(os.environ)
    for name in ("SCORCH_DEBUG", "SCORCH_COMPILE_TIMEOUT", "SCORCH_SANITIZE", "CXX"):
        env.pop(name, None)
    env.update(SCORCH_CACHE_DIR=str(cache), SCORCH_DISPATCH="sparse")
    env.update(extra)
    return env


def finish(proc: subprocess.CompletedProcess | subprocess.Popen, out: str, err: str) -> dict:
    assert proc.returncode == 0, (
        f"child ended with {proc.returncode}"
        f"{' (signal ' + signal.Signals(-proc.returncode).name + ')' if proc.returncode < 0 else ''}\n{err[-3000:]}")
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert lines, f"child printed no result\nstdout: {out}\nstderr: {err[-3000:]}"
    result = json.loads(lines[-1])
    result["stderr"] = err
    return result


def run_child(cache: pathlib.Path, dtype: str = "float32", **extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, dtype], env=child_env(cache, **extra), capture_output=True,
                          text=True, timeout=600)
    return finish(proc, proc.stdout, proc.stderr)


def entries(cache: pathlib.Path) -> dict[str, dict]:
    """The cache's manifests by key."""
    return {p.stem: json.loads(p.read_text()) for p in cache.glob("*.json")}


def key_of(result: dict) -> str:
    return pathlib.Path(result["library"]).stem


def leftovers(cache: pathlib.Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp." in p.name or ".load." in p.name)


@pytest.fixture
def built(tmp_path):
    """A cache holding the f32 SpMV kernel, built by a child, and that child's result."""
    cache = tmp_path / "cache"
    first = run_child(cache)
    assert first["y"] == EXPECTED and first["compiled"]
    manifest = entries(cache)[key_of(first)]
    lib = pathlib.Path(first["library"])
    assert manifest["library_bytes"] == lib.stat().st_size
    assert manifest["key"] == key_of(first)
    return cache, first


def test_entry_is_loaded_when_intact(built):
    cache, first = built
    again = run_child(cache)
    assert again["y"] == EXPECTED and not again["compiled"]
    assert leftovers(cache) == []


def test_truncated_library_is_rebuilt(built):
    # Loading this file with dlopen dies of SIGBUS, in every later process, unless it is checked first.
    cache, first = built
    lib = pathlib.Path(first["library"])
    size = lib.stat().st_size
    os.truncate(lib, 4096)
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    assert f"not trusted, rebuilt: its library is 4096 bytes, the manifest records {size}" in again["stderr"]
    assert lib.stat().st_size == size
    assert not run_child(cache)["compiled"]


def make_manifest_match(cache: pathlib.Path, first: dict, size: int) -> None:
    """Rewrites the entry's manifest to record its library as it now is (`size`: the size it records now)."""
    manifest = cache / f"{key_of(first)}.json"
    data = pathlib.Path(first["library"]).read_bytes()
    text = manifest.read_text()
    text = text.replace(f'"library_bytes": {size}', f'"library_bytes": {len(data)}', 1)
    text = text.replace(f'"library_hash": "{entries(cache)[key_of(first)]["library_hash"]}"',
                        f'"library_hash": "{fnv128(data)}"', 1)
    manifest.write_text(text)


@pytest.mark.parametrize("keep", [10000, 64, 0])
def test_a_truncated_library_under_a_manifest_made_to_match_is_rebuilt(built, keep):
    # The size and the hash agree with the bytes, so only the ELF headers can tell: dlopen mapped the segments
    # past the end and the process died of SIGBUS (helper-49), in every later process too.
    cache, first = built
    lib = pathlib.Path(first["library"])
    size = lib.stat().st_size
    os.truncate(lib, keep)
    make_manifest_match(cache, first, size)
    assert entries(cache)[key_of(first)]["library_bytes"] == keep
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    assert "not trusted, rebuilt: its library is damaged" in again["stderr"], again["stderr"][-2000:]
    assert lib.stat().st_size == size
    assert not run_child(cache)["compiled"]


def test_foreign_library_under_a_key_is_rebuilt(built):
    # The f64 kernel's valid library under the f32 kernel's key would compute garbage from f32 buffers.
    cache, first = built
    other = run_child(cache, "float64")
    assert other["y"] == EXPECTED and key_of(other) != key_of(first)
    mine, theirs = pathlib.Path(first["library"]), pathlib.Path(other["library"])
    mine.write_bytes(theirs.read_bytes())
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    # (the size check catches it first when the two libraries' sizes differ, the content hash otherwise)
    assert "content hash differs" in again["stderr"] or "the manifest records" in again["stderr"], again["stderr"]
    # A library of the right size with one byte changed: only the content hash can tell.
    data = bytearray(mine.read_bytes())
    data[len(data) // 2] ^= 0x01
    mine.write_bytes(bytes(data))
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    assert "content hash differs" in again["stderr"], again["stderr"]
    # The other kernel's library with its manifest copied along.
    mine.write_bytes(theirs.read_bytes())
    (cache / f"{key_of(first)}.json").write_bytes((cache / f"{key_of(other)}.json").read_bytes())
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    assert "for another kernel" in again["stderr"]
    assert entries(cache)[key_of(first)]["key"] == key_of(first)


def test_a_library_without_the_entry_points_under_a_manifest_made_to_match_is_rebuilt(built, tmp_path):
    # A sound library that is not a kernel (a CXX wrapper that built something else), its manifest agreeing:
    # it failed "lacks the scorch_kernel entry points" in every later process (helper-55).
    cache, first = built
    src = tmp_path / "other.cpp"
    src.write_text('extern "C" int not_a_kernel() { return 1; }\n')
    other = tmp_path / "other.so"
    subprocess.run([*os.environ.get("CXX", "c++").split(), "-shared", "-fPIC", "-o", str(other), str(src)],
                   check=True, timeout=120)
    lib = pathlib.Path(first["library"])
    size = lib.stat().st_size
    lib.write_bytes(other.read_bytes())
    make_manifest_match(cache, first, size)
    again = run_child(cache, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"], again
    assert "did not load, rebuilt: its library lacks the scorch_kernel entry points" in again["stderr"]
    assert lib.stat().st_size == size
    assert not run_child(cache)["compiled"]
    assert leftovers(cache) == []


@pytest.mark.parametrize("damage", ["garbage", "empty", "half", "missing", "not json"])
def test_garbled_or_missing_manifest_is_rebuilt(built, damage):
    cache, first = built
    manifest = cache / f"{key_of(first)}.json"
    good = manifest.read_text()
    if damage == "missing":
        manifest.unlink()
    else:
        manifest.write_text({"garbage": "\x00\xff garbage", "empty": "", "half": good[: len(good) // 2],
                             "not json": good.replace('"library_hash": "', '"library_hash": "x')}[damage])
    again = run_child(cache)
    assert again["y"] == EXPECTED and again["compiled"]
    assert manifest.read_text() == good


def compiler_script(tmp_path: pathlib.Path, body: str) -> str:
    """A compiler wrapper: target probes and --version go to c++; a compile runs `body`, then c++."""
    script = tmp_path / "cxx.sh"
    script.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -dM|--version) exec c++ "$@";; esac; done\n'
                      f'{body}\nexec c++ "$@"\n')
    script.chmod(0o755)
    return str(script)


def test_killed_compile_leaves_orphans_that_are_removed(tmp_path):
    # A real killed compile: the compiler writes a partial library under its temporary name and hangs; the
    # process that started it is killed. The next process (same compiler command: same key) cleans up.
    cache, hang, pids = tmp_path / "cache", tmp_path / "hang", tmp_path / "pids"
    hang.touch()
    cxx = compiler_script(tmp_path, f'if [ -e "{hang}" ]; then\n  echo $$ >> "{pids}"\n'
                                    '  while [ "$1" != "-o" ]; do shift; done; echo partial > "$2"; exec sleep 60\nfi')
    env = child_env(cache, CXX=cxx)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "float32"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(cache.glob("*.so.tmp.*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert list(cache.glob("*.so.tmp.*")), "the compile never started"
    finally:
        proc.kill()
        proc.wait()
        for pid in pids.read_text().split() if pids.exists() else []:
            try:
                os.killpg(int(pid), signal.SIGKILL)  # the compiler has a process group of its own
            except ProcessLookupError:
                pass
    orphans = leftovers(cache)
    assert any(f".so.tmp.{proc.pid}.so" in name for name in orphans), orphans
    hang.unlink()
    again = run_child(cache, CXX=cxx, SCORCH_DEBUG="1")
    assert again["y"] == EXPECTED and again["compiled"]
    assert f"removed orphan {key_of(again)}.so.tmp.{proc.pid}.so" in again["stderr"]
    assert leftovers(cache) == []


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiler dies with its parent on Linux")
def test_compiler_dies_with_the_process_that_started_it(tmp_path):
    # A compiler whose process was killed ran on unbounded (the timeout is the parent's to enforce) and wrote its
    # library's temporary into the cache after the kill, where nothing removed it once the entry was built
    # (helper-51). The compiler now gets SIGKILL when its parent dies (here it would sleep for a minute).
    cache, pids = tmp_path / "cache", tmp_path / "pids"
    cxx = compiler_script(tmp_path, f'echo $$ >> "{pids}"\nexec sleep 60')
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "float32"], env=child_env(cache, CXX=cxx),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert pids.exists(), "the compile never started"
        compiler = int(pids.read_text().split()[0])
        assert _alive(compiler)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while _alive(compiler) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not _alive(compiler), "the compiler outlived the process that started it"
    finally:
        if _alive(compiler):
            os.killpg(compiler, signal.SIGKILL)


def test_compile_timeout_is_a_clear_error_and_releases_the_lock(tmp_path):
    cache, hang = tmp_path / "cache", tmp_path / "hang"
    hang.touch()
    cxx = compiler_script(tmp_path, f'if [ -e "{hang}" ]; then sleep 60; fi')
    failed = run_child(cache, CXX=cxx, SCORCH_COMPILE_TIMEOUT="1")
    assert failed["error"] == "RuntimeError", failed
    assert "timed out after 1 s" in failed["message"] and "SCORCH_COMPILE_TIMEOUT" in failed["message"]
    assert leftovers(cache) == []
    # Same compiler command, so the same key and lock: a waiting process would get it.
    hang.unlink()
    again = run_child(cache, CXX=cxx, SCORCH_COMPILE_TIMEOUT="1000")
    assert again["y"] == EXPECTED and again["compiled"]


@pytest.mark.parametrize("name,value", [("SCORCH_COMPILE_TIMEOUT", "abc"), ("SCORCH_COMPILE_TIMEOUT", "-1"),
                                        ("SCORCH_SANITIZE", "yes")])
def test_bad_environment_is_a_clear_error(tmp_path, name, value):
    failed = run_child(tmp_path / "cache", **{name: value})
    assert failed["error"] == "ValueError", failed
    assert f"{name}='{value}'" in failed["message"]


def test_a_cache_that_cannot_be_a_directory_says_why(tmp_path):
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    failed = run_child(in_the_way)
    assert failed["error"] == "ValueError", failed
    assert "it exists and is not a directory" in failed["message"], failed
    below = run_child(in_the_way / "cache")
    assert below["error"] == "ValueError" and "Not a directory" in below["message"], below
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "gone")  # was "(reason unknown)": mkdir saw EEXIST, stat saw nothing
    failed = run_child(dangling)
    assert failed["error"] == "ValueError" and "symbolic link to" in failed["message"], failed
    assert "which does not exist" in failed["message"], failed


def test_a_bad_target_names_the_variable(tmp_path):
    failed = run_child(tmp_path / "cache", SCORCH_TARGET="-1")
    assert failed["error"] == "ValueError" and "SCORCH_TARGET" in failed["message"], failed


def test_a_blank_cache_variable_is_unset(tmp_path):
    """SCORCH_CACHE_DIR=" " means the default cache (as blanks mean unset for every variable), not a folder
    named " " in the working directory."""
    env = child_env(tmp_path / "unused", SCORCH_CACHE_DIR=" ", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    proc = subprocess.run([sys.executable, "-c", CHILD, "float32"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    result = finish(proc, proc.stdout, proc.stderr)
    assert result["y"] == EXPECTED
    assert not (tmp_path / " ").exists() and (tmp_path / "xdg" / "scorch").is_dir()


def test_sanitized_kernels_in_a_plain_process_are_an_error_not_an_abort(tmp_path):
    # Loading an ASan kernel into a process without the ASan runtime aborts inside dlopen; it must not be tried.
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this process runs under AddressSanitizer")
    failed = run_child(tmp_path / "cache", SCORCH_SANITIZE="1")
    assert failed["error"] == "ValueError", failed
    assert "LD_PRELOAD" in failed["message"]


def test_processes_racing_on_an_empty_cache_build_once(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, "float32"], env=child_env(cache),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append(finish(p, out, err))
    assert all(r["y"] == EXPECTED for r in results)
    assert sum(r["compiled"] for r in results) == 1, [r["compiled"] for r in results]
    assert len({key_of(r) for r in results}) == 1
    assert len(list(cache.glob("*.so"))) == len(entries(cache)) == 1
    assert leftovers(cache) == []


def test_a_private_copy_left_by_an_earlier_process_with_our_pid_is_replaced(built):
    # A process killed between creating KEY.load.PID.N.so and unlinking it leaves it behind; a later process
    # with the same PID (containers reuse them) must not fail on it.
    cache, first = built
    plant = (f"import os\nfor n in range(4):\n    open({str(cache / key_of(first))!r} + f'.load.{{os.getpid()}}.{{n}}.so', "
             "'wb').write(b'junk')\n")
    proc = subprocess.run([sys.executable, "-c", plant + CHILD, "float32"], env=child_env(cache), capture_output=True,
                          text=True, timeout=600)
    again = finish(proc, proc.stdout, proc.stderr)
    assert again["y"] == EXPECTED and not again["compiled"], again


def test_a_lock_held_too_long_is_a_clear_error_not_a_hang(built):
    # The entry is damaged, so the child must take KEY.lock to rebuild it; this process holds that lock (as a
    # process stopped with Ctrl-Z mid-compile would). The wait ends after 2 x timeout + 10 s.
    cache, first = built
    pathlib.Path(first["library"]).write_bytes(b"")
    with open(cache / (key_of(first) + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = time.monotonic()
        failed = run_child(cache, SCORCH_COMPILE_TIMEOUT="1")
        waited = time.monotonic() - start
    assert failed.get("error") == "RuntimeError", failed
    assert "held the kernel cache lock" in failed["message"] and "stopped or hung" in failed["message"]
    assert 11 <= waited < 120, waited
    again = run_child(cache)  # the lock is free again: the entry is rebuilt
    assert again["y"] == EXPECTED and again["compiled"]


@pytest.mark.parametrize("ext", [".so", ".json"])
def test_a_directory_where_an_entry_belongs_is_named(built, ext):
    cache, first = built
    for e in (".so", ".json"):
        (cache / (key_of(first) + e)).unlink()
    (cache / (key_of(first) + ext)).mkdir()
    failed = run_child(cache)
    assert failed.get("error") == "RuntimeError", failed
    assert "a directory is in the way: remove it" in failed["message"], failed["message"]
    assert leftovers(cache) == []


@pytest.mark.parametrize("what", ["directory", "dangling link", "link to /dev/null"])
def test_something_in_the_way_of_the_lock_is_named(built, what):
    # The lock was opened through symbolic links: one to /dev/null was taken as the lock, a dangling one gave
    # "No such file or directory", and a directory got no hint (the entries' own files had them).
    cache, first = built
    pathlib.Path(first["library"]).write_bytes(b"")  # damaged: the child must take the lock to rebuild
    lock = cache / (key_of(first) + ".lock")
    lock.unlink(missing_ok=True)
    if what == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(cache / "gone" if what == "dangling link" else "/dev/null")
    failed = run_child(cache)
    assert failed.get("error") == "RuntimeError", failed
    way = "a directory" if what == "directory" else "a symbolic link"
    assert f"{way} is in the way: remove it" in failed["message"], failed["message"]


def test_a_read_only_cache_still_loads_its_verified_entries(built):
    # A prebuilt cache shipped on a read-only file system: the private copy each load makes goes to TMPDIR.
    cache, first = built
    r = subprocess.run(["mount", "-o", "bind,ro", str(cache), str(cache)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.strip()[:200]}")
    try:
        with pytest.raises(OSError):
            (cache / "probe").write_text("x")  # it really is read-only
        again = run_child(cache)
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)
    assert again.get("y") == EXPECTED and not again["compiled"], again


# --- a compiler's odd behaviour (helper-55)
def test_compiler_output_that_is_not_utf8_keeps_its_error(tmp_path):
    # A compiler failing with bytes that are not UTF-8 (another locale; output cut inside a character): the
    # error was a UnicodeDecodeError and the compiler's message was lost.
    cxx = compiler_script(tmp_path, "printf 'broken \\377\\376 here\\n' >&2\nexit 1")
    failed = run_child(tmp_path / "cache", CXX=cxx)
    assert failed["error"] == "RuntimeError", failed
    assert "broken \ufffd\ufffd here" in failed["message"]


def test_a_process_the_compiler_leaves_holding_its_output_does_not_hold_the_compile(tmp_path):
    # A compiler cache's server keeps the pipe the compiler inherited: the compile lasted as long as that
    # process, or failed as timed out after it had succeeded.
    cxx = compiler_script(tmp_path, "(sleep 30 &)")
    start = time.monotonic()
    result = run_child(tmp_path / "cache", CXX=cxx, SCORCH_COMPILE_TIMEOUT="20")
    assert result["y"] == EXPECTED and result["compiled"], result
    assert time.monotonic() - start < 20


def test_a_compiler_hanging_on_the_target_probe_times_out_as_told(tmp_path):
    script = tmp_path / "cxx.sh"
    script.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -dM) exec sleep 60;; esac; done\nexec c++ "$@"\n')
    script.chmod(0o755)
    start = time.monotonic()
    failed = run_child(tmp_path / "cache", CXX=str(script), SCORCH_COMPILE_TIMEOUT="2")
    assert time.monotonic() - start < 30
    assert failed["error"] == "RuntimeError", failed
    assert "timed out after 2 s" in failed["message"] and "SCORCH_COMPILE_TIMEOUT" in failed["message"]


def test_a_relative_cache_directory_is_not_taken_for_an_option(tmp_path):
    # The kernel's source, named under the cache directory, is the compiler's last argument: "-x" was an option.
    env = child_env(pathlib.Path("-x"))
    proc = subprocess.run([sys.executable, "-c", CHILD, "float32"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    result = finish(proc, proc.stdout, proc.stderr)
    assert result["y"] == EXPECTED and result["compiled"], result
    assert pathlib.Path(result["library"]).is_absolute() and (tmp_path / "-x").is_dir()


# A process waiting on a compile is told of Ctrl-C: the loops run without the GIL, and Python's handler for
# SIGINT ran only when a compile (up to 300 s) or the wait for another process's lock (up to 610 s) ended
# (helper-61).
INTERRUPTED_CHILD = r"""
import time, torch, scorch_backend as sb
A = sb.sparse(torch.tensor([[1., 0, 2], [0, 0, 0], [0, 3, 0]]), "csr")
x = torch.tensor([1., 2, 3])
print("ready", flush=True)
try:
    sb.einsum("ij,j->i", A, x)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def interrupt_child(cache: pathlib.Path, **extra: str) -> str:
    """Starts INTERRUPTED_CHILD, sends SIGINT 1.5 s after it is ready, and returns what it printed."""
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CHILD], env=child_env(cache, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return out


def test_ctrl_c_stops_a_long_compile(tmp_path):
    cache = tmp_path / "cache"
    started = time.monotonic()
    out = interrupt_child(cache, CXX=compiler_script(tmp_path, "sleep 120"))
    assert out.split() == ["interrupted"], out
    assert time.monotonic() - started < 60
    assert leftovers(cache) == [] and not list(cache.glob("*.so"))
    assert run_child(cache)["y"] == EXPECTED  # the next process builds the kernel


def test_ctrl_c_stops_a_wait_for_another_process_s_lock(built):
    cache, first = built
    pathlib.Path(first["library"]).write_bytes(b"")  # damaged: the child must take the lock to rebuild it
    with open(cache / (key_of(first) + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = interrupt_child(cache)  # (the default timeout: the wait would end after 610 s)
    assert out.split() == ["interrupted"], out
    assert run_child(cache)["y"] == EXPECTED


def test_a_timed_out_compile_leaves_no_compiler_temporaries(tmp_path):
    # The compiler is sent SIGTERM before SIGKILL: a driver killed outright left its .s and .o files in TMPDIR.
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    failed = run_child(cache, SCORCH_COMPILE_TIMEOUT="0.2", TMPDIR=str(tmp))
    assert failed.get("error") == "RuntimeError" and "timed out" in failed["message"], failed
    assert [p.name for p in tmp.iterdir() if p.name.startswith("cc")] == []


def test_a_thread_waiting_for_the_kernel_the_main_thread_compiles_does_not_deadlock(tmp_path):
    # While the main thread compiles (holding the key's lock) it takes the GIL every 50-100 ms to run Python's
    # signal handlers; a thread that waited for that lock holding the GIL (kernel_info did not release it) would
    # have deadlocked the two.
    code = r"""
import threading, time, torch, scorch_backend as sb
A = sb.sparse(torch.tensor([[1., 0, 2], [0, 0, 0], [0, 3, 0]]), "csr")
x = torch.tensor([1., 2, 3])
spec = sb.plan_einsum("ij,j->i", A, x)["spec"]
seen = {}
def other():
    time.sleep(1.0)  # (the main thread is compiling by then)
    seen["info"] = sb.kernel_info(spec)["spec"] == spec
t = threading.Thread(target=other)
t.start()
y = sb.einsum("ij,j->i", A, x)
t.join()
print("done", y.tolist(), seen["info"])
"""
    env = child_env(tmp_path / "cache", CXX=compiler_script(tmp_path, "sleep 4"))
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the two threads did not finish in 120 s (a 4 s compile): deadlocked")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "done [7.0, 0.0, 6.0] True", proc.stdout
