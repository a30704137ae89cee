import os
import pathlib

import pytest
import torch

# The tests check the compiled kernels, so the run-time choice of dense ATen code is off unless a test turns
# it back on (test_cost_model.py does) or its module runs under both dispatch modes (below).
os.environ.setdefault("SCORCH_DISPATCH", "sparse")
# Small calls run on one thread by default (SCORCH_THREAD_GRAIN); the tests' inputs are small, so they ask for
# every thread to exercise the parallel code. test_dispatch.py checks the default grain.
os.environ.setdefault("SCORCH_THREAD_GRAIN", "1")

# Modules that set DISPATCH_MODES = ("sparse", "auto") run each of their tests once per mode: "sparse" forces
# the kernels, "auto" is what users get (the cost model picks dense ATen code for small or dense problems), so
# both paths must give the same values and gradients. A test opts out by parametrizing `scorch_dispatch`
# itself (test_fuzz.py runs fewer cases under "auto") or by taking its own `dispatch` argument.


def pytest_generate_tests(metafunc):
    modes = getattr(metafunc.module, "DISPATCH_MODES", None)
    if not modes or "scorch_dispatch" not in metafunc.fixturenames or "dispatch" in metafunc.fixturenames:
        return
    if any("scorch_dispatch" in _argnames(m) for m in metafunc.definition.iter_markers("parametrize")):
        return
    metafunc.parametrize("scorch_dispatch", list(modes), indirect=True)


def _argnames(marker) -> list[str]:
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", "")
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


@pytest.fixture(autouse=True)
def scorch_dispatch(request, monkeypatch):
    """SCORCH_DISPATCH for this test: the parameter when the test is parametrized by it, else unchanged."""
    mode = getattr(request, "param", None)
    if mode is not None:
        monkeypatch.setenv("SCORCH_DISPATCH", mode)
    return mode or os.environ.get("SCORCH_DISPATCH")


@pytest.fixture(autouse=True)
def _threads_kept():
    """A test that changes torch's thread count and does not put it back fails, and the count is put back: the
    tests after it would otherwise run their thread-split paths on one thread without saying so."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        torch.set_num_threads(before)
        pytest.fail(f"the test left torch's thread count at {after} (was {before})")


def pytest_addoption(parser):
    default = os.environ.get("SCORCH_DATA", str(pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
    parser.addoption("--data", default=default, help="folder of real sparse data sets (default ../shared/data)")


@pytest.fixture(scope="session")
def data_dir(request) -> pathlib.Path | None:
    """The real-data folder, or None when it is absent (tests then use generated data)."""
    p = pathlib.Path(request.config.getoption("--data")).resolve()
    return p if p.is_dir() else None


def random_dense(shape, density, dtype=torch.float32, seed=0) -> torch.Tensor:
    """A dense tensor with about `density` of its entries nonzero (values in [0.5, 1.5) with random sign)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < density
    vals = (torch.rand(shape, generator=g) + 0.5) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    return (vals * mask).to(dtype)


def fnv128(data: bytes) -> str:
    """common/hash.h's content_hash (the kernel cache's and bundles' content check), to re-seal files damaged on
    purpose."""
    m = (1 << 64) - 1
    h1, h2 = 1469598103934665603, 7809847782465536322
    for b in data:
        h1 = ((h1 ^ b) * 1099511628211) & m
        h2 = ((h2 ^ b) * 1099511628211 + 0x9E3779B97F4A7C15) & m
    return f"{h1:016x}{h2:016x}"


def pytest_terminal_summary(terminalreporter):
    """The figures the dense/sparse choices of the "auto" tests rest on, measured on this machine, printed at
    the end (where CI's log keeps them): a test that passes here and fails on another CPU is read against them."""
    try:
        from scorch_backend import _C, cost_model
        from scorch_backend.compiler import region_cost

        threads = torch.get_num_threads()
        cal = cost_model.calibration(threads)
        cpu = cost_model._cpu_identity().split("|")[0]
        terminalreporter.write_line(
            f"scorch cost model: {cpu}, target {_C.target_name()}, {threads} threads: crossover density "
            f"{cost_model.crossover_density():.3g} (calibrated {cal['dense_crossover_density']:.3g}), dense rate "
            f"{cost_model.dense_rate(threads) / 1e9:.1f} GFMA/s, region call "
            f"{region_cost.region_overhead_s() * 1e6:.1f} us")
    except Exception as e:  # noqa: BLE001 - a report only
        terminalreporter.write_line(f"scorch cost model: not available ({type(e).__name__}: {e})")
