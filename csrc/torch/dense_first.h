// Dense factors first: where an eager einsum contracts its dense factors with ATen before the sparse product
// (executor.cpp, run_einsum, for the user's eager calls only).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "executor.h"

namespace scorch::torch_glue {

// Dense factors first. An index summed over that no sparse operand holds (ik,kl,lj->ij with A sparse: l) is
// walked for every stored entry when the product runs as one loop nest: nnz x L x R multiply-adds. Contracted
// first among the dense factors that hold it (dense ATen, K x L x R), the rest is a product led by the sparse
// operands (nnz x R). Taken when the estimate at least halves; MTTKRP-like products, whose every summed index
// is a sparse operand's, never split.
struct DenseFirst {
  std::string dense_eq;    // the dense factors' contraction
  std::vector<int> group;  // the operands it takes
  std::string rest_eq;     // the remaining product: the other operands in order, then the contraction's result
  std::vector<int> rest;   // the other operands
  std::string why;
};

// The split for these operands, or none (a product that stays one loop nest).
std::optional<DenseFirst> plan_dense_first(const std::string& equation, const std::vector<Operand>& ops);

// plan_dense_first cached by the executor's plan key (the decision depends on nothing the key does not hold).
std::shared_ptr<const std::optional<DenseFirst>> dense_first_for(const std::string& key, const std::string& equation,
                                                                 const std::vector<Operand>& ops);

}  // namespace scorch::torch_glue
