#include "lower/lower.h"

#include "lower/native_forms.h"
#include "lower/lowerer.h"

namespace scorch {
namespace lowering {

Stmts Lowerer::lower_depth(int d, const ExprPtr& e, const States& states) {
  const int n = static_cast<int>(sched_.order.size());
  if (d == n) return compute(e, states);
  if (local_accumulation_at(d)) {
    current_sink_ = Sink::local;
    Stmts out{loops::line("val_t lacc = 0;")};
    Stmts inner = lower_depth(d, e, states);
    out.insert(out.end(), inner.begin(), inner.end());
    // Under loops that each visit every coordinate of their output variable once, this is the only store of
    // its element: stored, not added, so the output need not be zeroed first (overwrites_output).
    const bool store = covering_ == d;
    out.push_back(loops::line(fmt::format("o[{}] {} lacc;", dense_out_index(), store ? "=" : "+=")));
    (store ? assigned_output_ : added_output_) = true;
    current_sink_ = Sink::dense;
    return out;
  }
  if (d == tile_depth_ && current_sink_ == Sink::dense) {
    // The innermost output loop is split into tiles of columns accumulated in registers across the
    // reduction loop above it: full tiles in vector registers, then what is left in passes of half as many
    // vectors each (so any width is covered by one pass per power of two, each reading the sparse row once),
    // then the columns short of a vector in a small array.
    const std::string nj = size_of(tile_var_);
    const int tile = tile_columns();
    Stmts out;
    const int w = vector_width();
    std::string rest = "0";  // where the columns not covered by vector code start
    if (vector_tile_) {
      auto vector_pass = [&](int vectors, Stmts body_prefix, const std::string& loop_head) {
        current_sink_ = Sink::vtile;
        tile_vectors_ = vectors;
        Stmts body = std::move(body_prefix);
        std::string decl = "vec_t va0 = {}";
        for (int q = 1; q < vectors; ++q) decl += fmt::format(", va{} = {{}}", q);
        body.push_back(loops::line(decl + ";"));
        Stmts inner = lower_depth(d, e, states);
        body.insert(body.end(), inner.begin(), inner.end());
        for (int q = 0; q < vectors; ++q)
          body.push_back(loops::for_range("l", "0", std::to_string(w), {loops::line(fmt::format(
              "o[{}] += va{}[l];", dense_out_index(fmt::format("(jo + {} + l)", q * w)), q))}, true));
        added_output_ = true;
        out.push_back(loops::line(loop_head));
        out.insert(out.end(), body.begin(), body.end());
        out.push_back(loops::line("}"));
      };
      const int vectors = machine_.tile_vectors;
      vector_pass(vectors, {}, fmt::format("for (int64_t jo = 0; jo + {} <= {}; jo += {}) {{", tile, nj, tile));
      // The rest, fewer than a full tile: one pass of 2^p vectors for each bit p of the vectors left.
      out.push_back(loops::line(fmt::format("int64_t jdone = ({} / {}) * {};", nj, tile, tile)));
      int top = 1;
      while (top * 2 < vectors) top *= 2;
      for (int q = top; q >= 1; q /= 2) {
        Stmts prefix{loops::line("const int64_t jo = jdone;"), loops::line(fmt::format("jdone += {};", q * w))};
        vector_pass(q, prefix, fmt::format("if (jdone + {} <= {}) {{", q * w, nj));
      }
      rest = fmt::format("({} / {}) * {}", nj, w, w);
    }
    // The columns left (fewer than a vector, or all of them when loads along j are not contiguous), in
    // tiles kept in a small array.
    current_sink_ = Sink::tile;
    scalar_tile_ = tile;
    Stmts body{loops::line(fmt::format("const int64_t jo = {} + jt * {};", rest, tile)),
               loops::line(fmt::format("const int64_t jn = std::min<int64_t>({}, {} - jo);", tile, nj)),
               loops::line(fmt::format("val_t tacc[{}] = {{}};", tile))};
    Stmts inner = lower_depth(d, e, states);
    body.insert(body.end(), inner.begin(), inner.end());
    body.push_back(loops::for_range("jj", "0", "jn", {loops::line(fmt::format("o[{}] += tacc[jj];", dense_out_index("(jo + jj)")))}));
    added_output_ = true;
    current_sink_ = Sink::dense;
    out.push_back(loops::for_range("jt", "0", fmt::format("({} - {} + {}) / {}", nj, rest, tile - 1, tile), body));
    return out;
  }
  const int v = sched_.order[d];
  const std::string iv = var(v);
  if (current_sink_ == Sink::vtile && v == tile_var_) return lower_depth(d + 1, e, states);
  if (current_sink_ == Sink::tile && v == tile_var_) {
    // Inside a tile: a full tile has a constant trip count (kept in registers), the last one may be short.
    Stmts full{loops::line(fmt::format("const int64_t {} = jo + jj;", iv))};
    Stmts inner = lower_depth(d + 1, e, states);
    full.insert(full.end(), inner.begin(), inner.end());
    return {loops::if_chain({fmt::format("jn == {}", scalar_tile_), ""},
                            {{loops::for_range("jj", "0", std::to_string(scalar_tile_), full, true)},
                             {loops::for_range("jj", "0", "jn", full)}})};
  }

  std::vector<const Expr*> accs;
  ir::collect_accesses(e, accs);
  std::map<int, Part> parts;  // participating level-format accesses
  for (const Expr* a : accs) {
    const Access& info = access_.at(a->access_id);
    if (spec_.operands[info.tensor].strided()) continue;
    const State& s = states.at(a->access_id);
    if (s.level < static_cast<int>(info.lvars.size()) && info.lvars[s.level] == v) {
      const auto& lvl = format_of(a->access_id).levels()[s.level];
      parts[a->access_id] = {a->access_id, info.tensor, s.level, lvl.kind.get(), lvl.kind->walk(), lvl.kind->properties().unique};
    }
  }
  auto sparse_here = [&](const Expr& a) {
    auto it = parts.find(a.access_id);
    return it != parts.end() && it->second.walk != LevelWalk::locate;
  };
  // A union of many sparse iterators has a lattice of 2^n points: merge them linearly instead.
  if (lattice_points_bound(e, sparse_here).first > kLatticeLimit && linear_merge_fits(parts)) {
    std::vector<int> iters;
    for (const auto& [id, p] : parts)
      if (p.walk != LevelWalk::locate) iters.push_back(id);
    return linear_merge(d, e, states, parts, iters, always_present(e, sparse_here));
  }
  const auto lattice = build_lattice(e, sparse_here);
  const auto& all_iters = lattice.front().iterators;
  bool full = false;
  for (const auto& p : lattice) full |= p.iterators.empty();

  // Iterator names carry the level: deeper levels of the same access get their own.
  auto tag = [&](int id) { return fmt::format("{}l{}", id, parts.at(id).level); };
  auto k = [&](int id) { return "k" + tag(id); };
  auto ke = [&](int id) { return "ke" + tag(id); };
  auto kn = [&](int id) { return "kn" + tag(id); };
  auto m = [&](int id) { return "m" + tag(id); };
  auto c = [&](int id) { return "c" + tag(id); };

  Stmts out;
  // Start every sparse iterator at its parent's segment.
  for (int id : all_iters) {
    const Part& p = parts.at(id);
    const State& s = states.at(id);
    out.push_back(segment_start(k(id), ke(id), p.tensor, p.level, s, span_checked(id, p.level)));
  }
  auto crd = [&](int id) { const Part& p = parts.at(id); return fmt::format("{}[{}]", buf(p.tensor, p.level, "crd"), k(id)); };
  // A coordinate that becomes the loop variable is checked against the extent (kernel_abi.h).
  // Not in rows rows_in_range checked already.
  auto checked_crd = [&](int id) {
    return span_checked(id, parts.at(id).level) ? crd(id) : fmt::format("in_range({}, {}, bad)", crd(id), size_of(v));
  };
  // The end of the run of equal coordinates starting at k (non-unique levels) or k + 1.
  auto run_end = [&](int id, Stmts& body) -> std::string {
    const Part& p = parts.at(id);
    if (p.unique) return k(id) + " + 1";
    body.push_back(loops::line(fmt::format("int64_t {0} = {1} + 1; while ({0} < {2} && {3}[{0}] == {3}[{1}]) ++{0};",
                                           kn(id), k(id), ke(id), buf(p.tensor, p.level, "crd"))));
    return kn(id);
  };

  // The body of one lattice point: child segments for the participating accesses, then the next loop.
  auto case_body = [&](const LatticePoint& pt, const std::map<int, std::string>& ends) {
    std::vector<const Expr*> keep;
    ir::collect_accesses(pt.expr, keep);
    States next;
    for (const Expr* a : keep) {
      State s = states.at(a->access_id);
      auto it = parts.find(a->access_id);
      if (it != parts.end()) {
        if (it->second.walk == LevelWalk::locate) {
          const std::string pos = fmt::format("({} * {} + {})", s.b, size_of(v), iv);
          s = State{s.level + 1, pos, pos + " + 1", s.present};
        } else {
          s = State{s.level + 1, k(a->access_id), ends.at(a->access_id), ""};
        }
      }
      next[a->access_id] = s;
    }
    return wrap_emission(d, next, [&] { return lower_depth(d + 1, pt.expr, next); });
  };

  const bool can_parallel = d == 0 && sched_.parallel;
  if (full) {
    // Dense loop over the whole extent; sparse iterators advance when they hold the coordinate.
    std::string lo = "0", hi = size_of(v);
    if (can_parallel && all_iters.empty()) {
      parallel_ = true;
      split_dense_range(v, parts, states, out, lo, hi);
    } else if (can_parallel) {
      parallel_why_ = fmt::format("outer loop {} merges sparse iterators in a dense loop: serial", st_.var_names[v]);
    }
    // Under a split whose rows were checked, the nest is made with vector reductions over long rows first;
    // if any loop took one, it is made again without, and each thread picks one copy by its rows' mean
    // length. A copy per thread, not a test per row: on Zen 3 a scalar loop sharing its row loop with a
    // vector one ran 15-25% slower on short rows (graphs, 3-7 entries a row).
    // A loop over every coordinate of an output variable, with no condition, under such loops only: each
    // output element below is reached exactly once along it (covering_ counts them from depth 0).
    const bool covers = all_iters.empty() && lattice.size() == 1 && lattice.front().iterators.empty() &&
                        d == covering_ && current_sink_ == Sink::dense &&
                        std::count(st_.out_vars.begin(), st_.out_vars.end(), v) > 0;
    struct Covering {
      int& n;
      bool on;
      ~Covering() { n -= on; }
    } covering{covering_, covers};
    covering_ += covers;
    const bool span_here = span_tensor_ >= 0 && span_var_ == v;
    const bool vector_rows = span_here && machine_.vector_bytes > 0;
    if (vector_rows) {
      simd_rows_ = true;
      simd_rows_used_ = false;
    }
    const size_t reasons_before = reasons_.size();
    Stmts body;
    std::map<int, std::string> ends;
    for (int id : all_iters) {
      body.push_back(loops::line(fmt::format("const bool {0} = {1} < {2} && {3} == {4};", m(id), k(id), ke(id), crd(id), iv)));
      const Part& p = parts.at(id);
      if (p.unique) {
        ends[id] = k(id) + " + 1";
      } else {
        body.push_back(loops::line(fmt::format("int64_t {0} = {1}; if ({2}) {{ {0} = {1} + 1; while ({0} < {3} && {4}[{0}] == {5}) ++{0}; }}",
                                               kn(id), k(id), m(id), ke(id), buf(p.tensor, p.level, "crd"), iv)));
        ends[id] = kn(id);
      }
    }
    std::vector<std::string> conds;
    std::vector<Stmts> branches;
    for (const auto& pt : lattice) {
      std::string cond;
      for (int id : pt.iterators) cond += (cond.empty() ? "" : " && ") + m(id);
      conds.push_back(cond);
      branches.push_back(case_body(pt, ends));
      if (cond.empty()) break;
    }
    body.push_back(loops::if_chain(conds, branches));
    for (int id : all_iters) body.push_back(loops::line(fmt::format("if ({}) {} = {};", m(id), k(id), ends[id])));
    if (vector_rows && simd_rows_used_) {
      simd_rows_ = false;
      std::vector<Stmts> scalar_branches;
      for (const auto& pt : lattice) {
        scalar_branches.push_back(case_body(pt, ends));
        if (pt.iterators.empty()) break;
      }
      reasons_.resize(reasons_before + (reasons_.size() - reasons_before) / 2);  // the copy repeats them
      // Rows of 16 vectors or more on average (entries, not bytes): shorter ones spend more on the
      // vector loop's head and tail than its partial sums save.
      const int min_mean = 16 * vector_width();
      out.push_back(loops::line(fmt::format("const bool long_rows = (int64_t)({0}[{1}] - {0}[{2}]) >= (int64_t){3} * ({1} - {2});",
                                            span_pos_, hi, lo, min_mean)));
      reasons_.push_back(fmt::format("reductions over rows of >= {} entries on average run as vector loops", min_mean));
      out.push_back(loops::if_chain({"long_rows", ""}, {{loops::for_range(iv, lo, hi, body, false)},
                                                        {loops::for_range(iv, lo, hi, {loops::if_chain(conds, scalar_branches)}, false)}}));
      simd_rows_ = false;
      span_tensor_ = span_var_ = -1;
      return out;
    }
    if (vector_rows) simd_rows_ = false;
    if (span_here) span_tensor_ = span_var_ = -1;  // the checked rows end with this loop
    const bool simd = d == n - 1 && all_iters.empty() && current_sink_ == Sink::dense &&
                      std::count(st_.out_vars.begin(), st_.out_vars.end(), v) > 0;
    const std::string red = all_iters.empty() && lattice.size() == 1 ? innermost_accumulator(d) : "";
    if (!red.empty()) {
      // A pure reduction. Along contiguous operands: four vector accumulators (independent chains), then
      // the scalar remainder; otherwise a loop the pragma lets the compiler vectorize.
      if (red == "acc") out.push_back(loops::line(fmt::format("if ({} < {}) any = true;", lo, hi)));
      const States at = advance_dense(d, e, states);
      if (lo == "0" && machine_.vector_bytes > 0 && contiguous_along(e, v) && all_dense_here(e, states, v)) {
        const int w = vector_width();
        Stmts vec{loops::line("vec_t r0 = {}, r1 = {}, r2 = {}, r3 = {};"),
                  loops::line(fmt::format("int64_t rb = 0;")),
                  loops::line(fmt::format("for (; rb + {} <= {}; rb += {}) {{", 4 * w, hi, 4 * w))};
        for (int q = 0; q < 4; ++q)
          vec.push_back(loops::line(fmt::format("  r{} += {};", q, vector_value(e, at, v, "rb", q * w))));
        vec.push_back(loops::line("}"));
        vec.push_back(loops::line("const vec_t rs = (r0 + r1) + (r2 + r3);"));
        vec.push_back(loops::for_range("l", "0", std::to_string(w), {loops::line(fmt::format("{} += rs[l];", red))}));
        out.push_back(loops::block(vec));
        out.push_back(loops::line(fmt::format("for (int64_t {0} = ({1} / {2}) * {2}; {0} < {1}; ++{0}) {{", iv, hi, 4 * w)));
        Stmts tail = rebuild_without_any(d, e, states, v);
        for (const auto& t : tail) out.push_back(t);
        out.push_back(loops::line("}"));
        return out;
      }
      out.push_back(loops::for_range(iv, lo, hi, rebuild_without_any(d, e, states, v), false, red));
      return out;
    }
    out.push_back(loops::for_range(iv, lo, hi, body, simd));
    // Sorted, in-range coordinates are all matched by the dense loop; any left over were not.
    for (int id : all_iters) out.push_back(loops::line(fmt::format("bad |= {} != {};", k(id), ke(id))));
    return out;
  }

  // Sparse loops: one per lattice point, each co-iterating that point's iterators.
  for (size_t pi = 0; pi < lattice.size(); ++pi) {
    const auto& P = lattice[pi];
    std::vector<const LatticePoint*> cases;
    for (const auto& q : lattice)
      if (iterators_subset(q.iterators, P.iterators)) cases.push_back(&q);
    if (P.iterators.size() == 1 && cases.size() == 1) {
      const int id = P.iterators[0];
      Stmts body;
      std::map<int, std::string> ends;
      ends[id] = run_end(id, body);
      // A unique level's counted loop has its segment's coordinates checked all at once before it starts
      // (coords_in_range), so it loads them unchecked; the while loop of a non-unique level checks each.
      // Not inside a register tile: there each entry feeds a tile of multiply-adds, which hide a compare
      // and a select per load, while a check per segment would run once per pass over the row (measured on
      // the SpMM yardstick, Zen 3: 3-7% slower on short rows).
      const bool rows_checked = span_checked(id, parts.at(id).level);
      const bool hoisted = !rows_checked && parts.at(id).unique && current_sink_ != Sink::vtile && current_sink_ != Sink::tile;
      const std::string coord = hoisted ? crd(id) : checked_crd(id);
      body.insert(body.begin(), loops::line(fmt::format("const int64_t {} = {};", iv, coord)));
      Stmts inner = case_body(P, ends);
      body.insert(body.end(), inner.begin(), inner.end());
      if (pi == 0 && can_parallel && parts.at(id).unique) {
        parallel_ = true;
        out.push_back(loops::line(fmt::format("{{ const int64_t span = {} - {}; const int64_t b0 = {};", ke(id), k(id), k(id))));
        out.push_back(loops::line(fmt::format("  {} = b0 + (int64_t)((__int128)span * tid / nt);", k(id))));
        out.push_back(loops::line(fmt::format("  {} = b0 + (int64_t)((__int128)span * (tid + 1) / nt); }}", ke(id))));
      } else if (pi == 0 && can_parallel) {
        parallel_why_ = fmt::format("outer loop {} walks a non-unique level: serial", st_.var_names[v]);
      }
      const std::string red = parts.at(id).unique ? innermost_accumulator(d) : "";
      if (parts.at(id).unique) {
        // A counted loop; inside, the iterator's name is bound to the loop counter.
        Stmts fbody{loops::line(fmt::format("const int64_t {} = p{};", k(id), tag(id)))};
        if (!red.empty()) {
          if (red == "acc") out.push_back(loops::line(fmt::format("if ({} < {}) any = true;", k(id), ke(id))));
          any_hoisted_ = red == "acc";
          Stmts again{loops::line(fmt::format("const int64_t {} = {};", iv, coord))};
          Stmts inner2 = case_body(P, ends);
          again.insert(again.end(), inner2.begin(), inner2.end());
          any_hoisted_ = false;
          fbody.insert(fbody.end(), again.begin(), again.end());
        } else {
          fbody.insert(fbody.end(), body.begin(), body.end());
        }
        // Last, after the thread split of [k, ke): each thread checks its own share.
        if (hoisted)
          out.push_back(loops::line(fmt::format("coords_in_range({}, {}, {}, {}, bad);",
                                                buf(parts.at(id).tensor, parts.at(id).level, "crd"), k(id), ke(id), size_of(v))));
        // No simd pragma by default: on short rows the gathers and the vector head and tail cost more than they save.
        const std::string p_var = "p" + tag(id);
        if (current_sink_ == Sink::vtile) {
          auto [before, pf] = vtile_prefetch(e, v, buf(parts.at(id).tensor, parts.at(id).level, "crd"), k(id), ke(id));
          if (!pf.empty()) {
            // Two loops, with and without the prefetches, chosen once per pass: testing pf_on in the loop
            // cost small operands (whose rows stay cached, so pf_on is false) 1-5% on Zen 3.
            Stmts with_pf = fbody;
            with_pf.insert(with_pf.begin() + 1, pf.begin(), pf.end());
            out.insert(out.end(), before.begin(), before.end());
            out.push_back(loops::if_chain({"pf_on", ""}, {{loops::for_range(p_var, k(id), ke(id), with_pf, false, "")},
                                                          {loops::for_range(p_var, k(id), ke(id), fbody, false, "")}}));
            continue;
          }
        }
        // A row's sum as a vector loop (partial sums in lanes; the loads through crd become gathers) in the
        // long-row copy of the row loop (see the dense loop above).
        const bool vector_sum = simd_rows_ && rows_checked && red == "lacc";
        simd_rows_used_ |= vector_sum;
        out.push_back(loops::for_range(p_var, k(id), ke(id), fbody, false, vector_sum ? red : ""));
        continue;
      }
      body.push_back(loops::line(fmt::format("{} = {};", k(id), ends[id])));
      out.push_back(loops::while_loop(fmt::format("{} < {}", k(id), ke(id)), body));
      continue;
    }
    if (pi == 0 && can_parallel)
      parallel_why_ = fmt::format("outer loop {} co-iterates {} sparse operands: serial", st_.var_names[v],
                                  P.iterators.size());
    Stmts body;
    std::string cond;
    for (int id : P.iterators) {
      cond += (cond.empty() ? "" : " && ") + fmt::format("{} < {}", k(id), ke(id));
      body.push_back(loops::line(fmt::format("const int64_t {} = {};", c(id), checked_crd(id))));
    }
    std::string mn = c(P.iterators[0]);
    for (size_t q = 1; q < P.iterators.size(); ++q) mn = fmt::format("std::min<int64_t>({}, {})", mn, c(P.iterators[q]));
    body.push_back(loops::line(fmt::format("const int64_t {} = {};", iv, mn)));
    std::map<int, std::string> ends;
    for (int id : P.iterators) {
      const Part& p = parts.at(id);
      if (p.unique) {
        ends[id] = k(id) + " + 1";
      } else {
        body.push_back(loops::line(fmt::format("int64_t {0} = {1} + 1; if ({2} == {3}) {{ while ({0} < {4} && {5}[{0}] == {3}) ++{0}; }}",
                                               kn(id), k(id), c(id), iv, ke(id), buf(p.tensor, p.level, "crd"))));
        ends[id] = kn(id);
      }
    }
    std::vector<std::string> conds;
    std::vector<Stmts> branches;
    for (const LatticePoint* q : cases) {
      std::string cond;
      for (int id : q->iterators) cond += (cond.empty() ? "" : " && ") + fmt::format("{} == {}", c(id), iv);
      conds.push_back(cond.empty() ? "true" : cond);
      branches.push_back(case_body(*q, ends));
    }
    body.push_back(loops::if_chain(conds, branches));
    for (int id : P.iterators) body.push_back(loops::line(fmt::format("if ({} == {}) {} = {};", c(id), iv, k(id), ends[id])));
    out.push_back(loops::while_loop(cond, body));
  }
  return out;
}

}  // namespace lowering

LoweredKernel lower(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine) {
  // Forms with a lowering of their own (native_forms.h: BSR, ...) first.
  if (auto k = lower_native_form(spec, schedule, machine)) return std::move(*k);
  return lower_general(spec, schedule, machine);
}

LoweredKernel lower_general(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine) {
  return lowering::Lowerer(spec, schedule, machine).run();
}

}  // namespace scorch
