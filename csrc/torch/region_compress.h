// Dense tensors made into region operands on every call: their density (one pass), their compression into
// the format a region kernel reads, and a row-major copy of a transposed matrix (blocked, in parallel).
// The run path (region.cpp) calls these for activations and gradients, which change every call.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "executor.h"

namespace scorch::torch_glue {

// The share of nonzero entries. With `row_counts`, each row's count too (int32; the last dimension is a row)
// when the tensor is a contiguous float or double one of rank >= 2, else it is left undefined.
// `relu`: of relu(t) instead (an entry counts unless it is <= 0; a NaN stays, as the ReLU keeps it).
double density_of(const at::Tensor& t, at::Tensor* row_counts = nullptr, bool relu = false);

// CSR (dense outer levels, int32 indices) of a contiguous float or double tensor of rank >= 2 in format `f`,
// built in two passes over its rows (one when `counts` holds each row's nonzeros); nullopt for other tensors.
// `relu`: of relu(src), in the same passes (its entries <= 0 are left out).
std::optional<Operand> compress_rows(const at::Tensor& src, const FormatRef& f, const at::Tensor& counts = {},
                                     bool relu = false);

// A dense tensor compressed into the format a region's kernel reads: CSR for a matrix and up (dense outer
// levels), a compressed vector, or the value of a 0-dimensional tensor; int32 indices. `relu`: relu(src).
Operand compress(const at::Tensor& src, const at::Tensor& counts = {}, bool relu = false);

// `t` as a contiguous tensor of the same shape. A float or double matrix stored transposed (strides (1,
// rows): a region's output in its storage order, a column-order operand's transpose) is copied by blocks,
// in parallel; anything else through Tensor::contiguous.
at::Tensor row_major(const at::Tensor& t);

}  // namespace scorch::torch_glue
