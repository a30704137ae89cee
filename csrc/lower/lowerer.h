// The lowerer's state and its parts, shared by the files that implement it: lower.cpp (the loop nest for
// each index variable), linear_merge.cpp (co-iteration of many sparse operands in linear code) and
// register_tile.cpp (what the target's vector registers change). Internal to csrc/lower.
#pragma once

#include <algorithm>
#include <functional>
#include <map>

#include "common/error.h"
#include "lower/kernel_frame.h"
#include "lower/lower.h"
#include "lower/merge_lattice.h"

namespace scorch::lowering {

using ir::Expr;
using ir::ExprKind;
using ir::ExprPtr;
using loops::Stmts;

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
    if (!spec_.output.strided() || n < 2) return;
    const int j = sched_.order[n - 1], k = sched_.order[n - 2];
    if (!std::count(st_.out_vars.begin(), st_.out_vars.end(), j) || std::count(st_.out_vars.begin(), st_.out_vars.end(), k))
      return;
    for (const auto& [id, a] : access_)
      if (std::count(a.lvars.begin(), a.lvars.end(), j)) return;  // j walks a level: not a plain dense loop
    tile_depth_ = n - 2;
    tile_var_ = j;
    // Vector registers when the target has them and every access along j has it as its last, contiguous index.
    vector_tile_ = machine_.vector_bytes > 0 && machine_.tile_vectors > 0;
    for (const auto& [id, a] : access_) {
      const auto& vars = a.e->vars;
      if (std::count(vars.begin(), vars.end(), j) > 1 || (std::count(vars.begin(), vars.end(), j) && vars.back() != j))
        vector_tile_ = false;
    }
  }

  LoweredKernel run() {
    LoweredKernel out;
    out.sparse_output = !spec_.output.strided();
    Stmts& b = out.body;
    b = unpack_arguments(spec_);

    // The loop nest, inside the thread region.
    States states;
    for (const auto& [id, a] : access_) states[id] = State{};
    current_sink_ = sched_.output == OutputMode::coords ? Sink::stream : Sink::dense;
    Stmts nest = wrap_emission(-1, states, [&] { return lower_depth(0, st_.rhs, states); });

    if (!parallel_ && sched_.parallel) reasons_.push_back(parallel_why_);
    out.overwrites_output = !out.sparse_output && assigned_output_ && !added_output_;
    Stmts frame = thread_frame(spec_, sched_, nest, parallel_);
    b.insert(b.end(), frame.begin(), frame.end());
    out.reasons = reasons_;
    return out;
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
    std::string b = "0", e = "1";
    std::string present;  // empty: always present
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

  std::string size_of(int v) const { return fmt::format("N{}", v); }
  std::string var(int v) const { return fmt::format("i{}", v); }
  const Format& format_of(int access_id) const { return *spec_.operands[access_.at(access_id).tensor].format; }
  std::string buf(int tensor, int level, const char* name) const { return fmt::format("t{}_{}{}", tensor, name, level); }

  // At the emission depth of append/workspace outputs, the body gets an accumulator (or a workspace) and
  // the statements that emit what it collected; elsewhere the body is returned as it is.
  template <typename F>
  Stmts wrap_emission(int depth, const States& inside, F&& inner) {
    const bool here = depth == sched_.emit_depth &&
                      (sched_.output == OutputMode::append || sched_.output == OutputMode::workspace ||
                       sched_.output == OutputMode::sampled);
    if (!here) return inner();
    Stmts out;
    const Sink saved = current_sink_;
    if (sched_.output == OutputMode::sampled) {
      // The sampling operand's position: every level walked, its state points at its value.
      std::string pos;
      for (const auto& [id, a] : access_)
        if (a.tensor == sched_.sampled_tensor && inside.count(id)) pos = inside.at(id).b;
      SCORCH_ASSERT(!pos.empty(), "sampled output: the sampling operand is not walked at the emission depth");
      current_sink_ = Sink::scalar;
      out.push_back(loops::line("val_t acc = 0; bool any = false; (void)any;"));
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      out.push_back(loops::line(fmt::format("sampled_out[{}] = acc;", pos)));
    } else if (sched_.output == OutputMode::append) {
      current_sink_ = Sink::scalar;
      out.push_back(loops::line("val_t acc = 0; bool any = false;"));
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      out.push_back(loops::line(fmt::format("if (any) {{ const int64_t c[] = {{{}}}; push(st, c, {}, acc); }}",
                                            out_coords(), st_.out_vars.size())));
    } else {
      current_sink_ = Sink::workspace;
      Stmts body = inner();
      out.insert(out.end(), body.begin(), body.end());
      std::string coords;
      for (size_t d = 0; d < st_.out_vars.size(); ++d)
        coords += (d ? ", " : "") + (st_.out_vars[d] == sched_.workspace_var ? std::string("w") : var(st_.out_vars[d]));
      out.push_back(loops::line("std::sort(ws_list, ws_list + ws_n);"));
      out.push_back(loops::for_range("q", "0", "ws_n", {
          loops::line("const int64_t w = ws_list[q];"),
          loops::line(fmt::format("const int64_t c[] = {{{}}};", coords)),
          loops::line(fmt::format("push(st, c, {}, ws_val[w]);", st_.out_vars.size())),
          loops::line("ws_val[w] = 0; ws_flag[w] = 0;")}));
      out.push_back(loops::line("ws_n = 0;"));
    }
    current_sink_ = saved;
    return out;
  }

  std::string out_coords() const {
    std::string s;
    for (size_t d = 0; d < st_.out_vars.size(); ++d) s += (d ? ", " : "") + var(st_.out_vars[d]);
    return s;
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
  std::string vector_value(const ExprPtr& e, const States& states, int v, const std::string& base, int offset = 0) const {
    switch (e->kind) {
      case ExprKind::access: {
        std::string idx;
        const bool along = std::count(e->vars.begin(), e->vars.end(), v) > 0;
        if (!along) return value(e, states);
        for (size_t d = 0; d < e->vars.size(); ++d) {
          const std::string x = e->vars[d] == v ? "(" + base + ")" : var(e->vars[d]);
          idx += fmt::format("{}{} * t{}_st{}", d ? " + " : "", x, e->tensor, d);
        }
        if (offset == 0) return fmt::format("vload(&t{}_data[{}])", e->tensor, idx);
        return fmt::format("vload(&t{}_data[{}] + {})", e->tensor, idx, offset);
      }
      case ExprKind::literal: return "((val_t)" + ir::format_literal(e->value) + ")";
      case ExprKind::neg: return "(-" + vector_value(e->a, states, v, base, offset) + ")";
      case ExprKind::add: return "(" + vector_value(e->a, states, v, base, offset) + " + " + vector_value(e->b, states, v, base, offset) + ")";
      case ExprKind::sub: return "(" + vector_value(e->a, states, v, base, offset) + " - " + vector_value(e->b, states, v, base, offset) + ")";
      case ExprKind::mul: return "(" + vector_value(e->a, states, v, base, offset) + " * " + vector_value(e->b, states, v, base, offset) + ")";
    }
    return "0";
  }

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

  std::string value(const ExprPtr& e, const States& states) const {
    const Gated g = gated_value(e, states);
    return g.cond.empty() || g.zero_when_absent ? g.value : fmt::format("({} ? {} : (val_t)0)", g.cond, g.value);
  }

  struct Gated {
    std::string cond;               // where the value may be nonzero; empty: everywhere
    std::string value;
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
        if (s.strided()) {
          std::string idx;
          for (size_t d = 0; d < e->vars.size(); ++d)
            idx += fmt::format("{}{} * t{}_st{}", d ? " + " : "", var(e->vars[d]), e->tensor, d);
          return {"", fmt::format("t{}_data[{}]", e->tensor, idx.empty() ? "0" : idx)};
        }
        const State& stt = states.at(e->access_id);
        SCORCH_ASSERT(stt.level == static_cast<int>(s.format->levels().size()), "access not fully descended");
        return {stt.present, fmt::format("t{}_vals[{}]", e->tensor, stt.b)};
      }
      case ExprKind::literal: return {"", "((val_t)" + ir::format_literal(e->value) + ")"};
      case ExprKind::neg: {
        Gated g = gated_value(e->a, states);
        g.value = "(-" + g.value + ")";
        return g;
      }
      case ExprKind::mul: {
        const Gated a = gated_value(e->a, states), b = gated_value(e->b, states);
        const std::string c = a.cond.empty() ? b.cond : b.cond.empty() ? a.cond : "(" + a.cond + ") && (" + b.cond + ")";
        return {c, "(" + a.value + " * " + b.value + ")"};
      }
      case ExprKind::add:
      case ExprKind::sub: {
        const Gated a = gated_value(e->a, states), b = gated_value(e->b, states);
        const char* op = e->kind == ExprKind::add ? " + " : " - ";
        if (a.cond.empty() && b.cond.empty()) return {"", "(" + a.value + op + b.value + ")"};
        auto wrap = [](const Gated& g) {
          return g.cond.empty() || g.zero_when_absent ? g.value : fmt::format("(({}) ? {} : (val_t)0)", g.cond, g.value);
        };
        const std::string c = a.cond.empty() || b.cond.empty() ? "" : a.cond + " || " + b.cond;
        return {c, "(" + wrap(a) + op + wrap(b) + ")", true};
      }
    }
    return {"", "0"};
  }

  Stmts compute(const ExprPtr& e, const States& states) {
    const Gated g = gated_value(e, states);
    Stmts s = compute_value(e, states, g.value);
    if (g.cond.empty()) return s;
    return {loops::if_chain({g.cond}, {s})};  // nothing to add where every term is absent
  }

  Stmts compute_value(const ExprPtr& e, const States& states, const std::string& v) {
    switch (current_sink_) {
      case Sink::dense: added_output_ = true; return {loops::line(fmt::format("o[{}] += {};", dense_out_index(), v))};
      case Sink::scalar:
        if (any_hoisted_) return {loops::line(fmt::format("acc += {};", v))};
        return {loops::line(fmt::format("acc += {}; any = true;", v))};
      case Sink::local: return {loops::line(fmt::format("lacc += {};", v))};
      case Sink::tile: return {loops::line(fmt::format("tacc[jj] += {};", v))};
      case Sink::vtile: {
        Stmts out;
        for (int q = 0; q < tile_vectors_; ++q)
          out.push_back(loops::line(fmt::format("va{} += {};", q, vector_value(e, states, tile_var_, "jo", q * vector_width()))));
        return out;
      }
      case Sink::workspace:
        return {loops::line(fmt::format("{{ const int64_t w = {}; if (!ws_flag[w]) {{ ws_flag[w] = 1; ws_list[ws_n++] = w; }} ws_val[w] += {}; }}",
                                        var(sched_.workspace_var), v))};
      case Sink::stream:
        return {loops::line(fmt::format("{{ const int64_t c[] = {{{}}}; push(st, c, {}, {}); }}", out_coords(),
                                        st_.out_vars.size(), v))};
    }
    return {};
  }

  // The loops for order[d..]; `states` holds the accesses still in `e`.
  std::string dense_out_index(const std::string& tile_var = "") const {
    std::string lin;
    for (size_t d = 0; d < st_.out_vars.size(); ++d) {
      const int v = st_.out_vars[d];
      const std::string x = v == tile_var_ && !tile_var.empty() ? tile_var : var(v);
      lin += fmt::format("{}{} * os{}", d ? " + " : "", x, d);
    }
    return lin.empty() ? "0" : lin;
  }

  // The scalar an innermost loop at depth d sums into, when its iterations only add to it.
  std::string innermost_accumulator(int d) const {
    if (d != static_cast<int>(sched_.order.size()) - 1) return "";
    if (current_sink_ == Sink::local) return "lacc";
    if (current_sink_ == Sink::scalar) return "acc";
    return "";
  }

  // Dense output, and the loops from depth d inward are all reductions: sum into a register, store once.
  bool local_accumulation_at(int d) const {
    const int n = static_cast<int>(sched_.order.size());
    if (current_sink_ != Sink::dense || d == 0 || d >= n) return false;
    for (int q = d; q < n; ++q)
      if (std::count(st_.out_vars.begin(), st_.out_vars.end(), sched_.order[q])) return false;
    for (int q = d - 1; q >= 0; --q)  // only at the outermost such depth
      if (!std::count(st_.out_vars.begin(), st_.out_vars.end(), sched_.order[q])) return false;
    return true;
  }

  Stmts lower_depth(int d, const ExprPtr& e, const States& states);

  // The segment [k, ke) of a compressed level under the positions of `s`, clamped to the crd buffer: a pos
  // entry out of range or decreasing gives an empty segment and sets the thread's bad flag.
  // The level kind says where the range comes from (LevelKind::position_range); a range read from buffers is
  // clamped, one computed from the parent's positions (a singleton level's) is inside by induction.
  loops::StmtPtr segment_start(const std::string& k, const std::string& ke, int tensor, int level, const State& s,
                               bool checked = false) const {
    const LevelKind& kind = *spec_.operands[tensor].format->levels()[level].kind;
    const auto [b, e] = kind.position_range([&](const std::string& n) { return buf(tensor, level, n.c_str()); }, s.b, s.e);
    if (checked || !kind.range_from_buffers())  // checked: inside rows checked by rows_in_range
      return loops::line(fmt::format("int64_t {} = {}, {} = {};", k, b, ke, e));
    return loops::line(fmt::format("int64_t {0} = {2}, {1} = {3}; segment({0}, {1}, {4}_n, bad);", k, ke, b, e,
                                   buf(tensor, level, "crd")));
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
  // than half of this CPU's L2 (read at run time): below that the rows are cached and prefetching costs
  // more than it saves. Prefetches never fault, and the coordinate is range-checked anyway, so a bad index
  // buffer cannot make this read anything.
  // Returns the statement deciding whether to prefetch (before the loop) and the prefetches (in its body).
  std::pair<Stmts, Stmts> vtile_prefetch(const ExprPtr& e, int v, const std::string& crd_buf, const std::string& k,
                                         const std::string& ke) const;

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
        const std::string pos = fmt::format("({} * {} + {})", s.b, size_of(v), var(v));
        s = State{s.level + 1, pos, pos + " + 1", s.present};
      }
      next[a->access_id] = s;
    }
    return next;
  }

  // Bounds of this thread's share of a dense outer loop, balanced by nonzeros when a CSR-like operand
  // (dense level then compressed level) gives its row pointers.
  template <typename Parts>
  void split_dense_range(int v, const Parts& parts, const States& states, Stmts& out, std::string& lo, std::string& hi) {
    for (const auto& [id, p] : parts) {
      const Format& f = format_of(id);
      if (p.walk == LevelWalk::locate && p.level == 0 && f.levels().size() > 1 && f.levels()[1].kind->prefix_positions() &&
          states.at(id).b == "0") {
        const std::string pos = buf(p.tensor, 1, "pos");
        const std::string crd = buf(p.tensor, 1, "crd");
        out.push_back(loops::line(fmt::format("const int64_t lo{0} = balanced_bound({1}, {2}, tid, nt);", v, pos, size_of(v))));
        out.push_back(loops::line(fmt::format("int64_t hi{0} = balanced_bound({1}, {2}, tid + 1, nt);", v, pos, size_of(v))));
        // The thread's rows checked at once (rows_in_range): inside them, this operand's row segments and
        // coordinates are used unchecked (span_checked). Bad rows leave the thread nothing to do.
        const auto& lvars = access_.at(id).lvars;
        out.push_back(loops::line(fmt::format("if (!rows_in_range({0}, {1}, lo{2}, hi{2}, {1}_n, {3}, bad)) hi{2} = lo{2};",
                                              pos, crd, v, size_of(lvars.at(1)))));
        span_tensor_ = p.tensor;
        span_var_ = v;
        span_pos_ = pos;
        lo = fmt::format("lo{}", v);
        hi = fmt::format("hi{}", v);
        reasons_.push_back(fmt::format("outer loop {} split by nonzeros of operand {}", st_.var_names[v],
                                       st_.tensor_names[p.tensor]));
        return;
      }
    }
    out.push_back(loops::line(fmt::format("const int64_t lo{0} = (int64_t)((__int128){1} * tid / nt);", v, size_of(v))));
    out.push_back(loops::line(fmt::format("const int64_t hi{0} = (int64_t)((__int128){1} * (tid + 1) / nt);", v, size_of(v))));
    lo = fmt::format("lo{}", v);
    hi = fmt::format("hi{}", v);
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
  int scalar_tile_ = 16;  // columns of the array tile being generated
  VectorShape machine_;
  bool parallel_ = false;
  std::string parallel_why_ = "outer loop is not split";
  std::vector<std::string> reasons_;
  // The operand whose rows the parallel split checked (rows_in_range), the split variable and the row pointers.
  int span_tensor_ = -1;
  int span_var_ = -1;
  std::string span_pos_;
  // Reductions over a checked row's entries run as vector loops (partial sums in lanes, gathers): set while
  // the long-row copy of the row loop is generated; *_used_ says whether any loop took it.
  bool simd_rows_ = false;
  bool simd_rows_used_ = false;
  // Dense output stores: loops from depth 0 that cover their output variable (see lower_depth), and whether
  // any store assigns (covered) or adds. Only assignments: the output is overwritten (overwrites_output).
  int covering_ = 0;
  bool assigned_output_ = false, added_output_ = false;
};


}  // namespace scorch::lowering
