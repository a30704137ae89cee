"""The package's environment variables, read in one place and parsed strictly.

Every reader of a SCORCH_* variable in the Python package goes through a function here, so a typo
(`SCORCH_DEBUG=yes`, `SCORCH_DISPATCH=Sparse`, `SCORCH_DENSE_CROSSOVER=abc`) raises a ValueError that names
the variable and the values it accepts, instead of a bare int()/float() error or silently doing the default.
Values are read on every call (tests and users change them at run time); an unset or empty variable means
the default.

    SCORCH_DEBUG            0 (default), 1, 2, ...: how much the compiler and the backend print to stderr
    SCORCH_DISPATCH         auto (default) | sparse | dense: the cost model's choice, or one side forced
    SCORCH_DENSE_CROSSOVER  a number in (0, 1]: overrides the calibrated crossover density
    SCORCH_DATA             a folder of real matrices (default ../shared/data beside the checkout)

SCORCH_CACHE_DIR, SCORCH_TARGET and CXX are read by the C++ runtime.
"""

from __future__ import annotations

import math
import os

DISPATCH_MODES = ("auto", "sparse", "dense")


def _raw(name: str) -> str | None:
    v = os.environ.get(name)
    if v is None:
        return None
    v = v.strip()
    return v or None


def debug_level() -> int:
    """SCORCH_DEBUG as a level: 0 (unset, empty, "0") prints nothing, 1 prints each decision and plan."""
    v = _raw("SCORCH_DEBUG")
    if v is None:
        return 0
    try:
        level = int(v, 10)
    except ValueError:
        level = -1
    if level < 0:
        raise ValueError(f"SCORCH_DEBUG={os.environ['SCORCH_DEBUG']!r}: expected a non-negative integer "
                         "(0 = quiet, 1 = print decisions and plans, 2 = more)")
    return level


def dispatch_mode() -> str:
    """SCORCH_DISPATCH: "auto" (the cost model decides, the default), "sparse" or "dense" (forced)."""
    v = _raw("SCORCH_DISPATCH")
    if v is None:
        return "auto"
    if v not in DISPATCH_MODES:
        raise ValueError(f"SCORCH_DISPATCH={os.environ['SCORCH_DISPATCH']!r}: expected one of "
                         f"{', '.join(DISPATCH_MODES)}")
    return v


def dense_crossover_override() -> float | None:
    """SCORCH_DENSE_CROSSOVER as a density in (0, 1], or None when unset (use the calibrated crossover)."""
    v = _raw("SCORCH_DENSE_CROSSOVER")
    if v is None:
        return None
    try:
        x = float(v)
    except ValueError:
        x = math.nan
    if not (0.0 < x <= 1.0):
        raise ValueError(f"SCORCH_DENSE_CROSSOVER={os.environ['SCORCH_DENSE_CROSSOVER']!r}: expected a density, "
                         "a number greater than 0 and at most 1 (e.g. 0.3)")
    return x


def data_dir_override() -> str | None:
    """SCORCH_DATA: a folder of real matrices, or None when unset."""
    return _raw("SCORCH_DATA")
