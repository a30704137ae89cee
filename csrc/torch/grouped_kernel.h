// The grouped product through the generated kernel (codegen/emit_grouped.h): the forward of grouped_matmul
// when the kernel can take it, the weights streamed under the arithmetic instead of read by each group's
// matrix multiply after the one before.
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// out (entries x n, contiguous) = A[slice q] @ W[q] for every group (rows counts[q] from starts[q]), ReLU'd
// when `relu`, through the generated kernel; false (out untouched) when the kernel does not take it: W stored
// transposed (w_t), a dtype other than float32/float64, A's or W's last dimension not contiguous, a target whose
// vectors make a register tile too small to beat ATen (grouped_kernel.cpp), or no kernel to be had (no JIT and
// no bundle holding it).
bool grouped_product_kernel(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& starts, at::Tensor& out, bool relu);

}  // namespace scorch::torch_glue
