"""Benchmarking support shared by benchmarks/, examples/ and the model tests.

    from scorch_backend.bench import measure, Timing   # timing helper (timing.py), also stream_triad and
                                                       # contention_probe
    from scorch_backend.bench import zoo               # dense PyTorch models with sparsity in them (zoo.py)

`zoo` is imported on first use, so timing alone stays light.
"""

from .timing import Timing, contention_probe, measure, stream_triad, stream_triad_gbs

__all__ = ["Timing", "contention_probe", "measure", "stream_triad", "stream_triad_gbs", "zoo"]


def __getattr__(name):
    if name == "zoo":
        import importlib

        return importlib.import_module(".zoo", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
