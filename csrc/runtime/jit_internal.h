// Pieces of the JIT that kernel bundles (bundle.cpp) share: lowering a spec for a vector shape, and the
// description of a kernel derived from it. Not part of the runtime's public interface.
#pragma once

#include <string>
#include <vector>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"
#include "runtime/jit.h"
#include "runtime/target.h"

namespace scorch {

struct Lowered {
  KernelSpec spec;
  Schedule schedule;
  LoweredKernel kernel;
  std::string source;  // the generated C++ (what a bundle records the hash of)
  VectorShape machine;  // the vector shape it was lowered for
};

// Spec text -> schedule -> loop IR -> C++, for the machine's vector shape (Target::vector_shape(): vector
// width, tile accumulators, registers). Needs no compiler.
Lowered lower_spec(const std::string& text, const VectorShape& machine);

// Fills everything of a CompiledKernel that follows from the lowering (not fn, paths, timing or target).
void describe_kernel(const Lowered& l, const std::string& text, CompiledKernel& k);

// The flags every kernel is compiled with for a target, without the output options:
// -O3 <target flags> -fopenmp -fPIC -std=c++17 -w.
std::vector<std::string> kernel_compile_flags(const Target& target);

}  // namespace scorch
