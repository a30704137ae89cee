// C++ source for a lowered kernel: a fixed preamble (value and index types, the ABI struct, output streams,
// the balanced split of a CSR row range), then the extern "C" entry point around the loop IR. The source
// includes only C and C++ standard headers and OpenMP, never torch.
#pragma once

#include <string>

#include "lower/kernel_spec.h"
#include "lower/lower.h"

namespace scorch {

// vector_bytes: width of vec_t (the target's vector registers); 0 declares no vector type.
std::string emit_cpp(const KernelSpec& spec, const LoweredKernel& kernel, int vector_bytes);

}  // namespace scorch
