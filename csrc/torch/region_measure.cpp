// --- a region's decisions corrected by measurement ---------------------------------------------------------
// The density rule is an estimate. The first time a program runs at a size (sizes bucketed by powers of two,
// densities by 5%, per thread count) and the rule picks a kernel path, both that path and the dense one are
// timed on the real operands (measured_choice.h: one warm-up, then the best of three each, interleaved) and the
// faster is kept for every later call in that bucket; a timing that looked contended is taken again later, a
// few times at most. A grouped choice is first timed against the sparse kernel the same way, then the faster
// against dense. Only under SCORCH_DISPATCH=auto; SCORCH_MEASURE=0 turns it off (region.cpp: run_region).
#include "region_measure.h"

#include <ATen/Parallel.h>

namespace scorch::torch_glue {
namespace {

MeasuredChoices& table() {
  static MeasuredChoices t;
  return t;
}

}  // namespace

std::string measured_region_path(const RegionProgram& p, const std::map<char, int64_t>& sizes,
                                 const std::vector<double>& densities, const std::string& path,
                                 const std::string& other, const std::function<void()>& run_path,
                                 const std::function<void()>& run_other, Timing* timing, bool* fresh,
                                 at::ScalarType dtype) {
  // the program (interned: its address names it), the two paths and the dtype (one text runs in any)
  const int64_t tag = (path == "grouped" ? (other == "sparse" ? 2 : 1) : 0) + 4 * static_cast<int64_t>(dtype);
  const std::vector<int64_t> key = bucket_key(&p, tag, sizes, densities, at::get_num_threads());
  *fresh = false;
  if (auto second = table().known(key)) return *second ? other : path;
  *fresh = true;
  return table().measure(key, run_path, run_other, timing) ? other : path;
}

MeasureStats region_measure_stats() { return table().stats(); }

}  // namespace scorch::torch_glue
