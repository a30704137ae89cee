// A region program with addends (a linear's bias, a residual) runs as its product, a program of its own, and
// then adds them (region.cpp: run_region). The pieces of that, internal to the region op's files.
#pragma once

#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "region.h"

namespace scorch::torch_glue {

// The operands of a program's product: the product's slots, then the index buffers.
std::vector<at::Tensor> product_args(const RegionProgram& p, at::TensorList all);

// A product of two dense matrices plus addends, as one addmm; nullopt when the program is not that shape.
std::optional<at::Tensor> dense_matmul_with_addends(const RegionProgram& p, at::TensorList all);

// The product's result (requested order) plus the addends, each broadcast along the output letters it lacks.
at::Tensor add_addends(const RegionProgram& p, at::Tensor out, at::TensorList all);

}  // namespace scorch::torch_glue
