// Calling a compiled kernel outside the scorch::kernel op, for measurement tools.
#pragma once

#include <string>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// The median time of one call of a spec's kernel alone (its output zero-filled, as every call does; no
// dispatcher, no checks, no allocation), over `repeats` calls after three warm-ups, in seconds. The inputs
// are checked once, as scorch::kernel checks them. Kernels with a dense output only.
double time_kernel(const std::string& spec, at::TensorList inputs, c10::IntArrayRef sizes, int64_t num_threads,
                   int repeats);

}  // namespace scorch::torch_glue
