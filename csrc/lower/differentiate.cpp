#include "lower/differentiate.h"

#include <algorithm>
#include <functional>
#include <map>

#include "common/error.h"

namespace scorch {

using ir::Expr;
using ir::ExprKind;
using ir::ExprPtr;

namespace {

// -a, with a double negation folded, so that signs do not deepen the gradient.
ExprPtr negate(const ExprPtr& a, size_t pos) { return a->kind == ExprKind::neg ? a->a : Expr::neg(a, pos); }

// The sum of `terms` as a balanced tree: a gradient gathers one term per access of the operand, and a chain
// of them would be as deep as there are accesses.
ExprPtr balanced_sum(const std::vector<ExprPtr>& terms, size_t begin, size_t end) {
  if (end - begin == 1) return terms[begin];
  const size_t mid = begin + (end - begin) / 2;
  return Expr::binary(ExprKind::add, balanced_sum(terms, begin, mid), balanced_sum(terms, mid, end),
                      terms[begin]->pos);
}

// d e / d (the access with id `target`); null means zero. Never higher than `e` itself.
ExprPtr partial(const ExprPtr& e, int target) {
  switch (e->kind) {
    case ExprKind::access: return e->access_id == target ? Expr::literal(1.0, e->pos) : nullptr;
    case ExprKind::literal: return nullptr;
    case ExprKind::neg: {
      ExprPtr d = partial(e->a, target);
      return d ? negate(d, e->pos) : nullptr;
    }
    case ExprKind::add:
    case ExprKind::sub: {
      ExprPtr da = partial(e->a, target), db = partial(e->b, target);
      if (!db) return da;
      if (e->kind == ExprKind::sub) db = negate(db, e->pos);
      return da ? Expr::binary(ExprKind::add, da, db, e->pos) : db;
    }
    case ExprKind::mul: {
      ExprPtr da = partial(e->a, target), db = partial(e->b, target);
      ExprPtr left = da ? (da->kind == ExprKind::literal && da->value == 1.0 ? e->b : Expr::binary(ExprKind::mul, da, e->b, e->pos)) : nullptr;
      ExprPtr right = db ? (db->kind == ExprKind::literal && db->value == 1.0 ? e->a : Expr::binary(ExprKind::mul, e->a, db, e->pos)) : nullptr;
      if (!left) return right;
      if (!right) return left;
      return Expr::binary(ExprKind::add, left, right, e->pos);
    }
  }
  return nullptr;
}

ExprPtr rename(const ExprPtr& e, const std::map<int, int>& map, int& next_access) {
  switch (e->kind) {
    case ExprKind::access: {
      std::vector<int> vars;
      for (int v : e->vars) vars.push_back(map.at(v));
      return Expr::access(e->tensor, next_access++, vars, e->var_pos, e->pos);
    }
    case ExprKind::literal: return e;
    case ExprKind::neg: return Expr::neg(rename(e->a, map, next_access), e->pos);
    default: {
      ExprPtr a = rename(e->a, map, next_access);
      return Expr::binary(e->kind, a, rename(e->b, map, next_access), e->pos);
    }
  }
}

}  // namespace

std::optional<ir::Statement> differentiate(const ir::Statement& st, int tensor, bool with_pattern) {
  std::vector<const Expr*> acc;
  ir::collect_accesses(st.rhs, acc);
  std::vector<const Expr*> mine;
  for (const Expr* a : acc)
    if (a->tensor == tensor) mine.push_back(a);
  if (mine.empty()) return std::nullopt;

  ir::Statement g;
  g.source = st.source;
  g.tensor_names = st.tensor_names;
  g.tensor_names.push_back("grad_output");
  if (with_pattern) g.tensor_names.push_back("pattern");
  const int G = st.num_tensors(), P = st.num_tensors() + 1;
  // The gradient's indices I: fresh variables, one per dimension of T.
  const size_t rank = mine[0]->vars.size();
  for (size_t d = 0; d < rank; ++d) {
    g.var_names.push_back(fmt::format("d{}", d));
    g.out_vars.push_back(static_cast<int>(d));
    g.out_var_pos.push_back(mine[0]->pos);
  }
  int next_access = 0;
  std::vector<ExprPtr> terms;
  for (const Expr* a : mine) {
    std::vector<int> sorted = a->vars;
    std::sort(sorted.begin(), sorted.end());
    SCORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                 "cannot differentiate with respect to {}: it is indexed with a repeated index", st.tensor_names[tensor]);
    ExprPtr d = partial(st.rhs, a->access_id);
    if (!d) continue;
    // This access's indices become I; every other index gets a fresh variable of this contribution.
    std::map<int, int> map;
    for (size_t k = 0; k < rank; ++k) map[a->vars[k]] = static_cast<int>(k);
    for (int v = 0; v < st.num_vars(); ++v) {
      if (!map.count(v)) {
        map[v] = static_cast<int>(g.var_names.size());
        g.var_names.push_back(st.var_names[v] + "'");
      }
    }
    std::vector<int> out_vars;
    for (int v : st.out_vars) out_vars.push_back(map.at(v));
    ExprPtr term = Expr::access(G, next_access++, out_vars, std::vector<size_t>(out_vars.size(), a->pos), a->pos);
    ExprPtr coef = rename(d, map, next_access);
    if (!(coef->kind == ExprKind::literal && coef->value == 1.0)) term = Expr::binary(ExprKind::mul, term, coef, a->pos);
    if (with_pattern) {
      // Each contribution is sampled at T's pattern on its own, so none is ever formed densely.
      std::vector<int> ivars(rank);
      for (size_t k = 0; k < rank; ++k) ivars[k] = static_cast<int>(k);
      term = Expr::binary(ExprKind::mul, Expr::access(P, next_access++, ivars, std::vector<size_t>(rank, a->pos), a->pos),
                          term, a->pos);
    }
    terms.push_back(term);
  }
  if (terms.empty()) return std::nullopt;
  g.rhs = balanced_sum(terms, 0, terms.size());
  // The gradient is parsed again as a kernel's statement: refuse here, clearly, what the parser would.
  const int height = ir::expr_height(g.rhs);
  SCORCH_CHECK(height <= ir::kMaxExprHeight && ir::expr_size(g.rhs, ir::kMaxExprNodes + 1) <= ir::kMaxExprNodes,
               "cannot differentiate with respect to {}: its gradient expression would be {} (at most {} levels "
               "and {} operators and operands)", st.tensor_names[tensor],
               height > ir::kMaxExprHeight ? fmt::format("{} levels deep", height) : "too large",
               ir::kMaxExprHeight, ir::kMaxExprNodes);
  return g;
}

}  // namespace scorch
