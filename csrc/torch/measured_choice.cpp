#include "measured_choice.h"

#include <algorithm>

namespace scorch::torch_glue {

int64_t size_bucket(int64_t n) {
  int64_t bucket = 0;
  for (; n > 1; n = (n + 1) / 2) ++bucket;
  return bucket;
}

int64_t density_bucket(double density) { return static_cast<int64_t>(density * 20); }

namespace {

double ms_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Timing time_both(const std::function<void()>& kernel, const std::function<void()>& dense) {
  kernel();  // warm-up: compiles or loads the kernel, fills the caches
  dense();
  double k_lo = 1e300, k_hi = 0, d_lo = 1e300, d_hi = 0;
  for (int r = 0; r < MeasuredChoices::kRepeats; ++r) {
    const double k = ms_of(kernel), d = ms_of(dense);
    k_lo = std::min(k_lo, k);
    k_hi = std::max(k_hi, k);
    d_lo = std::min(d_lo, d);
    d_hi = std::max(d_hi, d);
  }
  const double spread = MeasuredChoices::kContendedSpread;
  return {k_lo, d_lo, k_hi > spread * k_lo || d_hi > spread * d_lo};
}

std::optional<bool> MeasuredChoices::known(const std::vector<int64_t>& key) {
  std::lock_guard lock(mu_);
  auto it = table_.find(key);
  if (it == table_.end()) return std::nullopt;
  Entry& e = it->second;
  if (e.contended && !e.remeasuring && e.remeasures < kMaxRemeasures &&
      std::chrono::steady_clock::now() - e.at >= kRemeasureAfter) {
    e.remeasuring = true;  // one caller measures again; the others keep the stored decision meanwhile
    return std::nullopt;
  }
  return e.dense;
}

bool MeasuredChoices::measure(const std::vector<int64_t>& key, const std::function<void()>& kernel,
                              const std::function<void()>& dense, Timing* timing) {
  const Timing t = time_both(kernel, dense);
  const bool chosen_dense = t.dense_ms < t.kernel_ms;
  {
    std::lock_guard lock(mu_);
    if (table_.size() >= kMaxDecisions && !table_.count(key)) table_.clear();
    Entry& e = table_[key];
    const bool again = e.remeasuring;
    e.dense = chosen_dense;
    e.contended = t.contended;
    e.remeasuring = false;
    e.remeasures += again ? 1 : 0;
    e.at = std::chrono::steady_clock::now();
    ++stats_.measured;
    stats_.kept_dense += chosen_dense;
    stats_.contended += t.contended;
    stats_.remeasured += again;
  }
  if (timing) *timing = t;
  return chosen_dense;
}

MeasureStats MeasuredChoices::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void MeasuredChoices::clear() {
  std::lock_guard lock(mu_);
  table_.clear();
}

}  // namespace scorch::torch_glue
