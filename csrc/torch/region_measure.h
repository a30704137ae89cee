// The region op's decisions corrected by measurement (region_measure.cpp); internal to the region op's files.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "measured_choice.h"
#include "region.h"

namespace scorch::torch_glue {

// The path a call takes once measured: `path` (the density rule's kernel or grouped choice) or `other`
// ("dense", or "sparse" against "grouped"). The first call in a bucket (program, the two paths, each letter's
// size by power of two, each compressed operand's density by a third of an octave, thread count, target, the
// dtype it computes in) runs `run_path` and
// `run_other` and keeps the faster; `timing` is set (and `*fresh` true) when this call measured (its
// kernel_ms is `path`'s, its dense_ms `other`'s).
std::string measured_region_path(const RegionProgram& p, const std::map<char, int64_t>& sizes,
                                 const std::vector<double>& densities, const std::string& path,
                                 const std::string& other, const std::function<void()>& run_path,
                                 const std::function<void()>& run_other, Timing* timing, bool* fresh,
                                 at::ScalarType dtype);

MeasureStats region_measure_stats();

}  // namespace scorch::torch_glue
