// Grouped matrix products (grouped_matmul.h): forward and gradient, the groups' products spread over threads.
//
// How the threads split: the groups' products are mostly small (the mixture of experts at batch 256: 16-45 rows
// a group), too small to split one product across threads, so each group's product runs single-threaded and the
// groups are shared among the threads, largest first. A group with more than its fair share of the rows (more
// than entries / threads) would leave the other threads idle at the end; those run first, one at a time, each
// split across every thread by ATen's own matrix multiply.
#include "grouped_matmul.h"

#include <algorithm>
#include <atomic>
#include <numeric>

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include "common/error.h"
#include "grouped_kernel.h"
#include "grouped_pool.h"

namespace scorch::torch_glue {
namespace {

// Run `work(q)` for every group with rows: the large ones (see above) one after another with all threads, the
// rest shared among the threads largest first with `work` single-threaded.
template <typename Work>
void for_groups(const std::vector<int64_t>& counts, const Work& work) {
  const int64_t entries = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  const int threads = at::get_num_threads();
  std::vector<int64_t> small;
  for (int64_t q = 0; q < static_cast<int64_t>(counts.size()); ++q) {
    const int64_t n = counts[static_cast<size_t>(q)];
    if (n == 0) continue;
    if (threads > 1 && n * threads > entries) work(q);  // all threads inside the one product
    else small.push_back(q);
  }
  if (small.empty()) return;
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) {
    return counts[static_cast<size_t>(a)] > counts[static_cast<size_t>(b)];
  });
  if (threads <= 1 || small.size() == 1) {
    for (int64_t q : small) work(q);
    return;
  }
  std::atomic<size_t> next{0};
  const at::ThreadLocalState caller;  // InferenceMode and the dispatch keys: OpenMP workers do not inherit them
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {  // inside: ATen's products run single-threaded
    at::ThreadLocalStateGuard tls(caller);
    for (size_t k = next++; k < small.size(); k = next++) work(small[k]);
  });
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> starts(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), starts.begin(), int64_t{0});
  return starts;
}

at::Tensor forward_products(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts) {
  const std::vector<int64_t> starts = starts_of(counts);
  at::Tensor out = at::empty({A.size(0), W.size(w_t ? 1 : 2)}, A.options());
  if (grouped_product_kernel(A, W, w_t, counts, starts, out, /*relu=*/false)) return out;
  for_groups(counts, [&](int64_t q) {
    const size_t u = static_cast<size_t>(q);
    at::Tensor dst = out.narrow(0, starts[u], counts[u]);
    const at::Tensor w = W.select(0, q);
    at::mm_out(dst, A.narrow(0, starts[u], counts[u]), w_t ? w.t() : w);
  });
  return out;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> grouped_matmul_grads(const at::Tensor& A, const at::Tensor& W, bool w_t,
                                                       const std::vector<int64_t>& counts, const at::Tensor& G,
                                                       bool want_a, bool want_w) {
  const std::vector<int64_t> starts = starts_of(counts);
  at::Tensor dA = want_a ? at::empty_like(A, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor dW = want_w ? pooled_empty(W.sizes(), W.options()) : at::Tensor();  // warm pages
  for_groups(counts, [&](int64_t q) {
    const size_t u = static_cast<size_t>(q);
    const at::Tensor a = A.narrow(0, starts[u], counts[u]), g = G.narrow(0, starts[u], counts[u]);
    const at::Tensor w = W.select(0, q);
    if (want_a) {  // dA = G W^T (w_t: G W)
      at::Tensor d = dA.narrow(0, starts[u], counts[u]);
      at::mm_out(d, g, w_t ? w : w.t());
    }
    if (want_w) {  // dW = A^T G (w_t: G^T A)
      at::Tensor d = dW.select(0, q);
      if (w_t) at::mm_out(d, g.t(), a);
      else at::mm_out(d, a.t(), g);
    }
  });
  if (want_w)
    for (size_t q = 0; q < counts.size(); ++q)
      if (counts[q] == 0) dW.select(0, static_cast<int64_t>(q)).zero_();  // a group without rows: no gradient
  return {dA, dW};
}

namespace {

class GroupedMatmul : public torch::autograd::Function<GroupedMatmul> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& A,
                                                const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts) {
    ctx->saved_data["w_t"] = w_t;
    ctx->saved_data["counts"] = counts;
    ctx->save_for_backward({A, W});
    at::NoGradGuard no_grad;
    return {forward_products(A.detach(), W.detach(), w_t, counts)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool w_t = ctx->saved_data["w_t"].toBool();
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const auto saved = ctx->get_saved_variables();
    // First order only (the chain's gradient op is not differentiated again): plain tensors, no recording.
    at::NoGradGuard no_grad;
    const at::Tensor A = saved[0].detach(), W = saved[1].detach();
    torch::autograd::variable_list result(4);
    if (!grads[0].defined()) return result;
    const at::Tensor G = grads[0].detach().contiguous();
    const bool want_a = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    auto [dA, dW] = grouped_matmul_grads(A, W, w_t, counts, G, want_a, want_w);
    result[0] = dA;
    result[1] = dW;
    return result;
  }
};

}  // namespace

at::Tensor grouped_matmul(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts,
                          bool differentiable) {
  SCORCH_CHECK(A.dim() != 2 || W.dim() != 3 || W.size(0) == static_cast<int64_t>(counts.size()),
               "scorch::chain: the gating mask has {} columns (one per expert) and the stacked expert weights {} "
               "experts (shape {})", counts.size(), W.size(0), c10::str(W.sizes()));
  SCORCH_CHECK(A.dim() == 2 && W.dim() == 3 && W.size(0) == static_cast<int64_t>(counts.size()) &&
                   A.size(1) == W.size(w_t ? 2 : 1),
               "scorch::chain: grouped product of shapes {} and {} over {} groups", c10::str(A.sizes()),
               c10::str(W.sizes()), counts.size());
  SCORCH_CHECK(std::all_of(counts.begin(), counts.end(), [](int64_t n) { return n >= 0; }) &&
                   std::accumulate(counts.begin(), counts.end(), int64_t{0}) == A.size(0),
               "scorch::chain: grouped product of {} rows given group counts that do not sum to them", A.size(0));
  if (differentiable && (A.requires_grad() || W.requires_grad()))
    return GroupedMatmul::apply(A, W, w_t, counts)[0];
  return forward_products(A, W, w_t, counts);
}

}  // namespace scorch::torch_glue
