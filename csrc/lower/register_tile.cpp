// Lowering: what the target's vector registers add to register-tiled loops.
#include "lower/lowerer.h"

namespace scorch::lowering {

// Software prefetch for a register-tiled loop over sparse positions (SpMM's k): the rows of the dense
// operands that the entry a few positions ahead will read are requested now. Those rows are gathered in
// an order no hardware prefetcher predicts, and once the dense operand outgrows L2 the loop waits on each
// one (measured on an AVX2 Zen 3: 25 -> 33 GFLOP/s for a 4096x4096 CSR at 10% times 4096x64). The
// distance covers about 4 KB of tiles ahead (4 to 16 entries). Only when the gathered operand spans more
// than this CPU's L2 (read at run time): below that the rows stay cached and prefetching costs more than
// it saves (half of L2 was the bound before: a 256x2304 DLMC matrix times 2304x64, 590 KB of rows on a
// 1 MB L2, ran at 0.82-0.85 of the hand-written loop with the prefetches and 0.98 without). Prefetches never fault, and the coordinate is range-checked anyway, so a bad index
// buffer cannot make this read anything.
// Returns the statement deciding whether to prefetch (before the loop) and the prefetches (in its body).
std::pair<Stmts, Stmts> Lowerer::vtile_prefetch(const ExprPtr& e, int v, const std::string& crd_buf, const LExpr& k,
                                                const LExpr& ke, const std::string& flag) const {
  std::vector<const Expr*> acc;
  ir::collect_accesses(e, acc);
  const int elem = spec_.f64 ? 8 : 4;
  const int tile_bytes = tile_vectors_ * machine_.vector_bytes;
  if (tile_bytes <= 0) return {{}, {}};
  const int distance = std::clamp(4096 / tile_bytes, 4, 16);
  Stmts prefetches;
  std::vector<LExpr> spans;  // elements the gathered operands span: no prefetch while they fit in cache
  for (const Expr* a : acc) {
    if (!spec_.operands[a->tensor].strided() || !std::count(a->vars.begin(), a->vars.end(), v) ||
        !std::count(a->vars.begin(), a->vars.end(), tile_var_))
      continue;
    for (size_t d = 0; d < a->vars.size(); ++d)
      if (a->vars[d] == v) spans.push_back(loops::mul(size_expr(v), V(fmt::format("t{}_st{}", a->tensor, d))));
    const LExpr idx = strided_index(*a, [&](int x) { return V(x == v ? "pfc" : x == tile_var_ ? "jo" : var(x)); });
    const LExpr row = loops::unary(UnOp::address_of, loops::load(V(fmt::format("t{}_data", a->tensor)), idx));
    for (int off = 0; off < tile_bytes; off += 64)
      prefetches.push_back(loops::eval(loops::call("__builtin_prefetch", {loops::add(row, I(off / elem))})));
  }
  if (prefetches.empty()) return {{}, {}};
  LExpr pf_on = loops::gt(loops::mul(loops::paren(sum_of(spans, I(0))), I(elem)), loops::call("l2_cache_bytes", {}));
  // On a target whose tile's accumulators fill half its vector registers or more (a narrow register file),
  // rows of more than kMaxPrefetchTiles tiles go without: each sparse row is walked once per tile, and the
  // prefetch bookkeeping per entry and tile costs more than the waits it hides. Measured on Zen 4, 2
  // threads, shaped as x86-64-v3 (16 registers, 8-vector tiles of 64 columns): a 256x2048 CSR at 10% times
  // 2048x512 (relu_mlp_sparse's fc2, 8 tiles a row) 0.94-0.97 ms with prefetches, 0.77 ms without; a
  // 512x4608 CSR at 20% times 4608x128 (2 tiles) lost without them (1.51-1.56 against 1.71-1.72 ms). With
  // a register file twice the tile (32 registers) the kernel is left as it was: commit 492681a's bound there
  // changed nothing for its rows yet its yardstick worst case dropped, so no bound is emitted at all.
  constexpr int kMaxPrefetchTiles = 4;
  if (2 * machine_.tile_vectors >= machine_.registers())
    pf_on = loops::land(pf_on, loops::le(size_expr(tile_var_), I(static_cast<int64_t>(kMaxPrefetchTiles) * tile_columns())));
  Stmts before{loops::decl("const bool", flag, pf_on)};
  // The entry `distance` positions ahead (or the last), and its row when its coordinate is in range.
  const LExpr ahead = loops::add(k, I(distance));
  Stmts out{loops::if_then(
      V(flag),
      {loops::on_one_line({loops::decl("const int64_t", "pfp", loops::select(loops::lt(ahead, ke), ahead, loops::sub(ke, I(1)))),
                           loops::decl("const int64_t", "pfc", loops::load(V(crd_buf), V("pfp")))}),
       loops::if_then(loops::lt(loops::cast("uint64_t", V("pfc")), loops::cast("uint64_t", size_expr(v))), prefetches)})};
  return {before, out};
}

}  // namespace scorch::lowering
