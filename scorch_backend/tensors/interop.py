"""torch.sparse in, Scorch out: the entry for models written against torch.sparse.

    fast = scorch_backend.compile(model)            # instead of torch.compile(model, backend="scorch")
    y = fast(x, adj)                                # adj: a torch.sparse COO/CSR/CSC/BSR tensor, unchanged code

torch.compile refuses torch.sparse tensors (Dynamo: "Attempted to wrap sparse Tensor"); a Scorch SparseTensor
is a traceable wrapper subclass and crosses the boundary with its format. So the conversion happens outside
the compiled code, once for what the model holds and once per call for what it is given:

- `convert_module(model)` replaces the model's torch.sparse parameters and buffers by SparseTensors in the
  same format. A parameter keeps its identity (`torch.utils.swap_tensors`), so an optimizer built before
  the conversion still updates it; its gradient is a SparseTensor with the parameter's pattern.
- `from_torch_sparse(t)` converts one tensor; when `t` requires grad (its values come from a computation or
  it is a leaf), the conversion is differentiable: the gradient goes back to `t` as a torch.sparse tensor
  of t's layout and pattern, as torch.sparse.mm would give it.
- `compile(model, ...)` (compiler/entry.py) does both and calls torch.compile(backend="scorch"): sparse arguments (in tuples,
  lists and dicts too) are converted on every call, cached per tensor (identity and version counters) when
  they do not require grad.

SparseTensors converted from CSR, CSC and COO report the torch.sparse layout (`.layout`), and answer
`crow_indices()`, `col_indices()`, `values()`, `indices()` and the like, so the model's code (and PyG's)
takes its sparse path; `torch.sparse.mm`, `torch.sparse.addmm`, `torch.mm`, `torch.matmul`, `@` and
`.to_dense()` on them run Scorch kernels.
"""

from __future__ import annotations

import weakref

import torch

from .. import _C
from .convert import _check_values_dtype, check_compressed_bounds, from_coordinates, sparse
from .format import make_format
from .sparse_tensor import SparseTensor


TORCH_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_INT32_MAX = 2**31 - 1


def is_torch_sparse(x) -> bool:
    """Is x a torch.sparse tensor (any sparse layout; a SparseTensor is not)?"""
    return isinstance(x, torch.Tensor) and not isinstance(x, SparseTensor) and x.layout in TORCH_SPARSE_LAYOUTS


def _format_of(x: torch.Tensor):
    """The Scorch format holding the same storage as torch.sparse tensor x, or a ValueError naming why not."""
    if x.layout == torch.sparse_coo:
        if x.dense_dim() != 0:
            raise ValueError(f"hybrid sparse COO tensors (dense_dim={x.dense_dim()}) are not supported; "
                             "use one sparse dimension per tensor dimension")
        if x.dim() == 0:
            raise ValueError("a 0-dimensional sparse COO tensor cannot become a SparseTensor")
        return make_format("coo", x.dim()), None
    if x.dim() != 2:
        raise ValueError(f"batched or hybrid {x.layout} tensors (shape {tuple(x.shape)}) are not supported; "
                         "only 2-D compressed tensors are")
    if x.layout == torch.sparse_csr:
        return make_format("csr", 2), None
    if x.layout == torch.sparse_csc:
        return make_format("csc", 2), None
    if x.layout == torch.sparse_bsr:
        # Held as CSR (the blocks' zeros stored explicitly): Scorch's "bsr" format does not cross torch.compile
        # yet (a product plans a conversion whose size is data-dependent), and CSR runs the same kernels.
        return make_format("csr", 2), tuple(x.values().shape[1:3])
    raise ValueError(f"{x.layout} tensors are not supported; convert with .to_sparse_bsr(blocksize) or "
                     ".to_sparse_csc()")


def _index_dtype(x: torch.Tensor) -> torch.dtype:
    nnz = x._nnz()
    big = nnz > _INT32_MAX or any(int(s) > _INT32_MAX for s in x.shape)
    return torch.int64 if big else torch.int32


def _convert(x: torch.Tensor) -> SparseTensor:
    """torch.sparse -> SparseTensor in the same format (values shared where the layout allows, detached)."""
    if x.device.type != "cpu":
        raise ValueError(f"Scorch runs on the CPU; got a sparse tensor on {x.device}")
    _check_values_dtype(x.dtype)
    fmt, blocksize = _format_of(x)
    idx = _index_dtype(x)
    x = x.detach()
    if x.layout == torch.sparse_bsr:
        check_compressed_bounds(x)  # torch's conversion reads out of bounds on bad indices
        coo = x.to_sparse_coo().coalesce()  # keeps the zeros stored inside blocks
        return from_coordinates(coo.indices(), coo.values(), x.shape, fmt, index_dtype=idx)
    if x.layout in (torch.sparse_csr, torch.sparse_csc):
        # The same buffers when each row is in order; else re-sorted (repeats summed), bad pointers refused
        # (convert._from_torch_sparse).
        return sparse(x, fmt, index_dtype=idx)
    coo = x.coalesce()
    return from_coordinates(coo.indices(), coo.values(), x.shape, fmt, index_dtype=idx)


def _to_torch_layout(coo: torch.Tensor, layout, blocksize) -> torch.Tensor:
    if layout == torch.sparse_coo:
        return coo
    if layout == torch.sparse_csr:
        return coo.to_sparse_csr()
    if layout == torch.sparse_csc:
        return coo.to_sparse_csc()
    return coo.to_sparse_bsr(blocksize)


class _FromTorchSparse(torch.autograd.Function):
    """torch.sparse tensor -> SparseTensor, differentiable: the gradient of the values comes back to the
    torch.sparse tensor in its own layout and pattern."""

    @staticmethod
    def forward(ctx, x):
        out = _convert(x)
        ctx.pattern = out.detach()
        ctx.layout = x.layout
        ctx.blocksize = tuple(x.values().shape[1:3]) if x.layout == torch.sparse_bsr else None
        ctx.is_coalesced = x.layout != torch.sparse_coo or x.is_coalesced()
        return out

    @staticmethod
    def backward(ctx, grad):
        p = ctx.pattern
        same = (isinstance(grad, SparseTensor) and grad.format == p.format
                and all(a is b for a, b in zip(grad._buffer_list(), p._buffer_list())))
        coords = p.coordinates()
        if same:
            values = grad.stored_values
        else:  # a dense gradient (or another pattern): torch's gradient of a sparse input is taken at its pattern
            dense = grad.to_dense() if isinstance(grad, SparseTensor) else grad
            values = dense[tuple(coords)]
        coo = torch.sparse_coo_tensor(coords, values.to(p.dtype), tuple(p.shape), is_coalesced=True)
        return _to_torch_layout(coo, ctx.layout, ctx.blocksize)


def from_torch_sparse(x: torch.Tensor) -> SparseTensor:
    """A torch.sparse tensor (COO, CSR, CSC, BSR; float values) as a SparseTensor in the same format; COO
    duplicates are summed. Differentiable when x requires grad. Clear errors for what has no Scorch form:
    hybrid or batched tensors, BSC, integer or complex values, tensors off the CPU."""
    if not is_torch_sparse(x):
        raise TypeError(f"expected a torch.sparse tensor, got {type(x).__name__} with layout "
                        f"{getattr(x, 'layout', None)}")
    if x.requires_grad and torch.is_grad_enabled():
        return _FromTorchSparse.apply(x)
    return _convert(x)


# --- the model's own sparse tensors -------------------------------------------------------------------------

def is_sten_tensor(x) -> bool:
    """Is x a STen sparse wrapper (sten.SparseTensorWrapper / SparseParameterWrapper)? Told by its class's
    module, so STen need not be installed."""
    return isinstance(x, torch.Tensor) and type(x).__module__.split(".")[0] == "sten" and \
        hasattr(x, "wrapped_tensor")


def from_sten(x: torch.Tensor) -> SparseTensor:
    """The SparseTensor holding a STen wrapper's data: its CsrTensor / CooTensor (torch.sparse inside) in the
    same format, CscTensor (scipy inside) as "csc", MaskedSparseTensor (dense with zeros) as "csr"."""
    wrapped = x.wrapped_tensor
    kind = type(wrapped).__name__
    data = getattr(wrapped, "data", None)
    if isinstance(data, torch.Tensor) and is_torch_sparse(data):
        return _convert(data)
    if kind == "CscTensor" and hasattr(data, "tocsc"):
        return sparse(data.tocsc(), "csc")
    if kind == "MaskedSparseTensor" and isinstance(data, torch.Tensor) and data.dim() == 2:
        return sparse(data.detach(), "csr")
    raise TypeError(f"STen format {kind} has no Scorch form here (CsrTensor, CooTensor, CscTensor and "
                    "MaskedSparseTensor do); densify it with .wrapped_tensor.to_dense() first")


def convert_module(module: torch.nn.Module) -> list[str]:
    """Replace the torch.sparse parameters and buffers of `module` (and its submodules) by SparseTensors in the
    same format, in place. Parameters keep their identity (optimizers built before still hold them) and
    their requires_grad. STen's sparse weights (sten.SparsityBuilder models) are converted too
    (`from_sten`); those are replaced by new Parameters, so build the optimizer after. Returns the
    qualified names converted."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_module takes an nn.Module, got {type(module).__name__}")
    done: list[str] = []
    buffers: dict[int, SparseTensor] = {}
    for prefix, mod in module.named_modules(remove_duplicate=True):
        for name, p in list(mod._parameters.items()):
            if p is not None and is_sten_tensor(p):
                mod._parameters[name] = torch.nn.Parameter(from_sten(p), requires_grad=p.requires_grad)
                done.append(f"{prefix}.{name}" if prefix else name)
                continue
            if p is None or not is_torch_sparse(p):
                continue
            new = torch.nn.Parameter(_convert(p), requires_grad=p.requires_grad)
            if p.grad is not None:
                new.grad = _convert(p.grad)
            try:
                p.grad = None
                torch.utils.swap_tensors(p, new)
            except RuntimeError as e:  # another reference holds the old one in a way swapping cannot move
                raise RuntimeError(f"cannot convert sparse parameter '{prefix + '.' if prefix else ''}{name}' in "
                                   f"place ({e}); build the model's sparse parameters as SparseTensors "
                                   "(scorch_backend.sparse) instead") from e
            done.append(f"{prefix}.{name}" if prefix else name)
        for name, b in list(mod._buffers.items()):
            if b is None or not is_torch_sparse(b):
                continue
            if id(b) not in buffers:
                buffers[id(b)] = _convert(b)
            mod._buffers[name] = buffers[id(b)]
            done.append(f"{prefix}.{name}" if prefix else name)
    return done


# --- the arguments of each call -----------------------------------------------------------------------------

class _InputCache:
    """Converted arguments by tensor identity, valid while the tensor's members hold the same bytes.

    Version counters cannot tell: a torch.sparse tensor built from index and value tensors shares their storage
    but not their counters, so a write to the value tensor the caller keeps (`w.mul_(10)` after
    `sparse_coo_tensor(i, w)`) left every counter as it was, and the cached conversion gave stale results
    (helper-48). So the members' bytes are hashed on every call (`_C.content_hash`: one read of them, about what
    a kernel reading the matrix once costs); a change makes a new conversion, a new SparseTensor whose own
    version and identity tell the compiled graph's caches that it changed."""

    def __init__(self, size: int = 64):
        self._entries: dict[int, tuple] = {}
        self._size = size

    @staticmethod
    def _state(x: torch.Tensor) -> tuple:
        if x.layout == torch.sparse_coo:
            members = (x._indices(), x._values())
        elif x.layout in (torch.sparse_csr, torch.sparse_bsr):
            members = (x.crow_indices(), x.col_indices(), x.values())
        else:
            members = (x.ccol_indices(), x.row_indices(), x.values())
        return (tuple(x.shape),) + tuple((m.data_ptr(), m.numel(), _C.content_hash(m)) for m in members)

    def get(self, x: torch.Tensor) -> SparseTensor:
        key = id(x)
        versions = self._state(x)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is x and hit[1] == versions:
            return hit[2]
        out = _convert(x)
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (weakref.ref(x, lambda _r, k=key: self._entries.pop(k, None)), versions, out)
        return out


def convert_inputs(args, kwargs, cache: _InputCache | None = None):
    """args and kwargs with every torch.sparse tensor (inside tuples, lists and dicts too) converted."""
    def one(x):
        if not is_torch_sparse(x):
            return x
        if (x.requires_grad and torch.is_grad_enabled()) or cache is None:
            return from_torch_sparse(x)
        return cache.get(x)

    return torch.utils._pytree.tree_map(one, (tuple(args), dict(kwargs)))
