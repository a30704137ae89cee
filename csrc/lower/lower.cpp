#include "lower/lower.h"

#include "lower/lowerer.h"
#include "lower/pipeline.h"

namespace scorch {
namespace lowering {
namespace {

// Counts a loop that covers its output variable for as long as the loop's code is being made.
struct Covering {
  int& n;
  bool on;
  Covering(int& count, bool covers) : n(count), on(covers) { n += on; }
  ~Covering() { n -= on; }
};

}  // namespace

Stmts Lowerer::lower_depth(int d, const ExprPtr& e, const States& states) {
  const int n = static_cast<int>(sched_.order.size());
  if (d == n) return compute(e, states);
  if (local_accumulation_at(d)) {
    current_sink_ = Sink::local;
    // (in double under a scalar result, as its thread's sum: pass_output.cpp)
    Stmts out{loops::decl(st_.out_vars.empty() ? "double" : "val_t", "lacc", I(0))};
    Stmts inner = lower_depth(d, e, states);
    out.insert(out.end(), inner.begin(), inner.end());
    // Under loops that each visit every coordinate of their output variable once, this is the only store of
    // its element: stored, not added, so the output need not be zeroed first (overwrites_output).
    const bool store = covering_ == d;
    out.push_back(loops::assign(loops::load(V("o"), dense_out_index()), V("lacc"), store ? AssignOp::set : AssignOp::add));
    (store ? assigned_output_ : added_output_) = true;
    current_sink_ = Sink::dense;
    return out;
  }
  if (d == tile_depth_ && current_sink_ == Sink::dense) {
    // The innermost output loop is split into tiles of columns accumulated in registers across the
    // reduction loop above it: full tiles in vector registers, then what is left in passes of half as many
    // vectors each (so any width is covered by one pass per power of two, each reading the sparse row once),
    // then the columns short of a vector in a small array.
    const LExpr nj = size_expr(tile_var_), jo = V("jo");
    const int tile = tile_columns();
    // Under loops that each visit every coordinate of their output variable once, and with the tiled
    // variable the only other output variable, each output element is written by exactly one tile (full,
    // remainder pass or array tile), after its whole reduction: stored, not added, so the output need not be
    // zeroed first (overwrites_output). An empty row stores its zero accumulators.
    const bool store = covering_ == d && st_.out_vars.size() == static_cast<size_t>(d) + 1;
    const AssignOp put = store ? AssignOp::set : AssignOp::add;
    bool& wrote = store ? assigned_output_ : added_output_;
    Stmts out;
    const int w = vector_width();
    LExpr rest = I(0);  // where the columns not covered by vector code start
    // (n / m) * m
    auto round_down = [](const LExpr& n, int m) { return loops::mul(loops::paren(loops::div(n, I(m))), I(m)); };
    if (vector_tile_) {
      // One pass over the reduction with `vectors` accumulators; `wrap` makes the loop or branch around it.
      // `partial`: one vector over the jn < w columns left (loads of jn lanes, jn stores).
      auto vector_pass = [&](int vectors, Stmts body_prefix, const std::function<loops::StmtPtr(Stmts)>& wrap,
                             bool partial = false) {
        current_sink_ = Sink::vtile;
        tile_vectors_ = vectors;
        partial_vector_ = partial;
        Stmts body = std::move(body_prefix);
        for (auto& ptr : tile_row_pointers(e, tile_var_, "jo")) body.push_back(std::move(ptr));
        std::vector<std::string> names;
        for (int q = 0; q < vectors; ++q) names.push_back(fmt::format("va{}", q));
        body.push_back(loops::decl("vec_t", names, loops::Exprs(names.size(), loops::init_list({}))));
        Stmts inner = lower_depth(d, e, states);
        body.insert(body.end(), inner.begin(), inner.end());
        partial_vector_ = false;
        for (int q = 0; q < vectors; ++q) {
          const LExpr col = loops::paren(loops::add(loops::add(jo, I(q * w)), V("l")));
          body.push_back(loops::for_range("l", I(0), partial ? V("jn") : I(w),
                                          {loops::assign(loops::load(V("o"), dense_out_index(col)),
                                                         loops::load(V(names[q]), V("l")), put)},
                                          !partial));
        }
        wrote = true;
        out.push_back(wrap(std::move(body)));
      };
      const int vectors = machine_.tile_vectors;
      vector_pass(vectors, {}, [&](Stmts body) {
        return loops::for_step("jo", I(0), loops::le(loops::add(jo, I(tile)), nj), tile, std::move(body));
      });
      // The rest, fewer than a full tile: one pass of 2^p vectors for each bit p of the vectors left.
      out.push_back(loops::decl("int64_t", "jdone", round_down(nj, tile)));
      int top = 1;
      while (top * 2 < vectors) top *= 2;
      for (int q = top; q >= 1; q /= 2) {
        Stmts prefix{loops::decl("const int64_t", "jo", V("jdone")), loops::assign(V("jdone"), I(q * w), AssignOp::add)};
        vector_pass(q, prefix, [&](Stmts body) {
          return loops::if_then(loops::le(loops::add(V("jdone"), I(q * w)), nj), std::move(body));
        });
      }
      // The jn < w columns left: one vector whose loads take jn lanes (vload_upto). In the scalar array
      // below, a row of n < w columns cost a store and a reload per entry and column (helper-75: an SpMM of
      // 1-15 columns ran 2-3x slower than of 16, and 0.4-0.67x torch's CSR SpMM on the graphs).
      Stmts prefix{loops::decl("const int64_t", "jo", V("jdone")), loops::decl("const int64_t", "jn", loops::sub(nj, jo))};
      vector_pass(1, prefix, [&](Stmts body) { return loops::if_then(loops::lt(V("jdone"), nj), std::move(body)); },
                  /*partial=*/true);
      current_sink_ = Sink::dense;
      return out;
    }
    // The columns left (fewer than a vector, or all of them when loads along j are not contiguous), in
    // tiles kept in a small array.
    current_sink_ = Sink::tile;
    scalar_tile_ = tile;
    Stmts body{loops::decl("const int64_t", "jo", loops::add(rest, loops::mul(V("jt"), I(tile)))),
               loops::decl("const int64_t", "jn", loops::call("std::min<int64_t>", {I(tile), loops::sub(nj, jo)})),
               loops::decl("val_t", fmt::format("tacc[{}]", tile), loops::init_list({}))};
    Stmts inner = lower_depth(d, e, states);
    body.insert(body.end(), inner.begin(), inner.end());
    body.push_back(loops::for_range("jj", I(0), V("jn"), {loops::assign(loops::load(V("o"), dense_out_index(loops::paren(loops::add(jo, V("jj"))))),
                                                                       loops::load(V("tacc"), V("jj")), put)}));
    wrote = true;
    current_sink_ = Sink::dense;
    out.push_back(loops::for_range("jt", I(0), loops::div(loops::paren(loops::add(loops::sub(nj, rest), I(tile - 1))), I(tile)), body));
    return out;
  }
  const int v = sched_.order[d];
  const std::string iv = var(v);
  const LExpr ivx = V(iv);
  if (current_sink_ == Sink::vtile && v == tile_var_) return lower_depth(d + 1, e, states);
  if (current_sink_ == Sink::tile && v == tile_var_) {
    // Inside a tile: a full tile has a constant trip count (kept in registers), the last one may be short.
    Stmts full{loops::decl("const int64_t", iv, loops::add(V("jo"), V("jj")))};
    Stmts inner = lower_depth(d + 1, e, states);
    full.insert(full.end(), inner.begin(), inner.end());
    return {loops::if_chain({loops::eq(V("jn"), I(scalar_tile_)), nullptr},
                            {{loops::for_range("jj", I(0), I(scalar_tile_), full, true)},
                             {loops::for_range("jj", I(0), V("jn"), full)}})};
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
    out.push_back(segment_start(k(id), ke(id), p.tensor, p.level, v, s, span_checked(id, p.level)));
  }
  auto crd_buf = [&](int id) { const Part& p = parts.at(id); return V(buf(p.tensor, p.level, "crd")); };
  auto crd_at = [&](int id, const std::string& pos) { return loops::load(crd_buf(id), V(pos)); };
  // A level that keeps no coordinates has them in its iterator's cursor (LevelKind::coordinate_cursor).
  auto cursor = [&](int id) { return has_cursor(parts.at(id).tensor, parts.at(id).level); };
  auto crd = [&](int id) { return cursor(id) ? V(cursor_of(k(id))) : crd_at(id, k(id)); };
  // A coordinate that becomes the loop variable is checked against the extent (kernel_abi.h). Not in rows
  // checked on a private copy (rows_snapshot): they read the copy. In a segment coords_in_range checked, the
  // coordinate read again is kept in range (kept_in): only the caller's data race could change it since, and
  // that must not reach out of bounds.
  auto kept_crd = [&](int id) {
    return cursor(id) ? crd(id) : loops::call("kept_in", {crd(id), size_expr(v)});
  };
  auto checked_crd = [&](int id) {
    return span_checked(id, parts.at(id).level) ? crd(id) : loops::call("in_range", {crd(id), size_expr(v), V("bad")});
  };
  auto K = [&](int id) { return V(k(id)); };
  auto KE = [&](int id) { return V(ke(id)); };
  auto KN = [&](int id) { return V(kn(id)); };
  // K = end; and the cursor moved on with it.
  auto step_to = [&](int id, const LExpr& end) {
    Stmts s{loops::assign(K(id), end)};
    for (auto& a : advance_cursor(parts.at(id).tensor, parts.at(id).level, k(id))) s.push_back(a);
    return s;
  };
  auto preinc = [](const LExpr& x) { return loops::eval(loops::unary(UnOp::pre_inc, x)); };
  // while (kn < ke && crd[kn] == value) ++kn;  (the end of a run of equal coordinates)
  auto skip_run = [&](int id, const LExpr& value) {
    return loops::while_loop(loops::land(loops::lt(KN(id), KE(id)), loops::eq(crd_at(id, kn(id)), value)), {preinc(KN(id))});
  };
  auto next_pos = [&](int id) { return loops::add(K(id), I(1)); };
  // The end of the run of equal coordinates starting at k (non-unique levels) or k + 1.
  auto run_end = [&](int id, Stmts& body) -> LExpr {
    const Part& p = parts.at(id);
    if (p.unique) return next_pos(id);
    body.push_back(loops::on_one_line({loops::decl("int64_t", kn(id), next_pos(id)), skip_run(id, crd(id))}));
    return KN(id);
  };

  // The body of one lattice point: child segments for the participating accesses, then the next loop.
  auto case_body = [&](const LatticePoint& pt, const std::map<int, LExpr>& ends) {
    std::vector<const Expr*> keep;
    ir::collect_accesses(pt.expr, keep);
    States next;
    for (const Expr* a : keep) {
      State s = states.at(a->access_id);
      auto it = parts.find(a->access_id);
      if (it != parts.end()) {
        if (it->second.walk == LevelWalk::locate) {
          const LExpr pos = located(s.b, v);
          s = State{s.level + 1, pos, loops::add(pos, I(1)), s.present};
        } else {
          s = State{s.level + 1, K(a->access_id), ends.at(a->access_id), nullptr};
        }
      }
      next[a->access_id] = s;
    }
    return wrap_emission(d, next, [&] { return lower_depth(d + 1, pt.expr, next); });
  };

  const bool can_parallel = d == 0 && sched_.parallel;
  if (full) {
    // Dense loop over the whole extent; sparse iterators advance when they hold the coordinate.
    LExpr lo = I(0), hi = size_expr(v);
    bool split = false;  // lo and hi are this thread's share
    if (can_parallel && all_iters.empty()) {
      split = true;
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
    const Covering covering(covering_, covers);
    const bool span_here = span_tensor_ >= 0 && span_var_ == v;
    const bool vector_rows = span_here && machine_.vector_bytes > 0;
    if (span_here) {  // the first copy: vector sums where the target has vectors, else interleaved ones
      simd_rows_ = vector_rows;
      unroll_rows_ = !vector_rows;
      simd_rows_used_ = unroll_rows_used_ = false;
    }
    const size_t reasons_before = reasons_.size();
    Stmts body;
    std::map<int, LExpr> ends;
    for (int id : all_iters) {
      body.push_back(loops::decl("const bool", m(id), loops::land(loops::lt(K(id), KE(id)), loops::eq(crd(id), ivx))));
      const Part& p = parts.at(id);
      if (p.unique) {
        ends[id] = next_pos(id);
      } else {
        body.push_back(loops::on_one_line({loops::decl("int64_t", kn(id), K(id)),
                                           loops::if_then(V(m(id)), {loops::assign(KN(id), next_pos(id)), skip_run(id, ivx)})}));
        ends[id] = KN(id);
      }
    }
    loops::Exprs conds;
    std::vector<Stmts> branches;
    for (const auto& pt : lattice) {
      std::vector<LExpr> present;
      for (int id : pt.iterators) present.push_back(V(m(id)));
      const LExpr cond = all_of(present);
      conds.push_back(cond);
      branches.push_back(case_body(pt, ends));
      if (!cond) break;
    }
    body.push_back(loops::if_chain(conds, branches));
    for (int id : all_iters) body.push_back(loops::on_one_line({loops::if_then(V(m(id)), step_to(id, ends[id]))}));
    if (span_here && (simd_rows_used_ || unroll_rows_used_)) {
      // Copies of the row loop, each thread taking one by its rows' mean length: vector sums for long rows,
      // four interleaved scalar sums for medium ones, one sum for short ones. Each copy after the first is
      // the nest made again with the next kind of sum.
      const size_t first_reasons = reasons_.size() - reasons_before;
      auto again = [&](bool simd, bool unroll) {
        simd_rows_ = simd;
        unroll_rows_ = unroll;
        std::vector<Stmts> branches2;
        for (const auto& pt : lattice) {
          branches2.push_back(case_body(pt, ends));
          if (pt.iterators.empty()) break;
        }
        return Stmts{loops::for_range(iv, lo, hi, {loops::if_chain(conds, branches2)}, false)};
      };
      std::vector<Stmts> tiers{{loops::for_range(iv, lo, hi, body, false)}};
      if (simd_rows_used_) tiers.push_back(again(false, true));
      tiers.push_back(again(false, false));
      simd_rows_ = unroll_rows_ = false;
      reasons_.resize(reasons_before + first_reasons);  // the copies repeat them
      const LExpr pos = V(span_pos_);
      auto mean_at_least = [&](const std::string& name, int entries) {
        out.push_back(loops::decl("const bool", name,
                                  loops::ge(loops::cast("int64_t", loops::paren(loops::sub(loops::load(pos, hi), loops::load(pos, lo)))),
                                            loops::mul(loops::cast("int64_t", I(entries)), loops::paren(loops::sub(hi, lo))))));
        return V(name);
      };
      loops::Exprs tier_conds;
      if (simd_rows_used_) {
        // Rows of 4 vectors or more on average (entries, not bytes): shorter ones spend more on the vector
        // loop's head and tail than its partial sums save. Measured on Zen 4 (2 threads, SpMV, rows of a
        // fixed length, gathered vector loop over four interleaved scalar sums): 16-lane vectors 0.97-1.10x
        // at 32 entries, 1.34-1.46x at 64; 8-lane vectors 1.09-1.17x at 16, 1.6-2.5x at 32. Sixteen vectors
        // (the earlier rule) left rows of 64-255 entries on the scalar loop at up to half the speed. Vectors
        // built from scalar loads (machine_.soft_gathers) pay from 2 vectors: on Zen 5 (2 threads, SpMV, kernel
        // alone) DLMC's 90%-pruned layers (51 entries a row) ran 1.46-1.66x faster than as four scalar sums,
        // rows of 32 and 48 entries 1.8-2.0x, native and x86-64-v3 alike; rows of 16 and 24 under 8 lanes
        // were even (7.2/7.6, 10.4/10.2 us).
        const int min_mean = (machine_.soft_gathers ? 2 : 4) * vector_width();
        tier_conds.push_back(mean_at_least("long_rows", min_mean));
        reasons_.push_back(fmt::format("reductions over rows of >= {} entries on average run as vector loops", min_mean));
      }
      // Rows of kMediumRow entries or more on average: four independent sums, so a row's multiply-adds are
      // not one chain of dependent additions (an add's latency per entry). On shorter rows the unrolled loop
      // rarely runs and its extra branch costs more (SpMV, Zen 4, 2 threads: rows of 51 and 25 entries
      // 1.15-1.5x faster, of 11 1.14x, of 6-8 10-35% slower).
      constexpr int kMediumRow = 12;
      tier_conds.push_back(mean_at_least("medium_rows", kMediumRow));
      reasons_.push_back(fmt::format("reductions over rows of >= {} entries on average keep four partial sums", kMediumRow));
      tier_conds.push_back(nullptr);
      span_tensor_ = span_var_ = -1;
      out.push_back(loops::if_chain(tier_conds, tiers));
      return close_chunks(out, d);
    }
    if (span_here) simd_rows_ = unroll_rows_ = false;
    if (span_here) span_tensor_ = span_var_ = -1;  // the checked rows end with this loop
    const bool simd = d == n - 1 && all_iters.empty() && current_sink_ == Sink::dense &&
                      std::count(st_.out_vars.begin(), st_.out_vars.end(), v) > 0;
    const std::string red = all_iters.empty() && lattice.size() == 1 ? innermost_accumulator(d) : "";
    if (!red.empty()) {
      // A pure reduction.
      if (red == "acc") out.push_back(any_if_nonempty(lo, hi));
      // Along contiguous operands the loop is marked unit-stride: the vectorisation pass (pass_vectorize.cpp)
      // sums it in vector accumulators. Otherwise the pragma lets the C++ compiler vectorize it.
      auto loop = std::make_shared<loops::For>(
          static_cast<const loops::For&>(*loops::for_range(iv, lo, hi, rebuild_without_any(d, e, states, v), false, red)));
      loop->unit_stride = !split && contiguous_along(e, v) && all_dense_here(e, states, v);
      out.push_back(loop);
      return close_chunks(out, d);
    }
    out.push_back(loops::for_range(iv, lo, hi, body, simd));
    // Sorted, in-range coordinates are all matched by the dense loop; any left over were not.
    for (int id : all_iters) {
      out.push_back(loops::assign(V("bad"), loops::ne(K(id), KE(id)), AssignOp::bit_or));
      for (auto& c : cursor_finished(parts.at(id).tensor, parts.at(id).level, k(id))) out.push_back(c);
    }
    return close_chunks(out, d);
  }

  // Sparse loops: one per lattice point, each co-iterating that point's iterators.
  for (size_t pi = 0; pi < lattice.size(); ++pi) {
    const auto& P = lattice[pi];
    std::vector<const LatticePoint*> cases;
    for (const auto& q : lattice)
      if (iterators_subset(q.iterators, P.iterators)) cases.push_back(&q);
    if (P.iterators.size() == 1 && cases.size() == 1) {
      const int id = P.iterators[0];
      // A loop over one of the levels a fibers output shares with this operand visits each of the output's
      // positions there once, as a dense loop visits each coordinate (covering_, above).
      const bool covers = sched_.output == OutputMode::fibers && lattice.size() == 1 && d < sched_.shared_levels &&
                          d == covering_ && current_sink_ == Sink::dense &&
                          parts.at(id).tensor == sched_.sampled_tensor && parts.at(id).unique;
      const Covering covering(covering_, covers);
      Stmts body;
      std::map<int, LExpr> ends;
      ends[id] = run_end(id, body);
      // A unique level's counted loop has its segment's coordinates checked all at once before it starts
      // (coords_in_range), so it loads them unchecked; the while loop of a non-unique level checks each.
      // Not inside a register tile: there each entry feeds a tile of multiply-adds, which hide a compare
      // and a select per load, while a check per segment would run once per pass over the row (measured on
      // the SpMM yardstick, Zen 3: 3-7% slower on short rows).
      const bool rows_checked = span_checked(id, parts.at(id).level);
      const bool hoisted = !rows_checked && parts.at(id).unique && current_sink_ != Sink::vtile && current_sink_ != Sink::tile &&
                           !cursor(id);
      const LExpr coord = hoisted ? kept_crd(id) : checked_crd(id);
      body.insert(body.begin(), loops::decl("const int64_t", iv, coord));
      Stmts inner = case_body(P, ends);
      body.insert(body.end(), inner.begin(), inner.end());
      if (pi == 0 && can_parallel && parts.at(id).unique && !cursor(id)) {
        parallel_ = true;
        // This thread's equal share of the positions [k, ke).
        out.push_back(loops::block({loops::decl("const int64_t", "span", loops::sub(KE(id), K(id))),
                                    loops::decl("const int64_t", "b0", K(id)),
                                    loops::assign(K(id), loops::add(V("b0"), share_bound(V("span"), V("tid")))),
                                    loops::assign(KE(id), loops::add(V("b0"), share_bound(V("span"), loops::paren(loops::add(V("tid"), I(1))))))}));
      } else if (pi == 0 && can_parallel) {
        parallel_why_ = fmt::format("outer loop {} walks a {} level: serial", st_.var_names[v],
                                    cursor(id) ? "cursor (bitmap-like)" : "non-unique");
      }
      const std::string red = parts.at(id).unique ? innermost_accumulator(d) : "";
      if (parts.at(id).unique) {
        // A counted loop; inside, the iterator's name is bound to the loop counter.
        Stmts fbody{loops::decl("const int64_t", k(id), V("p" + tag(id)))};
        if (!red.empty()) {
          if (red == "acc") out.push_back(any_if_nonempty(K(id), KE(id)));
          any_hoisted_ = red == "acc";
          Stmts again{loops::decl("const int64_t", iv, coord)};
          Stmts inner2 = case_body(P, ends);
          again.insert(again.end(), inner2.begin(), inner2.end());
          any_hoisted_ = false;
          fbody.insert(fbody.end(), again.begin(), again.end());
        } else {
          fbody.insert(fbody.end(), body.begin(), body.end());
        }
        for (auto& a : advance_cursor(parts.at(id).tensor, parts.at(id).level, k(id))) fbody.push_back(a);
        // Last, after the thread split of [k, ke): each thread checks its own share.
        if (hoisted)
          out.push_back(loops::eval(loops::call("coords_in_range", {crd_buf(id), K(id), KE(id), size_expr(v), V("bad")})));
        // No simd pragma by default: on short rows the gathers and the vector head and tail cost more than they save.
        const std::string p_var = "p" + tag(id);
        // Prefetches only in the innermost loop of a tile (the one whose entries each feed the multiply-adds).
        if (current_sink_ == Sink::vtile && d == n - 2 && !cursor(id)) {
          const std::string flag = "pf_" + tag(id);
          auto [before, pf] = vtile_prefetch(e, v, buf(parts.at(id).tensor, parts.at(id).level, "crd"), K(id), KE(id), flag);
          if (!pf.empty()) {
            // Two loops, with and without the prefetches, chosen once per pass: testing the flag in the loop
            // cost small operands (whose rows stay cached, so the flag is false) 1-5% on Zen 3.
            Stmts with_pf = fbody;
            with_pf.insert(with_pf.begin() + 1, pf.begin(), pf.end());
            out.insert(out.end(), before.begin(), before.end());
            out.push_back(loops::if_chain({V(flag), nullptr}, {{loops::for_range(p_var, K(id), KE(id), with_pf)},
                                                                  {loops::for_range(p_var, K(id), KE(id), fbody)}}));
            continue;
          }
        }
        // A row's sum as a vector loop (partial sums in lanes; the loads through crd become gathers) in the
        // long-row copy of the row loop (see the dense loop above).
        const bool vector_sum = simd_rows_ && rows_checked && red == "lacc";
        simd_rows_used_ |= vector_sum;
        // A cursor level's reductions always take it: its rows are as long as the level is dense (a bitmap is
        // chosen above about 1/32), and one sum would wait on each multiply-add in turn. Each step reads the
        // cursor and moves it on in order, so the four entries still get their own coordinates.
        if (((unroll_rows_ && rows_checked) || cursor(id)) && red == "lacc") {
          // In the medium-row copy: four entries a step, each summed into its own partial sum, the rest one
          // at a time into lacc, the partial sums added last.
          unroll_rows_used_ |= !cursor(id);
          constexpr int lanes = 4;
          struct Lane : loops::Mutator {
            std::string p, acc;
            int q;
            LExpr mutate_Var(const std::shared_ptr<const loops::Var>& n) override {
              if (n->name == p) return loops::paren(loops::add(V(p), I(q)));
              if (n->name == "lacc") return V(acc);
              return n;
            }
          };
          Stmts step;
          for (int q = 0; q < lanes; ++q) {
            Lane lane;
            lane.p = p_var;
            lane.acc = q ? fmt::format("lacc{}", q) : "lacc";
            lane.q = q;
            step.push_back(loops::block(q ? lane.mutate(fbody) : fbody));
          }
          std::vector<std::string> partial;
          for (int q = 1; q < lanes; ++q) partial.push_back(fmt::format("lacc{}", q));
          LExpr total = V(partial[0]);
          for (size_t q = 1; q < partial.size(); ++q) total = loops::add(total, V(partial[q]));
          out.push_back(loops::block(
              {loops::decl("val_t", partial, loops::Exprs(partial.size(), value_zero())),
               loops::decl("int64_t", p_var, K(id)),
               loops::for_step(p_var, nullptr, loops::le(loops::add(V(p_var), I(lanes)), KE(id)), lanes, step),
               loops::for_step(p_var, nullptr, loops::lt(V(p_var), KE(id)), 1, fbody),
               loops::assign(V("lacc"), loops::paren(total), AssignOp::add)}));
          for (auto& c : cursor_finished(parts.at(id).tensor, parts.at(id).level, k(id))) out.push_back(c);
          continue;
        }
        auto sum_loop = std::make_shared<loops::For>(
            static_cast<const loops::For&>(*loops::for_range(p_var, K(id), KE(id), fbody, false, vector_sum ? red : "")));
        sum_loop->gather_sum = vector_sum;
        out.push_back(sum_loop);
        for (auto& c : cursor_finished(parts.at(id).tensor, parts.at(id).level, k(id))) out.push_back(c);
        continue;
      }
      body.push_back(loops::assign(K(id), ends[id]));
      out.push_back(loops::while_loop(loops::lt(K(id), KE(id)), body));
      continue;
    }
    if (pi == 0 && can_parallel)
      parallel_why_ = fmt::format("outer loop {} co-iterates {} sparse operands: serial", st_.var_names[v],
                                  P.iterators.size());
    Stmts body;
    std::vector<LExpr> live;
    for (int id : P.iterators) {
      live.push_back(loops::lt(K(id), KE(id)));
      body.push_back(loops::decl("const int64_t", c(id), checked_crd(id)));
    }
    LExpr mn = V(c(P.iterators[0]));
    for (size_t q = 1; q < P.iterators.size(); ++q) mn = loops::call("std::min<int64_t>", {mn, V(c(P.iterators[q]))});
    body.push_back(loops::decl("const int64_t", iv, mn));
    auto here = [&](int id) { return loops::eq(V(c(id)), ivx); };  // the iterator holds the coordinate
    std::map<int, LExpr> ends;
    for (int id : P.iterators) {
      const Part& p = parts.at(id);
      if (p.unique) {
        ends[id] = next_pos(id);
      } else {
        body.push_back(loops::on_one_line({loops::decl("int64_t", kn(id), next_pos(id)), loops::if_then(here(id), {skip_run(id, ivx)})}));
        ends[id] = KN(id);
      }
    }
    loops::Exprs conds;
    std::vector<Stmts> branches;
    for (const LatticePoint* q : cases) {
      std::vector<LExpr> held;
      for (int id : q->iterators) held.push_back(here(id));
      const LExpr cond = all_of(held);
      conds.push_back(cond ? cond : loops::boolean(true));
      branches.push_back(case_body(*q, ends));
    }
    body.push_back(loops::if_chain(conds, branches));
    for (int id : P.iterators) body.push_back(loops::on_one_line({loops::if_then(here(id), step_to(id, ends[id]))}));
    out.push_back(loops::while_loop(all_of(live), body));
  }
  return out;
}

// Bounds of this thread's share of a dense outer loop (lowerer.h): balanced by nonzeros, in checked chunks.
template <typename Parts>
void Lowerer::split_dense_range(int v, const Parts& parts, const States& states, Stmts& out, LExpr& lo, LExpr& hi) {
  const std::string lo_name = fmt::format("lo{}", v), hi_name = fmt::format("hi{}", v);
  const LExpr tid = V("tid"), nt = V("nt"), next_tid = loops::add(V("tid"), I(1));
  for (const auto& [id, p] : parts) {
    const Format& f = format_of(id);
    const auto* start = dynamic_cast<const loops::Int*>(states.at(id).b.get());
    if (p.walk == LevelWalk::locate && p.level == 0 && f.levels().size() > 1 && f.levels()[1].kind->prefix_positions() &&
        start && start->value == 0) {
      const std::string pos = buf(p.tensor, 1, "pos");
      const std::string crd = buf(p.tensor, 1, "crd");
      // The thread's rows are visited in chunks of about chunk_entries() stored entries, each checked
      // (rows_in_range) just before its rows run: inside a chunk, this operand's row segments and coordinates
      // are used unchecked (span_checked), and the check's pass over the coordinates leaves them in cache for
      // the rows that read them next (checking a thread's whole share first read a large operand's
      // coordinates from memory twice: SpMV 4096x4096 at 5%, 20% of the kernel). A bad chunk ends the
      // thread's rows. The caller's row loops go inside the chunk loop (close_chunks).
      const std::string lt = fmt::format("lt{}", v), ht = fmt::format("ht{}", v), c = fmt::format("c{}", v);
      out.push_back(loops::decl("const int64_t", lt, loops::call("balanced_bound", {V(pos), size_expr(v), tid, nt})));
      out.push_back(loops::decl("const int64_t", ht, loops::call("balanced_bound", {V(pos), size_expr(v), next_tid, nt})));
      out.push_back(loops::decl("int64_t", c, V(lt)));
      // The chunk's positions and coordinates are checked on a private copy (rows_snapshot), and inside the
      // chunk the buffers' names stand for the copy: every later read sees the values checked, whatever a
      // caller writing the buffers during the call does (checked and then read again, they reached out of
      // bounds under such a race). snapshot_free after the chunk loop (close_chunks).
      const auto& lvars = access_.at(id).lvars;
      const std::string snap = fmt::format("snap{}", v), sp = fmt::format("sp{}", v), sc = fmt::format("sc{}", v);
      const LExpr rows_ok = loops::call("rows_snapshot", {V(pos), V(crd), V(lo_name), V(hi_name), V(crd + "_n"),
                                                          size_expr(lvars.at(1)), V("bad"), V(snap), V(sp), V(sc)});
      out.push_back(loops::line(fmt::format("RowsSnapshot {} = {{nullptr, nullptr, 0, 0}};", snap)));
      chunk_cond_ = loops::lt(V(c), V(ht));
      chunk_prelude_ = {
          loops::decl("const int64_t", lo_name, V(c)),
          loops::decl("int64_t", hi_name, loops::call("chunk_end", {V(pos), V(c), V(ht), loops::call("chunk_entries", {})})),
          loops::assign(V(c), V(hi_name)),
          loops::decl("const idx_t*", sp, V(pos)),
          loops::decl("const idx_t*", sc, V(crd)),
          loops::on_one_line({loops::if_then(loops::unary(UnOp::logical_not, rows_ok),
                                             {loops::assign(V(hi_name), V(lo_name)), loops::assign(V(c), V(ht))})}),
          loops::decl("const idx_t* __restrict", pos, V(sp)),
          loops::decl("const idx_t* __restrict", crd, V(sc))};
      chunk_free_ = loops::eval(loops::call("snapshot_free", {V(snap)}));
      chunk_mark_ = out.size();
      span_tensor_ = p.tensor;
      span_var_ = v;
      span_pos_ = pos;
      lo = V(lo_name);
      hi = V(hi_name);
      reasons_.push_back(fmt::format("outer loop {} split by nonzeros of operand {}", st_.var_names[v],
                                     st_.tensor_names[p.tensor]));
      return;
    }
  }
  out.push_back(loops::decl("const int64_t", lo_name, share_bound(size_expr(v), tid)));
  out.push_back(loops::decl("const int64_t", hi_name, share_bound(size_expr(v), loops::paren(next_tid))));
  lo = V(lo_name);
  hi = V(hi_name);
}

}  // namespace lowering

LoweredKernel lower(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine) {
  passes::KernelIR k = run_pipeline(spec, schedule, machine);
  return std::move(k.facts);
}

LoweredKernel lower_general(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine) {
  passes::KernelIR k = run_pipeline(spec, schedule, machine, nullptr, false);
  return std::move(k.facts);
}

}  // namespace scorch
