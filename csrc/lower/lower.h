// Lowering: a kernel spec and its schedule become loop IR. Each index variable becomes a loop whose form
// comes from the merge lattice of the expression at that variable: a dense loop (locating into dense
// levels, merging sparse iterators), a plain loop over one sparse iterator, or a co-iterating while loop.
// The output is written in place (dense), appended, collected in a workspace, or collected as coordinates.
#pragma once

#include <string>
#include <vector>

#include "lower/kernel_spec.h"
#include "lower/loop_ir.h"
#include "lower/schedule.h"
#include "lower/vector_shape.h"

namespace scorch {

struct LoweredKernel {
  loops::Stmts body;                 // the body of the kernel entry function
  std::vector<std::string> reasons;  // decisions taken while lowering (e.g. a parallel loop made serial)
  bool sparse_output = false;
  // Dense output: every element is stored exactly once and never read, so the caller need not zero it.
  bool overwrites_output = false;
  // Sparse output written by the kernel as the output format's own buffers (lower/assemble.h's protocol), not
  // as a stream of coordinates.
  bool assembled_output = false;
};

// Argument layout shared by lowering and the runtime: for each operand, its index buffers (in
// Format::buffer_names() order) then its values; a strided operand is one data pointer and contributes its
// strides to the strides array, operand by operand.
int input_pointer_count(const KernelSpec& spec);

LoweredKernel lower(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine);

// The general lowering alone, without trying the native forms first (native_forms.h): what `lower` gives
// for a spec no native form matches. For tests that follow the general path of a spec a native form takes.
LoweredKernel lower_general(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine);

}  // namespace scorch
