"""Scorch: a sparse tensor compiler for PyTorch.

    import scorch_backend as sb
    A = sb.sparse(dense, format="csr")      # or "csc", "coo", "dcsr", "dcsc", "csf", "bsr", levels...
    A.format, A.nnz, A.density, A.to_dense(), A.to_torch(torch.sparse_csr), A.to_scipy(), A.to_format("coo")
    y = sb.einsum("ij,j->i", A, x)                           # compiled sparse kernels, any sparse/dense mix
    y = sb.compute("y(i) = A(i,j) * x(j) + b(i)", A=A, x=x, b=b)

    sb.prune(model, "magnitude", 0.9)                        # or "threshold", "random", "n:m", "block"
    fast = torch.compile(model, backend="scorch")            # sparse regions run as Scorch kernels
    fast = sb.compile(model)                                 # the same, for models taking torch.sparse tensors
    print(sb.explain(model, x, png="patterns.png"))          # what was compiled and why
"""

from ._native import ops, ops_library_path
from .convert import from_coordinates, sparse, to_format, to_scipy, to_torch
from .frontend import compute, einsum, kernel_info, plan_einsum, precompile
from . import autograd, fake, kernel_rules  # noqa: F401  (autograd, fake kernels, dispatch rules)
from .format import Format, make_format
from .tensor import SparseTensor
from . import region  # noqa: F401  (registers scorch::region)
from . import backend  # noqa: F401  (registers the torch.compile backend "scorch")
from .explain import explain
from .interop import compile, convert_module, from_sten, from_torch_sparse  # noqa: A004 - sb.compile, as torch.compile
from .sparsify import prune
from .target import describe_machine, set_target, target_info, target_name, using_target

__all__ = [
    "Format",
    "SparseTensor",
    "compile",
    "compute",
    "convert_module",
    "from_sten",
    "from_torch_sparse",
    "einsum",
    "explain",
    "prune",
    "kernel_info",
    "plan_einsum",
    "precompile",
    "from_coordinates",
    "make_format",
    "ops",
    "ops_library_path",
    "sparse",
    "to_format",
    "to_scipy",
    "to_torch",
    "describe_machine",
    "set_target",
    "target_info",
    "target_name",
    "using_target",
]
__version__ = "0.1.0"
