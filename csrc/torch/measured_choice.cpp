#include "measured_choice.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <time.h>

#include "common/error.h"
#include "runtime/target.h"

namespace scorch::torch_glue {

int64_t size_bucket(int64_t n) {
  int64_t bucket = 0;
  for (; n > 1; n = (n + 1) / 2) ++bucket;
  return bucket;
}

// A third of an octave: density 0.045 and 0.001 are 16 buckets apart (helper-43: with 5% buckets a dense
// decision at 4.5% held at 0.1% and 0.005%, 17-35x slower than the kernel there). 0 has a bucket of its own.
int64_t density_bucket(double density) {
  if (!(density > 0)) return std::numeric_limits<int32_t>::min();
  return static_cast<int64_t>(std::floor(std::log2(std::min(density, 1.0)) * 3));
}

std::vector<int64_t> bucket_key(const void* owner, int64_t tag, const std::map<char, int64_t>& sizes,
                                const std::vector<double>& densities, int64_t threads) {
  std::vector<int64_t> key{reinterpret_cast<int64_t>(owner), tag};
  key.reserve(3 + sizes.size() + densities.size());
  for (const auto& [letter, n] : sizes) key.push_back(static_cast<int64_t>(letter) * 64 + size_bucket(n));
  for (double d : densities) key.push_back(density_bucket(d));
  key.push_back(threads);
  // The kernels' target by name, not resolved: resolving runs the compiler, which a deployed process lacks
  // (helper-43: a decision measured under `scalar` held under `native`, 3x slower).
  key.push_back(static_cast<int64_t>(std::hash<std::string>{}(target_name())));
  return key;
}

std::vector<int64_t> bucket_key(const std::string& owner, int64_t tag, const std::map<char, int64_t>& sizes,
                                const std::vector<double>& densities, int64_t threads) {
  std::vector<int64_t> key = bucket_key(nullptr, tag, sizes, densities, threads);
  key[0] = static_cast<int64_t>(std::hash<std::string>{}(owner));
  return key;
}

namespace {

// One timed run: its wall time and the CPU time the whole process spent meanwhile (every thread's, system
// time included), both in ms.
struct Run {
  double wall = 0, cpu = 0;
  // The process got much less CPU than the run's wall time: it was stopped or preempted for most of it (another
  // process on the core, a SIGSTOP, a swapped-out page), so the run says little about the path. A run doing
  // its work holds a core for its whole time; a short run is not judged (the clocks' granularity).
  bool stalled() const { return wall > MeasuredChoices::kStallMinMs && cpu < MeasuredChoices::kStallCpuShare * wall; }
};

Run run_of(const std::function<void()>& f, const Clocks& clocks) {
  const double c0 = clocks.cpu_ms(), w0 = clocks.wall_ms();
  f();
  return {clocks.wall_ms() - w0, clocks.cpu_ms() - c0};
}

}  // namespace

Timing timing_of(const std::vector<double>& kernel_ms, const std::vector<double>& dense_ms, bool stalled) {
  SCORCH_CHECK(!kernel_ms.empty() && !dense_ms.empty(), "timing_of: no runs");
  const auto [k_lo, k_hi] = std::minmax_element(kernel_ms.begin(), kernel_ms.end());
  const auto [d_lo, d_hi] = std::minmax_element(dense_ms.begin(), dense_ms.end());
  const double spread = MeasuredChoices::kContendedSpread;
  return {*k_lo, *d_lo, stalled || *k_hi > spread * *k_lo || *d_hi > spread * *d_lo};
}

const Clocks& real_clocks() {
  static const Clocks clocks{
      [] {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
      },
      [] {
        timespec ts{};
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
      }};
  return clocks;
}

Timing time_both(const std::function<void()>& kernel, const std::function<void()>& dense, const Clocks& clocks) {
  kernel();  // warm-up: compiles or loads the kernel, fills the caches
  // The dense warm-up is timed too: it is an upper bound of the dense path's time (no compile in it).
  const Run d0 = run_of(dense, clocks);
  const Run k0 = run_of(kernel, clocks);
  std::vector<double> k{k0.wall}, d;
  bool stalled = d0.stalled() || k0.stalled();
  // A path many times slower than the other is not run again: the answer cannot change, and repeating it
  // would cost a user seconds (a dense gradient that measured 13.7 s against 17 ms, timed four times, and
  // again on each re-measurement of a decision that looked contended). Such a timing is not contended. Unless
  // that one run was stalled: then it is no evidence (helper-43: a stop during the kernel's first timed run
  // kept the dense path for good, 2-4x slower), and both paths are timed in full.
  const double far = MeasuredChoices::kDecisiveRatio;
  if (d0.wall > far * k0.wall && !d0.stalled()) return {k0.wall, d0.wall, false};
  const Run d1 = run_of(dense, clocks);
  d.push_back(d1.wall);
  stalled = stalled || d1.stalled();
  if (k0.wall > far * std::min(d0.wall, d1.wall) && !k0.stalled()) return {k0.wall, std::min(d0.wall, d1.wall), false};
  for (int r = 1; r < MeasuredChoices::kRepeats; ++r) {
    const Run kr = run_of(kernel, clocks), dr = run_of(dense, clocks);
    k.push_back(kr.wall);
    d.push_back(dr.wall);
    stalled = stalled || kr.stalled() || dr.stalled();
  }
  return timing_of(k, d, stalled);
}

std::optional<bool> MeasuredChoices::known(const std::vector<int64_t>& key) {
  std::lock_guard lock(mu_);
  auto it = table_.find(key);
  if (it == table_.end()) return std::nullopt;
  Entry& e = it->second;
  if (e.contended && e.remeasures < kMaxRemeasures && std::chrono::steady_clock::now() - e.at >= remeasure_after_) {
    // This caller measures again; the others keep the stored decision meanwhile (`at` moves on).
    ++e.remeasures;
    e.at = std::chrono::steady_clock::now();
    ++stats_.remeasured;
    return std::nullopt;
  }
  return e.dense;
}

bool MeasuredChoices::measure(const std::vector<int64_t>& key, const std::function<void()>& kernel,
                              const std::function<void()>& dense, Timing* timing) {
  const Timing t = time_both(kernel, dense);
  if (timing) *timing = t;
  return record(key, t);
}

bool MeasuredChoices::record(const std::vector<int64_t>& key, const Timing& t) {
  const bool dense = t.dense_ms < t.kernel_ms;
  std::lock_guard lock(mu_);
  if (table_.size() >= kMaxDecisions && !table_.count(key)) table_.clear();
  Entry& e = table_[key];
  e.dense = dense;
  e.contended = t.contended;
  e.at = std::chrono::steady_clock::now();
  ++stats_.measured;
  stats_.kept_dense += dense;
  stats_.contended += t.contended;
  return dense;
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
