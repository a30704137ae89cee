"""Loads the native pieces: the pybind11 module `_C` and the torch operator library `libscorch_ops`.

Both are installed side by side; `_C.__file__` tells where (in an editable install the Python sources and
the built libraries live in different folders).
"""

import os

import torch

from . import _C

_OPS_LIB = os.path.join(os.path.dirname(_C.__file__), "libscorch_ops.so")
torch.ops.load_library(_OPS_LIB)

ops = torch.ops.scorch


def ops_library_path() -> str:
    """Path of libscorch_ops.so, for C++ programs that run TorchScript models calling Scorch ops."""
    return _OPS_LIB
