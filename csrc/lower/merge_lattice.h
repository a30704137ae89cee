// Merge lattices (Kjolstad et al., OOPSLA 2017): for one index variable, the regions where different subsets
// of the sparse iterators hold a coordinate, and the expression to compute in each. A product co-iterates the
// intersection of its factors' iterators, a sum their union.
#pragma once

#include <functional>
#include <vector>

#include "ir/expr.h"

namespace scorch {

struct LatticePoint {
  std::vector<int> iterators;  // access ids iterated sparsely at this variable, sorted
  ir::ExprPtr expr;            // what to compute where exactly these iterators (of the point's) have the coordinate
};

// Points ordered from the most iterators to the fewest. `sparse_here(access)` tells whether the access is
// iterated sparsely (a compressed or singleton level) at the variable; other accesses are always present.
std::vector<LatticePoint> build_lattice(const ir::ExprPtr& e, const std::function<bool(const ir::Expr&)>& sparse_here);

// True when every iterator of `sub` is in `super`.
bool iterators_subset(const std::vector<int>& sub, const std::vector<int>& super);

}  // namespace scorch
