// The lowerer's state and its parts, shared by the files that implement it: lower.cpp (the loop nest for
// each index variable), linear_merge.cpp (co-iteration of many sparse operands in linear code) and
// register_tile.cpp (what the target's vector registers change). Internal to csrc/lower.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "common/error.h"
#include "lower/kernel_frame.h"
#include "lower/lower.h"
#include "lower/merge_lattice.h"
#include "lower/passes.h"

namespace scorch::lowering {

using ir::Expr;
using ir::ExprKind;
using ir::ExprPtr;
using loops::Stmts;
// Loop IR expressions (typed nodes, loop_ir.h); ir::ExprPtr above is the statement's own expression.
using LExpr = loops::ExprPtr;
using loops::AssignOp;
using loops::UnOp;

// Short names for the loop IR builders used throughout the lowerer.
inline LExpr V(const std::string& name) { return loops::var(name); }
inline LExpr I(int64_t v) { return loops::integer(v); }
// a0 + a1 + ... (left to right, no parentheses), or `empty` when there are no terms.
inline LExpr sum_of(const std::vector<LExpr>& terms, LExpr empty) {
  if (terms.empty()) return empty;
  LExpr s = terms[0];
  for (size_t q = 1; q < terms.size(); ++q) s = loops::add(s, terms[q]);
  return s;
}
// c0 && c1 && ... (null: no condition).
inline LExpr all_of(const std::vector<LExpr>& conds) {
  LExpr s;
  for (const auto& c : conds) s = s ? loops::land(s, c) : c;
  return s;
}

// Where the value computed in the innermost loop goes.
enum class Sink { dense, scalar, workspace, stream, local, tile, vtile };

class Lowerer {
 public:
  Lowerer(const KernelSpec& spec, const Schedule& sched, const VectorShape& machine)
      : spec_(spec), sched_(sched), st_(spec.stmt), machine_(machine) {
    std::vector<const Expr*> acc;
    ir::collect_accesses(st_.rhs, acc);
    for (const Expr* a : acc) {
      Access info{a, a->tensor, {}};
      const Storage& s = spec.operands[a->tensor];
      if (!s.strided()) {
        info.lvars = level_vars(*s.format, a->vars);
        for (const auto& l : s.format->levels()) {
          SCORCH_CHECK(l.kind->walk() != LevelWalk::none, "level kind '{}' does not say how to walk it; convert first",
                       l.kind->name());
          SCORCH_CHECK(l.expr.part == LevelExpr::Part::whole, "blocked levels are not compiled; convert first");
          SCORCH_CHECK(l.kind->properties().ordered, "unordered levels are not compiled; convert first");
        }
      }
      access_[a->access_id] = info;
    }
    choose_tile();
  }

  // Tile the innermost loop when it runs over an output index that only strided operands use, right inside
  // a reduction (SpMM's j inside k): the tile of output columns then stays in registers.
  void choose_tile() {
    const int n = static_cast<int>(sched_.order.size());
    if (!dense_values() || n < 2) return;
    const int j = sched_.order[n - 1], k = sched_.order[n - 2];
    if (!std::count(st_.out_vars.begin(), st_.out_vars.end(), j) || std::count(st_.out_vars.begin(), st_.out_vars.end(), k))
      return;
    for (const auto& [id, a] : access_)
      if (std::count(a.lvars.begin(), a.lvars.end(), j)) return;  // j walks a level: not a plain dense loop
    tile_depth_ = n - 2;
    // Further out across every reduction loop right above it (MTTKRP's k over l): the tile of output columns
    // then stays in registers across the whole reduction, and is added to the output once per output row
    // instead of once per fiber of the loop above the innermost. Each pass over the reduction then walks
    // those outer fibers once per tile, a few index loads against a load and a store of the tile per fiber.
    // Never to depth 0: the outermost loop is the one threads split, and a split reduction would race.
    while (tile_depth_ > 1 && !std::count(st_.out_vars.begin(), st_.out_vars.end(), sched_.order[tile_depth_ - 1]))
      --tile_depth_;
    tile_var_ = j;
    // Vector registers when the target has them and every access along j has it as its last, contiguous index.
    vector_tile_ = machine_.vector_bytes > 0 && machine_.tile_vectors > 0;
    for (const auto& [id, a] : access_) {
      const auto& vars = a.e->vars;
      if (std::count(vars.begin(), vars.end(), j) > 1 || (std::count(vars.begin(), vars.end(), j) && vars.back() != j))
        vector_tile_ = false;
    }
  }

  // The loop nest of one thread and what lowering learnt about it, into the pipeline's kernel (the
  // iteration pass; the frame around the nest is the later passes').
  void run(passes::KernelIR& k) {
    LoweredKernel& out = k.facts;
    out.sparse_output = !spec_.output.strided();
    States states;
    for (const auto& [id, a] : access_) states[id] = State{};
    current_sink_ = sched_.output == OutputMode::coords ? Sink::stream : Sink::dense;
    k.nest = wrap_emission(-1, states, [&] { return lower_depth(0, st_.rhs, states); });
    if (!parallel_ && sched_.parallel) reasons_.push_back(parallel_why_);
    out.overwrites_output = dense_values() && assigned_output_ && !added_output_;
    k.parallel = parallel_;
    out.reasons = reasons_;
  }

 private:
  struct Access {
    const Expr* e;
    int tensor;
    std::vector<int> lvars;  // index variable of each level (level-format operands)
  };
  // The positions of an access's next level that belong to the coordinates fixed so far: [b, e). Inside a
  // linear merge an access may be absent at the current coordinate: `present` is then the condition under
  // which it is there (its segment [b, e) is empty otherwise, and its value must not be read).
  struct State {
    int level = 0;
    LExpr b = I(0), e = I(1);
    LExpr present;  // null: always present
  };
  using States = std::map<int, State>;
  // A level-format access that has a level at the current loop variable.
  struct Part {
    int id, tensor, level;
    const LevelKind* kind;
    LevelWalk walk;  // locate (dense) or iterate (sparse iterator)
    bool unique;
  };
  // Above this many lattice points (an upper bound, see lattice_points_bound) a union is merged linearly.
  static constexpr int64_t kLatticeLimit = 8;

  // The output's values are updated in place through `o` (a dense output, or the dense blocks under a sparse
  // factor's positions: OutputMode::fibers).
  bool dense_values() const { return spec_.output.strided() || sched_.output == OutputMode::fibers; }

  std::string size_of(int v) const { return fmt::format("N{}", v); }
  std::string var(int v) const { return fmt::format("i{}", v); }
  LExpr size_expr(int v) const { return V(size_of(v)); }
  LExpr var_expr(int v) const { return V(var(v)); }
  const Format& format_of(int access_id) const { return *spec_.operands[access_.at(access_id).tensor].format; }
  std::string buf(int tensor, int level, const char* name) const { return fmt::format("t{}_{}{}", tensor, name, level); }
  // The position one level down when a dense level at variable v is located: (b * N + i).
  LExpr located(const LExpr& b, int v) const {
    return loops::paren(loops::add(loops::mul(b, size_expr(v)), var_expr(v)));
  }
  // Row-major index of an access into its strided operand: i0 * t<T>_st0 + i1 * t<T>_st1 + ...; `at` gives
  // the index expression of each variable.
  template <typename At>
  LExpr strided_index(const Expr& a, At&& at) const {
    std::vector<LExpr> terms;
    for (size_t d = 0; d < a.vars.size(); ++d)
      terms.push_back(loops::mul(at(a.vars[d]), V(fmt::format("t{}_st{}", a.tensor, d))));
    return sum_of(terms, I(0));
  }

  // At the emission depth of append/workspace outputs, the body gets an accumulator (or a workspace) and
  // the statements that emit what it collected; elsewhere the body is returned as it is.
  template <typename F>
  Stmts wrap_emission(int depth, const States& inside, F&& inner) {
    const bool here = depth == sched_.emit_depth &&
                      (sched_.output == OutputMode::append || sched_.output == OutputMode::workspace ||
                       sched_.output == OutputMode::sampled || sched_.output == OutputMode::fibers);
    if (!here) return inner();
    Stmts out;
    if (sched_.output == OutputMode::fibers) {
      // The position of the shared levels' last one: the output's dense block below it starts at ofib * its size.
      out.push_back(loops::decl("const int64_t", "ofib", sampled_position(inside)));
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      return out;
    }
    const Sink saved = current_sink_;
    auto accumulator = [](bool void_any) {
      Stmts parts{loops::decl("val_t", "acc", I(0)), loops::decl("bool", "any", loops::boolean(false))};
      if (void_any) parts.push_back(loops::eval(loops::cast("void", V("any"))));
      return loops::on_one_line(parts);
    };
    if (sched_.output == OutputMode::sampled) {
      // The sampling operand's position: every level walked, its state points at its value.
      const LExpr pos = sampled_position(inside);
      current_sink_ = Sink::scalar;
      out.push_back(accumulator(true));
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      out.push_back(loops::assign(loops::load(V("sampled_out"), pos), V("acc")));
    } else if (sched_.output == OutputMode::append) {
      current_sink_ = Sink::scalar;
      out.push_back(accumulator(false));
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      out.push_back(loops::on_one_line({loops::if_then(V("any"), {coords_decl(out_coords()), push_entry(V("acc"))})}));
    } else {
      current_sink_ = Sink::workspace;
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      loops::Exprs coords;
      for (int v : st_.out_vars) coords.push_back(v == sched_.workspace_var ? V("w") : var_expr(v));
      out.push_back(loops::eval(loops::call("std::sort", {V("ws_list"), loops::add(V("ws_list"), V("ws_n"))})));
      out.push_back(loops::for_range("q", I(0), V("ws_n"), {
          loops::decl("const int64_t", "w", loops::load(V("ws_list"), V("q"))),
          coords_decl(coords),
          push_entry(loops::load(V("ws_val"), V("w"))),
          loops::on_one_line({loops::assign(loops::load(V("ws_val"), V("w")), I(0)),
                              loops::assign(loops::load(V("ws_flag"), V("w")), I(0))})}));
      out.push_back(loops::assign(V("ws_n"), I(0)));
    }
    current_sink_ = saved;
    return out;
  }

  // The sampling operand's position at the emission depth (sampled, fibers outputs).
  LExpr sampled_position(const States& inside) const {
    LExpr pos;
    for (const auto& [id, a] : access_)
      if (a.tensor == sched_.sampled_tensor && inside.count(id)) pos = inside.at(id).b;
    SCORCH_ASSERT(pos != nullptr, "sampled output: the sampling operand is not walked at the emission depth");
    return pos;
  }

  loops::Exprs out_coords() const {
    loops::Exprs c;
    for (int v : st_.out_vars) c.push_back(var_expr(v));
    return c;
  }
  // const int64_t c[] = {coordinates};
  static loops::StmtPtr coords_decl(loops::Exprs coords) {
    return loops::decl("const int64_t", "c[]", loops::init_list(std::move(coords)));
  }
  // push(st, c, <output rank>, value);  (the thread's output stream, kernel preamble)
  loops::StmtPtr push_entry(LExpr value) const {
    return loops::eval(loops::call("push", {V("st"), V("c"), I(static_cast<int64_t>(st_.out_vars.size())), std::move(value)}));
  }

  // Lanes of one vector register of the target (1 when it has none).
  int vector_width() const { return machine_.vector_bytes > 0 ? machine_.vector_bytes / (spec_.f64 ? 8 : 4) : 1; }
  // Columns of the dense output a full register tile keeps live: the target's accumulators times its lanes.
  int tile_columns() const {
    return vector_tile_ ? machine_.tile_vectors * vector_width() : std::max(16, machine_.tile_vectors * vector_width());
  }

  // The value of `e` for the vector of consecutive values of index `v` starting at `base`: accesses along v
  // (it must be their last, contiguous index) load a vector, the rest are scalars that broadcast.
  // `offset` (a constant number of elements) is added to the address outside the index arithmetic: v is the
  // last, contiguous index of every access along it, so the vectors of a tile share one row address and
  // differ by a displacement (no register per vector for the index).
  LExpr vector_value(const ExprPtr& e, const States& states, int v, const std::string& base, int offset = 0) const {
    switch (e->kind) {
      case ExprKind::access: {
        const bool along = std::count(e->vars.begin(), e->vars.end(), v) > 0;
        if (!along) return value(e, states);
        // The tile's columns start at a row pointer the pass declares (tile_row_pointers): v contributes
        // nothing more to the index.
        std::vector<LExpr> terms;
        for (size_t d = 0; d < e->vars.size(); ++d)
          if (e->vars[d] != v) terms.push_back(loops::mul(var_expr(e->vars[d]), V(fmt::format("t{}_st{}", e->tensor, d))));
        const LExpr idx = sum_of(terms, I(0));
        LExpr addr = loops::unary(UnOp::address_of, loops::load(V(fmt::format("t{}_{}", e->tensor, base)), idx));
        if (offset != 0) addr = loops::add(addr, I(offset));
        if (partial_vector_)
          return loops::call("vload_upto", {addr, V("jn"), loops::add(V(fmt::format("t{}_data", e->tensor)),
                                                                       V(fmt::format("t{}_numel", e->tensor)))});
        return loops::call("vload", {addr});
      }
      case ExprKind::literal: return value_literal(e->value);
      case ExprKind::neg: return loops::paren(loops::unary(UnOp::neg, vector_value(e->a, states, v, base, offset)));
      case ExprKind::add:
      case ExprKind::sub:
      case ExprKind::mul:
        return loops::paren(loops::binary(binop_of(e->kind), vector_value(e->a, states, v, base, offset),
                                          vector_value(e->b, states, v, base, offset)));
    }
    return I(0);
  }

  // const val_t* __restrict t<T>_<base> = t<T>_data + base * t<T>_st<d>; for each operand read along v (its
  // last index d): the start of the columns a register tile covers. vector_value addresses from it, so the
  // tile's loads need one register for the row (the gathered coordinate times the row stride) and none for
  // the column offset: with the column offset in the index, GCC ran out of registers in the 4-vector pass of
  // an AVX-512 SpMM and reloaded it from the stack on every entry (0.89 -> 0.97 of the hand-written loop).
  Stmts tile_row_pointers(const ExprPtr& e, int v, const std::string& base) const {
    std::vector<const Expr*> acc;
    ir::collect_accesses(e, acc);
    std::set<int> seen;
    Stmts out;
    for (const Expr* a : acc) {
      const auto it = std::find(a->vars.begin(), a->vars.end(), v);
      if (it == a->vars.end() || !seen.insert(a->tensor).second) continue;
      const size_t d = static_cast<size_t>(it - a->vars.begin());
      out.push_back(loops::decl("const val_t* __restrict", fmt::format("t{}_{}", a->tensor, base),
                                loops::add(V(fmt::format("t{}_data", a->tensor)),
                                           loops::mul(V(base), V(fmt::format("t{}_st{}", a->tensor, d))))));
    }
    return out;
  }

  static loops::BinOp binop_of(ExprKind k) {
    return k == ExprKind::add ? loops::BinOp::add : k == ExprKind::sub ? loops::BinOp::sub : loops::BinOp::mul;
  }
  // ((val_t)x): a literal of the statement in the kernel's value type.
  static LExpr value_literal(double x) { return loops::paren(loops::cast("val_t", loops::floating(x))); }
  // (val_t)0
  static LExpr value_zero() { return loops::cast("val_t", I(0)); }

  // Every access along v has it as its last index, once, and is strided (contiguous loads).
  bool contiguous_along(const ExprPtr& e, int v) const {
    std::vector<const Expr*> acc;
    ir::collect_accesses(e, acc);
    for (const Expr* a : acc) {
      const auto n = std::count(a->vars.begin(), a->vars.end(), v);
      if (n == 0) continue;
      if (n > 1 || a->vars.back() != v || !spec_.operands[a->tensor].strided()) return false;
    }
    return true;
  }

  LExpr value(const ExprPtr& e, const States& states) const {
    const Gated g = gated_value(e, states);
    return !g.cond || g.zero_when_absent ? g.value : loops::paren(loops::select(g.cond, g.value, value_zero()));
  }

  struct Gated {
    LExpr cond;                     // where the value may be nonzero; null: everywhere
    LExpr value;
    bool zero_when_absent = false;  // value is already 0 where cond fails (a sum of gated terms)
  };

  // The value of `e` and the condition under which it is nonzero, for accesses that may be absent (linear
  // merges): a product is there when all its factors are, a sum when any term is, and an absent term is
  // never evaluated (so an absent entry times inf is 0, as in the lattice's points). Empty condition: always.
  // A sum of n terms is n gated terms (its value needs no gate of its own), so the code is linear in n.
  Gated gated_value(const ExprPtr& e, const States& states) const {
    switch (e->kind) {
      case ExprKind::access: {
        const Storage& s = spec_.operands[e->tensor];
        if (s.strided())
          return {nullptr, loops::load(V(fmt::format("t{}_data", e->tensor)), strided_index(*e, [&](int x) { return var_expr(x); }))};
        const State& stt = states.at(e->access_id);
        SCORCH_ASSERT(stt.level == static_cast<int>(s.format->levels().size()), "access not fully descended");
        return {stt.present, loops::load(V(fmt::format("t{}_vals", e->tensor)), stt.b)};
      }
      case ExprKind::literal: return {nullptr, value_literal(e->value)};
      case ExprKind::neg: {
        Gated g = gated_value(e->a, states);
        g.value = loops::paren(loops::unary(UnOp::neg, g.value));
        return g;
      }
      case ExprKind::mul: {
        const Gated a = gated_value(e->a, states), b = gated_value(e->b, states);
        const LExpr c = !a.cond ? b.cond : !b.cond ? a.cond : loops::land(loops::paren(a.cond), loops::paren(b.cond));
        return {c, loops::paren(loops::mul(a.value, b.value))};
      }
      case ExprKind::add:
      case ExprKind::sub: {
        const Gated a = gated_value(e->a, states), b = gated_value(e->b, states);
        const loops::BinOp op = binop_of(e->kind);
        if (!a.cond && !b.cond) return {nullptr, loops::paren(loops::binary(op, a.value, b.value))};
        auto wrap = [](const Gated& g) {
          return !g.cond || g.zero_when_absent ? g.value
                                               : loops::paren(loops::select(loops::paren(g.cond), g.value, value_zero()));
        };
        const LExpr c = !a.cond || !b.cond ? nullptr : loops::lor(a.cond, b.cond);
        return {c, loops::paren(loops::binary(op, wrap(a), wrap(b))), true};
      }
    }
    return {nullptr, I(0)};
  }

  Stmts compute(const ExprPtr& e, const States& states) {
    const Gated g = gated_value(e, states);
    Stmts s = compute_value(e, states, g.value);
    if (!g.cond) return s;
    return {loops::if_then(g.cond, s)};  // nothing to add where every term is absent
  }

  Stmts compute_value(const ExprPtr& e, const States& states, const LExpr& v) {
    auto add_to = [&](LExpr target) { return loops::assign(std::move(target), v, AssignOp::add); };
    switch (current_sink_) {
      case Sink::dense: added_output_ = true; return {add_to(loops::load(V("o"), dense_out_index()))};
      case Sink::scalar:
        if (any_hoisted_) return {add_to(V("acc"))};
        return {loops::on_one_line({add_to(V("acc")), loops::assign(V("any"), loops::boolean(true))})};
      case Sink::local: return {add_to(V("lacc"))};
      case Sink::tile: return {add_to(loops::load(V("tacc"), V("jj")))};
      case Sink::vtile: {
        Stmts out;
        for (int q = 0; q < tile_vectors_; ++q)
          out.push_back(loops::assign(V(fmt::format("va{}", q)), vector_value(e, states, tile_var_, "jo", q * vector_width()),
                                      AssignOp::add));
        return out;
      }
      case Sink::workspace: {
        // { const int64_t w = i; if (!ws_flag[w]) { ws_flag[w] = 1; ws_list[ws_n++] = w; } ws_val[w] += v; }
        const LExpr w = V("w");
        return {loops::on_one_line({loops::block({
            loops::decl("const int64_t", "w", var_expr(sched_.workspace_var)),
            loops::if_then(loops::unary(UnOp::logical_not, loops::load(V("ws_flag"), w)),
                           {loops::assign(loops::load(V("ws_flag"), w), I(1)),
                            loops::assign(loops::load(V("ws_list"), loops::unary(UnOp::post_inc, V("ws_n"))), w)}),
            add_to(loops::load(V("ws_val"), w))})})};
      }
      case Sink::stream: return {loops::on_one_line({loops::block({coords_decl(out_coords()), push_entry(v)})})};
    }
    return {};
  }

  // The loops for order[d..]; `states` holds the accesses still in `e`.
  // The dense output's index of the current element; `tile_var` (when given) stands for the tiled variable.
  LExpr dense_out_index(const LExpr& tile_var = nullptr) const {
    auto at = [&](int v) { return v == tile_var_ && tile_var ? tile_var : var_expr(v); };
    if (sched_.output == OutputMode::fibers) {
      // Below the shared levels' position ofib, the output's dense levels located one by one (b * N + i).
      const auto& levels = spec_.output.format->levels();
      LExpr index = V("ofib");
      for (size_t l = static_cast<size_t>(sched_.shared_levels); l < levels.size(); ++l) {
        const int v = st_.out_vars[levels[l].expr.dim];
        index = loops::paren(loops::add(loops::mul(index, size_expr(v)), at(v)));
      }
      return index;
    }
    std::vector<LExpr> terms;
    for (size_t d = 0; d < st_.out_vars.size(); ++d) {
      const int v = st_.out_vars[d];
      terms.push_back(loops::mul(at(v), V(fmt::format("os{}", d))));
    }
    return sum_of(terms, I(0));
  }

  // The scalar an innermost loop at depth d sums into, when its iterations only add to it.
  std::string innermost_accumulator(int d) const {
    if (d != static_cast<int>(sched_.order.size()) - 1) return "";
    if (current_sink_ == Sink::local) return "lacc";
    if (current_sink_ == Sink::scalar) return "acc";
    return "";
  }

  // Dense output, and the loops from depth d inward are all reductions: sum into a register, store (or add)
  // once. Only at the outermost such depth below the first loop: the loop above it writes an output variable,
  // or it is the first loop's, which sums too (a full reduction "ij->", split among threads): then each row's
  // sum is added to the output, not every element one after another (helper-43 F14: 8192^2 values at 50%
  // summed one by one into one float32 were off by 155 where torch was off by 1.5).
  bool local_accumulation_at(int d) const {
    const int n = static_cast<int>(sched_.order.size());
    if (current_sink_ != Sink::dense || d == 0 || d >= n) return false;
    auto writes = [&](int q) { return std::count(st_.out_vars.begin(), st_.out_vars.end(), sched_.order[q]) > 0; };
    for (int q = d; q < n; ++q)
      if (writes(q)) return false;
    return writes(d - 1) || d == 1;
  }

  Stmts lower_depth(int d, const ExprPtr& e, const States& states);

  // The segment [k, ke) of a compressed level under the positions of `s`, clamped to the crd buffer: a pos
  // entry out of range or decreasing gives an empty segment and sets the thread's bad flag.
  // The level kind says where the range comes from (LevelKind::position_range); a range read from buffers is
  // clamped, one computed from the parent's positions (a singleton level's) is inside by induction.
  // The level kind gives the range as C++ text (LevelKind::position_range, csrc/format): it stays Text here.
  // v: the level's index variable (its extent bounds a cursor's coordinates).
  loops::StmtPtr segment_start(const std::string& k, const std::string& ke, int tensor, int level, int v, const State& s,
                               bool checked = false) const {
    const LevelKind& kind = *spec_.operands[tensor].format->levels()[level].kind;
    const auto [b, e] = kind.position_range([&](const std::string& n) { return buf(tensor, level, n.c_str()); },
                                            loops::print(s.b), loops::print(s.e));
    const loops::StmtPtr decl = loops::decl("int64_t", {k, ke}, {loops::text(b), loops::text(e)});
    Stmts parts{decl};
    if (!checked && kind.range_from_buffers())  // checked: inside rows checked on a private copy (rows_snapshot)
      parts.push_back(loops::eval(loops::call("segment", {V(k), V(ke), V(buf(tensor, level, "crd") + "_n"), V("bad")})));
    if (kind.coordinate_cursor())
      parts.push_back(loops::line(kind.cursor_start([&](const std::string& n) { return buf(tensor, level, n.c_str()); },
                                                    loops::print(s.b), loops::print(s.e),
                                                    size_of(v), cursor_of(k))));
    return parts.size() == 1 ? decl : loops::on_one_line(parts);
  }
  // The cursor of a level that keeps no coordinates (LevelKind::coordinate_cursor) walked by iterator k<tag>:
  // q<tag>, the coordinate of the iterator's current position.
  static std::string cursor_of(const std::string& k) { return "q" + k.substr(1); }
  bool has_cursor(int tensor, int level) const {
    return spec_.operands[tensor].format->levels()[level].kind->coordinate_cursor();
  }
  // bad |= !(cursor done); after a loop that ran iterator k<tag> to its segment's end (none without a cursor).
  Stmts cursor_finished(int tensor, int level, const std::string& k) const {
    if (!has_cursor(tensor, level)) return {};
    const LevelKind& kind = *spec_.operands[tensor].format->levels()[level].kind;
    return {loops::assign(V("bad"), loops::unary(UnOp::logical_not, loops::paren(loops::text(kind.cursor_done(cursor_of(k))))),
                          AssignOp::bit_or)};
  }
  // The statements that move iterator k<tag>'s cursor to its next position (none for a level with crd).
  Stmts advance_cursor(int tensor, int level, const std::string& k) const {
    if (!has_cursor(tensor, level)) return {};
    return {loops::line(spec_.operands[tensor].format->levels()[level].kind->cursor_advance(cursor_of(k)))};
  }

  // Size of the merge lattice of `e` before repeated points are dropped (saturating), and whether it has
  // the point where no sparse iterator is needed; computed without building it.
  static std::pair<int64_t, bool> lattice_points_bound(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here);

  // Whether some part of `e` is nonzero with no sparse iterator at the variable (a dense loop is needed).
  static bool always_present(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here);

  // The linear merge keeps absent accesses in the nest below with empty segments; a dense level below a
  // sparse one would locate into an absent parent, so those keep the lattice.
  bool linear_merge_fits(const std::map<int, Part>& parts) const;

  // Co-iteration of any number of sparse iterators in code linear in their number (the lattice of a union
  // of n operands has 2^n points, each a loop or a branch). One loop visits every coordinate where some
  // iterator has an entry (or every coordinate, when some term needs none): the coordinate is the least
  // among the live iterators, those holding it are marked present, and the whole expression is computed
  // once with the absent accesses gated off (gated_value) and with empty segments below them. It costs a
  // compare per iterator per coordinate where the lattice's loops shed exhausted iterators, so it is used
  // only past kLatticeLimit points.
  Stmts linear_merge(int d, const ExprPtr& e, const States& states, const std::map<int, Part>& parts,
                     const std::vector<int>& iters, bool full);

  // Software prefetch for a register-tiled loop over sparse positions (SpMM's k): the rows of the dense
  // operands that the entry a few positions ahead will read are requested now. Those rows are gathered in
  // an order no hardware prefetcher predicts, and once the dense operand outgrows L2 the loop waits on each
  // one (measured on an AVX2 Zen 3: 25 -> 33 GFLOP/s for a 4096x4096 CSR at 10% times 4096x64). The
  // distance covers about 4 KB of tiles ahead (4 to 16 entries). Only when the gathered operand spans more
  // than this CPU's L2 (read at run time): below that the rows stay cached and prefetching costs more than
  // it saves (register_tile.cpp). Prefetches never fault, and the coordinate is range-checked anyway, so a bad index
  // buffer cannot make this read anything.
  // Returns the statement declaring `flag`, whether to prefetch (before the loop), and the prefetches (in its
  // body). The flag is named after the loop's iterator: the leftover loops after a union's merge each declare
  // theirs in the same scope.
  std::pair<Stmts, Stmts> vtile_prefetch(const ExprPtr& e, int v, const std::string& crd_buf, const LExpr& k,
                                         const LExpr& ke, const std::string& flag) const;

  // No level-format access of `e` has a level left at v (so the loop at v only reads strided operands).
  bool all_dense_here(const ExprPtr& e, const States& states, int v) const {
    std::vector<const Expr*> acc;
    ir::collect_accesses(e, acc);
    for (const Expr* a : acc) {
      const Access& info = access_.at(a->access_id);
      const State& s = states.at(a->access_id);
      if (!spec_.operands[info.tensor].strided() && s.level < static_cast<int>(info.lvars.size()) &&
          info.lvars[s.level] == v)
        return false;
    }
    return true;
  }

  // The body of an innermost dense loop with one (full) lattice point, made again with `any` hoisted.
  Stmts rebuild_without_any(int d, const ExprPtr& e, const States& states, int v) {
    any_hoisted_ = current_sink_ == Sink::scalar;
    (void)v;
    Stmts body = compute(e, advance_dense(d, e, states));
    any_hoisted_ = false;
    return body;
  }

  // States after locating every access that has a dense level at depth d's variable.
  States advance_dense(int d, const ExprPtr& e, const States& states) {
    const int v = sched_.order[d];
    std::vector<const Expr*> keep;
    ir::collect_accesses(e, keep);
    States next;
    for (const Expr* a : keep) {
      State s = states.at(a->access_id);
      const Access& info = access_.at(a->access_id);
      if (!spec_.operands[info.tensor].strided() && s.level < static_cast<int>(info.lvars.size()) &&
          info.lvars[s.level] == v) {
        const LExpr pos = located(s.b, v);
        s = State{s.level + 1, pos, loops::add(pos, I(1)), s.present};
      }
      next[a->access_id] = s;
    }
    return next;
  }

  // Bounds of this thread's share of a dense outer loop, balanced by nonzeros when a CSR-like operand
  // (dense level then compressed level) gives its row pointers.
  template <typename Parts>
  void split_dense_range(int v, const Parts& parts, const States& states, Stmts& out, LExpr& lo, LExpr& hi);  // lower.cpp

  // if (lo < hi) any = true;  (an innermost reduction that will add at least once)
  static loops::StmtPtr any_if_nonempty(const LExpr& lo, const LExpr& hi) {
    return loops::on_one_line({loops::if_then(loops::lt(lo, hi), {loops::assign(V("any"), loops::boolean(true))})});
  }

  // (int64_t)((__int128)n * t / nt): where thread t's equal share of [0, n) starts.
  static LExpr share_bound(const LExpr& n, const LExpr& t) {
    return loops::cast("int64_t", loops::paren(loops::div(loops::mul(loops::cast("__int128", n), t), V("nt"))));
  }

  // Whether access `id`'s level `level` lies in the rows this thread checked with rows_in_range: the
  // compressed level under the split loop's dense level, of the operand the split was balanced on.
  bool span_checked(int id, int level) const {
    if (span_tensor_ < 0 || level != 1) return false;
    const Access& a = access_.at(id);
    return a.tensor == span_tensor_ && !a.lvars.empty() && a.lvars[0] == span_var_;
  }

  const KernelSpec& spec_;
  const Schedule& sched_;
  const ir::Statement& st_;
  std::map<int, Access> access_;
  Sink current_sink_ = Sink::dense;
  bool any_hoisted_ = false;  // an innermost reduction loop set `any` before it runs
  int tile_depth_ = -1;
  int tile_var_ = -1;
  bool vector_tile_ = false;
  int tile_vectors_ = 4;  // vector accumulators of the vector pass being generated
  // The pass being generated is the last one, over the jn < lanes columns left: its loads take jn lanes
  // (vload_upto), whole vectors where the operand's buffer goes on past them.
  bool partial_vector_ = false;
  int scalar_tile_ = 16;  // columns of the array tile being generated
  VectorShape machine_;
  bool parallel_ = false;
  std::string parallel_why_ = "outer loop is not split";
  std::vector<std::string> reasons_;
  // The chunk loop of a checked split (split_dense_range): the statements made after out[chunk_mark_] go
  // inside `while (chunk_cond_) { chunk_prelude_; ... }`. close_chunks wraps them at depth 0 (where the
  // split is); npos: no chunk loop open.
  size_t chunk_mark_ = static_cast<size_t>(-1);
  LExpr chunk_cond_;
  Stmts chunk_prelude_;
  loops::StmtPtr chunk_free_;
  Stmts& close_chunks(Stmts& out, int depth) {
    if (depth != 0 || chunk_mark_ == static_cast<size_t>(-1)) return out;  // the split is the outermost loop
    Stmts body = chunk_prelude_;
    body.insert(body.end(), out.begin() + static_cast<std::ptrdiff_t>(chunk_mark_), out.end());
    out.resize(chunk_mark_);
    out.push_back(loops::while_loop(chunk_cond_, body));
    out.push_back(chunk_free_);
    chunk_mark_ = static_cast<size_t>(-1);
    chunk_prelude_.clear();
    return out;
  }
  // The operand whose rows the parallel split checked (rows_in_range), the split variable and the row pointers.
  int span_tensor_ = -1;
  int span_var_ = -1;
  std::string span_pos_;
  // Reductions over a checked row's entries run as vector loops (partial sums in lanes, gathers): set while
  // the long-row copy of the row loop is generated; *_used_ says whether any loop took it.
  bool simd_rows_ = false;
  bool simd_rows_used_ = false;
  // The same for the medium-row copy: a checked row's sum kept in four interleaved partial sums.
  bool unroll_rows_ = false;
  bool unroll_rows_used_ = false;
  // Dense output stores: loops from depth 0 that cover their output variable (see lower_depth), and whether
  // any store assigns (covered) or adds. Only assignments: the output is overwritten (overwrites_output).
  int covering_ = 0;
  bool assigned_output_ = false, added_output_ = false;
};


}  // namespace scorch::lowering
