// grouped_product_kernel (grouped_kernel.h): the units of work and the call.
//
// The units: each group with rows is one unit (all of its output columns), run largest first; a group with more
// than its fair share of the rows (more than entries / threads) would keep one thread busy while the others
// idle, so it is cut into one unit per thread by columns, cuts on whole panels of the kernel's register tile.
#include "grouped_kernel.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <string>

#include <fmt/format.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include "codegen/emit_grouped.h"
#include "codegen/kernel_abi.h"
#include "common/error.h"
#include "region.h"
#include "runtime/bundle.h"
#include "runtime/jit.h"
#include "runtime/settings.h"
#include "runtime/target.h"
#include "tensor_version.h"

namespace scorch::torch_glue {
namespace {

// The kernel is taken when its register tile holds at least this many values (rows x vectors x lanes, from the
// target): its weights stream under the arithmetic, but the arithmetic runs at the target's width, where ATen's
// matrix multiply runs at the CPU's. Measured on the 16-expert MoE forward (AVX-512 CPU, 2 threads; ATen's
// products 8.7-8.9 ms): tiles of 384 values (64-byte vectors) 5.6 ms, 96 (32-byte) 5.4 ms, 48 (16-byte, the
// generic target) 10.9 ms, 12 (scalar) 113-164 ms.
constexpr int64_t kMinTileValues = 64;

// Columns of one panel of the register tile of a kernel lowered for `shape`, for values of `elem_bytes`, or 0
// when the tile holds fewer than kMinTileValues values.
int64_t panel_columns(const VectorShape& shape, int64_t elem_bytes) {
  const int64_t lanes = shape.vector_bytes > 0 ? shape.vector_bytes / elem_bytes : 1;
  const GroupedTile t = grouped_tile(shape);
  if (t.rows * t.vectors * lanes < kMinTileValues) return 0;
  return t.vectors * lanes;
}

std::vector<int64_t> make_units(const std::vector<int64_t>& counts, int64_t n, int64_t threads, int64_t panel) {
  const int64_t entries = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<int64_t> order;
  for (int64_t q = 0; q < static_cast<int64_t>(counts.size()); ++q)
    if (counts[static_cast<size_t>(q)] > 0) order.push_back(q);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return counts[static_cast<size_t>(a)] > counts[static_cast<size_t>(b)];
  });
  std::vector<int64_t> units;
  for (int64_t q : order) {
    const bool large = threads > 1 && counts[static_cast<size_t>(q)] * threads > entries;
    const int64_t panels = (n + panel - 1) / panel;
    const int64_t parts = large ? std::min(threads, panels) : 1;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t lo = std::min(n, panels * p / parts * panel), hi = std::min(n, panels * (p + 1) / parts * panel);
      if (hi > lo) units.insert(units.end(), {q, lo, hi});
    }
  }
  return units;
}

// The kernel for values of dtype `dt` and the columns of its register tile's panel, or {null, 0} when the product
// is left to ATen. The tile is the loaded kernel's: a bundle's (its own target, read with no compiler), else this
// process's target, asked before compiling so that a target whose tile is too small never compiles it. Anything
// that fails on the way (no compiler to resolve the target, a failed compile) leaves the product to ATen. A failure
// is remembered (per dtype, for the process): it is not retried, and logged once.
std::pair<std::shared_ptr<const CompiledKernel>, int64_t> usable_kernel(at::ScalarType dt) {
  const std::string spec = std::string(kGroupedProductSpec) + (dt == at::kFloat ? " f32" : " f64");
  if (!kernel_available(spec)) return {nullptr, 0};
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dt));
  static std::atomic<bool> failed[2] = {false, false};
  std::atomic<bool>& gave_up = failed[dt == at::kFloat ? 0 : 1];
  load_bundles_from_environment();  // as get_kernel would first (SCORCH_KERNEL_BUNDLES; once per process)
  std::shared_ptr<const CompiledKernel> kernel = find_bundled_kernel(spec);
  if (!kernel && gave_up.load(std::memory_order_relaxed)) return {nullptr, 0};
  try {
    if (!kernel && panel_columns(current_target().vector_shape(), elem) == 0) return {nullptr, 0};
    if (!kernel) kernel = get_kernel(spec);
  } catch (const std::exception& e) {
    if (!gave_up.exchange(true))
      log_message(30, "grouped", fmt::format("the grouped product kernel is not available ({}); ATen's products run",
                                             e.what()));
    return {nullptr, 0};
  }
  const int64_t panel = panel_columns(kernel->vector_shape, elem);
  return {panel == 0 ? nullptr : kernel, panel};
}

// With no products to sum (K = 0): each group's rows are its bias (or zeros), ReLU'd.
void without_products(at::Tensor& out, const std::vector<int64_t>& counts, const std::vector<int64_t>& starts,
                      bool relu, const at::Tensor& bias) {
  out.zero_();
  if (bias.defined())
    for (size_t q = 0; q < counts.size(); ++q)
      out.narrow(0, starts[q], counts[q]).add_(bias.dim() == 1 ? bias : bias[static_cast<int64_t>(q)]);
  if (relu) out.relu_();
}

// Where the weights are: group q's (K x N) at w + q * wq, rows ldw apart, panels of the tile's columns ps apart.
struct WeightLayout {
  const void* w;
  int64_t groups, K, N, wq, ldw, ps;
};

void call_kernel(const CompiledKernel& kernel, int64_t panel, const at::Tensor& A, const WeightLayout& W,
                 const std::vector<int64_t>& counts, const std::vector<int64_t>& starts, at::Tensor& out, bool relu,
                 const at::Tensor& bias) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<int64_t> units = make_units(counts, W.N, threads, panel);
  const int64_t n_units = static_cast<int64_t>(units.size()) / 3;
  if (n_units == 0) return;
  void* inputs[6] = {A.data_ptr(), const_cast<void*>(W.w), const_cast<int64_t*>(starts.data()),
                     const_cast<int64_t*>(counts.data()), units.data(), bias.defined() ? bias.data_ptr() : nullptr};
  const int64_t sizes[5] = {W.groups, W.K, W.N, n_units, relu ? 1 : 0};
  const int64_t bias_q = bias.defined() && bias.dim() == 2 ? bias.stride(0) : 0;
  const int64_t strides[6] = {A.stride(0), W.wq, W.ldw, out.stride(0), bias_q, W.ps};
  RECORD_FUNCTION("scorch::grouped_product", std::vector<c10::IValue>{});  // seen by the profiler, as aten::mm is
  scorch_kernel_args args{inputs, sizes, strides, out.data_ptr(), 0, nullptr, nullptr, static_cast<int32_t>(threads),
                          0, nullptr};
  const int rc = kernel.fn(&args);
  SCORCH_CHECK(rc == SCORCH_STATUS_OK, "scorch::chain: the grouped product kernel failed (status {})", rc);
}

bool bias_fits(const at::Tensor& bias, at::ScalarType dt, int64_t groups, int64_t n) {
  return !bias.defined() ||
         (bias.scalar_type() == dt && bias.device().is_cpu() && bias.dim() >= 1 && bias.size(-1) == n &&
          (bias.dim() == 1 || (bias.dim() == 2 && bias.size(0) == groups)) && (n <= 1 || bias.stride(-1) == 1));
}

}  // namespace

bool grouped_product_kernel(const at::Tensor& A, const at::Tensor& W, bool w_t, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& starts, at::Tensor& out, bool relu, const at::Tensor& bias) {
  const at::ScalarType dt = A.scalar_type();
  if (w_t || (dt != at::kFloat && dt != at::kDouble) || W.scalar_type() != dt || out.scalar_type() != dt ||
      !A.device().is_cpu() || !W.device().is_cpu() || A.dim() != 2 || W.dim() != 3 || out.dim() != 2 ||
      !out.is_contiguous() || A.size(1) != W.size(1) || out.size(1) != W.size(2) || out.size(0) != A.size(0) ||
      (A.size(1) > 1 && A.stride(1) != 1) || (W.size(2) > 1 && W.stride(2) != 1) ||
      !bias_fits(bias, dt, W.size(0), W.size(2)))
    return false;
  const auto [kernel, panel] = usable_kernel(dt);
  if (!kernel) return false;
  if (A.size(0) == 0 || W.size(2) == 0) return true;
  if (A.size(1) == 0) {
    without_products(out, counts, starts, relu, bias);
    return true;
  }
  const WeightLayout layout{W.data_ptr(), W.size(0), A.size(1), W.size(2), W.stride(0), W.stride(1), panel};
  call_kernel(*kernel, panel, A, layout, counts, starts, out, relu, bias);
  return true;
}

namespace {

// w read as (K, N) (its transpose when w_t) stored panel by panel -- (panels, K, panel columns), the last panel
// padded with zeros -- kept with the weight in the region op's operand cache (version, fingerprint, cleared with
// it); undefined for a weight without a version counter (made under inference mode: copying it at every call
// would cost more than ATen's product).
at::Tensor kept_panels(const at::Tensor& w, bool w_t, int64_t panel) {
  if (version_of(w) < 0) return at::Tensor();
  return cached_derived(w, fmt::format("panels|{}|{}", w_t ? "t" : "n", panel), [&] {
    const at::Tensor kn = w_t ? w.detach().t() : w.detach();
    const int64_t K = kn.size(0), N = kn.size(1), panels = (N + panel - 1) / panel;
    const at::Tensor padded = at::constant_pad_nd(kn, {0, panels * panel - N});
    return padded.reshape({K, panels, panel}).permute({1, 0, 2}).contiguous();
  });
}

}  // namespace

at::Tensor linear_product_kernel(const at::Tensor& A, const at::Tensor& w, bool w_t, const at::Tensor& bias,
                                 bool relu) {
  const at::ScalarType dt = A.scalar_type();
  if ((dt != at::kFloat && dt != at::kDouble) || w.scalar_type() != dt || !A.device().is_cpu() ||
      !w.device().is_cpu() || A.dim() != 2 || w.dim() != 2 || A.size(1) != w.size(w_t ? 1 : 0) ||
      (A.size(1) > 1 && A.stride(1) != 1) || !bias_fits(bias, dt, 1, w.size(w_t ? 0 : 1)) ||
      (bias.defined() && bias.dim() != 1))
    return at::Tensor();
  const auto [kernel, panel] = usable_kernel(dt);
  if (!kernel) return at::Tensor();
  const int64_t M = A.size(0), K = A.size(1), N = w.size(w_t ? 0 : 1);
  at::Tensor out = at::empty({M, N}, A.options());
  if (M == 0 || N == 0) return out;
  const std::vector<int64_t> counts{M}, starts{0};
  if (K == 0) {
    without_products(out, counts, starts, relu, bias);
    return out;
  }
  const at::Tensor panels = kept_panels(w, w_t, panel);
  if (!panels.defined()) return at::Tensor();
  // The kernel shares work by (group, column panels); with fewer panels than threads (a narrow layer on a machine
  // of many cores) the rows are cut into parts as well, each a group of its own reading the same weight (group
  // stride 0), of at least two register tiles of rows each.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads()), n_panels = (N + panel - 1) / panel;
  const int64_t min_rows = 2 * std::max(1, grouped_tile(kernel->vector_shape).rows);
  const int64_t parts = std::max<int64_t>(1, std::min((threads + n_panels - 1) / n_panels, M / min_rows));
  std::vector<int64_t> part_counts, part_starts;
  for (int64_t p = 0; p < parts; ++p) {
    part_starts.push_back(M * p / parts);
    part_counts.push_back(M * (p + 1) / parts - M * p / parts);
  }
  const WeightLayout layout{panels.data_ptr(), parts, K, N, 0, panel, K * panel};
  call_kernel(*kernel, panel, A, layout, part_counts, part_starts, out, relu, bias);
  return out;
}

}  // namespace scorch::torch_glue
