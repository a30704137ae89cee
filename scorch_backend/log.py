"""What Scorch says about its work: Python `logging` under the `scorch` logger, dumps and compile progress.

Loggers, one per stage (all children of `scorch`, so one setting covers them):

    scorch.backend            one line per compiled graph, each region taken and each contraction left dense
    scorch.passes.<name>      the passes (discover, propagate, partition, rewrite)
    scorch.region             the run-time path of each region (once per region and path at INFO, per call
                              at DEBUG)
    scorch.kernel             kernels planned for regions (spec and reasons, once per kernel), and from the
                              C++ runtime each kernel compiled or loaded (spec, schedule, loop IR)
    scorch.bundle             kernel bundles loaded (C++ runtime)

SCORCH_DEBUG picks the level of `scorch` (see `sync`): unset or 0 leaves WARNING, 1 is INFO (every decision,
once per compile), 2 is DEBUG and also writes dumps (`dump_dir`): the FX graph and the sparsity attributes
after every backend pass and the loop IR of every kernel a region uses. A level set on `scorch` by the
program itself is kept while SCORCH_DEBUG is unset.

Output: unless the program has put a handler of its own on `scorch`, one handler writes `[scorch] message`
lines to stderr (records also propagate to the root logger, as usual).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import os
import pathlib
import re
import sys
import threading
import time

from . import _C, config

ROOT = "scorch"
STAGES = ("backend", "passes", "passes.discover", "passes.propagate", "passes.partition", "passes.rewrite",
          "region", "kernel")

_lock = threading.Lock()
_applied_level: int | None = None  # the level sync() last put on `scorch` (None: never, or given back)
_dumping = False  # SCORCH_DEBUG >= 2 at the last sync()


def get(stage: str = "") -> logging.Logger:
    """The logger of a stage ("backend", "passes.partition", "region", ...), or `scorch` itself."""
    return logging.getLogger(f"{ROOT}.{stage}" if stage else ROOT)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (pytest and tools swap it)."""

    _scorch_own = True

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ and setStream assign it; the property always wins
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname.lower()}: {msg}"
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return "\n".join(f"[scorch] {line}" for line in msg.split("\n"))


def _level_for(debug: int) -> int:
    return logging.WARNING if debug <= 0 else logging.INFO if debug == 1 else logging.DEBUG


def sync() -> int:
    """Bring the `scorch` logger in line with SCORCH_DEBUG (read now) and return the debug level.

    Called where a compile starts (the backend), so a change of the variable between compiles is seen.
    SCORCH_DEBUG >= 1 sets the level; unset or 0 sets WARNING unless the program chose a
    level of its own. Adds the stderr handler unless a handler of the program's is on `scorch`."""
    debug = _configure()
    drain()
    return debug


def _configure() -> int:
    """sync() without handing over the runtime's queued messages."""
    global _applied_level, _dumping
    debug = config.debug_level()
    _dumping = debug >= 2
    root = get()
    with _lock:
        if debug >= 1:
            want = _level_for(debug)
            if root.level != want:
                root.setLevel(want)
            _applied_level = want
        elif root.level in (logging.NOTSET, _applied_level):
            root.setLevel(logging.WARNING)
            _applied_level = logging.WARNING
        own = [h for h in root.handlers if getattr(h, "_scorch_own", False)]
        theirs = [h for h in root.handlers if not getattr(h, "_scorch_own", False)]
        if theirs:
            for h in own:
                root.removeHandler(h)
        elif not own:
            h = _StderrHandler()
            h.setFormatter(_Format())
            root.addHandler(h)
    return debug


# --- the C++ runtime's messages ------------------------------------------------------------------------------
# The runtime (kernels compiled or loaded, bundles loaded) queues its messages; they are handed to
# `scorch.<name>` here, where Python logs anyway: at each sync, after an eager call that explains itself,
# when the backend has compiled a graph's kernels, at exit. A C++ program without this package gets them on
# stderr instead.
_C.queue_log_messages(True)


def drain() -> None:
    """Log the runtime's queued messages (oldest first) under scorch.<name>. A process that never compiled a
    graph or made an eager call (one that only loads bundles and calls ops) has not configured `scorch` yet:
    it is configured here first, so SCORCH_DEBUG=1 shows those messages too."""
    messages = _C.take_log_messages()
    if messages and _applied_level is None:
        try:
            _configure()
        except ValueError:  # a bad SCORCH_DEBUG: the call that reads it next says so (not an exit handler)
            pass
    for level, name, text in messages:
        get(name).log(level, text)


atexit.register(drain)


_said: set = set()
_SAID_MAX = 20000


def once(logger: logging.Logger, key, msg: str, *args, level: int = logging.INFO) -> bool:
    """Log `msg` the first time `key` is seen (per logger); True when it was logged."""
    if not logger.isEnabledFor(level):
        return False
    k = (logger.name, key)
    with _lock:
        if k in _said:
            return False
        if len(_said) >= _SAID_MAX:  # a bound, not a cache: a long-running process keeps saying new things
            _said.clear()
        _said.add(k)
    logger.log(level, msg, *args)
    return True


# --- dumps (SCORCH_DEBUG >= 2) ----------------------------------------------------------------------------

_session: str | None = None
graph_numbers = itertools.count()  # compiled graphs of this process, numbered for logs and dumps
_dumped_kernels: dict = {}  # (dump folder, spec) -> file written


def dumping() -> bool:
    """Whether SCORCH_DEBUG was 2 or more at the last `sync` (a flag: region calls ask it every time)."""
    return _dumping


def dump_dir() -> pathlib.Path:
    """The dump folder: SCORCH_DUMP_DIR, else ./scorch_dump/<time>-<pid>/ (one per process); created."""
    global _session
    chosen = config.dump_dir_override()
    if chosen is None:
        if _session is None:
            _session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        path = pathlib.Path("scorch_dump") / _session
    else:
        path = pathlib.Path(chosen)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")[:60] or "x"


class GraphDump:
    """Numbered files for one compiled graph: <dump>/graph<N>/<k>-<pass>.txt."""

    def __init__(self):
        self.number = next(graph_numbers)
        self.folder = dump_dir() / f"graph{self.number:03d}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.step = 0

    def write(self, stage: str, text: str) -> pathlib.Path | None:
        path = self.folder / f"{self.step:02d}-{_safe(stage)}.txt"
        self.step += 1
        try:
            path.write_text(text if text.endswith("\n") else text + "\n")
        except OSError as e:  # a dump must not stop the compile
            once(get("backend"), ("dump failed", str(self.folder)), "could not write %s: %s", path, e,
                 level=logging.WARNING)
            return None
        get("backend").debug("graph %d: %s written to %s", self.number, stage, path)
        return path


def dump_kernel(spec: str, info: dict, used_by: str) -> pathlib.Path | None:
    """Write a kernel's loop IR (with its spec, schedule and reasons) once per dump folder and spec."""
    folder = dump_dir() / "kernels"
    key = (str(folder.resolve()), spec)
    with _lock:
        if key in _dumped_kernels:
            return None
        digest = hashlib.sha1(spec.encode()).hexdigest()[:10]
        path = folder / f"{len(_dumped_kernels):03d}-{_safe(used_by)}-{digest}.txt"
        _dumped_kernels[key] = path
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"# kernel used by {used_by}", f"spec:      {spec}", f"statement: {info.get('statement', '')}",
             f"schedule:  {info.get('schedule', '')}", f"target:    {info.get('target', '')}",
             f"source:    {info.get('source_path', '')}", "reasons:"]
    lines += [f"  - {r}" for r in info.get("reasons", [])]
    lines += ["", "loop IR:", str(info.get("loop_ir", ""))]
    path.write_text("\n".join(lines) + "\n")
    get("kernel").debug("loop IR of %s written to %s", spec, path)
    return path


# --- progress on a terminal -------------------------------------------------------------------------------

class Progress:
    """`[scorch] <what> k/n` on one line of a terminal, rewritten in place with \\r and cleared by `close`.

    Shown only when stderr is a TTY and once `delay` seconds have passed since `started` (short compiles
    stay silent)."""

    def __init__(self, what: str, total: int, started: float | None = None, delay: float = 1.0, stream=None):
        self.what = what
        self.total = total
        self.started = time.perf_counter() if started is None else started
        self.delay = delay
        self.stream = stream if stream is not None else sys.stderr
        self.width = 0
        try:
            self.enabled = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.enabled = False

    def update(self, done: int) -> None:
        if not self.enabled or time.perf_counter() - self.started < self.delay:
            return
        text = f"[scorch] {self.what} {done}/{self.total}"
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = max(self.width, len(text))

    def close(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


__all__ = ["ROOT", "STAGES", "get", "sync", "once", "dumping", "dump_dir", "GraphDump", "dump_kernel",
           "Progress"]
