// Reduction scopes. In "y(i) = A(i,j) * x(j) + b(i)" the sum over j belongs to the term A(i,j) * x(j) only:
// a summed index is summed over the smallest term (operand of + or -) holding all its uses. One loop nest
// sums over the whole right side, so such terms are split off into temporaries computed first:
//   tmp(i) = A(i,j) * x(j);  y(i) = tmp(i) + b(i)
#pragma once

#include <cstdint>
#include <vector>

#include "ir/expr.h"

namespace scorch::ir {

struct Step {
  Statement stmt;             // tensors numbered locally
  std::vector<int> operands;  // global tensor of each local one; the original operands are 0..n-1 and the
                              // result of step k is tensor n + k
};

// Within a product, an index used by one factor only is summed over that factor first when the product's other
// factors hold indices of their own: "s = a(i) * b(j) * c(k)" as one loop nest runs |i| * |j| * |k| times
// (100^6 multiply-adds for six vectors of 100, helper-53), summed factor by factor |i| + |j| + |k| (torch.einsum
// sums such indices first too). Where nothing else varies ("s = A(i,j) * x(j)") the one nest stays. With
// `var_sizes` (indexed by variable) a factor's temporary over more than kMaxFactorTemporary elements is not made
// (a hypersparse operand's dense row sums); without them, sizes are not checked.
constexpr int64_t kMaxFactorTemporary = int64_t{1} << 26;

// The steps to evaluate a statement; the last one computes the statement's output. A statement whose
// reductions all span the whole right side (or a factor, as above) is one step.
std::vector<Step> split_reductions(const Statement& st, const std::vector<int64_t>& var_sizes = {});

}  // namespace scorch::ir
