#include "ir/split_reductions.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "common/error.h"

namespace scorch::ir {
namespace {

struct Node {
  ExprPtr e;
  int parent;
};

void flatten(const ExprPtr& e, int parent, std::vector<Node>& nodes) {
  const int me = static_cast<int>(nodes.size());
  nodes.push_back({e, parent});
  if (e->a) flatten(e->a, me, nodes);
  if (e->b) flatten(e->b, me, nodes);
}

bool is_sum(const Expr& e) { return e.kind == ExprKind::add || e.kind == ExprKind::sub; }

std::vector<int> ancestors(const std::vector<Node>& nodes, int n) {
  std::vector<int> path;
  for (; n >= 0; n = nodes[n].parent) path.push_back(n);
  std::reverse(path.begin(), path.end());
  return path;
}

// Replace node `target` (by identity) with `with`.
ExprPtr replace(const ExprPtr& e, const Expr* target, const ExprPtr& with) {
  if (e.get() == target) return with;
  switch (e->kind) {
    case ExprKind::access:
    case ExprKind::literal: return e;
    case ExprKind::neg: return Expr::neg(replace(e->a, target, with), e->pos);
    default: return Expr::binary(e->kind, replace(e->a, target, with), replace(e->b, target, with), e->pos);
  }
}

// A statement over `rhs` whose tensors are renumbered locally; fills the global ids of its operands.
Step make_step(const Statement& base, const std::vector<std::string>& global_names, const std::vector<int>& out_vars,
               const ExprPtr& rhs) {
  Step s;
  std::map<int, int> local;
  int next_access = 0;
  std::function<ExprPtr(const ExprPtr&)> renumber = [&](const ExprPtr& e) -> ExprPtr {
    switch (e->kind) {
      case ExprKind::access: {
        auto it = local.find(e->tensor);
        if (it == local.end()) {
          it = local.emplace(e->tensor, static_cast<int>(s.operands.size())).first;
          s.operands.push_back(e->tensor);
        }
        return Expr::access(it->second, next_access++, e->vars, e->var_pos, e->pos);
      }
      case ExprKind::literal: return e;
      case ExprKind::neg: return Expr::neg(renumber(e->a), e->pos);
      default: {
        ExprPtr a = renumber(e->a);
        return Expr::binary(e->kind, a, renumber(e->b), e->pos);
      }
    }
  };
  s.stmt.source = base.source;
  s.stmt.var_names = base.var_names;
  s.stmt.out_vars = out_vars;
  s.stmt.out_var_pos.assign(out_vars.size(), 0);
  s.stmt.rhs = renumber(rhs);
  for (int g : s.operands) s.stmt.tensor_names.push_back(global_names[g]);
  return s;
}

// The variables of the accesses below node n.
std::set<int> vars_below(const std::vector<Node>& nodes, int n) {
  std::vector<const Expr*> acc;
  collect_accesses(nodes[n].e, acc);
  std::set<int> vars;
  for (const Expr* a : acc) vars.insert(a->vars.begin(), a->vars.end());
  return vars;
}

}  // namespace

std::vector<Step> split_reductions(const Statement& st, const std::vector<int64_t>& var_sizes) {
  std::vector<Step> steps;
  std::vector<std::string> names = st.tensor_names;
  ExprPtr rhs = st.rhs;
  for (;;) {
    std::vector<Node> nodes;
    flatten(rhs, -1, nodes);
    std::map<int, std::vector<int>> uses;  // reduction var -> access nodes using it
    for (int n = 0; n < static_cast<int>(nodes.size()); ++n)
      if (nodes[n].e->kind == ExprKind::access)
        for (int v : nodes[n].e->vars)
          if (std::find(st.out_vars.begin(), st.out_vars.end(), v) == st.out_vars.end()) uses[v].push_back(n);
    // Each reduction's scope: the term (child of a + or -) holding all its uses, or the root.
    std::map<int, int> scope;
    for (const auto& [v, us] : uses) {
      std::vector<int> lca = ancestors(nodes, us[0]);
      for (int u : us) {
        const auto path = ancestors(nodes, u);
        size_t k = 0;
        while (k < lca.size() && k < path.size() && lca[k] == path[k]) ++k;
        lca.resize(k);
      }
      int s = 0;
      for (size_t k = lca.size(); k-- > 1;) {
        if (is_sum(*nodes[nodes[lca[k]].parent].e)) {
          s = lca[k];
          break;
        }
      }
      // One factor (an access) holds every use, and the rest of its term varies over other indices: the sum
      // goes to that factor (between the two, only products and negations: the sum's scope was the term).
      const int factor = lca.back();
      if (factor != s && nodes[factor].e->kind == ExprKind::access) {
        const std::set<int> mine = vars_below(nodes, factor), term = vars_below(nodes, s);
        const bool crosses = std::any_of(term.begin(), term.end(), [&](int w) { return !mine.count(w); });
        long double kept = 1;
        for (int w : mine)
          if (w != v && w < static_cast<int>(var_sizes.size())) kept *= static_cast<long double>(std::max<int64_t>(var_sizes[w], 1));
        if (crosses && kept <= static_cast<long double>(kMaxFactorTemporary)) s = factor;
      }
      scope[v] = s;
    }
    // The deepest non-root scope is split off first.
    int target = -1;
    size_t depth = 0;
    for (const auto& [v, s] : scope) {
      if (s == 0) continue;
      const size_t d = ancestors(nodes, s).size();
      if (target < 0 || d > depth) {
        target = s;
        depth = d;
      }
    }
    if (target < 0) break;
    // The temporary keeps the term's variables that are not summed inside it.
    std::vector<const Expr*> acc;
    collect_accesses(nodes[target].e, acc);
    std::vector<int> keep;
    for (const Expr* a : acc)
      for (int v : a->vars) {
        bool summed_here = false;
        if (scope.count(v)) {
          const auto up = ancestors(nodes, scope[v]);  // summed at the target or inside it
          summed_here = std::find(up.begin(), up.end(), target) != up.end();
        }
        if (!summed_here && std::find(keep.begin(), keep.end(), v) == keep.end()) keep.push_back(v);
      }
    steps.push_back(make_step(st, names, keep, nodes[target].e));
    const int tmp = static_cast<int>(names.size());
    names.push_back(fmt::format("temporary {}", steps.size()));
    std::vector<size_t> pos(keep.size(), nodes[target].e->pos);
    rhs = replace(rhs, nodes[target].e.get(), Expr::access(tmp, -1, keep, pos, nodes[target].e->pos));
  }
  steps.push_back(make_step(st, names, st.out_vars, rhs));
  return steps;
}

}  // namespace scorch::ir
