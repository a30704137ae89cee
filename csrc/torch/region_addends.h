// A region program with addends (a linear's bias, a residual) or masks runs as its product, a program of its
// own, and then masks and adds them (region.cpp: run_region). The pieces of that, internal to the region op's files.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "region.h"

namespace scorch::torch_glue {

// The operands of a program's product: the product's slots, then the index buffers.
std::vector<at::Tensor> product_args(const RegionProgram& p, at::TensorList all);

// Two 2-D factors (operand a with tensor at, b with bt) whose product is a matrix product with `out`'s two letters:
// (L, R), views, with L @ R in that order. nullopt for any other shape (a batch letter, a letter in both, ...).
std::optional<std::pair<at::Tensor, at::Tensor>> matmul_factors(const RegionOperand& a, const at::Tensor& at,
                                                               const RegionOperand& b, const at::Tensor& bt,
                                                               const std::string& out);

// A product of two dense matrices plus addends, as one addmm; nullopt when the program is not that shape.
std::optional<at::Tensor> dense_matmul_with_addends(const RegionProgram& p, at::TensorList all);

// The product's result (requested order) plus the addends, each broadcast along the output letters it lacks.
at::Tensor add_addends(const RegionProgram& p, at::Tensor out, at::TensorList all);

// The product's result (requested order, a tensor of its own) zeroed wherever a mask operand is 0, in place.
void apply_masks(const RegionProgram& p, at::Tensor& out, at::TensorList all);

}  // namespace scorch::torch_glue
