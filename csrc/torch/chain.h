// scorch::chain in C++: region programs (steps) joined by elementwise ops, run as one op call. Two kinds:
//
// - grouped: every intermediate is zero outside one sparse 2-D factor S(p, q) of the first step (the mixture of
//   experts' one-hot dispatch: S = mask(b, n)), so the chain runs grouped by S (grouped.cpp): the rows p of each
//   group q are gathered, every step runs on the groups' rows, intermediates are kept per group (never the dense
//   (p, q, ...) tensor) and the last step's result is scattered back. A region's own grouped path is the
//   one-step case of the same runner.
// - sequence: each step a region call on the result before it, through elementwise ops applied in place (a
//   linear -> bias -> ReLU -> linear whose ReLU output is measured sparse).
//
// The program text is the JSON the backend writes (scorch_backend/custom_ops/chain.py: ChainProgram), parsed and
// checked once per text. The op, its Meta kernel and its gradient are in chain_op.cpp.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "region.h"

namespace scorch::torch_glue {

enum class Elementwise { relu, gelu, tanh, abs, neg };

// A sparse 2-D factor S(p, q) to group a product by: its operand index, p the letter of the rows gathered per
// group, q the letter of the groups.
struct GroupPlan {
  int s = -1;
  char p = 0, q = 0;
};

struct ChainStep {
  std::string text;                 // the step's region program
  const RegionProgram* program = nullptr;
  std::vector<int> inputs;          // per operand: >= 0 an operand of the chain, < 0 the result of step -(k + 1)
  std::vector<Elementwise> then;    // applied to the step's result, in order
  char p = 0, q = 0;                // grouped: the group letters in this step's own letters
};

struct ChainProgram {
  enum class Kind { grouped, sequence } kind = Kind::grouped;
  std::vector<ChainStep> steps;
  std::string name, label, title, profile_name;
  int s = -1;  // grouped: the operand of step 0 that is S
  // A training graph's chain (program text "keep": true): the forward keeps the intermediates its direct gradient
  // reads (grouped_backward.cpp: kept_intermediates), so the gradient does not compute them again.
  bool keep = false;
  // Per chain operand: read by some step as a factor with a gradient (not only as a 0/1 pattern).
  std::vector<bool> differentiable;
};

// Parsed and checked once per text (ValueError naming the problem for a malformed or ungroupable chain).
const ChainProgram& chain_program(const std::string& text);

// The chain of one step: a region program run through the grouped runner (its grouped path). Interned. The
// program's ReLUs are the caller's to apply to the operands first (region.cpp run_path does).
const ChainProgram& grouped_region_chain(const std::string& region_text);

// How a program groups: nullopt unless it has no addends, exactly one compressed factor, 2-D, and some operand
// (or the output) holds a matrix per group that does not depend on the rows.
std::optional<GroupPlan> grouped_plan(const RegionProgram& p);

// Does running grouped pay for these operands (given the compressed factor's density)? Enough rows per group.
bool grouped_worth(const RegionProgram& p, at::TensorList operands, double density);

// The dtype the chain computes in (its floating operands' promoted type, float32 when none) and its output shape.
at::ScalarType chain_dtype(const ChainProgram& c, at::TensorList operands);
std::vector<c10::SymInt> chain_output_shape(const ChainProgram& c, at::TensorList operands);

// Run a chain (grouped or sequence). `differentiable`: with out-of-place ops only where autograd needs them and
// the sequence's steps through the region op's autograd (chain_op.cpp records the gradient this way).
at::Tensor run_chain(const ChainProgram& c, at::TensorList operands, bool differentiable = false);

// The grouped runner (grouped.cpp).
at::Tensor run_grouped_chain(const ChainProgram& c, at::TensorList operands, bool differentiable);

// The gradient of a grouped chain whose steps are all plain grouped products (grouped_backward.cpp says which),
// without autograd: fills `out` (per operand; undefined: none) for the operands `wanted` marks and returns true;
// false (nothing done) for a chain of another form.
bool grouped_chain_backward(const ChainProgram& c, at::TensorList operands, const at::Tensor& grad,
                            const std::vector<bool>& wanted, std::vector<at::Tensor>& out);

// A keep chain's forward (grouped.cpp) hands its steps' results (the rows after each step's elementwise ops, all but
// the last) to the direct gradient, which takes them when its operands are the same tensors at the same versions.
void keep_intermediates(const ChainProgram& c, at::TensorList operands, std::vector<at::Tensor> results);

// Whether grouped_chain_backward takes this chain (grouped, every step a plain grouped product).
bool chain_has_direct_gradient(const ChainProgram& c);

// An elementwise op on a fresh result, in place unless autograd records it.
at::Tensor apply_elementwise(Elementwise f, at::Tensor t, bool in_place);

}  // namespace scorch::torch_glue
