import os
import pathlib

import pytest
import torch

# The tests check the compiled kernels, so the run-time choice of dense ATen code is off unless a test turns
# it back on (test_cost_model.py does).
os.environ.setdefault("SCORCH_DISPATCH", "sparse")


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
