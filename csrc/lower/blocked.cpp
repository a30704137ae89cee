// Native kernels over blocked levels (blocked.h). The loop nest:
//
//   for each block row po (threads split the block rows by stored blocks):
//     [kb, kbe) = the block row's segment of block columns, checked (segment, coords_in_range)
//     for each group of RT rows of the block (rr):
//       for each tile of V vectors of the dense operand's free index (jo):
//         RT x V vector accumulators
//         for each stored block b of the row: qo = crd[b] (kept in range: checked above, read again)
//           for each column c of the block (a constant trip count):
//             V vectors of dense row qo * bw + c, then for each of the RT rows:
//               one broadcast value of the block times the V vectors
//         add the accumulators into the output
//
// Each vector of the dense operand is used by RT rows of the block and each block value by V vectors: RT
// times the reuse of a CSR kernel, which loads one dense vector per multiply-add. RT and V come from the
// target's register tile (VectorShape::tile_vectors accumulators, vector_bytes wide): nothing here is
// written for one instruction set. The linear form transposes the dense operand once (in parallel) so that
// its free index is contiguous and runs the same loop nest, storing the accumulators transposed.
#include "lower/blocked.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/error.h"
#include "lower/kernel_frame.h"

namespace scorch {

using loops::line;
using loops::Stmts;

bool bsr_blocks(const Format& f, int64_t& bh, int64_t& bw) {
  using P = LevelExpr::Part;
  const auto& ls = f.levels();
  if (f.ndim() != 2 || ls.size() != 4) return false;
  // Asked of the level kinds, not their names: block rows and the block located, block columns iterated.
  auto is = [&](size_t l, LevelWalk walk, int dim, P part) {
    return ls[l].kind->walk() == walk && !ls[l].kind->coordinate_cursor() && ls[l].expr.dim == dim && ls[l].expr.part == part &&
           ls[l].kind->properties().ordered && ls[l].kind->properties().unique;
  };
  if (!is(0, LevelWalk::locate, 0, P::outer) || !is(1, LevelWalk::iterate, 1, P::outer) ||
      !is(2, LevelWalk::locate, 0, P::inner) || !is(3, LevelWalk::locate, 1, P::inner))
    return false;
  bh = ls[0].expr.block;
  bw = ls[1].expr.block;
  return bh >= 1 && bw >= 1;
}

std::optional<BlockedMatch> match_blocked(const ir::Statement& st, const std::vector<Storage>& operands,
                                          const Storage& output) {
  if (!output.strided() || st.rhs->kind != ir::ExprKind::mul) return std::nullopt;
  const auto& a = st.rhs->a;
  const auto& b = st.rhs->b;
  if (a->kind != ir::ExprKind::access || b->kind != ir::ExprKind::access || a->tensor == b->tensor)
    return std::nullopt;
  if (a->vars.size() != 2 || b->vars.size() != 2 || st.out_vars.size() != 2) return std::nullopt;
  const ir::Expr* sp = nullptr;
  const ir::Expr* dn = nullptr;
  for (const ir::Expr* x : {a.get(), b.get()}) {
    const Storage& s = operands[x->tensor];
    if (s.strided()) dn = x;
    else sp = x;
  }
  if (!sp || !dn) return std::nullopt;
  BlockedMatch m;
  if (!bsr_blocks(*operands[sp->tensor].format, m.bh, m.bw)) return std::nullopt;
  m.sparse = sp->tensor;
  m.dense = dn->tensor;
  m.p = sp->vars[0];
  m.q = sp->vars[1];
  if (m.p == m.q) return std::nullopt;
  const auto& o = st.out_vars;
  if (dn->vars[0] == m.q && o[0] == m.p && dn->vars[1] == o[1]) {
    m.form = BlockedMatch::Form::spmm;
    m.k = o[1];
  } else if (dn->vars[1] == m.q && o[1] == m.p && dn->vars[0] == o[0]) {
    m.form = BlockedMatch::Form::linear;
    m.k = o[0];
  } else {
    return std::nullopt;
  }
  if (m.k == m.p || m.k == m.q) return std::nullopt;
  return m;
}

namespace {

// The register tile: RT rows of the block x NV vectors of the dense operand's free index. Each dense vector
// loaded feeds RT multiply-adds, and the dense rows come from L2 (a block row's columns are scattered), so RT
// sets the L2 traffic per multiply-add: rows before vectors. RT is the largest divisor of the block height
// for which one vector still fits, then as many vectors as the registers hold: RT x NV accumulators, the NV
// dense vectors (kept in registers when RT > 1; one row takes them as operands), one broadcast block value
// and one spare. RT and NV each stay within the target's tile accumulators (tile_vectors). Measured (8
// accumulators; 1024^2, 10% of 16x16 blocks, N = 128, 2 threads): 8 rows x 1 vector ran 1.19x as fast as
// 4 x 2 on AVX-512 and 1.07x on AVX2; 4 x 2 ran 1.4x as fast as 2 x 4 and 2x as fast as 1 x 8. 16 registers
// give 4 x 2 and 8 x 1 for 4x4 and 16x16 blocks (4 x 3 fills all 16 and ran slower); 32 give 4 x 6 and
// 8 x 3 (16 x 1 ran 2-3% slower than 8 x 1 and 8 x 3, which were level; docs/levels.md).
struct BlockTile {
  int rows = 1, vectors = 1;
};

BlockTile block_tile(int64_t bh, int registers, int max_vectors) {
  const int budget = std::max(2, registers - 2);  // less the broadcast value and a spare
  BlockTile t;
  for (int r = 1; r + 1 <= budget && r <= std::max(1, max_vectors); ++r)
    if (bh % r == 0) t.rows = r;
  const int per_vector = t.rows + (t.rows > 1 ? 1 : 0);  // its accumulators, and itself when shared by rows
  t.vectors = std::clamp(budget / per_vector, 1, std::max(1, max_vectors));
  return t;
}

}  // namespace

LoweredKernel lower_blocked(const KernelSpec& spec, const Schedule& sched, const BlockedMatch& m,
                            const VectorShape& machine) {
  LoweredKernel out;
  out.overwrites_output = true;  // every output element is stored once (out_at below)
  out.body = unpack_arguments(spec);
  Stmts& b = out.body;
  const int A = m.sparse, D = m.dense;
  const bool linear = m.form == BlockedMatch::Form::linear;
  const int elem = spec.f64 ? 8 : 4;
  const bool vec = machine.vector_bytes > 0 && machine.tile_vectors > 0;
  const int w = vec ? machine.vector_bytes / elem : 1;
  // Scalar code: the 16 registers of the ISA's base, 8 accumulators a row.
  const BlockTile tile = vec ? block_tile(m.bh, machine.registers(), machine.tile_vectors) : block_tile(m.bh, 16, 8);
  const int rt = tile.rows, nv = tile.vectors;
  const std::string NP = fmt::format("N{}", m.p), NQ = fmt::format("N{}", m.q), NK = fmt::format("N{}", m.k);
  const std::string pos = fmt::format("t{}_pos1", A), crd = fmt::format("t{}_crd1", A);
  const std::string vals = fmt::format("t{}_vals", A);
  const std::string BH = std::to_string(m.bh), BW = std::to_string(m.bw);

  b.push_back(line(fmt::format("// blocked kernel ({}): {}x{} blocks, {} rows x {} vectors of {} lanes per register tile",
                               linear ? "linear" : "spmm", m.bh, m.bw, rt, nv, w)));
  // Sizes the format cannot hold (the caller checks shapes; a direct call may not).
  b.push_back(line(fmt::format("if ({0} % {1} != 0 || {2} % {3} != 0) return SCORCH_STATUS_BAD_INDEX;", NP, BH, NQ, BW)));
  b.push_back(line(fmt::format("const int64_t NPb = {} / {}, NQb = {} / {};", NP, BH, NQ, BW)));
  // An empty asm statement that takes a vector in a register and gives it back: the value is then loaded
  // once, into a register. The register class is the architecture's vector class (any width).
  for (const char* l : {"#if defined(__x86_64__) || defined(__i386__)", "#define SCORCH_IN_REGISTER(v) __asm__(\"\" : \"+x\"(v))",
                        "#elif defined(__aarch64__)", "#define SCORCH_IN_REGISTER(v) __asm__(\"\" : \"+w\"(v))", "#else",
                        "#define SCORCH_IN_REGISTER(v) (void)0", "#endif"})
    b.push_back(line(l));
  // The dense operand with its free index contiguous: itself (spmm) or a transposed copy (linear).
  std::string dbase, dstride;
  if (linear) {
    dbase = "Dt";
    dstride = NK;
  } else {
    dbase = fmt::format("t{}_data", D);
    dstride = fmt::format("t{}_st0", D);
  }
  // Output element (row p, column k): the output itself (spmm) or its transposed copy (linear), copied into
  // the output at the end. Every element is written once, by one pass (block rows without blocks too), so
  // it is stored, not added: the output is not read.
  auto out_at = [&](const std::string& p, const std::string& k) {
    return linear ? fmt::format("Ot[({}) * {} + ({})]", p, NK, k) : fmt::format("o[({}) * os0 + ({}) * os1]", p, k);
  };
  const char* add_to = " = ";

  // One pass: `vectors` accumulators per row of the group (width `lanes`: w, or 1 for the scalar tail).
  auto pass = [&](int vectors, bool vector_code) {
    const std::string vt = vector_code ? "vec_t" : "val_t";
    const int lanes = vector_code ? w : 1;
    Stmts body;
    std::string decl = vt + " ";
    for (int r = 0; r < rt; ++r)
      for (int v = 0; v < vectors; ++v) decl += fmt::format("{}a{}_{} = {}", r || v ? ", " : "", r, v, vector_code ? "{}" : "0");
    body.push_back(line(decl + ";"));
    Stmts inner{line(fmt::format("const val_t* __restrict blk = {} + (bq * {} + rr) * {};", vals, BH, BW)),
                line(fmt::format("const val_t* __restrict dr = {} + kept_in({}[bq], NQb) * ({} * {}) + jo;", dbase, crd, BW, dstride))};
    Stmts cbody;
    std::string loads = vt + " ";
    for (int v = 0; v < vectors; ++v) {
      const std::string at = fmt::format("dr + c * {}{}", dstride, v ? fmt::format(" + {}", v * lanes) : "");
      loads += fmt::format("{}d{} = {}", v ? ", " : "", v, vector_code ? "vload(" + at + ")" : "*(" + at + ")");
    }
    cbody.push_back(line(loads + ";"));
    if (vector_code && rt > 1) {
      // Keep the dense vectors in registers: left to itself GCC folds each load into every multiply-add
      // that uses it (RT loads of the same vector), which made the loop bound by loads at half the speed.
      std::string keep;
      for (int v = 0; v < vectors; ++v) keep += fmt::format(" SCORCH_IN_REGISTER(d{});", v);
      cbody.push_back(line(keep.substr(1)));
    }
    for (int r = 0; r < rt; ++r) {
      std::string fma = fmt::format("{{ const val_t s = blk[{} + c];", r * m.bw);
      for (int v = 0; v < vectors; ++v) fma += fmt::format(" a{0}_{1} += s * d{1};", r, v);
      cbody.push_back(line(fma + " }"));
    }
    inner.push_back(line(m.bw <= 32 ? "#pragma GCC unroll 32" : "#pragma GCC unroll 4"));
    inner.push_back(loops::for_range("c", "0", BW, cbody));
    body.push_back(loops::for_range("bq", "kb", "kbe", inner));
    for (int r = 0; r < rt; ++r)
      for (int v = 0; v < vectors; ++v) {
        const std::string row = fmt::format("po * {} + rr + {}", BH, r);
        if (vector_code)
          body.push_back(loops::for_range("l", "0", std::to_string(lanes), {line(fmt::format(
              "{}{}a{}_{}[l];", out_at(row, fmt::format("jo + {} + l", v * lanes)), add_to, r, v))}, true));
        else
          body.push_back(line(fmt::format("{}{}a{}_{};", out_at(row, fmt::format("jo + {}", v)), add_to, r, v)));
      }
    return body;
  };

  Stmts rows;
  const int full = nv * w;
  rows.push_back(line("int64_t jo = 0;"));
  rows.push_back(line(fmt::format("for (; jo + {} <= {}; jo += {}) {{", full, NK, full)));
  for (const auto& s : pass(nv, vec)) rows.push_back(s);
  rows.push_back(line("}"));
  // The columns left after the full tiles (fewer than nv vectors): passes of the powers of two below nv, each
  // at most once.
  int below = 1;
  while (below * 2 < nv) below *= 2;
  for (int v = below; vec && v >= 1 && nv > 1; v /= 2) {
    rows.push_back(line(fmt::format("for (; jo + {} <= {}; jo += {}) {{", v * w, NK, v * w)));
    for (const auto& s : pass(v, true)) rows.push_back(s);
    rows.push_back(line("}"));
  }
  if (full > 1) {
    rows.push_back(line(fmt::format("for (; jo < {}; ++jo) {{", NK)));
    for (const auto& s : pass(1, false)) rows.push_back(s);
    rows.push_back(line("}"));
  }

  const LevelKind& cols = *spec.operands[A].format->levels()[1].kind;
  const auto [kb0, kbe0] = cols.position_range([&](const std::string& n) { return fmt::format("t{}_{}1", A, n); }, "po",
                                               "po + 1");
  Stmts row_body{
      line(fmt::format("int64_t kb = {}, kbe = {};{}", kb0, kbe0,
                       cols.range_from_buffers() ? fmt::format(" segment(kb, kbe, {}_n, bad);", crd) : "")),
      line(fmt::format("coords_in_range({}, kb, kbe, NQb, bad);", crd)),
      line(fmt::format("for (int64_t rr = 0; rr < {}; rr += {}) {{", BH, rt))};
  row_body.insert(row_body.end(), rows.begin(), rows.end());
  row_body.push_back(line("}"));
  // Threads take block rows balanced by stored blocks when the level has row pointers, else equal shares.
  Stmts nest;
  if (cols.prefix_positions()) {
    nest.push_back(line(fmt::format("const int64_t lo = balanced_bound({}, NPb, tid, nt);", pos)));
    nest.push_back(line(fmt::format("const int64_t hi = balanced_bound({}, NPb, tid + 1, nt);", pos)));
  } else {
    nest.push_back(line("const int64_t lo = (int64_t)((__int128)NPb * tid / nt), hi = (int64_t)((__int128)NPb * (tid + 1) / nt);"));
  }
  nest.push_back(loops::for_range("po", "lo", "hi", row_body));

  Schedule s = sched;
  s.private_output = false;  // p is an output index: threads write disjoint rows
  Stmts frame = thread_frame(spec, s, nest, true);
  if (linear) {
    // dst[r * cols + c] (op) src[c * src_stride + r] for r < rows, c < cols, in tiles of 32 x 32, each thread
    // a share of the rows.
    auto transpose = [](const std::string& dst, const std::string& op, const std::string& src, const std::string& rows,
                        const std::string& cols, const std::string& src_stride) {
      // Sizes and pointers copied into the region's locals (shared ones are re-read through memory).
      Stmts tr{line("const int tid = omp_get_thread_num(), nt = omp_get_num_threads();"),
               line(fmt::format("const int64_t R = {}, C = {}, S = {};", rows, cols, src_stride)),
               line(fmt::format("val_t* __restrict dst = {}; const val_t* __restrict src = {};", dst, src)),
               line("const int64_t nrt = (R + 15) / 16;"),
               line("for (int64_t rt = nrt * tid / nt; rt < nrt * (tid + 1) / nt; ++rt)"),
               line("  for (int64_t ct = 0; ct < C; ct += 16) {"),
               line("    const int64_t re = std::min<int64_t>(R, rt * 16 + 16), ce = std::min<int64_t>(C, ct + 16);"),
               line("    for (int64_t r = rt * 16; r < re; ++r)"),
               line(fmt::format("      for (int64_t c = ct; c < ce; ++c) dst[r * C + c] {} src[c * S + r];", op)),
               line("  }")};
      return loops::parallel("nthreads", tr);
    };
    // The dense operand transposed before the blocks are walked; the transposed result added into the
    // output after. Both live in scratch memory kept by the calling thread from call to call and freed when
    // it exits: memory allocated and freed per call comes fresh from the system each time (large blocks are
    // mapped), and touching its new pages cost as much as the transposes themselves (measured: 1024 x 128).
    Stmts pre{
        line("static thread_local struct Scratch { val_t* p = nullptr; size_t n = 0; ~Scratch() { free(p); } } scratch;"),
        line(fmt::format("const size_t scratch_need = (size_t)({0} * {1} + {2} * {1}) + 1;", NQ, NK, NP)),
        line("if (scratch.n < scratch_need) { free(scratch.p); scratch.p = (val_t*)malloc(scratch_need * sizeof(val_t)); "
             "scratch.n = scratch.p ? scratch_need : 0; }"),
        line("if (!scratch.p) return SCORCH_STATUS_NO_MEMORY;"),
        line("val_t* __restrict Dt = scratch.p;"),
        line(fmt::format("val_t* __restrict Ot = scratch.p + {} * {};", NQ, NK)),
        transpose("Dt", "=", fmt::format("t{}_data", D), NQ, NK, fmt::format("t{}_st0", D))};
    frame.insert(frame.begin() + 1, pre.begin(), pre.end());
    // After the blocks' region (before the status lines): out(k, p) = Ot(p, k), rows of out split. Scratch
    // past 64 MB is not kept (a large call's work dwarfs its page faults; a thread should not hold that much).
    frame.insert(frame.end() - 2, transpose("out", "=", "Ot", NK, NP, NK));
    frame.insert(frame.end() - 1,
                 line("if (scratch.n * sizeof(val_t) > ((size_t)64 << 20)) { free(scratch.p); scratch.p = nullptr; scratch.n = 0; }"));
  }
  b.insert(b.end(), frame.begin(), frame.end());
  out.reasons.push_back(fmt::format(
      "operand t{} walked natively as {}x{} blocks: {} rows of a block x {} vectors of the dense operand's {} in "
      "registers{}",
      A, m.bh, m.bw, rt, nv, linear ? "rows (transposed once)" : "columns", vec ? "" : " (scalar target)"));
  out.reasons.push_back("outer loop over block rows split among threads by stored blocks");
  return out;
}

}  // namespace scorch
