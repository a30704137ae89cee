// A dense einsum of three or more factors contracted a pair at a time, in an order chosen by size.
//
// at::einsum contracts its operands left to right, and a letter can only be summed once no later operand
// holds it: a gradient such as "bnh,bnd,bn->nhd" first forms the (b, n, h, d) product of the first two (8 GB
// for a 16-expert MoE at batch 256), where multiplying "bn" into "bnd" first keeps every intermediate small.
// The region op's and the executor's dense paths call this instead.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// at::einsum(equation, factors) with the factors contracted greedily: at each step the pair whose result
// (the letters either holds that another factor or the output still needs) has the fewest elements. Two or
// fewer factors, or an equation with an ellipsis or no "->", go to at::einsum unchanged.
at::Tensor dense_einsum(const std::string& equation, const std::vector<at::Tensor>& factors);

}  // namespace scorch::torch_glue
