#include "dense_einsum.h"

#include <cctype>
#include <limits>
#include <map>

namespace scorch::torch_glue {

namespace {

// The letters of each factor and of the output; false when the equation is not in the simple form.
bool split_equation(const std::string& equation, size_t n, std::vector<std::string>& ins, std::string& out) {
  const size_t arrow = equation.find("->");
  if (arrow == std::string::npos || equation.find('.') != std::string::npos) return false;
  out = equation.substr(arrow + 2);
  const std::string lhs = equation.substr(0, arrow);
  ins.assign(1, "");
  for (char c : lhs) {
    if (c == ',')
      ins.emplace_back();
    else if (c != ' ')
      ins.back() += c;
  }
  return ins.size() == n;
}

}  // namespace

at::Tensor dense_einsum(const std::string& user_equation, const std::vector<at::Tensor>& factors) {
  // Scorch's parser takes any whitespace between subscripts; torch.einsum takes spaces but not tabs or newlines.
  std::string equation;
  for (char c : user_equation)
    if (!std::isspace(static_cast<unsigned char>(c))) equation += c;
  std::vector<std::string> ins;
  std::string out;
  if (factors.size() <= 2 || !split_equation(equation, factors.size(), ins, out)) return at::einsum(equation, factors);
  std::map<char, int64_t> size;
  for (size_t k = 0; k < factors.size(); ++k) {
    if (factors[k].dim() != static_cast<int64_t>(ins[k].size())) return at::einsum(equation, factors);  // einsum says why
    for (size_t d = 0; d < ins[k].size(); ++d) size[ins[k][d]] = std::max(size[ins[k][d]], factors[k].size(d));
  }
  std::vector<at::Tensor> ts = factors;
  while (ts.size() > 2) {
    size_t bi = 0, bj = 1;
    std::string best_letters;
    double best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < ts.size(); ++i) {
      for (size_t j = i + 1; j < ts.size(); ++j) {
        // The pair's result keeps a letter of either factor that the output or a third factor still holds.
        std::string kept;
        for (const std::string& side : {ins[i], ins[j]}) {
          for (char c : side) {
            if (kept.find(c) != std::string::npos) continue;
            bool needed = out.find(c) != std::string::npos;
            for (size_t k = 0; k < ts.size() && !needed; ++k) needed = k != i && k != j && ins[k].find(c) != std::string::npos;
            if (needed) kept += c;
          }
        }
        double elems = 1;
        for (char c : kept) elems *= static_cast<double>(size[c]);
        if (elems < best) best = elems, bi = i, bj = j, best_letters = kept;
      }
    }
    at::Tensor r = at::einsum(ins[bi] + "," + ins[bj] + "->" + best_letters, {ts[bi], ts[bj]});
    ts.erase(ts.begin() + static_cast<std::ptrdiff_t>(bj));  // bj > bi: erase it first
    ts.erase(ts.begin() + static_cast<std::ptrdiff_t>(bi));
    ins.erase(ins.begin() + static_cast<std::ptrdiff_t>(bj));
    ins.erase(ins.begin() + static_cast<std::ptrdiff_t>(bi));
    ts.push_back(std::move(r));
    ins.push_back(best_letters);
  }
  return at::einsum(ins[0] + "," + ins[1] + "->" + out, ts);
}

}  // namespace scorch::torch_glue
