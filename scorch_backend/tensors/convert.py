"""Building SparseTensors from dense tensors, torch.sparse layouts and scipy.sparse, and converting back.

All roads go through the C++ format layer: coordinates and values are packed into the target format (which
sorts them and sums duplicates), or buffers are taken over directly where the layouts already agree (torch
CSR/CSC/BSR into the csr/csc/bsr presets) and validated.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .._native import ops
from .format import Format, FormatLike, make_format
from .sparse_tensor import (INDEX_DTYPES, VALUE_DTYPES, SparseTensor, _check_index_dtype,  # noqa: F401
                            _check_values_dtype, _from_dense, refuse_dual, sizes_of, to_format, to_scipy,
                            to_torch)

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def from_coordinates(indices: torch.Tensor, values: torch.Tensor, shape: Sequence[int], format: FormatLike = "coo",
                     *, mode_order=None, blocksize=None, index_dtype=torch.int32) -> SparseTensor:
    """Pack (ndim, nnz) coordinates and their values, in any order, duplicates summed, into `format`."""
    shape = [int(s) for s in sizes_of(shape)]  # symbolic sizes specialize here, as packing needs them
    for s in shape:
        if s < 0:
            raise ValueError(f"sizes must be non-negative, got shape {tuple(shape)}")
    fmt = make_format(format, len(shape), mode_order=mode_order, blocksize=blocksize)
    _check_index_dtype(index_dtype)
    _check_values_dtype(values.dtype)
    buffers, vals = ops.pack(indices, values, shape, fmt.canonical, index_dtype)
    return SparseTensor(fmt, shape, buffers, vals, validate=False)


def _index_buffer(t: torch.Tensor, index_dtype, what: str) -> torch.Tensor:
    """`t` cast to the index dtype, refusing values the cast would wrap (int64 indices past 2^31 into int32).
    While tracing there are no values to read: the check is the eager call's."""
    if index_dtype == torch.int32 and t.dtype != torch.int32 and t.numel() and not torch.compiler.is_compiling():
        lo, hi = (int(v) for v in torch.aminmax(t))  # one pass over the indices
        if lo < -2**31 or hi >= 2**31:
            raise ValueError(f"{what} holds {hi if hi >= 2**31 else lo}, which does not fit in int32; "
                             "use index_dtype=torch.int64")
    return t.to(index_dtype)


def _from_torch_sparse(x: torch.Tensor, fmt: Format, index_dtype) -> SparseTensor:
    _check_values_dtype(x.dtype)
    if x.layout != torch.sparse_coo and x.dim() == 2:
        direct = {torch.sparse_csr: ("csr", x.crow_indices, x.col_indices),
                  torch.sparse_csc: ("csc", x.ccol_indices, x.row_indices)}.get(x.layout)
        if direct is not None and fmt.name == direct[0]:
            pos, crd = direct[1](), direct[2]()
            try:  # the same buffers, when each row's indices are sorted and unique (torch need not have it)
                return SparseTensor(fmt, x.shape, [_index_buffer(pos, index_dtype, "the pointer array"),
                                                   _index_buffer(crd, index_dtype, "the index array")],
                                    x.values().detach())
            except ValueError:
                pass  # re-sorted through COO below, or refused there with what is wrong
        if x.layout == torch.sparse_bsr and fmt.name == "bsr({},{})".format(*x.values().shape[1:3]):
            pos, crd = x.crow_indices(), x.col_indices()
            return SparseTensor(fmt, x.shape, [_index_buffer(pos, index_dtype, "crow_indices"),
                                               _index_buffer(crd, index_dtype, "col_indices")],
                                x.values().detach().reshape(-1))
    if x.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        check_compressed_bounds(x)  # torch's own conversion reads out of bounds on bad indices (a SIGSEGV)
        x = x.to_sparse_coo()  # then coalesced below: unsorted columns in a row are sorted, duplicates summed
    if x.dense_dim() != 0:
        raise ValueError(f"hybrid sparse tensors (dense_dim={x.dense_dim()}) are not supported")
    x = x.coalesce()
    buffers, vals = ops.pack(x.indices(), x.values().detach(), list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def check_compressed_bounds(x: torch.Tensor) -> None:
    """What a compressed torch.sparse tensor (CSR, CSC, BSR, BSC; made with check_invariants=False, say) must
    hold before torch converts it to COO, which reads out of bounds otherwise (a SIGSEGV): pointers that start
    at 0, never decrease and end at the number of stored entries, and indices inside the other dimension.
    Unsorted or repeated indices within a row are allowed (torch's own invariants refuse them; Scorch sorts
    them and sums repeats, as coalesce does). A ValueError names what fails."""
    rowwise = x.layout in (torch.sparse_csr, torch.sparse_bsr)
    compressed, plain = (x.crow_indices(), x.col_indices()) if rowwise else (x.ccol_indices(), x.row_indices())
    name = str(x.layout).replace("torch.", "")
    what = ("crow_indices", "col_indices") if rowwise else ("ccol_indices", "row_indices")
    blocked = x.layout in (torch.sparse_bsr, torch.sparse_bsc)
    batch = compressed.dim() - 1
    block = tuple(x.values().shape[batch + 1:batch + 3]) if blocked else (1, 1)
    outer, inner = (0, 1) if rowwise else (1, 0)
    dims = x.shape[batch:batch + 2]
    n_outer, n_inner = dims[outer] // block[outer], dims[inner] // block[inner]
    nnz = plain.shape[-1]
    if compressed.shape[-1] != n_outer + 1:
        raise ValueError(f"invalid torch {name} tensor: {what[0]} has {compressed.shape[-1]} entries per "
                         f"batch, expected {n_outer + 1}")
    if compressed.numel() and bool((compressed[..., 0] != 0).any()):
        raise ValueError(f"invalid torch {name} tensor: {what[0]} must start at 0")
    if compressed.numel() and bool((compressed[..., -1] != nnz).any()):
        raise ValueError(f"invalid torch {name} tensor: {what[0]} must end at the number of stored entries "
                         f"({nnz})")
    if bool((compressed.diff(dim=-1) < 0).any()):
        raise ValueError(f"invalid torch {name} tensor: {what[0]} decreases")
    if plain.numel() and bool(((plain < 0) | (plain >= n_inner)).any()):
        bad = plain[(plain < 0) | (plain >= n_inner)][0].item()
        raise ValueError(f"invalid torch {name} tensor: {what[1]} holds {bad}, outside 0..{n_inner - 1}")
    if x.values().shape[batch] != nnz:
        raise ValueError(f"invalid torch {name} tensor: {x.values().shape[batch]} values for {nnz} indices")


def _from_scipy(x, fmt: Format, index_dtype) -> SparseTensor:
    values = torch.from_numpy(np.ascontiguousarray(x.data))
    _check_values_dtype(values.dtype)
    kind = x.format
    if kind in ("csr", "csc") and fmt.name == kind and x.has_canonical_format:
        pos = _index_buffer(torch.from_numpy(x.indptr.astype(np.int64)), index_dtype, "indptr")
        crd = _index_buffer(torch.from_numpy(x.indices.astype(np.int64)), index_dtype, "indices")
        return SparseTensor(fmt, x.shape, [pos, crd], values.clone())
    coo = x.tocoo()
    indices = torch.from_numpy(np.stack([coo.row.astype(np.int64), coo.col.astype(np.int64)]))
    values = torch.from_numpy(np.ascontiguousarray(coo.data))
    buffers, vals = ops.pack(indices, values, list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def sparse(x, format: FormatLike = "csr", *, mode_order: Sequence[int] | None = None,
           blocksize: Sequence[int] | None = None, index_dtype: torch.dtype = torch.int32) -> SparseTensor:
    """Make a SparseTensor from a dense tensor, a torch.sparse tensor, a scipy.sparse matrix or another
    SparseTensor.

    `format` is a preset name ("csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr", "dense"), canonical text
    ("dense(0),compressed(1)"), a Format, or a list of level kinds with an optional `mode_order`. "bsr" takes
    `blocksize`; from a torch BSR tensor the block size defaults to the tensor's own.
    """
    _check_index_dtype(index_dtype)
    if isinstance(x, SparseTensor):
        return to_format(x, format, mode_order=mode_order, blocksize=blocksize, index_dtype=index_dtype)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"Scorch runs on the CPU; got a tensor on {x.device}")
        if x.layout == torch.sparse_bsr and format == "bsr" and blocksize is None:
            blocksize = tuple(x.values().shape[1:3])
        fmt = make_format(format, x.dim(), mode_order=mode_order, blocksize=blocksize)
        if x.layout == torch.strided:
            refuse_dual(x)  # its values are read by a kernel: a forward-mode tangent would be dropped
            return _from_dense(x, fmt, index_dtype)
        if x.layout in _SPARSE_LAYOUTS:
            return _from_torch_sparse(x, fmt, index_dtype)
        raise TypeError(f"unsupported layout {x.layout}")
    if hasattr(x, "tocoo") and hasattr(x, "format") and hasattr(x, "shape"):  # scipy.sparse
        fmt = make_format(format, len(x.shape), mode_order=mode_order, blocksize=blocksize)
        return _from_scipy(x, fmt, index_dtype)
    if isinstance(x, np.ndarray):
        return _from_dense(torch.from_numpy(x), make_format(format, x.ndim, mode_order=mode_order,
                                                            blocksize=blocksize), index_dtype)
    raise TypeError(f"cannot make a SparseTensor from {type(x).__name__}")
