#include "lower/schedule.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "lower/assemble.h"

namespace scorch {

std::vector<int> level_vars(const Format& f, const std::vector<int>& access_vars) {
  std::vector<int> vars;
  for (const auto& l : f.levels()) vars.push_back(access_vars[l.expr.dim]);
  return vars;
}

std::vector<int> ordered_level_vars(const Format& f, const std::vector<int>& access_vars) {
  std::vector<int> vars;
  for (const auto& l : f.levels())
    if (l.expr.part != LevelExpr::Part::inner) vars.push_back(access_vars[l.expr.dim]);
  return vars;
}

std::vector<std::pair<int, int>> order_constraints(const KernelSpec& spec) {
  std::vector<std::pair<int, int>> c;
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(spec.stmt.rhs, acc);
  for (const ir::Expr* a : acc) {
    const Storage& s = spec.operands[a->tensor];
    if (s.strided()) continue;
    const auto vars = ordered_level_vars(*s.format, a->vars);
    for (size_t l = 1; l < vars.size(); ++l) c.emplace_back(vars[l - 1], vars[l]);
  }
  return c;
}

namespace {

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// Variables walked by a level of some level-format operand (any kind: a CSR's dense row level too). The
// others index only strided operands and the output, and vectorize best innermost.
std::vector<int> sparse_vars(const KernelSpec& spec) {
  std::vector<int> out;
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(spec.stmt.rhs, acc);
  for (const ir::Expr* a : acc) {
    const Storage& s = spec.operands[a->tensor];
    if (s.strided() || s.format->all_dense()) continue;
    for (const auto& l : s.format->levels()) out.push_back(a->vars[l.expr.dim]);
  }
  return out;
}

// The output's variables in its storage order.
std::vector<int> output_storage_vars(const KernelSpec& spec) {
  if (spec.output.strided()) return spec.stmt.out_vars;
  return level_vars(*spec.output.format, spec.stmt.out_vars);
}

bool is_product(const ir::ExprPtr& e) {
  switch (e->kind) {
    case ir::ExprKind::access:
    case ir::ExprKind::literal: return true;
    case ir::ExprKind::mul: return is_product(e->a) && is_product(e->b);
    case ir::ExprKind::neg: return is_product(e->a);
    default: return false;
  }
}

}  // namespace

const ir::Expr* sole_sparse_factor(const KernelSpec& spec) {
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(spec.stmt.rhs, acc);
  const ir::Expr* only = nullptr;
  for (const ir::Expr* a : acc) {
    const Storage& s = spec.operands[a->tensor];
    if (s.strided() || s.format->all_dense()) continue;
    if (only) return nullptr;
    only = a;
  }
  return only;
}

int sampling_operand(const KernelSpec& spec) {
  if (spec.output.strided() || !is_product(spec.stmt.rhs)) return -1;
  // Only with a single level-format factor: with two, the output is their intersection, and writing the
  // first one's whole pattern would store explicit zeros wherever the other has none.
  const ir::Expr* only = sole_sparse_factor(spec);
  if (!only || !(*spec.operands[only->tensor].format == *spec.output.format) || only->vars != spec.stmt.out_vars)
    return -1;
  return only->tensor;
}

SharedFibers shared_fibers(const KernelSpec& spec) {
  if (spec.output.strided() || !is_product(spec.stmt.rhs)) return {};
  const ir::Expr* only = sole_sparse_factor(spec);
  if (!only) return {};
  const auto& in = spec.operands[only->tensor].format->levels();
  const auto& out = spec.output.format->levels();
  const auto in_vars = level_vars(*spec.operands[only->tensor].format, only->vars);
  const auto out_vars = level_vars(*spec.output.format, spec.stmt.out_vars);
  size_t shared = 0;
  while (shared < out.size() && shared + 1 < in.size()) {
    const Level& a = in[shared];
    const Level& b = out[shared];
    const auto& pa = a.kind->properties();
    if (a.kind->name() != b.kind->name() || !(pa == b.kind->properties()) || !pa.unique || !pa.ordered ||
        a.expr.part != LevelExpr::Part::whole || b.expr.part != LevelExpr::Part::whole ||
        in_vars[shared] != out_vars[shared])
      break;
    ++shared;
  }
  if (shared == 0) return {};
  for (size_t l = shared; l < out.size(); ++l) {
    const Level& b = out[l];
    if (b.kind->walk() != LevelWalk::locate || !b.kind->buffer_names().empty() || b.expr.part != LevelExpr::Part::whole ||
        contains(in_vars, out_vars[l]))
      return {};
  }
  // At least one shared level stores positions of its own (else the output is dense in all but name).
  bool sparse = false;
  for (size_t l = 0; l < shared; ++l) sparse |= in[l].kind->walk() != LevelWalk::locate;
  if (!sparse) return {};
  return {only->tensor, static_cast<int>(shared)};
}

std::vector<int> choose_loop_order(const KernelSpec& spec, const std::vector<std::pair<int, int>>& constraints) {
  const int n = spec.stmt.num_vars();
  const auto sparse = sparse_vars(spec);
  const auto out_order = output_storage_vars(spec);
  std::vector<int> order;
  std::vector<bool> placed(n, false);
  for (int step = 0; step < n; ++step) {
    int best = -1;
    auto key = [&](int v) {
      const int out_pos = static_cast<int>(std::find(out_order.begin(), out_order.end(), v) - out_order.begin());
      // Variables of sparse operands' levels first (they are where the work is), then output variables in
      // storage order (parallel, race-free outer loops and ordered sparse output), then the rest.
      return std::make_tuple(contains(sparse, v) ? 0 : 1, out_pos, v);
    };
    for (int v = 0; v < n; ++v) {
      if (placed[v]) continue;
      bool ready = true;
      for (auto [a, b] : constraints) ready &= !(b == v && !placed[a] && a != b);
      for (auto [a, b] : constraints) ready &= !(a == b && a == v);  // a self-loop can never be satisfied
      if (ready && (best < 0 || key(v) < key(best))) best = v;
    }
    if (best < 0) return {};
    placed[best] = true;
    order.push_back(best);
  }
  return order;
}

Schedule make_schedule(const KernelSpec& spec) {
  Schedule s;
  const auto& st = spec.stmt;
  const auto constraints = order_constraints(spec);
  s.order = choose_loop_order(spec, constraints);
  SCORCH_CHECK(!s.order.empty() || st.num_vars() == 0,
               "no loop order walks every sparse operand in its storage order; convert an operand first "
               "(the planner does this: {})",
               spec.str());
  {
    std::string why = "loop order ";
    for (int v : s.order) why += st.var_names[v] + " ";
    why += ": every level-format operand walked in level order";
    const auto sv = sparse_vars(spec);
    if (!sv.empty()) why += "; sparse operands' level variables placed outermost";
    s.reasons.push_back(why);
  }
  const int n = static_cast<int>(s.order.size());
  const auto out_vars = output_storage_vars(spec);
  const int m = static_cast<int>(out_vars.size());
  auto prefix_is = [&](const std::vector<int>& vars, int len) {
    if (len > n) return false;
    for (int d = 0; d < len; ++d)
      if (s.order[d] != vars[d]) return false;
    return true;
  };

  bool blocked_output = false;
  if (!spec.output.strided())
    for (const auto& l : spec.output.format->levels()) blocked_output |= l.expr.part != LevelExpr::Part::whole;
  if (spec.output.strided()) {
    s.output = OutputMode::dense;
    s.reasons.push_back("dense output: updated in place");
  } else if (blocked_output) {
    s.output = OutputMode::coords;
    s.reasons.push_back("blocked output format: coordinates collected, then packed into blocks");
  } else if (const int t = sampling_operand(spec); t >= 0 && prefix_is(out_vars, m)) {
    s.output = OutputMode::sampled;
    s.emit_depth = m - 1;
    s.sampled_tensor = t;
    s.reasons.push_back(fmt::format("output has the pattern of operand t{} (a product with it, same format and "
                                    "indices): each value is written at its position, its index buffers shared",
                                    t));
  } else if (const SharedFibers f = shared_fibers(spec); f.tensor >= 0 && prefix_is(out_vars, f.levels)) {
    s.output = OutputMode::fibers;
    s.emit_depth = f.levels - 1;
    s.sampled_tensor = f.tensor;
    s.shared_levels = f.levels;
    s.reasons.push_back(fmt::format("output shares the first {} level(s) of operand t{}, the rest dense: a block of "
                                    "values under each of its positions, updated in place, its index buffers copied",
                                    f.levels, f.tensor));
  } else if (prefix_is(out_vars, m)) {
    s.output = OutputMode::append;
    s.emit_depth = m - 1;
    s.reasons.push_back(m < n ? "sparse output reached in storage order; reductions inside are accumulated in a "
                                "scalar and each entry appended once"
                              : "sparse output reached in storage order: entries appended");
  } else if (m >= 1 && prefix_is(out_vars, m - 1)) {
    s.output = OutputMode::workspace;
    s.emit_depth = m - 2;
    s.workspace_var = out_vars[m - 1];
    s.reasons.push_back(fmt::format("sparse output's last variable {} is reached inside a reduction: a dense "
                                    "workspace over it collects each {} before it is sorted and appended",
                                    st.var_names[s.workspace_var], m >= 2 ? "row" : "result"));
  } else {
    s.output = OutputMode::coords;
    s.reasons.push_back("sparse output reached out of order: coordinates collected, then sorted and summed");
  }

  if (n == 0) {
    s.reasons.push_back("no loops");
    return s;
  }
  // A native form that writes the sparse output itself (lower/assemble.h) has no streams to join.
  const bool assembled = !spec.output.strided() && match_assembled(spec).has_value();
  if (assembled)
    s.reasons.back() = "sparse output assembled in the kernel as CSR (a native form, lower/assemble.h)";
  const int outer = s.order[0];
  const bool outer_is_output = std::find(st.out_vars.begin(), st.out_vars.end(), outer) != st.out_vars.end();
  s.parallel = true;
  if (spec.output.strided() && !outer_is_output) {
    s.private_output = true;
    s.reasons.push_back(fmt::format("outer loop {} is a reduction: each thread sums into its own copy of the "
                                    "output, added up at the end",
                                    st.var_names[outer]));
  } else {
    s.reasons.push_back(fmt::format("outer loop {} split among threads{}", st.var_names[outer],
                                    spec.output.strided() || s.output == OutputMode::fibers
                                        ? " (each writes its own output entries)"
                                    : assembled           ? " (each writes its own rows of the output)"
                                                          : " (per-thread output streams, joined in order)"));
  }
  return s;
}

double estimate_nest_cost(const KernelSpec& spec, const std::vector<int>& order, const std::vector<int64_t>& var_sizes,
                          const std::vector<int64_t>& nnz, bool sparse_output) {
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(spec.stmt.rhs, acc);
  auto extent = [&](int v) { return std::max(1.0, static_cast<double>(var_sizes.at(v))); };
  // Each level-format access as the variables of its levels, whether each is iterated, and the mean length
  // of a segment of each (positions of the level over positions of its parent).
  struct Walk {
    std::vector<int> vars;
    std::vector<bool> iterated;
    std::vector<double> length;
    size_t next = 0;
  };
  std::vector<Walk> walks;
  for (const ir::Expr* a : acc) {
    const Storage& s = spec.operands[a->tensor];
    if (s.strided()) continue;
    Walk w;
    const double stored = std::max(1.0, static_cast<double>(nnz.at(a->tensor)));
    double parents = 1;
    const auto& levels = s.format->levels();
    for (size_t l = 0; l < levels.size(); ++l) {
      const Level& lvl = levels[l];
      const int v = a->vars[lvl.expr.dim];
      double ext = extent(v);
      if (lvl.expr.part == LevelExpr::Part::outer) ext = std::max(1.0, std::floor(ext / std::max<int64_t>(lvl.expr.block, 1)));
      if (lvl.expr.part == LevelExpr::Part::inner) ext = static_cast<double>(std::max<int64_t>(lvl.expr.block, 1));
      const bool it = lvl.kind->walk() != LevelWalk::locate;
      const double positions = !it ? parents * ext : l + 1 == levels.size() ? stored : std::min(stored, parents * ext);
      w.vars.push_back(v);
      w.iterated.push_back(it);
      w.length.push_back(positions / std::max(parents, 1.0));
      parents = positions;
    }
    walks.push_back(std::move(w));
  }
  const bool product = is_product(spec.stmt.rhs);
  double count = 1, cost = 0;
  for (int v : order) {
    const double n = extent(v);
    std::vector<double> lengths;
    for (auto& w : walks) {
      bool iterated = false;
      double len = 1;
      // Every level of the access at this variable (a blocked dimension has two) is walked here.
      while (w.next < w.vars.size() && w.vars[w.next] == v) {
        if (w.iterated[w.next]) {
          iterated = true;
          len *= w.length[w.next];
        }
        ++w.next;
      }
      if (iterated) lengths.push_back(len);
    }
    double visits = 0, passed = 0;
    if (lengths.empty()) {
      visits = passed = n;
    } else if (product) {
      passed = n;
      for (double l : lengths) {
        visits += l;
        passed *= std::min(1.0, l / n);
      }
    } else {
      for (double l : lengths) visits += l;
      passed = std::min(n, visits);
    }
    cost += count * visits;
    count *= passed;
  }
  cost += count;
  if (spec.output.strided() && !sparse_output && !order.empty() &&
      !std::count(spec.stmt.out_vars.begin(), spec.stmt.out_vars.end(), order[0])) {
    // An outer reduction over a dense output: each thread sums into a copy of the output, added up after.
    double numel = 1;
    for (int v : spec.stmt.out_vars) numel *= extent(v);
    cost += numel;
  }
  if (sparse_output) {
    // Coordinates collected out of storage order are sorted afterwards: about log2 of their number per entry.
    const auto out_vars = output_storage_vars(spec);
    const size_t m = out_vars.size();
    bool in_order = m <= order.size();
    for (size_t d = 0; in_order && d + 1 < m; ++d) in_order = order[d] == out_vars[d];
    if (!in_order) cost += 4 * count * std::log2(count + 2);
  }
  return cost;
}

std::string Schedule::str(const ir::Statement& st) const {
  std::string s = "order:";
  for (int v : order) s += " " + st.var_names[v];
  const char* modes[] = {"dense", "append", "workspace", "coords", "sampled", "fibers"};
  s += fmt::format("; output: {}", modes[static_cast<int>(output)]);
  if (workspace_var >= 0) s += fmt::format(" over {}", st.var_names[workspace_var]);
  s += parallel ? "; parallel outer loop" : "; serial";
  if (private_output) s += " with private outputs";
  return s;
}

}  // namespace scorch
