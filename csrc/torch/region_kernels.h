// The kernels a region call runs on its sparse path, found without data: for compiling them ahead of the first
// call (scorch_backend/compiler/backend.py). The run path (region.cpp, region_op.cpp) uses the same pieces, so
// the prediction cannot drift from what runs.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "executor.h"
#include "region.h"

namespace scorch::torch_glue {

// The format a compressed (sparse or pattern) operand of this rank reaches the kernel in (region.cpp:
// compress): CSR for a matrix and up (dense outer levels), a compressed vector, or a 0-d value.
const FormatRef& region_compressed_format(int rank);

// Whether the backward computes operand o's gradient by running a gradient program (region_gradient), when
// the gradient is asked for and the operand is floating: not for pattern factors, packed operands or addends.
bool gradient_by_program(const RegionOperand& o);

// Every kernel spec a call of the program runs on its sparse path, for operands of these shapes (as the op
// receives them; a packed operand's entry is ignored, its size comes from the program or the other operands)
// and this dtype (the region's: its floating operands' promoted type): the forward's (none when no operand is
// compressed), and for each operand whose `grads` entry is true, the kernels of its gradient program, which
// the backward runs as a region call (col_major operands and masked gradients included). Each spec once.
// The planner weighs conversions and loop orders by the stored entries, so the prediction takes an estimate:
// `densities` per operand (empty: all 1; dense ones ignored) and `grad_density`, the output gradient's (a
// program whose output feeds a ReLU takes it compressed). A ValueError for shapes that do not fit the program.
std::vector<std::string> region_kernel_specs(const std::string& text, const std::vector<std::vector<int64_t>>& shapes,
                                             at::ScalarType dtype, const std::vector<bool>& grads = {},
                                             const std::vector<double>& densities = {}, double grad_density = 1.0);

}  // namespace scorch::torch_glue
