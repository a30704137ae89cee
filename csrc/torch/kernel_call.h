// Calling a compiled kernel outside the scorch::kernel op, for measurement tools.
#pragma once

#include <string>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// The time of one call of a spec's kernel alone (its output zero-filled, as every call does; no dispatcher,
// no checks, no allocation), in seconds: the median over `repeats` calls after `warmup` calls, or with `mean`
// their mean (the statistic of a batch timed as a whole, which is how a benchmark times a whole call to
// compare with it). The inputs are checked once, as scorch::kernel checks them. Dense outputs only.
double time_kernel(const std::string& spec, at::TensorList inputs, c10::IntArrayRef sizes, int64_t num_threads,
                   int repeats, int warmup = 3, bool mean = false);

// Seconds the calling thread's last kernel call (scorch::kernel, from any route: eager, region, chain) spent
// in the kernel itself, 0 before the first.
double last_kernel_seconds();

}  // namespace scorch::torch_glue
