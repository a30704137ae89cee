// Lowering: sums of many sparse operands co-iterated in one loop (code linear in their number).
#include "lower/lowerer.h"

namespace scorch::lowering {

// Size of the merge lattice of `e` before repeated points are dropped (saturating), and whether it has
// the point where no sparse iterator is needed; computed without building it.
std::pair<int64_t, bool> Lowerer::lattice_points_bound(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here) {
  constexpr int64_t cap = int64_t{1} << 40;
  switch (e->kind) {
    case ExprKind::access: return {1, !sparse_here(*e)};
    case ExprKind::literal: return {1, true};
    case ExprKind::neg: return lattice_points_bound(e->a, sparse_here);
    case ExprKind::mul:
    case ExprKind::add:
    case ExprKind::sub: {
      auto [a, fa] = lattice_points_bound(e->a, sparse_here);
      auto [b, fb] = lattice_points_bound(e->b, sparse_here);
      int64_t n = std::min(cap, a * b);
      if (e->kind == ExprKind::mul) return {n, fa && fb};
      if (!fb) n = std::min(cap, n + a);
      if (!fa) n = std::min(cap, n + b);
      return {n, fa || fb};
    }
  }
  return {1, true};
}

// Whether some part of `e` is nonzero with no sparse iterator at the variable (a dense loop is needed).
bool Lowerer::always_present(const ExprPtr& e, const std::function<bool(const Expr&)>& sparse_here) {
  switch (e->kind) {
    case ExprKind::access: return !sparse_here(*e);
    case ExprKind::literal: return true;
    case ExprKind::neg: return always_present(e->a, sparse_here);
    case ExprKind::mul: return always_present(e->a, sparse_here) && always_present(e->b, sparse_here);
    case ExprKind::add:
    case ExprKind::sub: return always_present(e->a, sparse_here) || always_present(e->b, sparse_here);
  }
  return true;
}

// The linear merge keeps absent accesses in the nest below with empty segments; a dense level below a
// sparse one would locate into an absent parent, so those keep the lattice.
bool Lowerer::linear_merge_fits(const std::map<int, Part>& parts) const {
  for (const auto& [id, p] : parts) {
    if (p.walk == LevelWalk::locate) continue;
    const auto& levels = format_of(id).levels();
    for (size_t l = p.level + 1; l < levels.size(); ++l)
      if (levels[l].kind->walk() == LevelWalk::locate) return false;
  }
  return true;
}

// Co-iteration of any number of sparse iterators in code linear in their number (the lattice of a union
// of n operands has 2^n points, each a loop or a branch). One loop visits every coordinate where some
// iterator has an entry (or every coordinate, when some term needs none): the coordinate is the least
// among the live iterators, those holding it are marked present, and the whole expression is computed
// once with the absent accesses gated off (gated_value) and with empty segments below them. It costs a
// compare per iterator per coordinate where the lattice's loops shed exhausted iterators, so it is used
// only past kLatticeLimit points.
Stmts Lowerer::linear_merge(int d, const ExprPtr& e, const States& states, const std::map<int, Part>& parts,
                   const std::vector<int>& iters, bool full) {
  const int v = sched_.order[d];
  const std::string iv = var(v);
  const LExpr ivx = V(iv), n = size_expr(v);
  auto name = [&](const char* pre, int id) { return fmt::format("{}{}l{}", pre, id, parts.at(id).level); };
  auto nv = [&](const char* pre, int id) { return V(name(pre, id)); };
  auto crd_buf = [&](int id) { return V(buf(parts.at(id).tensor, parts.at(id).level, "crd")); };
  auto crd_at = [&](int id, const char* pre) {
    // A level that keeps no coordinates has its iterator's in a cursor (unique levels only: pre is "k").
    if (has_cursor(parts.at(id).tensor, parts.at(id).level)) return V(cursor_of(name("k", id)));
    return loops::load(crd_buf(id), nv(pre, id));
  };
  Stmts out;
  for (int id : iters) {
    const Part& p = parts.at(id);
    const State& s = states.at(id);
    out.push_back(segment_start(name("k", id), name("ke", id), p.tensor, p.level, v, s));
  }
  auto live = [&](int id) { return loops::lt(nv("k", id), nv("ke", id)); };
  Stmts body;
  if (full) {
    for (int id : iters)
      body.push_back(loops::decl("const bool", name("m", id), loops::land(live(id), loops::eq(crd_at(id, "k"), ivx))));
  } else {
    for (int id : iters)
      body.push_back(loops::decl("const int64_t", name("c", id),
                                 loops::select(live(id), loops::call("in_range", {crd_at(id, "k"), n, V("bad")}), n)));
    body.push_back(loops::decl("int64_t", iv, n));
    for (int id : iters) body.push_back(loops::assign(ivx, loops::select(loops::lt(nv("c", id), ivx), nv("c", id), ivx)));
    for (int id : iters) body.push_back(loops::decl("const bool", name("m", id), loops::eq(nv("c", id), ivx)));
  }
  std::map<int, LExpr> ends;
  for (int id : iters) {
    const LExpr k = nv("k", id), m = nv("m", id);
    if (parts.at(id).unique) {
      ends[id] = loops::paren(loops::add(k, m));
    } else {
      // The run of equal coordinates; empty when absent.
      const LExpr kn = nv("kn", id);
      body.push_back(loops::on_one_line(
          {loops::decl("int64_t", name("kn", id), loops::add(k, m)),
           loops::if_then(m, {loops::while_loop(loops::land(loops::lt(kn, nv("ke", id)), loops::eq(crd_at(id, "kn"), crd_at(id, "k"))),
                                                {loops::eval(loops::unary(UnOp::pre_inc, kn))})})}));
      ends[id] = kn;
    }
  }
  std::vector<const Expr*> keep;
  ir::collect_accesses(e, keep);
  States next;
  for (const Expr* a : keep) {
    State s = states.at(a->access_id);
    auto it = parts.find(a->access_id);
    if (it != parts.end()) {
      if (it->second.walk == LevelWalk::locate) {
        const LExpr pos = located(s.b, v);
        s = State{s.level + 1, pos, loops::add(pos, I(1)), s.present};
      } else {
        s = State{s.level + 1, nv("k", a->access_id), ends.at(a->access_id), nv("m", a->access_id)};
      }
    }
    next[a->access_id] = s;
  }
  Stmts inner = wrap_emission(d, next, [&] { return lower_depth(d + 1, e, next); });
  body.insert(body.end(), inner.begin(), inner.end());
  for (int id : iters) {
    body.push_back(loops::assign(nv("k", id), ends[id]));
    Stmts step = advance_cursor(parts.at(id).tensor, parts.at(id).level, name("k", id));
    if (!step.empty()) body.push_back(loops::on_one_line({loops::if_then(nv("m", id), step)}));
  }
  if (d == 0 && sched_.parallel)
    parallel_why_ = fmt::format("outer loop {} merges {} sparse operands: serial", st_.var_names[v], iters.size());
  const std::string why = fmt::format("loop {} merges {} sparse iterators linearly", st_.var_names[v], iters.size());
  if (std::find(reasons_.begin(), reasons_.end(), why) == reasons_.end()) reasons_.push_back(why);
  if (full) {
    out.push_back(loops::for_range(iv, I(0), n, body));
    for (int id : iters) out.push_back(loops::assign(V("bad"), loops::ne(nv("k", id), nv("ke", id)), AssignOp::bit_or));
  } else {
    LExpr any_live;
    for (int id : iters) any_live = any_live ? loops::lor(any_live, live(id)) : live(id);
    out.push_back(loops::while_loop(any_live, body));
  }
  // Every iterator ran to its segment's end: a cursor must have no coordinate left.
  for (int id : iters)
    for (auto& c : cursor_finished(parts.at(id).tensor, parts.at(id).level, name("k", id))) out.push_back(c);
  return out;
}

}  // namespace scorch::lowering
