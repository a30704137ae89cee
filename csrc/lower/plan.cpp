#include "lower/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <set>

#include "common/error.h"
#include "ir/parser.h"
#include "lower/blocked.h"
#include "lower/kernel_spec.h"
#include "lower/nm.h"
#include "lower/schedule.h"

namespace scorch {
namespace {

bool compilable(const Format& f) {
  const auto& ls = f.levels();
  for (size_t l = 0; l < ls.size(); ++l) {
    if (ls[l].kind->walk() == LevelWalk::none) return false;
    if (ls[l].expr.part != LevelExpr::Part::whole || !ls[l].kind->properties().ordered) return false;
    // A cursor level (a bitmap) is walked from one parent position at a time: under a unique level.
    if (ls[l].kind->coordinate_cursor() && (!ls[l].kind->properties().unique || (l > 0 && !ls[l - 1].kind->properties().unique)))
      return false;
    // A run of equal coordinates of a non-unique level is one position to the loops, its children's segments
    // joined: a last level's run (duplicate entries, to be summed) or a dense child (one row per position) is not
    // a segment, and only the run's first entry would be read. The conversion sums them.
    if (!ls[l].kind->properties().unique && (l + 1 == ls.size() || ls[l + 1].kind->walk() == LevelWalk::locate))
      return false;
  }
  return true;
}

std::string level_text(const Level& l, int dim) {
  const auto& p = l.kind->properties();
  std::string props;
  if (!p.unique) props += "nonunique";
  if (!p.ordered) props += std::string(props.empty() ? "" : ",") + "unordered";
  return l.kind->name() + (props.empty() ? "" : "[" + props + "]") + fmt::format("({})", dim);
}

// Level l of f as text for a format that stores another dimension order or another pattern (a conversion to
// loop order, an output): a singleton level under a unique parent (or first) holds exactly one entry per
// parent, a promise about this pattern in this order only, so it is written compressed there (helper-45: a
// row-unique `compressed(0),singleton(1)` converted to column order, or copied for the union A + B, failed
// with "a singleton level needs exactly one coordinate per parent"). Under a non-unique parent (COO) each
// entry has a parent of its own, and the level keeps its kind.
std::string retargeted_level_text(const Format& f, size_t l, int dim) {
  const Level& lvl = f.levels()[l];
  const bool unique_parent = l == 0 || f.levels()[l - 1].kind->properties().unique;
  if (lvl.kind->one_child_per_parent() && unique_parent) return fmt::format("compressed({})", dim);
  return level_text(lvl, dim);
}

// Whether an expression adds or subtracts terms (a union of patterns), not only multiplies.
bool has_sum(const ir::Expr& e) {
  if (e.kind == ir::ExprKind::add || e.kind == ir::ExprKind::sub) return true;
  return (e.a && has_sum(*e.a)) || (e.b && has_sum(*e.b));
}

// A compilable format holding the same data: dense levels first in their order, the rest compressed.
std::string compilable_equivalent(const Format& f) {
  std::vector<int> dims;
  bool dense_prefix = true, first = true;
  std::string out;
  for (const auto& l : f.levels())
    if (std::find(dims.begin(), dims.end(), l.expr.dim) == dims.end()) dims.push_back(l.expr.dim);
  for (size_t k = 0; k < dims.size(); ++k) {
    const bool dense = f.levels()[0].kind->walk() == LevelWalk::locate && k + 1 < dims.size() && dense_prefix;
    dense_prefix = dense;
    out += std::string(first ? "" : ",") + (dense ? "dense" : "compressed") + fmt::format("({})", dims[k]);
    first = false;
  }
  return out;
}

// Does the constraint graph have a cycle?
bool cyclic(int n, const std::vector<std::pair<int, int>>& edges) {
  std::vector<int> indeg(n, 0);
  for (auto [a, b] : edges) {
    if (a == b) return true;
    indeg[b]++;
  }
  std::vector<int> ready;
  for (int v = 0; v < n; ++v)
    if (!indeg[v]) ready.push_back(v);
  int seen = 0;
  while (!ready.empty()) {
    const int v = ready.back();
    ready.pop_back();
    ++seen;
    for (auto [a, b] : edges)
      if (a == v && --indeg[b] == 0) ready.push_back(b);
  }
  return seen != n;
}

// Is the result of `e` sparse enough to store sparse? A product is, when one factor is a sparse operand
// indexed only by output variables (its pattern bounds the result: SDDMM, A * B) or when every factor is
// sparse (SpGEMM); a sum when both terms are. A sparse operand summed against dense ones (SpMV, SpMM,
// MTTKRP) fills nearly every output entry, so that result is dense.
void factors(const ir::ExprPtr& e, std::vector<ir::ExprPtr>& out) {
  if (e->kind == ir::ExprKind::mul) {
    factors(e->a, out);
    factors(e->b, out);
  } else {
    out.push_back(e);
  }
}

bool sparse_value(const ir::ExprPtr& e, const std::vector<bool>& sparse_operand, const std::vector<int>& out_vars) {
  switch (e->kind) {
    case ir::ExprKind::access: {
      if (!sparse_operand[e->tensor]) return false;
      for (int v : e->vars)
        if (std::find(out_vars.begin(), out_vars.end(), v) == out_vars.end()) return false;
      return true;
    }
    case ir::ExprKind::literal: return false;
    case ir::ExprKind::neg: return sparse_value(e->a, sparse_operand, out_vars);
    case ir::ExprKind::mul: {
      std::vector<ir::ExprPtr> fs;
      factors(e, fs);
      bool all_sparse = true;
      for (const auto& f : fs) {
        if (sparse_value(f, sparse_operand, out_vars)) return true;
        all_sparse &= f->kind == ir::ExprKind::access ? static_cast<bool>(sparse_operand[f->tensor]) : false;
      }
      return all_sparse;
    }
    case ir::ExprKind::add:
    case ir::ExprKind::sub:
      return sparse_value(e->a, sparse_operand, out_vars) && sparse_value(e->b, sparse_operand, out_vars);
  }
  return false;
}

// The inferred sparse output's format with its dense levels checked against the data: a dense level stores
// an entry (or a position) for every coordinate under every parent position, so a CSR result with 2^31 rows
// allocates 2^31 + 1 row positions even when only two entries are stored. A dense level whose positions would
// exceed both kDenseLevelFloor and kDenseLevelRatio times the operands' stored values is made compressed.
constexpr int64_t kDenseLevelFloor = int64_t{1} << 20;
constexpr int64_t kDenseLevelRatio = 64;

std::string bounded_levels(const std::string& text, const std::vector<int64_t>& shape, int64_t stored,
                           std::vector<std::string>& reasons) {
  const Format f = Format::parse(text, static_cast<int>(shape.size()));
  const double limit = std::max(static_cast<double>(kDenseLevelFloor), static_cast<double>(kDenseLevelRatio) *
                                                                           static_cast<double>(std::max<int64_t>(stored, 1)));
  double positions = 1;  // an estimate of the positions under the levels seen so far
  bool changed = false;
  std::string out;
  for (size_t l = 0; l < f.levels().size(); ++l) {
    const Level& lvl = f.levels()[l];
    const double extent = static_cast<double>(shape[lvl.expr.dim]);
    std::string piece = level_text(lvl, lvl.expr.dim);
    if (lvl.kind->walk() == LevelWalk::locate && lvl.expr.part == LevelExpr::Part::whole && positions * extent > limit) {
      piece = fmt::format("compressed({})", lvl.expr.dim);
      changed = true;
    }
    positions = piece.rfind("dense", 0) == 0 ? positions * extent
                                             : std::min(positions * extent, static_cast<double>(std::max<int64_t>(stored, 1)));
    out += (l ? "," : "") + piece;
  }
  if (!changed) return text;
  reasons.push_back(fmt::format("sparse output stored as {} rather than {}: a dense level would hold far more "
                                "positions than the {} values the operands store",
                                Format::parse(out, f.ndim()).short_name(), f.short_name(), stored));
  return out;
}

// Converting an operand re-sorts its entries: about log2(nnz) steps per entry, plus writing it, plus what a
// conversion costs whatever its size (a call, new buffers: microseconds, i.e. thousands of loop steps).
constexpr double kConversionOverhead = 1e4;
double conversion_cost(int64_t nnz) {
  const double n = std::max(1.0, static_cast<double>(nnz));
  return kConversionOverhead + n * (4 + std::log2(n + 1));
}

// Loop orders tried exhaustively up to this many index variables (6! = 720 orders, each a few microseconds).
constexpr int kMaxCostedVars = 6;

void choose_by_cost(const ir::Statement& st, const std::vector<OperandDesc>& ops, const std::vector<const ir::Expr*>& acc,
                    Plan& plan, KernelSpec& spec, int native_operand, const std::string& out_format) {
  const int nv = st.num_vars();
  if (nv < 2 || nv > kMaxCostedVars) return;
  std::vector<int64_t> nnz;
  for (const auto& o : ops) nnz.push_back(o.nnz);
  std::vector<bool> sparse_operand;
  for (const auto& s : spec.operands) sparse_operand.push_back(!s.strided() && !s.format->all_dense());
  const bool sparse_out = out_format.empty() ? !st.out_vars.empty() && sparse_value(st.rhs, sparse_operand, st.out_vars)
                                             : out_format != "strided" && out_format != "dense";
  // Operands that may be converted: level formats accessed once (one access fixes the storage order wanted).
  std::vector<const ir::Expr*> only(ops.size(), nullptr);
  std::vector<int> uses(ops.size(), 0);
  for (const ir::Expr* a : acc) {
    ++uses[a->tensor];
    only[a->tensor] = a;
  }
  auto cost_of = [&](const KernelSpec& s, std::vector<int>& order) {
    order = choose_loop_order(s, order_constraints(s));
    if (order.empty()) return std::numeric_limits<double>::infinity();
    return estimate_nest_cost(s, order, plan.var_sizes, nnz, sparse_out);
  };
  std::vector<int> base_order;
  const double base = cost_of(spec, base_order);
  double best = base;
  KernelSpec best_spec = spec;
  std::vector<int> best_order = base_order, best_changed;
  double best_conversions = 0;
  std::vector<int> perm(nv);
  std::iota(perm.begin(), perm.end(), 0);
  std::set<std::string> seen;
  do {
    KernelSpec trial = spec;
    std::vector<int> changed;
    double conversions = 0;
    for (size_t t = 0; t < ops.size(); ++t) {
      if (spec.operands[t].strided() || uses[t] != 1 || static_cast<int>(t) == native_operand) continue;
      const Format& f = *spec.operands[t].format;
      const ir::Expr* a = only[t];
      const auto lv = ordered_level_vars(f, a->vars);
      auto at = [&](int v) { return std::find(perm.begin(), perm.end(), v) - perm.begin(); };
      bool fits = true;
      for (size_t l = 1; l < lv.size(); ++l) fits &= at(lv[l - 1]) <= at(lv[l]);
      if (fits) continue;
      bool whole = true;
      for (const auto& l : f.levels()) whole &= l.expr.part == LevelExpr::Part::whole;
      if (!whole) continue;
      std::vector<int> dims(a->vars.size());
      std::iota(dims.begin(), dims.end(), 0);
      std::stable_sort(dims.begin(), dims.end(), [&](int x, int y) { return at(a->vars[x]) < at(a->vars[y]); });
      std::string text;
      for (size_t l = 0; l < f.levels().size(); ++l) text += (l ? "," : "") + retargeted_level_text(f, l, dims[l]);
      trial.operands[t].format = Format::parse(text, f.ndim());
      changed.push_back(static_cast<int>(t));
      conversions += conversion_cost(nnz[t]);
    }
    if (changed.empty() || !seen.insert(trial.str()).second) continue;
    std::vector<int> order;
    const double c = cost_of(trial, order) + conversions;
    if (c < best) {
      best = c;
      best_spec = trial;
      best_order = order;
      best_changed = changed;
      best_conversions = conversions;
    }
  } while (std::next_permutation(perm.begin(), perm.end()));
  auto order_text = [&](const std::vector<int>& order) {
    std::string o;
    for (int v : order) o += (o.empty() ? "" : " ") + st.var_names[v];
    return o;
  };
  if (best_changed.empty() || !(2 * best < base)) {
    if (!base_order.empty())
      plan.reasons.push_back(fmt::format("loop order {} kept: estimated cost {:.3g}; no conversion makes it less than "
                                         "half",
                                         order_text(base_order), base));
    return;
  }
  std::string what;
  for (int t : best_changed) {
    what += fmt::format("{}{} converted from {} to {}", what.empty() ? "" : "; ", st.tensor_names[t],
                        spec.operands[t].format->short_name(), best_spec.operands[t].format->short_name());
    plan.convert[t] = best_spec.operands[t].format->str();
  }
  plan.reasons.push_back(fmt::format(
      "{}: loop order {} costs an estimated {:.3g} (conversions {:.3g} of it) against {:.3g} for {} as given",
      what, order_text(best_order), best, best_conversions, base, order_text(base_order)));
  spec = best_spec;
}

// A sparse output that shares the leading levels of the statement's one sparse factor and is dense below them
// (OutputMode::fibers), when the statement sums a sparse factor against dense ones but keeps the variables of
// its first levels: TTM's Y(i,j,r) = X(i,j,k) U(k,r) on a CSF X stores r densely under each (i, j) fiber X has,
// instead of a dense I x J x R result that is zero wherever X has no fiber. Only when the factor stores at most
// half as many values as its shared levels have coordinates (I x J), so that at least half the fibers are
// certainly missing: a matrix's rows (SpMV, SpMM, MTTKRP's i) are usually all there, and a dense result is
// what those callers get. The format's text, or empty.
std::string shared_fibers_format(const KernelSpec& spec, const std::vector<OperandDesc>& ops,
                                 const std::vector<int64_t>& var_sizes) {
  const ir::Statement& st = spec.stmt;
  const ir::Expr* only = sole_sparse_factor(spec);
  if (!only) return "";
  const auto& levels = spec.operands[only->tensor].format->levels();
  const auto lv = level_vars(*spec.operands[only->tensor].format, only->vars);
  auto out_dim = [&](int v) {
    return static_cast<int>(std::find(st.out_vars.begin(), st.out_vars.end(), v) - st.out_vars.begin());
  };
  std::string text;
  std::vector<bool> placed(st.out_vars.size(), false);
  size_t shared = 0;
  while (shared + 1 < levels.size() && out_dim(lv[shared]) < static_cast<int>(st.out_vars.size())) {
    const int d = out_dim(lv[shared]);
    text += (shared ? "," : "") + level_text(levels[shared], d);
    placed[d] = true;
    ++shared;
  }
  if (shared == 0) return "";
  double coordinates = 1;
  for (size_t l = 0; l < shared; ++l) coordinates *= static_cast<double>(var_sizes[lv[l]]);
  if (2.0 * static_cast<double>(ops[only->tensor].nnz) > coordinates) return "";
  for (size_t d = 0; d < st.out_vars.size(); ++d)
    if (!placed[d]) text += fmt::format(",dense({})", d);
  KernelSpec trial = spec;
  trial.output.format = Format::parse(text, static_cast<int>(st.out_vars.size()));
  if (shared_fibers(trial).tensor < 0 || make_schedule(trial).output != OutputMode::fibers) return "";
  return text;
}

}  // namespace

Plan make_plan(const ir::Statement& st, const std::vector<OperandDesc>& ops, const std::string& out_format, bool f64,
               bool idx64) {
  SCORCH_CHECK(static_cast<int>(ops.size()) == st.num_tensors(), "the statement uses {} operands, {} were given",
               st.num_tensors(), ops.size());
  Plan plan;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& o : ops) shapes.push_back(o.shape);
  plan.var_sizes = ir::infer_var_sizes(st, shapes);
  for (int v : st.out_vars) plan.out_shape.push_back(plan.var_sizes[v]);

  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(st.rhs, acc);
  KernelSpec spec;
  spec.stmt = st;
  spec.f64 = f64;
  spec.idx64 = idx64;
  plan.convert.assign(ops.size(), "");
  // A blocked operand the compiler runs natively (blocked.h) keeps its format.
  std::optional<BlockedMatch> blocked;
  {
    std::vector<Storage> as_given;
    for (const auto& o : ops) {
      Storage s;
      if (o.format != "strided") s.format = Format::parse(o.format, static_cast<int>(o.shape.size()));
      as_given.push_back(s);
    }
    if (out_format.empty() || out_format == "strided" || out_format == "dense")
      blocked = match_blocked(st, as_given, Storage{});
    if (blocked)
      plan.reasons.push_back(fmt::format("{} ({}) walked natively, block by block: no conversion",
                                         st.tensor_names[blocked->sparse], as_given[blocked->sparse].format->short_name()));
    // An n:m operand the n:m kernels run (nm.h) keeps its format too.
    if (!blocked && (out_format.empty() || out_format == "strided" || out_format == "dense")) {
      if (auto nm = match_nm(st, as_given, Storage{})) {
        blocked = BlockedMatch{};
        blocked->sparse = nm->sparse;
        plan.reasons.push_back(fmt::format("{} ({}) walked natively, group by group: no conversion",
                                           st.tensor_names[nm->sparse], as_given[nm->sparse].format->short_name()));
      }
    }
  }
  for (size_t t = 0; t < ops.size(); ++t) {
    Storage s;
    if (ops[t].format != "strided") {
      Format f = Format::parse(ops[t].format, static_cast<int>(ops[t].shape.size()));
      if (!compilable(f) && !(blocked && blocked->sparse == static_cast<int>(t))) {
        const std::string eq = compilable_equivalent(f);
        plan.reasons.push_back(fmt::format("{} ({}) converted to {}: the compiler walks dense, compressed, singleton and bitmap levels "
                                           "(a bitmap under a unique level), unblocked and ordered, with a non-unique "
                                           "level's duplicates told apart by a compressed or singleton child",
                                           st.tensor_names[t], f.short_name(), eq));
        plan.convert[t] = eq;
        f = Format::parse(eq, static_cast<int>(ops[t].shape.size()));
      }
      s.format = f;
    }
    spec.operands.push_back(s);
  }
  // An access that repeats an index (a diagonal) of a sparse operand: densify it.
  for (const ir::Expr* a : acc) {
    std::vector<int> v = a->vars;
    std::sort(v.begin(), v.end());
    if (std::adjacent_find(v.begin(), v.end()) != v.end() && !spec.operands[a->tensor].strided()) {
      plan.reasons.push_back(fmt::format("{} densified: it is indexed with a repeated index", st.tensor_names[a->tensor]));
      plan.convert[a->tensor] = "strided";
      spec.operands[a->tensor].format.reset();
    }
  }

  // Accept operands' storage orders from the largest down; convert those that conflict.
  std::vector<int> by_size(ops.size());
  std::iota(by_size.begin(), by_size.end(), 0);
  std::stable_sort(by_size.begin(), by_size.end(), [&](int a, int b) { return ops[a].nnz > ops[b].nnz; });
  std::vector<std::pair<int, int>> accepted;
  std::vector<int> rejected;
  for (int t : by_size) {
    if (spec.operands[t].strided()) continue;
    std::vector<std::pair<int, int>> mine;
    for (const ir::Expr* a : acc) {
      if (a->tensor != t) continue;
      const auto lv = ordered_level_vars(*spec.operands[t].format, a->vars);
      for (size_t l = 1; l < lv.size(); ++l) mine.emplace_back(lv[l - 1], lv[l]);
    }
    auto trial = accepted;
    trial.insert(trial.end(), mine.begin(), mine.end());
    if (cyclic(st.num_vars(), trial)) rejected.push_back(t);
    else accepted = trial;
  }
  if (!rejected.empty()) {
    KernelSpec trial = spec;
    for (int t : rejected) trial.operands[t].format.reset();
    const auto order = choose_loop_order(trial, accepted);
    SCORCH_ASSERT(!order.empty() || st.num_vars() == 0, "accepted constraints are acyclic");
    for (int t : rejected) {
      const Format& f = *spec.operands[t].format;
      const ir::Expr* a = nullptr;
      for (const ir::Expr* x : acc)
        if (x->tensor == t) a = x;
      // Same level kinds, dimensions in loop order.
      std::vector<int> dims(a->vars.size());
      std::iota(dims.begin(), dims.end(), 0);
      std::stable_sort(dims.begin(), dims.end(), [&](int x, int y) {
        return std::find(order.begin(), order.end(), a->vars[x]) < std::find(order.begin(), order.end(), a->vars[y]);
      });
      std::string text;
      for (size_t l = 0; l < f.levels().size(); ++l) text += (l ? "," : "") + retargeted_level_text(f, l, dims[l]);
      Format g = Format::parse(text, f.ndim());
      plan.reasons.push_back(fmt::format("{} converted from {} to {} so that one loop order walks every sparse operand "
                                         "in storage order (it stores {} values, the fewest to re-sort)",
                                         st.tensor_names[t], f.short_name(), g.short_name(), ops[t].nnz));
      plan.convert[t] = g.str();
      spec.operands[t].format = g;
    }
    // A tensor read in two conflicting ways cannot be fixed by one conversion: densify what still conflicts.
    if (cyclic(st.num_vars(), order_constraints(spec))) {
      for (int t : rejected) {
        plan.convert[t] = "strided";
        spec.operands[t].format.reset();
        plan.reasons.push_back(fmt::format("{} densified: its accesses need conflicting orders", st.tensor_names[t]));
      }
    }
  }

  // Loop orders and conversions chosen by cost: a loop order that the operands' storage orders allow may
  // still be far from the cheapest (A·Bᵀ on two CSR operands takes order i k j: an inner product of two rows
  // for every output coordinate). Every loop order is tried with the operands it needs converted, and the
  // cheapest by estimate_nest_cost plus the conversions' cost is taken when it costs under half the plan so
  // far (small differences are within the estimate's error and not worth a conversion).
  choose_by_cost(st, ops, acc, plan, spec, blocked ? blocked->sparse : -1, out_format);

  // The output.
  const int out_rank = static_cast<int>(st.out_vars.size());
  std::string out = out_format;
  if (out.empty()) {
    std::vector<bool> sparse_operand;
    for (const auto& s : spec.operands) sparse_operand.push_back(!s.strided() && !s.format->all_dense());
    if (out_rank > 0 && sparse_value(st.rhs, sparse_operand, st.out_vars)) {
      // Prefer the format of a sparse operand over exactly the output's indices (SDDMM, A * B, A + B).
      for (const ir::Expr* a : acc) {
        const Storage& s = spec.operands[a->tensor];
        if (s.strided() || s.format->all_dense() || a->vars.size() != st.out_vars.size()) continue;
        std::vector<int> x = a->vars, y = st.out_vars;
        std::sort(x.begin(), x.end());
        std::sort(y.begin(), y.end());
        if (x != y || std::adjacent_find(x.begin(), x.end()) != x.end()) continue;
        // The result has exactly this operand's pattern when it is the only sparse factor of a product (each of
        // its entries written once); a union or an intersection with another sparse operand need not fit a
        // level that promises one entry per parent.
        const bool same_pattern = !has_sum(*st.rhs) &&
                                  std::count(sparse_operand.begin(), sparse_operand.end(), true) == 1;
        std::string text;
        for (size_t l = 0; l < s.format->levels().size(); ++l) {
          const auto& lvl = s.format->levels()[l];
          const int v = a->vars[lvl.expr.dim];
          const int d = static_cast<int>(std::find(st.out_vars.begin(), st.out_vars.end(), v) - st.out_vars.begin());
          // A cursor level (a bitmap) is walked but not assembled inside the kernel: the output stores its
          // coordinates compressed, so the kernel writes it directly (a bitmap output would be streamed and packed).
          text += (l ? "," : "") + (lvl.kind->coordinate_cursor() ? fmt::format("compressed({})", d)
                                    : same_pattern           ? level_text(lvl, d)
                                                             : retargeted_level_text(*s.format, l, d));
        }
        out = text;
        plan.reasons.push_back(fmt::format("output takes the format of {}, which has the output's indices",
                                           st.tensor_names[a->tensor]));
        break;
      }
      if (out.empty()) {
        out = out_rank == 2 ? "csr" : "csf";
        int64_t stored = 0;
        for (size_t t = 0; t < ops.size(); ++t)
          if (sparse_operand[t]) stored += ops[t].nnz;
        const std::string bounded = bounded_levels(Format::parse(out, out_rank).str(), plan.out_shape, stored,
                                                   plan.reasons);
        if (bounded == Format::parse(out, out_rank).str()) plan.reasons.push_back(fmt::format("sparse output stored as {}", out));
        out = bounded;
      }
    } else if (const std::string fibers = out_rank > 0 ? shared_fibers_format(spec, ops, plan.var_sizes) : ""; !fibers.empty()) {
      out = fibers;
      plan.reasons.push_back(fmt::format("output stored as {}: its leading levels are those of the sparse factor, "
                                         "dense below (no values where the factor has no fiber, and it stores "
                                         "too few values to have half of them)",
                                         Format::parse(out, out_rank).short_name()));
    } else {
      out = "strided";
      plan.reasons.push_back(out_rank == 0 ? "scalar output is dense"
                                           : "output is dense: no sparse factor bounds its pattern");
    }
  }
  Storage o;
  if (out != "strided" && out != "dense") o.format = Format::parse(out, out_rank);
  if (!out_format.empty())  // the caller chose: say so, whatever the choice
    plan.reasons.push_back(o.strided() ? "output requested dense"
                                       : fmt::format("output requested as {}", o.format->short_name()));
  plan.out_format = o.strided() ? "strided" : o.format->str();
  spec.output = o;
  plan.spec = spec.str();
  return plan;
}

}  // namespace scorch
