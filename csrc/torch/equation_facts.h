// Facts about an einsum equation and its operands that the executor's choices read (executor.cpp).
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "executor.h"

namespace scorch::torch_glue {

// Does a stored sparse operand's term hold exactly the output's letters (each once)? Every einsum operand is a
// factor, so the result is zero wherever that operand stores nothing: a sampled product ("ij,ik,jk->ij").
inline bool sampled_by_a_factor(const std::string& equation, const std::vector<Operand>& ops) {
  const size_t arrow = equation.find("->");
  if (arrow == std::string::npos || equation.find('.') != std::string::npos) return false;
  auto letters_of = [](const std::string& term) {
    std::string l;
    for (char c : term)
      if (std::isalpha(static_cast<unsigned char>(c))) l += c;
    std::sort(l.begin(), l.end());
    return l;
  };
  const std::string out = letters_of(equation.substr(arrow + 2));
  if (out.empty() || std::adjacent_find(out.begin(), out.end()) != out.end()) return false;
  const std::string lhs = equation.substr(0, arrow);
  size_t start = 0;
  for (size_t k = 0; k < ops.size() && start <= lhs.size(); ++k) {
    const size_t end = std::min(lhs.find(',', start), lhs.size());
    if (ops[k].sparse() && letters_of(lhs.substr(start, end - start)) == out) return true;
    start = end + 1;
  }
  return false;
}

// Does an operand that needs a gradient repeat an index in its term of `equation` ("ii,i->i")?
inline bool diagonal_needs_grad(const std::string& equation, const std::vector<Operand>& ops) {
  // (the common call wants no gradient: no parse of the equation then)
  if (std::none_of(ops.begin(), ops.end(), [](const Operand& o) { return o.values.requires_grad(); })) return false;
  const std::string lhs = equation.substr(0, equation.find("->"));
  size_t start = 0;
  for (size_t k = 0; k < ops.size() && start <= lhs.size(); ++k) {
    const size_t end = std::min(lhs.find(',', start), lhs.size());
    std::string letters;
    for (size_t c = start; c < end; ++c)
      if (std::isalpha(static_cast<unsigned char>(lhs[c]))) letters += lhs[c];
    std::sort(letters.begin(), letters.end());
    if (ops[k].values.requires_grad() && std::adjacent_find(letters.begin(), letters.end()) != letters.end())
      return true;
    start = end + 1;
  }
  return false;
}

}  // namespace scorch::torch_glue
