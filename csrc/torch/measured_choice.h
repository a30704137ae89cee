// Dense-or-kernel decisions settled by timing both paths on the real operands, once per bucket of calls.
// Used by the region op (region_measure.cpp) and by eager calls near the crossover (executor.cpp); each keeps
// a table of its own and builds its own keys from the parts below.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace scorch::torch_glue {

// The parts of a bucket key: a size by power of two, a density by a third of an octave.
int64_t size_bucket(int64_t n);
int64_t density_bucket(double density);

// A decision's bucket: what is decided (`owner`, an interned program or plan, and a `tag` of the caller's),
// each index letter's size bucket, each compressed operand's density bucket, the thread count, and the kernels'
// target. Integers: a key is looked up on every call. Callers put the dtype into `tag`.
std::vector<int64_t> bucket_key(const void* owner, int64_t tag, const std::map<char, int64_t>& sizes,
                                const std::vector<double>& densities, int64_t threads);
// The same with the owner named by a text (an equation and its operands' formats, say), not an address.
std::vector<int64_t> bucket_key(const std::string& owner, int64_t tag, const std::map<char, int64_t>& sizes,
                                const std::vector<double>& densities, int64_t threads);

// One measurement: the best time of each path (ms) and whether it looked contended (the machine busy: the
// repeats of a path disagreed by more than kContendedSpread).
struct Timing {
  double kernel_ms = 0, dense_ms = 0;
  bool contended = false;
};

struct MeasureStats {
  int64_t measured = 0;    // measurements taken (re-measurements included)
  int64_t kept_dense = 0;  // of those, how many kept the dense path
  int64_t contended = 0;   // of those, how many looked contended
  int64_t remeasured = 0;  // contended decisions handed back for another measurement
};

class MeasuredChoices {
 public:
  // Warm-up runs, then timed runs of each path, interleaved; a path's time is the best of its runs.
  static constexpr int kRepeats = 3;
  // A path whose slowest timed run took more than this times its fastest was timed on a busy machine.
  static constexpr double kContendedSpread = 1.5;
  // A path whose first timed run took more than this times the other path's is decided on that run alone.
  static constexpr double kDecisiveRatio = 8.0;
  // A timed run during which the process had less than this share of one CPU's time, over its wall time, was
  // stalled (stopped or preempted): it decides nothing alone and makes the timing contended. Runs shorter than
  // kStallMinMs are not judged.
  static constexpr double kStallCpuShare = 0.5;
  static constexpr double kStallMinMs = 0.5;
  // A contended decision is measured again on a later call at least this long after, at most this often.
  static constexpr std::chrono::milliseconds kRemeasureAfter{1000};
  static constexpr int kMaxRemeasures = 3;
  static constexpr size_t kMaxDecisions = 4096;

  // The decision stored for `key` (true: dense); nullopt when there is none, or when it was contended and is
  // due for another measurement (the caller then measures; the first caller to ask gets the nullopt).
  std::optional<bool> known(const std::vector<int64_t>& key);

  explicit MeasuredChoices(std::chrono::milliseconds remeasure_after = kRemeasureAfter)
      : remeasure_after_(remeasure_after) {}

  // Times both paths (`kernel` and `dense` run the call each way: time_both) and records the faster for `key`.
  // Returns true when dense was kept.
  bool measure(const std::vector<int64_t>& key, const std::function<void()>& kernel, const std::function<void()>& dense,
               Timing* timing = nullptr);
  // Records a timing taken for `key`; true when dense was kept (the faster one).
  bool record(const std::vector<int64_t>& key, const Timing& t);

  MeasureStats stats() const;
  void clear();

 private:
  struct Entry {
    bool dense = false;
    bool contended = false;
    int remeasures = 0;
    std::chrono::steady_clock::time_point at;
  };
  std::chrono::milliseconds remeasure_after_;
  mutable std::mutex mu_;
  std::map<std::vector<int64_t>, Entry> table_;
  MeasureStats stats_;
};

// Times two ways of running one call: one warm-up each, then kRepeats timed runs of each, interleaved; a path
// kDecisiveRatio times slower than the other at its first timed run (dense: its warm-up) is not run again,
// unless that run was stalled (the process off the CPU for most of it).
// The clocks a timing reads, in ms: wall time, and the CPU time of the whole process (every thread's, system
// time included). Tests give clocks of their own.
struct Clocks {
  std::function<double()> wall_ms, cpu_ms;
};
const Clocks& real_clocks();
Timing time_both(const std::function<void()>& kernel, const std::function<void()>& dense,
                 const Clocks& clocks = real_clocks());
// The timing those runs give (each path's best; contended when a path's slowest run took more than
// kContendedSpread times its fastest, or when `stalled`: a run was stalled).
Timing timing_of(const std::vector<double>& kernel_ms, const std::vector<double>& dense_ms, bool stalled = false);

}  // namespace scorch::torch_glue
