// The operands of a region call as the op receives them (csrc/torch/region.cpp runs them): the slots, the
// index buffers of packed operands, and the packed operands' sizes in this call.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "executor.h"
#include "region.h"

namespace scorch::torch_glue {

// The operand list of a call: one slot per program operand, then the index buffers of the packed ones.
struct Slots {
  at::TensorList slots;
  std::vector<at::TensorList> buffers;  // per operand; empty unless packed
  std::vector<std::vector<int64_t>> packed_sizes;  // per packed operand: its size in this call
};

// The call's operands split into slots and packed buffers. `resolve`: work out the packed operands' sizes
// (the Meta kernel, whose sizes may be symbolic, does it itself).
Slots split_operands(const RegionProgram& p, at::TensorList operands, bool resolve = true);

// Packed operand k as the executor takes it, its buffers validated (once per identity, version and size).
Operand packed_operand(const RegionProgram& p, size_t k, const Slots& s, at::ScalarType dtype);

// While one lives on this thread, a call of `program` takes these sizes for its packed operands whose size the
// program leaves to the call (-1): one list per operand, empty for the rest. How a gradient program, whose
// operands may lack the letter that gave such a size (j of `adj(i,j) @ h(j,k)` when differentiating h), gets
// the sizes its forward call resolved, without a text of its own per size. Nested ones stack.
class GivenPackedSizes {
 public:
  GivenPackedSizes(const RegionProgram& program, std::vector<std::vector<int64_t>> sizes);
  ~GivenPackedSizes();
  GivenPackedSizes(const GivenPackedSizes&) = delete;
  GivenPackedSizes& operator=(const GivenPackedSizes&) = delete;

  // The sizes given to operand k of `program` by the innermost one for it (nullptr: none).
  static const std::vector<int64_t>* find(const RegionProgram& program, size_t k);

 private:
  const RegionProgram* program_;
  std::vector<std::vector<int64_t>> sizes_;
  const GivenPackedSizes* outer_;
};

// The dtype a region computes in: its floating operands' promoted type (float32 when none).
at::ScalarType region_dtype(const RegionProgram& p, at::TensorList operands);

// While one lives on this thread, a half-precision program computes and returns float32 (region_dtype): a
// product whose addends are added before its result is rounded (a bfloat16 linear's bias: the product rounded
// first, then the bias added, cancelled to an exact 0 where eager's addmm gives 1e-4, and a ReLU after it then
// passed no gradient where eager's did).
struct HalfAsFloat {
  HalfAsFloat();
  ~HalfAsFloat();
  HalfAsFloat(const HalfAsFloat&) = delete;
  HalfAsFloat& operator=(const HalfAsFloat&) = delete;

 private:
  bool before_;
};

}  // namespace scorch::torch_glue
