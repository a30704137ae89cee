// Front ends to index notation: einsum equations and tensor index notation text. Both are strict; a mistake
// raises ValueError with a caret under the offending character.
#pragma once

#include <string>
#include <vector>

#include "ir/expr.h"

namespace scorch::ir {

// "ij,jk->ik" (explicit) or "ij,jk" (implicit: indices used once, in alphabetical order). `ndims` gives each
// operand's rank, which must match its subscripts; "..." stands for the leading dimensions not named.
Statement parse_einsum(const std::string& equation, const std::vector<int>& ndims);

// "y(i) = A(i,j) * x(j) + 2 * b(i)": the left side names the output; `tensor_names` are the operands, in
// the order their data will be given (names not listed are an error). A name without parentheses is a
// 0-dimensional tensor. `ndims`, when not empty, gives each operand's rank, checked against its accesses.
Statement parse_index_notation(const std::string& text, const std::vector<std::string>& tensor_names,
                               const std::vector<int>& ndims = {});

// Check the index variable extents implied by the operand shapes; returns the size of each variable.
// Raises ValueError with a caret at the first occurrence that disagrees.
std::vector<int64_t> infer_var_sizes(const Statement& st, const std::vector<std::vector<int64_t>>& shapes);

// The shapes the operands of an einsum take under torch.einsum's broadcasting: a dimension of size 1 stretches
// to its index's size elsewhere, and "..." covers the most dimensions any operand gives it (an operand with
// fewer gains leading dimensions of size 1, then stretched). Empty when no operand changes, or when the
// equation and shapes do not line up (the parser then names the problem). An operand marked in `sparse` that
// would change raises ValueError naming it: only dense operands are broadcast.
std::vector<std::vector<int64_t>> broadcast_shapes(const std::string& equation,
                                                   const std::vector<std::vector<int64_t>>& shapes,
                                                   const std::vector<bool>& sparse);

}  // namespace scorch::ir
