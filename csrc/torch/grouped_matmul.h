// Grouped matrix products for the grouped runner (grouped.cpp): rows A (entries, k), sorted by group, each
// group's slice multiplied by that group's matrix W[q] (k, n), or W[q]^T when W is stored (groups, n, k).
#pragma once

#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// out (entries, n) with out[slice q] = A[slice q] @ W[q] (w_t: @ W[q]^T); counts[q] rows per group, in order.
// `differentiable`: recorded by autograd as one node whose gradient is grouped products again (dA by group,
// dW only for the groups that have rows, zero for the others), never a per-group einsum.
at::Tensor grouped_matmul(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts,
                          bool differentiable);

// The gradients of grouped_matmul(A, W, w_t, counts) given the output's gradient G (entries, n), contiguous:
// dA = G W[q]^T per group (want_a) and dW[q] = A[q]^T G[q] (w_t: G[q]^T A[q]; zero for a group without rows)
// (want_w); undefined when not wanted.
std::pair<at::Tensor, at::Tensor> grouped_matmul_grads(const at::Tensor& A, const at::Tensor& W, bool w_t,
                                                       const std::vector<int64_t>& counts, const at::Tensor& G,
                                                       bool want_a, bool want_w);

}  // namespace scorch::torch_glue
