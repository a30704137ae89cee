// The grouped product through the generated kernel (codegen/emit_grouped.h): the forward of grouped_matmul
// when the kernel can take it, the weights streamed under the arithmetic instead of read by each group's
// matrix multiply after the one before.
#pragma once

#include <vector>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// out (entries x n, contiguous) = A[slice q] @ W[q] (+ bias[q], when `bias` is defined: (groups, n) or (n) for
// every group, last dimension contiguous) for every group (rows counts[q] from starts[q]), ReLU'd when `relu`,
// through the generated kernel; false (out untouched) when the kernel does not take it: W stored
// transposed (w_t), a dtype other than float32/float64, A's or W's last dimension not contiguous, a target whose
// vectors make a register tile too small to beat ATen (grouped_kernel.cpp), or no kernel to be had (no JIT and
// no bundle holding it).
bool grouped_product_kernel(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& starts, at::Tensor& out, bool relu,
                            const at::Tensor& bias = at::Tensor());

// A dense linear product through the same kernel, as one group: A (m, k) @ B (k, n) (+ bias (n)), ReLU'd when
// `relu`; B is `w` read as (k, n) (its transpose when `w_t`: a Linear's weight, stored (n, k)). The weight is copied
// once into the kernel's panels (each panel of the register tile's columns a contiguous (k, columns) block, so the
// blocks the kernel walks never collide in the cache's sets) and the copy is kept in the region op's operand cache
// while the weight's version and fingerprint stay: a parameter in inference is copied once. Undefined when the
// kernel does not take it (as grouped_product_kernel; also a weight made under inference mode, which has no
// version counter to keep a copy by): the caller runs ATen's product.
at::Tensor linear_product_kernel(const at::Tensor& A, const at::Tensor& w, bool w_t, const at::Tensor& bias,
                                 bool relu);

}  // namespace scorch::torch_glue
