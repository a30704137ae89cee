// Eager calls near the dense/sparse crossover settled by timing both paths (executor.cpp asks, per call).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "executor.h"

namespace scorch::torch_glue {

// What the measurement needs of one eager call: its operands, the plan's facts, and the two paths to time.
struct EagerCall {
  const std::string& equation;
  const std::vector<Operand>& ops;
  const std::vector<int64_t>& out_shape;
  bool sparse_out = false;  // the plan stores the result sparse (the dense path then compresses it)
  int64_t threads = 1;
  bool explain = false;
  double crossover = 0;     // the density rule's crossover for this call
  std::function<void()> kernel, dense;
  std::function<bool()> finite;  // every operand value finite (the dense path may only run then)
};

// The decision `d` of the density rule, kept, replaced by one measured on an earlier call of the same bucket,
// or measured now (eager_measure.cpp says when).
Decision measured_eager_choice(const EagerCall& c, Decision d);

}  // namespace scorch::torch_glue
