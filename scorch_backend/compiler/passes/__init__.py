"""The backend's passes, in the order they run: discover -> propagate -> partition -> fuse -> rewrite."""

from .discover import discover, example_run
from .partition import Decision, Region, partition
from .propagate import propagate
from .rewrite import rewrite

__all__ = ["Decision", "Region", "discover", "example_run", "partition", "propagate", "rewrite"]
