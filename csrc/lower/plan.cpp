#include "lower/plan.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "common/error.h"
#include "ir/parser.h"
#include "lower/blocked.h"
#include "lower/kernel_spec.h"
#include "lower/schedule.h"

namespace scorch {
namespace {

bool compilable(const Format& f) {
  for (const auto& l : f.levels()) {
    if (l.kind->walk() == LevelWalk::none) return false;
    if (l.expr.part != LevelExpr::Part::whole || !l.kind->properties().ordered) return false;
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
  }
  for (size_t t = 0; t < ops.size(); ++t) {
    Storage s;
    if (ops[t].format != "strided") {
      Format f = Format::parse(ops[t].format, static_cast<int>(ops[t].shape.size()));
      if (!compilable(f) && !(blocked && blocked->sparse == static_cast<int>(t))) {
        const std::string eq = compilable_equivalent(f);
        plan.reasons.push_back(fmt::format("{} ({}) converted to {}: the compiler walks dense, compressed and "
                                           "singleton levels, unblocked and ordered",
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
      for (size_t l = 0; l < f.levels().size(); ++l) text += (l ? "," : "") + level_text(f.levels()[l], dims[l]);
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
        std::string text;
        for (size_t l = 0; l < s.format->levels().size(); ++l) {
          const auto& lvl = s.format->levels()[l];
          const int v = a->vars[lvl.expr.dim];
          const int d = static_cast<int>(std::find(st.out_vars.begin(), st.out_vars.end(), v) - st.out_vars.begin());
          text += (l ? "," : "") + level_text(lvl, d);
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
