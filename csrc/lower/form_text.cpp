#include "lower/form_text.h"

#include <sstream>

namespace scorch::forms {

bool product_factors(const ir::ExprPtr& e, std::vector<const ir::Expr*>& accesses, double& scale) {
  switch (e->kind) {
    case ir::ExprKind::access: accesses.push_back(e.get()); return true;
    case ir::ExprKind::literal: scale *= e->value; return true;
    case ir::ExprKind::neg: scale = -scale; return product_factors(e->a, accesses, scale);
    case ir::ExprKind::mul: return product_factors(e->a, accesses, scale) && product_factors(e->b, accesses, scale);
    default: return false;
  }
}

bool distinct_vars(const ir::Expr* a) { return a->vars.size() == 2 && a->vars[0] != a->vars[1]; }

std::string subst(std::string text, const std::vector<std::pair<std::string, std::string>>& vars) {
  for (const auto& [k, v] : vars) {
    for (size_t at = text.find(k); at != std::string::npos; at = text.find(k, at + v.size())) text.replace(at, k.size(), v);
  }
  return text;
}

void push_lines(loops::Stmts& out, const std::string& text) {
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(loops::line(l));
}

}  // namespace scorch::forms
