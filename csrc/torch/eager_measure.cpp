// Eager decisions corrected by measurement (eager_measure.h).
//
// The density rule compares the sparse operands' combined density with a crossover measured for a CSR SpMM.
// That is an estimate, and a poor one where the format's kernel runs at another rate than CSR's (n:m and
// blocked formats keep dense register blocks; a 2:4 operand at 50% density runs its native kernel about 10x
// faster than densifying it on every call and multiplying dense), where the call's shape is unlike the
// calibration's, or where the result is sparse (SpGEMM assembles its rows). So, as the region op does, the
// first eager call in a bucket (the equation and its operands' formats, each index's size by power of two,
// each sparse operand's density by a third of an octave, the dtype, the thread count and the target) whose
// combined density is within a factor of kMeasureWindow of the crossover times the kernel and the dense path on
// its real operands (one warm-up each, then the best of three, interleaved) and keeps the faster for the
// bucket. Only where the dense path is cheap to try: every operand and the result densified stay under
// kMeasureMaxElements, and the dense product (the product of all index sizes) under kMeasureMaxFlops.
#include "eager_measure.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <fmt/format.h>

#include <map>

#include "common/saturating.h"
#include "measured_choice.h"

namespace scorch::torch_glue {
namespace {

constexpr double kMeasureWindow = 3.0;
// Below the crossover, a call with a sparse result and a summed index (SpGEMM) is measured from a much lower
// combined density: the rule's product of densities says nothing of how full its result comes out, and the
// kernel assembles every entry of it. At 1000^3 and density 0.3 each (0.09 combined, out of the window above)
// the rule kept the kernel at 39 ms where the dense product and its compression took 22 (helper-75).
constexpr double kSparseResultWindow = 40.0;
constexpr int64_t kMeasureMaxElements = int64_t{1} << 25;
constexpr double kMeasureMaxFlops = 4.0e9;

MeasuredChoices& eager_decisions() {
  static MeasuredChoices t;
  return t;
}

// Each index letter's size, from the equation's input terms and the operands' shapes; empty when the
// equation has an ellipsis or does not match the shapes (then nothing is measured).
std::map<char, int64_t> letter_sizes(const std::string& equation, const std::vector<Operand>& ops) {
  std::map<char, int64_t> sizes;
  const auto arrow = equation.find("->");
  const std::string lhs = equation.substr(0, arrow);
  if (lhs.find('.') != std::string::npos) return {};
  size_t op = 0, dim = 0;
  for (char c : lhs) {
    if (c == ' ') continue;
    if (c == ',') {
      ++op;
      dim = 0;
      continue;
    }
    if (op >= ops.size() || dim >= ops[op].shape.size()) return {};
    sizes[c] = ops[op].shape[dim++];
  }
  return sizes;
}

}  // namespace

EagerMeasureStats eager_measure_stats() {
  const MeasureStats m = eager_decisions().stats();
  return {m.measured, m.kept_dense, m.contended, m.remeasured};
}

Decision measured_eager_choice(const EagerCall& c, Decision d) {
  std::vector<double> densities;
  double combined = 1.0;
  int64_t elements = 0;
  for (const auto& o : c.ops) {
    elements = saturating_add(elements, o.numel());
    if (o.sparse()) {
      densities.push_back(o.density());
      combined *= densities.back();
    }
  }
  if (densities.empty()) return d;
  const double below = c.sparse_out ? kSparseResultWindow : kMeasureWindow;
  if (combined < c.crossover / below || combined > c.crossover * kMeasureWindow) return d;
  const auto sizes = letter_sizes(c.equation, c.ops);
  if (sizes.empty()) return d;
  double flops = 1.0;
  for (const auto& [letter, n] : sizes) flops *= static_cast<double>(std::max<int64_t>(n, 1));
  int64_t out_elements = 1;
  for (int64_t n : c.out_shape) out_elements = saturating_mul(out_elements, n);
  if (flops > kMeasureMaxFlops || saturating_add(elements, out_elements) > kMeasureMaxElements) return d;

  // Decisions belong to the equation and its operands' formats (interned: their addresses name them), not to
  // the plan entry: a plan's key holds each operand's exact shape and entry count, so another matrix of the
  // same size and density (a graph's next batch) would be measured again (helper-43 F6: 74-138 ms first
  // calls), and a freed entry's address could pass a stale decision to a new plan. Sizes and densities come
  // into the key by bucket; the dtype as the tag (ATen multiplies float32 and the half types at very
  // different speeds).
  std::string owner = c.equation;
  for (const auto& o : c.ops) owner += fmt::format("|{}", static_cast<const void*>(o.format));
  if (c.sparse_out) owner += "|sparse result";
  const std::vector<int64_t> key =
      bucket_key(owner, static_cast<int64_t>(result_dtype(c.ops)), sizes, densities, c.threads);
  if (auto known = eager_decisions().known(key)) {
    // Dense only where the values are finite (choose's contract: 0 * inf must not appear).
    if (*known && !d.dense && !c.finite()) return d;
    if (c.explain && *known != d.dense)
      d.why = fmt::format("{} (measured on an earlier call of this size and density: {} is faster)", d.why,
                          *known ? "dense" : "the sparse kernel");
    d.dense = *known;
    return d;
  }
  if (!c.finite()) return d;  // the rule keeps such calls on the kernel; nothing to measure
  at::NoGradGuard no_grad;
  Timing t;
  const bool chosen_dense = eager_decisions().measure(key, c.kernel, c.dense, &t);
  if (c.explain)
    d.why = fmt::format("{}; measured on this call: kernel {:.3g} ms, dense {:.3g} ms (densifying{} included): {}",
                        d.why, t.kernel_ms, t.dense_ms, c.sparse_out ? " and compressing the result" : "",
                        chosen_dense ? "dense" : "sparse kernel");
  d.dense = chosen_dense;
  return d;
}

}  // namespace scorch::torch_glue
