"""What Scorch says about its work: the `scorch` loggers, SCORCH_DEBUG levels, dumps, progress, profiler rows."""

from __future__ import annotations

import io
import logging
import os
import pathlib
import re
import time

import pytest
import torch

import scorch_backend as sb
from scorch_backend.compiler import backend
from scorch_backend import config, log


@pytest.fixture(autouse=True)
def _kernel_path(monkeypatch):
    """The logs checked here are those of regions on small models, which the automatic dispatch leaves dense:
    the kernel path is asked for, whatever the run's SCORCH_DISPATCH."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
from scorch_backend.custom_ops import region as R
from scorch_backend.tools import zoo


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    torch._dynamo.reset()
    root = logging.getLogger("scorch")
    level, handlers, applied = root.level, list(root.handlers), log._applied_level
    monkeypatch.delenv("SCORCH_DEBUG", raising=False)
    monkeypatch.delenv("SCORCH_DUMP_DIR", raising=False)
    yield
    torch._dynamo.reset()
    root.setLevel(level)
    root.handlers[:] = handlers
    log._applied_level = applied


def _compiled_mlp(**options):
    case = zoo.make("pruned_mlp", "test")
    reports = []
    backend._recorders.append(reports)
    return case, model_of(case, options), reports


def model_of(case, options):
    return torch.compile(case.model, backend="scorch", options=options or None)


def _scorch_records(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.name.startswith("scorch") and r.levelno >= level]


def test_logger_hierarchy_and_levels(monkeypatch):
    root = logging.getLogger("scorch")
    for stage in log.STAGES:
        logger = log.get(stage)
        assert logger.name == f"scorch.{stage}"
        parents = []
        p = logger.parent
        while p is not None:
            parents.append(p)
            p = p.parent
        assert root in parents
    assert log.get("passes.partition").parent is log.get("passes")

    root.setLevel(logging.NOTSET)
    for value, level in (("", logging.WARNING), ("0", logging.WARNING), ("1", logging.INFO), ("2", logging.DEBUG),
                         ("0", logging.WARNING)):
        monkeypatch.setenv("SCORCH_DEBUG", value)
        log.sync()
        assert root.level == level, value
    # A level the program chose is kept while SCORCH_DEBUG is unset, and SCORCH_DEBUG wins when set.
    root.setLevel(logging.ERROR)
    monkeypatch.delenv("SCORCH_DEBUG")
    log.sync()
    assert root.level == logging.ERROR
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    log.sync()
    assert root.level == logging.INFO
    monkeypatch.setenv("SCORCH_DEBUG", "yes")
    with pytest.raises(ValueError, match="SCORCH_DEBUG"):
        log.sync()


def test_stderr_handler_unless_the_program_has_one(monkeypatch, capsys):
    root = logging.getLogger("scorch")
    root.handlers[:] = []
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    log.sync()
    log.sync()
    assert len(root.handlers) == 1
    log.get("backend").info("hello\nsecond line")
    log.get("region").warning("careful")
    err = capsys.readouterr().err
    assert "[scorch] hello\n[scorch] second line\n" in err
    assert "[scorch] warning: careful" in err
    mine = logging.StreamHandler(io.StringIO())
    root.addHandler(mine)
    log.sync()
    assert root.handlers == [mine]  # the program's handler replaces ours: no line is written twice
    log.get("kernel").info("once")
    assert mine.stream.getvalue() == "once\n"
    assert "once" not in capsys.readouterr().err


def test_once_logs_a_key_once(caplog, monkeypatch):
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    log.sync()
    logger = log.get("region")
    said = [log.once(logger, ("test_once", 1), "first %d", 1) for _ in range(3)]
    assert said == [True, False, False]
    assert [r.getMessage() for r in caplog.records if r.name == "scorch.region"] == ["first 1"]


def test_debug_1_says_each_decision_once_per_compile_not_per_call(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    case, model, reports = _compiled_mlp(fallback="eager")
    try:
        with torch.no_grad():
            model(*case.inputs)
    finally:
        backend._recorders.remove(reports)
    first = _scorch_records(caplog)
    assert len(reports) == 1 and len(reports[0].regions) == 3
    backend_lines = [r.getMessage() for r in first if r.name == "scorch.backend"]
    assert sum("graph " in m and "3 region(s)" in m for m in backend_lines) == 1
    for name, module in (("region0", "fc1"), ("region1", "fc2"), ("region2", "fc3")):
        lines = [m for m in backend_lines if f"{name} {module} (Linear): linear" in m]
        assert len(lines) == 1, backend_lines
        runs = [r.getMessage() for r in first if r.name == "scorch.region" and r.getMessage().startswith(name + " ")]
        assert len(runs) == 1 and "runs the sparse kernel" in runs[0], runs
    caplog.clear()
    with torch.no_grad():
        for _ in range(3):
            model(*case.inputs)
    again = _scorch_records(caplog)
    assert again == [], [r.getMessage() for r in again]
    # DEBUG (SCORCH_DEBUG=2) does say something per call
    monkeypatch.setenv("SCORCH_DEBUG", "2")
    monkeypatch.setenv("SCORCH_DUMP_DIR", str(tmp_path))
    log.sync()
    with torch.no_grad():
        model(*case.inputs)
    assert sum(r.name == "scorch.region" and r.levelno == logging.DEBUG for r in caplog.records) == 3


def _training_step_with_dumps(tmp_path, monkeypatch):
    """One training step of the compiled pruned MLP under SCORCH_DEBUG=2: the dump folder and the report."""
    dump = tmp_path / "dumps"
    # (the gradient programs' kernels are what these tests look for: under "auto" the cost model may leave them
    # to dense ATen, as a run of the suite under SCORCH_DISPATCH=auto did on a loaded machine; and with a
    # crossover of 0.4, another CPU's, the gradient programs change and no kernel of their own is compiled)
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.7")
    monkeypatch.setenv("SCORCH_DEBUG", "2")
    monkeypatch.setenv("SCORCH_DUMP_DIR", str(dump))
    case, model, reports = _compiled_mlp(fallback="eager")
    try:
        model(*case.inputs).sum().backward()  # training: the gradient regions' kernels too
    finally:
        backend._recorders.remove(reports)
    return dump, reports


def test_debug_2_writes_graph_dumps_per_pass_and_loop_ir(tmp_path, monkeypatch):
    dump, reports = _training_step_with_dumps(tmp_path, monkeypatch)
    graphs = sorted(p for p in dump.iterdir() if p.name.startswith("graph"))
    assert len(graphs) == 1
    files = sorted(p.name for p in graphs[0].iterdir())
    assert files == ["00-input.txt", "01-discover.txt", "02-example_run.txt", "03-propagate.txt",
                     "04-partition.txt", "05-rewrite.txt"]
    for name in files[1:]:
        text = (graphs[0] / name).read_text()
        assert "## graph" in text and "## sparsity attributes" in text, name
        assert re.search(r"l_self_modules_fc1_parameters_weight_ .*density 0\.1", text), name
    # (the linear's bias is an addend of the region since sums are fused: "+ b", kind "add")
    assert "region0 fc1 (Linear): linear: ac,bc->ab + b [dense, sparse, add]" in (graphs[0] / "04-partition.txt").read_text()
    assert "torch.ops.scorch.region.default" in (graphs[0] / "05-rewrite.txt").read_text()
    assert "scorch.region" not in (graphs[0] / "03-propagate.txt").read_text()

    kernels = sorted((dump / "kernels").iterdir())
    assert kernels, "no loop IR written"
    dumped = set()
    for k in kernels:
        text = k.read_text()
        assert "loop IR:" in text and "for (int64_t" in text, k.name
        dumped.add(re.search(r"^spec:\s+(.*)$", text, re.M).group(1))
    assert any("grad" in k.name for k in kernels)
    # The kernels compiled ahead of the first call are the ones the calls then used (the forward's and every
    # gradient program's, col_major ones included): test_every_kernel_a_training_step_uses_is_compiled_ahead.
    assert dumped & set(reports[0].kernels), (dumped, reports[0].kernels)


def _spec_of(path) -> str:
    return re.search(r"^spec:\s+(.*)$", path.read_text(), re.M).group(1)


def test_every_kernel_a_training_step_uses_is_compiled_ahead(tmp_path, monkeypatch):
    dump, reports = _training_step_with_dumps(tmp_path, monkeypatch)
    # (the cost model's probe of a region call's overhead runs a kernel of its own while compiling: not the step's)
    dumped = {_spec_of(k) for k in (dump / "kernels").iterdir() if "cost_model_probe" not in k.name}
    assert any("grad" in k.name for k in (dump / "kernels").iterdir())
    assert dumped and dumped <= set(reports[0].kernels), (dumped, reports[0].kernels)


def test_default_dump_folder_is_per_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = log.dump_dir()
    assert d.parent == pathlib.Path("scorch_dump") and (tmp_path / d).is_dir()
    assert d.name.endswith(f"-{os.getpid()}")
    assert log.dump_dir() == d


def test_dump_dir_variable_is_strict(tmp_path, monkeypatch):
    assert config.dump_dir_override() is None
    monkeypatch.setenv("SCORCH_DUMP_DIR", str(tmp_path / "new"))
    assert config.dump_dir_override() == str(tmp_path / "new")
    f = tmp_path / "a_file"
    f.write_text("")
    monkeypatch.setenv("SCORCH_DUMP_DIR", str(f))
    with pytest.raises(ValueError, match="SCORCH_DUMP_DIR=.*a folder"):
        config.dump_dir_override()


def test_profiler_rows_name_the_region():
    case, model, reports = _compiled_mlp()
    try:
        with torch.no_grad():
            model(*case.inputs)  # compiled outside the profile
    finally:
        backend._recorders.remove(reports)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            model(*case.inputs)
    names = {e.name for e in prof.events()}
    rows = sorted(n for n in names if n.startswith("scorch::region "))
    assert rows == ["scorch::region region0 fc1 (Linear): linear", "scorch::region region1 fc2 (Linear): linear",
                    "scorch::region region2 fc3 (Linear): linear"], sorted(names)


def test_label_travels_in_the_program_text_and_to_gradients():
    prog = R.Program((R.Operand("ik"), R.Operand("ok", "sparse", cached=True)), "io", name="region4",
                     label="block.ff (Linear): linear")
    text = prog.text()
    assert R.parse_program(text).label == "block.ff (Linear): linear"
    assert R.profile_name(text) == "scorch::region region4 block.ff (Linear): linear"
    g, _, _ = R.gradient_program(text, 0)
    assert R.parse_program(g).title == "region4.grad0 block.ff (Linear): linear"
    bare = R.Program((R.Operand("ik"), R.Operand("ok", "sparse")), "io").text()
    assert "label" not in bare and R.parse_program(bare).label == ""


class _Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_only_on_a_terminal_after_a_second():
    out = _Terminal(True)
    p = log.Progress("kernels compiled", 3, started=time.perf_counter() - 2, stream=out)
    for k in range(4):
        p.update(k)
    p.close()
    text = out.getvalue()
    assert "\r[scorch] kernels compiled 0/3" in text and "\r[scorch] kernels compiled 3/3" in text
    assert "\n" not in text and text.endswith(" \r")  # one line, rewritten, then blanked
    quiet = _Terminal(False)
    p = log.Progress("kernels compiled", 3, started=time.perf_counter() - 2, stream=quiet)
    p.update(1)
    p.close()
    assert quiet.getvalue() == ""
    fast = _Terminal(True)
    p = log.Progress("kernels compiled", 3, stream=fast)  # started now: under a second
    p.update(1)
    p.close()
    assert fast.getvalue() == ""


def test_backend_compile_shows_kernel_progress_on_a_terminal(monkeypatch):
    case, model, reports = _compiled_mlp(fallback="eager")
    try:
        with torch.no_grad():
            model(*case.inputs)
    finally:
        backend._recorders.remove(reports)
    regions = reports[0].regions
    term = _Terminal(True)
    monkeypatch.setattr("sys.stderr", term)
    # training=False, as the backend compiled them (under no_grad): with it the regions' gradient kernels (a
    # region that folded a ReLU has some) would be listed too, and reports[0].kernels has the forward ones
    specs = backend.precompile_regions(regions, training=False, started=time.perf_counter() - 5)
    text = term.getvalue()
    # The regions' forward kernels (the layers after a sparse ReLU read it compressed, so not all share one).
    assert specs == reports[0].kernels and len(specs) >= 1
    assert f"[scorch] kernels compiled {len(specs)}/{len(specs)}" in text and text.endswith("\r"), repr(text)


def test_runtime_messages_reach_the_kernel_logger(monkeypatch, caplog):
    # The C++ runtime's line for a kernel it loads goes to `scorch.kernel` through logging, not to stderr.
    monkeypatch.setenv("SCORCH_DEBUG", "1")
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = torch.tensor([[0.0, 2.0, 0.0], [1.5, 0.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64)
    A = sb.sparse(x, "dcsc", index_dtype=torch.int64)  # a spec no other test loads: this process loads it here
    with caplog.at_level(logging.INFO, logger="scorch"):
        out = sb.einsum("ij,ij->", A, A)
    assert torch.allclose(out, (x * x).sum())
    lines = [r for r in caplog.records if r.name == "scorch.kernel" and "index notation:" in r.getMessage()]
    assert lines, [r.getMessage()[:80] for r in caplog.records]
    assert "loop IR:" in lines[0].getMessage() and lines[0].levelno == logging.INFO


_OP_ONLY = """
import torch, scorch_backend
from scorch_backend import _C
spec = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f64; i64"
pos, crd = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
vals, x = torch.tensor([2.0, 3.0], dtype=torch.float64), torch.tensor([1.0, 4.0], dtype=torch.float64)
out = torch.ops.scorch.kernel(spec, [pos, crd, vals, x], [2, 2], 1)[0]
assert out.tolist() == [8.0, 3.0], out
print("ok")
"""


def _run_op_only(tmp_path, **env):
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if k not in ("SCORCH_DUMP_DIR", "SCORCH_DEBUG")}
    full.update(SCORCH_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-c", _OP_ONLY], env=full, capture_output=True, text=True, timeout=300)


def test_debug_1_speaks_in_a_process_that_only_calls_ops(tmp_path):
    """A deployment-style process (no compiled graph, no eager einsum: ops only) still has its runtime's
    messages shown under SCORCH_DEBUG=1, at exit at the latest: the queue configures `scorch` the first time
    it hands any over."""
    r = _run_op_only(tmp_path, SCORCH_DEBUG="1")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert "[scorch]" in r.stderr and "index notation:" in r.stderr, r.stderr[-2000:]
    quiet = _run_op_only(tmp_path / "again", SCORCH_DEBUG="0")
    assert quiet.returncode == 0 and "[scorch]" not in quiet.stderr, quiet.stderr[-2000:]


def test_debug_2_with_an_unwritable_dump_folder_warns_and_runs(tmp_path):
    """Debugging output must not stop a working run: the loop IR dump folder cannot be made (a file is in its
    way), so the kernel still compiles and runs and one warning says why."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    r = _run_op_only(tmp_path, SCORCH_DEBUG="2", SCORCH_DUMP_DIR=str(blocker / "dumps"))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("loop IR dumps are not written") == 1, r.stderr[-2000:]
