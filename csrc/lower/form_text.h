// Helpers shared by the native forms that write their kernels as blocks of C++ text (assemble.cpp,
// sampled_dot.cpp): reading a statement's product, and turning generated text into loop IR lines.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ir/expr.h"
#include "lower/loop_ir.h"

namespace scorch::forms {

// The factors of a product tree (accesses, literals; negations folded into the sign): false when `e` is not
// a product.
bool product_factors(const ir::ExprPtr& e, std::vector<const ir::Expr*>& accesses, double& scale);

// A matrix access with two different variables.
bool distinct_vars(const ir::Expr* a);

// `text` with each $NAME token replaced (every name ends where a non-name character follows).
std::string subst(std::string text, const std::vector<std::pair<std::string, std::string>>& vars);

// One statement per non-empty line of `text` (generated code written as a block of C++).
void push_lines(loops::Stmts& out, const std::string& text);

}  // namespace scorch::forms
