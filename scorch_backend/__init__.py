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

# The package in stages, each importing only from those above it in this list (docs/package.md):
#   config, log, target, _native, cost_model   settings, logging, the machine, the native libraries, the model
#   tensors/      SparseTensor, formats, conversions, the eager einsum and its op table, torch.sparse interop
#   custom_ops/   the Python faces of the C++ ops scorch::kernel, scorch::region, scorch::chain, scorch::masked_attention
#   compiler/     the torch.compile backend, its passes, TorchScript rewriting
#   tools/        explain, plots, pruning, data sets, the timing harness and model zoo
from ._native import ops, ops_library_path
from .target import describe_machine, set_target, target_info, target_name, torch_isa_environment, using_target
from .tensors import rules  # noqa: F401  (the eager op table: ATen ops on SparseTensors as kernels)
from .tensors.convert import from_coordinates, sparse, to_format, to_scipy, to_torch
from .tensors.frontend import compute, einsum, kernel_info, plan_einsum, precompile
from .tensors.format import Format, make_format
from .tensors.interop import convert_module, from_sten, from_torch_sparse
from .tensors.sparse_tensor import SparseTensor
from .custom_ops import aot, chain, fake, region  # noqa: F401  (op faces: fake kernels, hooks, scorch::chain)
from .compiler import backend, jit  # noqa: F401  (registers the torch.compile backend "scorch")
from .compiler.entry import compile  # noqa: A004 - sb.compile, as torch.compile
from .tools.explain import explain
from .tools.sparsify import prune

__all__ = [
    "Format",
    "aot",
    "jit",
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
    "torch_isa_environment",
    "using_target",
]
__version__ = "0.1.0"
