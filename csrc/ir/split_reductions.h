// Reduction scopes. In "y(i) = A(i,j) * x(j) + b(i)" the sum over j belongs to the term A(i,j) * x(j) only:
// a summed index is summed over the smallest term (operand of + or -) holding all its uses. One loop nest
// sums over the whole right side, so such terms are split off into temporaries computed first:
//   tmp(i) = A(i,j) * x(j);  y(i) = tmp(i) + b(i)
#pragma once

#include <vector>

#include "ir/expr.h"

namespace scorch::ir {

struct Step {
  Statement stmt;             // tensors numbered locally
  std::vector<int> operands;  // global tensor of each local one; the original operands are 0..n-1 and the
                              // result of step k is tensor n + k
};

// The steps to evaluate a statement; the last one computes the statement's output. A statement whose
// reductions all span the whole right side is one step.
std::vector<Step> split_reductions(const Statement& st);

}  // namespace scorch::ir
