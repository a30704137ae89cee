// The schedule of a kernel, chosen from the spec alone in microseconds: loop order, how the output is
// written, and whether and how the outermost loop runs in parallel, with the reason for each choice.
#pragma once

#include <string>
#include <vector>

#include "lower/kernel_spec.h"

namespace scorch {

enum class OutputMode {
  dense,      // strided output, updated in place (out += ...)
  append,     // sparse output produced in storage order, one entry per coordinate: appended
  workspace,  // sparse output whose last variable is reached out of order: a dense row workspace per thread
  coords,     // anything else: coordinates appended in any order, sorted and summed afterwards
  sampled,    // the output has the pattern of a sparse factor (SDDMM): values written at its positions
  fibers,     // the output shares a sparse factor's leading levels, its other levels dense (TTM's Y(i,j,r) on
              // X(i,j,k)): a dense block of values under each position of the shared levels, updated in place
};

struct Schedule {
  std::vector<int> order;       // index variables, outermost first
  OutputMode output = OutputMode::dense;
  int emit_depth = -1;          // append/workspace: depth whose loop body emits (-1: around the whole nest)
  int workspace_var = -1;       // workspace: the output variable the workspace is indexed by
  int sampled_tensor = -1;      // sampled, fibers: the operand whose index buffers the output shares
  int shared_levels = 0;        // fibers: how many of its leading levels (the output's first levels)
  bool parallel = false;        // the outermost loop is split among threads
  bool private_output = false;  // dense output with an outer reduction: per-thread copies, summed at the end
  std::vector<std::string> reasons;

  std::string str(const ir::Statement& st) const;
};

// Order constraints: every level-format operand must be walked in its level order.
// Returns pairs (before, after) of index variables.
std::vector<std::pair<int, int>> order_constraints(const KernelSpec& spec);

// A loop order respecting the constraints, or empty when they conflict.
std::vector<int> choose_loop_order(const KernelSpec& spec, const std::vector<std::pair<int, int>>& constraints);

Schedule make_schedule(const KernelSpec& spec);

// Estimated work of the loop nest `order` for operands of these index sizes and stored values (nnz: one per
// operand, numel for a strided one), in loop iterations. Each level is modelled by its mean segment length
// (its positions over its parent's); a loop over a variable visits the whole extent when no operand iterates
// a level there, else the entries of the iterated segments (their sum: a merge walks them all), and passes on
// as many coordinates as the product keeps (an intersection: the extent times each segment's fill) or the sum
// covers (a union). The nest's cost is the sum over depths of the loop's visits times how often it is entered,
// plus the innermost statements; a sparse output reached out of its storage order adds the sort of its
// coordinates, an outer reduction into a dense output the sum of the threads' copies. Used by the planner
// to compare loop orders and the conversions that make them possible.
double estimate_nest_cost(const KernelSpec& spec, const std::vector<int>& order, const std::vector<int64_t>& var_sizes,
                          const std::vector<int64_t>& nnz, bool sparse_output);

// The operand whose pattern a sparse output has by construction (the statement is a product with it, the
// output has its format and indices), or -1.
int sampling_operand(const KernelSpec& spec);

// The one access of a level-format operand (not all dense) in the statement, or null when there are none
// or several.
const ir::Expr* sole_sparse_factor(const KernelSpec& spec);

// A sparse output that shares the leading levels of a sparse factor and stores the rest densely
// (OutputMode::fibers): the statement is a product with exactly one level-format factor, the output's first
// `levels` levels are that factor's first levels (same kinds, unique and ordered, same index variables), its
// other levels are dense over variables none of the factor's levels walks, and the factor has levels left
// below them (which the product sums over). Every output value then lies under a position of the factor's
// level `levels - 1`, so the output's index buffers are copies of the factor's first ones. tensor -1: none.
struct SharedFibers {
  int tensor = -1;
  int levels = 0;
};
SharedFibers shared_fibers(const KernelSpec& spec);

// Level variables of an access of a level-format operand: the index variable of each level, in level order.
std::vector<int> level_vars(const Format& f, const std::vector<int>& access_vars);

// The level variables that order the loops: those of every level except the inner levels of a block (d%b),
// which a kernel over blocks walks inside each block (blocked.h), whatever the loop order of the rest.
std::vector<int> ordered_level_vars(const Format& f, const std::vector<int>& access_vars);

}  // namespace scorch
