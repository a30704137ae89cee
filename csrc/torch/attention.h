// scorch::masked_attention in C++: softmax(mask ? q k^T * scale : -inf) @ v, computed only where the mask is
// set. The forward pass samples q k^T at the mask's pattern (SDDMM), takes a softmax over each row's stored
// scores and multiplies those probabilities with v (SpMM); the backward pass (scorch::masked_attention_backward,
// an op of its own so that AOTAutograd and torch.export trace it) stays on the pattern as well. Where the mask
// is too dense to pay, the dense formula runs. The mask's pattern is compressed once per version through the
// region op's cache of data inputs (region.h: cached_compressed).
//
// Python is asked for two things only, through hooks the _C module installs: explain's recording of operands
// (only while a recorder is registered) and the log line of the path taken (SCORCH_DEBUG >= 1). A program
// without Python (TorchScript from C++) runs every path.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// The operands' ranks and shapes agree (ValueError naming them otherwise).
void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask);

// "dense" or "sparse": what a call on these operands runs (SCORCH_DISPATCH, then the mask's density against
// the crossover, tiny problems dense).
std::string attention_choose(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask);

// The forward and backward passes below autograd. `force`: "" (choose), "dense" or "sparse".
at::Tensor run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale, const std::string& force = "");
std::vector<at::Tensor> run_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& mask, double scale, const at::Tensor& grad,
                                               const std::string& force = "");

struct AttentionStats {
  int64_t sparse_runs = 0, dense_runs = 0, sparse_backward = 0, dense_backward = 0;
};
AttentionStats attention_stats();

// The specs of the kernels a call on q, k, v of these shapes runs on the sparse path (and its backward pass
// when `training`), found without data, for compiling them ahead of the first call: the same table and
// planner the run path uses. dtype is q's. A ValueError for ranks the op would refuse.
std::vector<std::string> attention_kernel_specs(const std::vector<int64_t>& q_shape,
                                                const std::vector<int64_t>& k_shape,
                                                const std::vector<int64_t>& v_shape, at::ScalarType dtype,
                                                bool training);

struct AttentionHooks {
  std::function<void(double scale, at::TensorList)> capture;  // (q, k, v, mask) while `explain` records
  // The path a forward call takes (called on every call while SCORCH_DEBUG >= 1; Python logs once per mask
  // shape and path), the mask's density, and (q, k, v, mask).
  std::function<void(const std::string& path, double density, at::TensorList)> note_path;
};
void set_attention_hooks(AttentionHooks hooks);
void set_attention_capture(bool on);

}  // namespace scorch::torch_glue
