"""Building SparseTensors from dense tensors, torch.sparse layouts and scipy.sparse, and converting back.

All roads go through the C++ format layer: coordinates and values are packed into the target format (which
sorts them and sums duplicates), or buffers are taken over directly where the layouts already agree (torch
CSR/CSC/BSR into the csr/csc/bsr presets) and validated.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from ._native import ops
from .format import Format, FormatLike, make_format
from .tensor import INDEX_DTYPES, VALUE_DTYPES, SparseTensor

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _check_index_dtype(index_dtype) -> torch.dtype:
    if index_dtype not in INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    return index_dtype


def _check_values_dtype(dtype) -> None:
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"Scorch stores float32, float64, bfloat16 or float16 values, got {dtype}; "
                        "convert the input first (e.g. x.float())")


def from_coordinates(indices: torch.Tensor, values: torch.Tensor, shape: Sequence[int], format: FormatLike = "coo",
                     *, mode_order=None, blocksize=None, index_dtype=torch.int32) -> SparseTensor:
    """Pack (ndim, nnz) coordinates and their values, in any order, duplicates summed, into `format`."""
    shape = [int(s) for s in shape]
    for s in shape:
        if s < 0:
            raise ValueError(f"sizes must be non-negative, got shape {tuple(shape)}")
    fmt = make_format(format, len(shape), mode_order=mode_order, blocksize=blocksize)
    _check_index_dtype(index_dtype)
    _check_values_dtype(values.dtype)
    buffers, vals = ops.pack(indices, values, shape, fmt.canonical, index_dtype)
    return SparseTensor(fmt, shape, buffers, vals, validate=False)


def _from_dense(x: torch.Tensor, fmt: Format, index_dtype) -> SparseTensor:
    _check_values_dtype(x.dtype)
    if fmt.all_dense:  # values are the tensor itself, in the format's mode order
        order = [lv["dim"] for lv in fmt.levels]
        return SparseTensor(fmt, x.shape, [], x.detach().permute(order).reshape(-1).clone(), validate=False)
    if x.dim() == 0:
        raise ValueError("a 0-dimensional tensor can only be stored in the 'dense' format")
    indices = x.nonzero().t()
    values = x.detach()[tuple(indices)] if x.numel() else x.new_empty(0)
    buffers, vals = ops.pack(indices, values, list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def _from_torch_sparse(x: torch.Tensor, fmt: Format, index_dtype) -> SparseTensor:
    _check_values_dtype(x.dtype)
    if x.layout != torch.sparse_coo and x.dim() == 2:
        direct = {torch.sparse_csr: ("csr", x.crow_indices, x.col_indices),
                  torch.sparse_csc: ("csc", x.ccol_indices, x.row_indices)}.get(x.layout)
        if direct is not None and fmt.name == direct[0]:
            pos, crd = direct[1](), direct[2]()
            return SparseTensor(fmt, x.shape, [pos.to(index_dtype), crd.to(index_dtype)], x.values().detach())
        if x.layout == torch.sparse_bsr and fmt.name == "bsr({},{})".format(*x.values().shape[1:3]):
            pos, crd = x.crow_indices(), x.col_indices()
            return SparseTensor(fmt, x.shape, [pos.to(index_dtype), crd.to(index_dtype)],
                                x.values().detach().reshape(-1))
    if x.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        x = x.to_sparse_coo()
    if x.dense_dim() != 0:
        raise ValueError(f"hybrid sparse tensors (dense_dim={x.dense_dim()}) are not supported")
    x = x.coalesce()
    buffers, vals = ops.pack(x.indices(), x.values().detach(), list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def _from_scipy(x, fmt: Format, index_dtype) -> SparseTensor:
    values = torch.from_numpy(np.ascontiguousarray(x.data))
    _check_values_dtype(values.dtype)
    kind = x.format
    if kind in ("csr", "csc") and fmt.name == kind and x.has_canonical_format:
        pos = torch.from_numpy(x.indptr.astype(np.int64)).to(index_dtype)
        crd = torch.from_numpy(x.indices.astype(np.int64)).to(index_dtype)
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


def _coordinates_and_values(x: SparseTensor, drop_padding: bool = True):
    """Coordinates and values of x. Zeros stored only because a dense level pads them are dropped."""
    coords = x.coordinates()
    values = x.stored_values
    if drop_padding and x.format.last_level_dense:
        keep = values != 0
        coords, values = coords[:, keep], values[keep]
    return coords, values


def to_format(x: SparseTensor, format: FormatLike, *, mode_order=None, blocksize=None,
              index_dtype=None) -> SparseTensor:
    """Convert between any two formats (coordinates are re-packed; buffers are shared when nothing changes)."""
    index_dtype = _check_index_dtype(index_dtype or x.index_dtype)
    fmt = make_format(format, x.dim(), mode_order=mode_order, blocksize=blocksize)
    if fmt == x.format and index_dtype == x.index_dtype:
        return x
    if fmt.all_dense:
        return _from_dense(x.to_dense(), fmt, index_dtype)
    coords, values = _coordinates_and_values(x)
    buffers, vals = ops.pack(coords, values, list(x.shape), fmt.canonical, index_dtype)
    return SparseTensor(fmt, x.shape, buffers, vals, validate=False)


def to_torch(x: SparseTensor, layout=torch.sparse_coo, *, blocksize=None) -> torch.Tensor:
    """The same tensor as a torch.sparse tensor (COO, CSR, CSC, BSR) or a dense one (torch.strided)."""
    if layout == torch.strided:
        return x.to_dense()
    if layout == torch.sparse_coo:
        coords, values = _coordinates_and_values(x)
        return torch.sparse_coo_tensor(coords, values, tuple(x.shape), check_invariants=False).coalesce()
    if x.dim() != 2:
        raise ValueError(f"torch layout {layout} needs a 2-D tensor here, got {x.dim()} dimensions")
    if layout in (torch.sparse_csr, torch.sparse_csc):
        name = "csr" if layout == torch.sparse_csr else "csc"
        y = to_format(x, name)
        pos, crd = y.level_buffers["pos1"], y.level_buffers["crd1"]
        make = torch.sparse_csr_tensor if name == "csr" else torch.sparse_csc_tensor
        with warnings.catch_warnings():  # torch's "CSR support is in beta" notice, once per process
            warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
            return make(pos, crd, y.stored_values, tuple(x.shape), check_invariants=False)
    if layout == torch.sparse_bsr:
        blocksize = tuple(blocksize or x.format.blocksize or ())
        if len(blocksize) != 2:
            raise ValueError("converting to torch.sparse_bsr needs blocksize=(rows, cols)")
        y = to_format(x, "bsr", blocksize=blocksize)
        bh, bw = blocksize
        pos, crd = y.level_buffers["pos1"], y.level_buffers["crd1"]
        return torch.sparse_bsr_tensor(pos, crd, y.stored_values.reshape(-1, bh, bw), tuple(x.shape),
                                       check_invariants=False)
    raise ValueError(f"unsupported torch layout {layout}")


def to_scipy(x: SparseTensor):
    """A scipy.sparse array: csr/csc/bsr when x is in that format, else COO."""
    import scipy.sparse as sp

    if x.dim() != 2:
        raise ValueError(f"scipy.sparse holds 2-D arrays, got {x.dim()} dimensions")
    shape = tuple(x.shape)
    values = x.stored_values.detach()
    if values.dtype in (torch.bfloat16, torch.float16):
        values = values.float()
    name = x.format.name
    if name in ("csr", "csc"):
        make = sp.csr_array if name == "csr" else sp.csc_array
        b = x.level_buffers
        return make((values.numpy(), b["crd1"].numpy(), b["pos1"].numpy()), shape=shape)
    if name.startswith("bsr("):
        bh, bw = x.format.blocksize
        b = x.level_buffers
        return sp.bsr_array((values.reshape(-1, bh, bw).numpy(), b["crd1"].numpy(), b["pos1"].numpy()), shape=shape)
    coords, vals = _coordinates_and_values(x)
    if vals.dtype in (torch.bfloat16, torch.float16):
        vals = vals.float()
    return sp.coo_array((vals.numpy(), (coords[0].numpy(), coords[1].numpy())), shape=shape)
