#include "lower/merge_lattice.h"

#include <algorithm>

namespace scorch {

using ir::Expr;
using ir::ExprKind;
using ir::ExprPtr;

bool iterators_subset(const std::vector<int>& sub, const std::vector<int>& super) {
  return std::includes(super.begin(), super.end(), sub.begin(), sub.end());
}

namespace {

std::vector<int> unite(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> u;
  std::set_union(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(u));
  return u;
}

bool has_full_point(const std::vector<LatticePoint>& l) {
  for (const auto& p : l)
    if (p.iterators.empty()) return true;
  return false;
}

std::vector<LatticePoint> lattice(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here) {
  switch (e->kind) {
    case ExprKind::access:
      if (sparse_here(*e)) return {{{e->access_id}, e}};
      return {{{}, e}};
    case ExprKind::literal: return {{{}, e}};
    case ExprKind::neg: {
      auto l = lattice(e->a, sparse_here);
      for (auto& p : l) p.expr = Expr::neg(p.expr, e->pos);
      return l;
    }
    case ExprKind::mul: {
      auto a = lattice(e->a, sparse_here), b = lattice(e->b, sparse_here);
      std::vector<LatticePoint> out;
      for (const auto& p : a)
        for (const auto& q : b) out.push_back({unite(p.iterators, q.iterators), Expr::binary(e->kind, p.expr, q.expr, e->pos)});
      return out;
    }
    case ExprKind::add:
    case ExprKind::sub: {
      auto a = lattice(e->a, sparse_here), b = lattice(e->b, sparse_here);
      std::vector<LatticePoint> out;
      for (const auto& p : a)
        for (const auto& q : b) out.push_back({unite(p.iterators, q.iterators), Expr::binary(e->kind, p.expr, q.expr, e->pos)});
      // Where one side has no coordinate, only the other contributes; a side with an always-present point
      // is never absent.
      if (!has_full_point(b))
        for (const auto& p : a) out.push_back(p);
      if (!has_full_point(a))
        for (const auto& q : b) out.push_back({q.iterators, e->kind == ExprKind::sub ? Expr::neg(q.expr, e->pos) : q.expr});
      return out;
    }
  }
  return {};
}

}  // namespace

std::vector<LatticePoint> build_lattice(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here) {
  auto l = lattice(e, sparse_here);
  std::stable_sort(l.begin(), l.end(),
                   [](const LatticePoint& x, const LatticePoint& y) { return x.iterators.size() > y.iterators.size(); });
  // Drop repeated iterator sets (keep the first, which came from the fuller expression).
  std::vector<LatticePoint> out;
  for (auto& p : l) {
    bool seen = false;
    for (const auto& q : out) seen |= q.iterators == p.iterators;
    if (!seen) out.push_back(std::move(p));
  }
  return out;
}

}  // namespace scorch
