// The grouped runner's layout (chain.h, grouped.cpp): the nonzeros of the grouping factor S(p, q) sorted by
// group, and the rows of an operand gathered in that order. Shared by the forward (grouped.cpp) and the direct
// gradient (grouped_backward.cpp).
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "chain.h"

namespace scorch::torch_glue::grouped {

struct Groups {
  bool padded = false;
  int64_t groups = 0, most = 0, entries = 0;
  at::Tensor qs, ps;   // (entries) each entry's group and row, sorted by group
  at::Tensor slot;     // padded: each entry's slot in its group
  at::Tensor rows;     // padded: (groups, most) each slot's row (0 on padding); ragged: ps
  at::Tensor cols;     // padded: (groups, most) each slot's group; ragged: qs
  at::Tensor vals;     // S's value per slot (0 on padding) or per entry; undefined: all ones (ragged pattern)
  bool unique_rows = false;  // no row in two groups (one-hot dispatch): the rows scatter back without sums
  std::vector<int64_t> counts, starts;
};

bool has(const std::string& s, char c);
std::string without(const std::string& s, char a, char b);

// The rows of `t` (letters `lt`, p among them) gathered in the layout: leading (groups, slots) or (entries).
at::Tensor gather_rows(const at::Tensor& t, const std::string& lt, char p, char q, const Groups& g);

// S (p, q) grouped: its entries sorted by q, with S's values per entry (`pattern`: none; values that are all 1
// and need no gradient are dropped), padded when allowed and the padding is small.
Groups group_entries(const at::Tensor& S, bool pattern, at::ScalarType dtype, bool padded_allowed);

// A grouped chain's factor S as the runner reads it: S(p, q) from step 0's operand (0/1 when it is a pattern).
struct Factor {
  at::Tensor S;
  bool pattern = false;
  int input = -1;  // the chain operand it is
};
Factor grouping_factor(const ChainProgram& c, at::TensorList operands);

}  // namespace scorch::torch_glue::grouped
