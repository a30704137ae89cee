// Native kernels over n:m levels (nm.h). The loop nest of the spmm form:
//
//   each thread takes an equal share of the rows [lo, hi) (every row stores the same number of values)
//   for each tile of V vectors of the dense operand's free index k (then one-vector tiles, then scalars)
//     for each block of rows of the share (their output tiles fill a quarter of L2)
//       for each chunk of mask words (their dense rows, one tile wide, fill three quarters of L1)
//         for each row p of the block (the values and mask words of row p + 4 prefetched)
//           V vector accumulators (zero in the first chunk, else the output so far)
//           for each mask word of the chunk (32 / m groups), unrolled over its groups and their n entries:
//             c = lowest set bit of the group's field (then cleared); the value (a lane splat of the word's
//             values, loaded as vectors) times the V vectors of dense row g * m + c; the field's popcount
//             checked on the way
//           (last chunk: the groups after the last full word, a short last group, one by one)
//           store the accumulators
//   a mask found bad on the way sets the thread's bad flag (the call fails); its decoding never leaves
//   the group, so no read leaves the dense operand
//
// No index is loaded per value: a 32-bit word of the mask gives the coordinates of 32 / m groups by bit
// operations. The chunking keeps the dense rows a chunk touches in L1 while every row of the block walks them; the
// row blocks keep the outputs the chunks revisit in L2 (measured, 2048^2 2:4, N = 128: 1.2x with the checks folded
// in, against a separate checking pass and no row blocks). V comes from the target's register tile
// (VectorShape::tile_vectors accumulators, vector_bytes wide; half as many ran slower), the chunk and the row
// block from the L1 and L2 sizes the kernel reads where it runs. Every multiply-add loads its dense vector (rows
// share no dense row), so the loop is bound by loads, not by accumulator latency: on 16 registers of 8 lanes
// (x86-64-v3, Zen 4, 2:4, N = 128) tiles of 1 row x 12 vectors (then 3 x 4), 2 x 6, 3 x 4 and 2 x 8 all ran
// 7-25% slower than 1 x 8, and walking both 64-column tiles per row in one pass ran 11% slower; packing the
// dense rows chunk by chunk into an L1 buffer instead of a panel per call changed nothing. With broadcast loads
// the 1 x 8 loop ran at ~93% of an L1-resident loop of the same loads and multiply-adds with no mask decoding
// (0.76 us per row of 512 columns per thread against 0.71); the lane splats (below) take one load in 9 away.
// The linear form transposes the dense operand once (in parallel) so that its free index is contiguous, runs the
// same nest into a transposed result and transposes that into the output (as the blocked kernels do, blocked.cpp).
#include "lower/nm.h"

#include <fmt/format.h>

#include "common/error.h"
#include "lower/kernel_frame.h"

namespace scorch {

using loops::line;
using loops::Stmts;

bool nm_levels(const Format& f, int& n, int& m, int& row_dim) {
  using P = LevelExpr::Part;
  const auto& ls = f.levels();
  if (f.ndim() != 2 || ls.size() != 2) return false;
  // Asked of the level kinds: the rows located, the columns in structured groups.
  if (ls[0].kind->walk() != LevelWalk::locate || ls[0].expr.part != P::whole || ls[1].expr.part != P::whole) return false;
  const auto [gn, gm] = ls[1].kind->structured_groups();
  if (gm <= 0 || gn <= 0 || gn > gm || gm > 32) return false;
  n = gn;
  m = gm;
  row_dim = ls[0].expr.dim;
  return ls[1].expr.dim == 1 - row_dim;
}

std::optional<NmMatch> match_nm(const ir::Statement& st, const std::vector<Storage>& operands, const Storage& output) {
  if (!output.strided() || st.rhs->kind != ir::ExprKind::mul) return std::nullopt;
  const auto& a = st.rhs->a;
  const auto& b = st.rhs->b;
  if (a->kind != ir::ExprKind::access || b->kind != ir::ExprKind::access || a->tensor == b->tensor) return std::nullopt;
  if (a->vars.size() != 2 || b->vars.size() != 2 || st.out_vars.size() != 2) return std::nullopt;
  const ir::Expr* sp = nullptr;
  const ir::Expr* dn = nullptr;
  for (const ir::Expr* x : {a.get(), b.get()}) (operands[x->tensor].strided() ? dn : sp) = x;
  if (!sp || !dn) return std::nullopt;
  NmMatch m;
  int row_dim = 0;
  if (!nm_levels(*operands[sp->tensor].format, m.n, m.m, row_dim)) return std::nullopt;
  m.sparse = sp->tensor;
  m.dense = dn->tensor;
  m.p = sp->vars[row_dim];
  m.q = sp->vars[1 - row_dim];
  if (m.p == m.q) return std::nullopt;
  const auto& o = st.out_vars;
  if (dn->vars[0] == m.q && o[0] == m.p && dn->vars[1] == o[1]) {
    m.form = NmMatch::Form::spmm;
    m.k = o[1];
  } else if (dn->vars[1] == m.q && o[1] == m.p && dn->vars[0] == o[0]) {
    m.form = NmMatch::Form::linear;
    m.k = o[0];
  } else {
    return std::nullopt;
  }
  if (m.k == m.p || m.k == m.q) return std::nullopt;
  return m;
}

LoweredKernel lower_nm(const KernelSpec& spec, const Schedule& sched, const NmMatch& m, const VectorShape& machine) {
  LoweredKernel out;
  out.overwrites_output = true;  // every output element is stored (no read of the output before it is)
  out.body = unpack_arguments(spec);
  Stmts& b = out.body;
  const int A = m.sparse, D = m.dense;
  const bool linear = m.form == NmMatch::Form::linear;
  const int elem = spec.f64 ? 8 : 4;
  const bool vec = machine.vector_bytes > 0 && machine.tile_vectors > 0;
  const int w = vec ? machine.vector_bytes / elem : 1;
  const int nv = vec ? machine.tile_vectors : 8;  // accumulators of one row
  const int gpw = 32 / m.m;
  // Argument numbers of A's mask and values (kernel_frame's order: per operand, its buffers then values).
  int arg = 0;
  for (int t = 0; t < A; ++t) arg += spec.operands[t].strided() ? 1 : spec.operands[t].format->buffer_count() + 1;
  const int mask_arg = arg, vals_arg = arg + 1;

  b.push_back(line(fmt::format("// n:m kernel ({}): {}:{} groups, {} per mask word; 1 row x {} vectors of {} lanes per "
                               "register tile", linear ? "linear" : "spmm", m.n, m.m, gpw, nv, w)));
  b.push_back(line(fmt::format("const int64_t NR = N{}, NC = N{}, NK = N{};", m.p, m.q, m.k)));
  b.push_back(line(fmt::format("constexpr int64_t NMn = {}, NMm = {}, GPW = {};", m.n, m.m, gpw)));
  b.push_back(line(fmt::format("constexpr uint32_t FM = {};", m.m == 32 ? "0xffffffffu" : fmt::format("{}u", (1u << m.m) - 1))));
  b.push_back(line("const int64_t G = (NC + NMm - 1) / NMm, GF = NC / NMm, S = NMn * GF + std::min<int64_t>(NMn, NC % NMm);"));
  b.push_back(line("const int64_t W = (G + GPW - 1) / GPW, FW = GF / GPW;"));
  // The lengths the caller checked (check_lengths); a direct call that gives lengths is held to them too.
  b.push_back(line(fmt::format("if (args->lengths && (args->lengths[{}] != NR * W || args->lengths[{}] != NR * S)) "
                               "return SCORCH_STATUS_BAD_INDEX;", mask_arg, vals_arg)));
  b.push_back(line(fmt::format("const idx_t* __restrict nm_mask = t{}_mask1; const val_t* __restrict nm_vals = t{}_vals;", A, A)));
  const std::string DB = linear ? "Dt" : fmt::format("t{}_data", D);
  const std::string LD = linear ? "NK" : fmt::format("t{}_st0", D);
  auto orow = [&](const std::string& p) {
    return linear ? fmt::format("Ot + ({}) * NK", p) : fmt::format("o + ({}) * os0", p);
  };

  // One tile pass: `vectors` accumulators of `lanes` each. The masks are checked where they are decoded (a
  // popcount per group, scalar work beside the multiply-adds), and decoded so that no check comes first: a
  // group's c-th coordinate is the lowest set bit of its field with the group's last coordinate also set,
  // which for a good mask is its own lowest bit and for a bad one (too few bits) stays inside the group, so
  // every dense row read lies inside the operand. A bad mask sets the thread's bad flag; the call then fails.
  auto pass = [&](int vectors, bool vector_code) {
    const std::string vt = vector_code ? "vec_t" : "val_t";
    const int lanes = vector_code ? w : 1;
    const int tile = vectors * lanes;
    auto load = [&](const std::string& at) { return vector_code ? "vload(" + at + ")" : "*(" + at + ")"; };
    auto fmas = [&](const std::string& dr) {
      std::string s;
      for (int v = 0; v < vectors; ++v) s += fmt::format(" a{} += s * {};", v, load(v ? fmt::format("{} + {}", dr, v * lanes) : dr));
      return s;
    };
    Stmts body;
    body.push_back(line(fmt::format("for (; jo + {0} <= NK; jo += {0}) {{", tile)));
    // The dense rows as the groups read them: the operand's rows from column jo (stride LD), or, when its rows
    // are longer than the tile, the tile's columns of every row packed one after another (stride tile) in
    // memory the thread keeps. Unpacked, the rows of a chunk lie LD apart and with a power-of-two LD fill only
    // some of L1's sets (tile 64 of 128 columns: half of them), so a chunk that should fill most of L1 evicts
    // itself (measured, 1024^2 2:4, N = 128, 8-lane vectors, one thread: 1.83 -> 1.65 ms packed).
    const bool packable = vector_code && vectors > 1;  // the main vector pass (the panel is made for it below)
    const std::string stride = packable ? std::to_string(tile) : LD;
    body.push_back(line(fmt::format("const val_t* __restrict dbase = {} + jo;", DB)));
    // The tile's slice of the thread's panel, packed before the passes (below).
    if (packable)
      body.push_back(line(fmt::format("if ({0} != {1}) dbase = nm_pp + (size_t)tid * NC * (NK / {1}) * {1} + (jo / {1}) * NC * {1};", LD, tile)));
    // Mask words per chunk: their GPW * NMm dense rows of one tile fill three quarters of L1 (the rest holds
    // the row's values, mask words and outputs). Half of L1 ran 2-5% slower with 8-lane tiles (2:4, N = 128,
    // x86-64-v3, 2 threads, ctypes harness, quiet rounds: 1024^2 844-869 -> 821-853 us, 2048^2 3527-3595 ->
    // 3389-3507 us; 3 words per chunk instead of 2); all of L1 was slower at 512^2. 16-lane tiles of 128
    // columns get one word per chunk either way. Rows per block: their output tiles fill a quarter of L2, so
    // that a block's outputs stay there while the chunks pass.
    body.push_back(line(fmt::format("const int64_t KCW = std::max<int64_t>(1, (l1_cache_bytes() * 3 / 4) / ((int64_t)sizeof(val_t) * {} * GPW * NMm));", tile)));
    body.push_back(line(fmt::format("const int64_t PB = std::max<int64_t>(1, (l2_cache_bytes() / 4) / ((int64_t)sizeof(val_t) * {}));", tile)));
    body.push_back(line("for (int64_t pb = lo; pb < hi; pb += PB) {"));
    body.push_back(line("const int64_t pe = std::min<int64_t>(hi, pb + PB);"));
    body.push_back(line("for (int64_t w0 = 0; w0 == 0 || w0 < FW; w0 += KCW) {"));
    body.push_back(line("const int64_t w1 = std::min<int64_t>(FW, w0 + KCW);"));
    body.push_back(line("for (int64_t p = pb; p < pe; ++p) {"));
    body.push_back(line("const val_t* __restrict vp = nm_vals + p * S; const idx_t* __restrict mp = nm_mask + p * W;"));
    // The values and mask words of this chunk four rows ahead, fetched now: rows lie S values apart (4 KB at
    // 2048 columns of 2:4), a stride no hardware prefetcher follows, so each row's first read of a chunk
    // missed to L3 or memory (measured, 2048^2 2:4, N = 128: 1.15x on AVX-512 code, 1.4x on AVX2 code; no
    // change at 512^2 and 1024^2).
    body.push_back(line("if (p + 4 < pe) {"));
    body.push_back(line("const char* pf = (const char*)(vp + 4 * S + w0 * (GPW * NMn));"));
    body.push_back(line("const char* const pfe = (const char*)(vp + 4 * S + w1 * (GPW * NMn));"));
    body.push_back(line("for (; pf < pfe; pf += 64) __builtin_prefetch(pf);"));
    body.push_back(line("__builtin_prefetch(mp + 4 * W + w0);"));
    body.push_back(line("}"));
    body.push_back(line(fmt::format("val_t* __restrict orow = {} + jo;", orow("p"))));
    std::string decl = vt + " ";
    for (int v = 0; v < vectors; ++v)
      decl += fmt::format("{}a{} = w0 == 0 ? {} : {}", v ? ", " : "", v, vector_code ? "vec_t{}" : "val_t(0)",
                          load(v ? fmt::format("orow + {}", v * lanes) : "orow"));
    body.push_back(line(decl + ";"));
    body.push_back(line("for (int64_t wi = w0; wi < w1; ++wi) {"));
    body.push_back(line("const uint32_t mw = (uint32_t)mp[wi];"));
    if (gpw * m.m < 32) body.push_back(line(fmt::format("chk |= mw >> {};", gpw * m.m)));
    body.push_back(line(fmt::format("const val_t* __restrict dw = dbase + wi * (GPW * NMm) * {};", stride)));
    body.push_back(line("const val_t* __restrict vw = vp + wi * (GPW * NMn);"));
    if (packable && (gpw * m.n) % lanes == 0) {
      // The main pass: the word's values come in gpw * n / lanes vector loads and each multiplier is a lane
      // splat of them, instead of one broadcast load per value: the loop is bound by loads (every
      // multiply-add loads its dense vector), and the splats run on the shuffle units (measured, 2:4, N = 128,
      // 2 threads: x86-64-v3 206/837/3579 -> 194/787/3322 us at 512^2/1024^2/2048^2, native 197/800/3281 ->
      // 192/773/3138 us). The loaded vectors are multiplied by an opaque 1 (exact), or the compiler turns the
      // splats of plain loads back into broadcast loads. The word is unrolled so that lanes are constants.
      std::string vbs;
      for (int k = 0; k < gpw * m.n / lanes; ++k) vbs += fmt::format(" const vec_t vb{0} = vload(vw + {1}) * nm_one;", k, k * lanes);
      body.push_back(line(vbs.substr(1)));
      for (int gi = 0; gi < gpw; ++gi) {
        body.push_back(line(fmt::format("{{ uint32_t f = (mw >> {}) & FM;", gi * m.m)));
        body.push_back(line("chk |= (uint32_t)__builtin_popcount(f) ^ (uint32_t)NMn;"));
        body.push_back(line("f |= 1u << (NMm - 1);"));
        for (int j = 0; j < m.n; ++j) {
          const int k = gi * m.n + j;
          std::string lane = std::to_string(k % lanes);
          for (int l = 1; l < lanes; ++l) lane += ", " + std::to_string(k % lanes);
          body.push_back(line("{ const int c = __builtin_ctz(f); f &= f - 1;"));
          body.push_back(line(fmt::format("const vec_t s = __builtin_shufflevector(vb{0}, vb{0}, {1});", k / lanes, lane)));
          body.push_back(line(fmt::format("const val_t* __restrict dr = dw + ({} + c) * {};", gi * m.m, stride)));
          body.push_back(line(fmas("dr").substr(1) + " }"));
        }
        body.push_back(line("}"));
      }
    } else {
      body.push_back(line("#pragma GCC unroll 32"));
      body.push_back(line("for (int gi = 0; gi < GPW; ++gi) {"));
      body.push_back(line("uint32_t f = (mw >> (gi * NMm)) & FM;"));
      body.push_back(line("chk |= (uint32_t)__builtin_popcount(f) ^ (uint32_t)NMn;"));
      body.push_back(line("f |= 1u << (NMm - 1);"));
      body.push_back(line("#pragma GCC unroll 32"));
      body.push_back(line("for (int j = 0; j < NMn; ++j) {"));
      body.push_back(line("const int c = __builtin_ctz(f); f &= f - 1;"));
      body.push_back(line("const val_t s = vw[gi * NMn + j];"));
      body.push_back(line(fmt::format("const val_t* __restrict dr = dw + (gi * NMm + c) * {};", stride)));
      body.push_back(line(fmas("dr").substr(1)));
      body.push_back(line("}"));
      body.push_back(line("}"));
    }
    body.push_back(line("}"));
    // The groups after the last full word (a partial word, a short last group), in the last chunk; then
    // the fields of the last word past the last group must be empty.
    body.push_back(line("if (w1 >= FW) {"));
    body.push_back(line("for (int64_t g = FW * GPW; g < G; ++g) {"));
    body.push_back(line("uint32_t f = ((uint32_t)mp[g / GPW] >> ((g % GPW) * NMm)) & FM;"));
    body.push_back(line("const int64_t len = std::min<int64_t>(NMm, NC - g * NMm), cnt = std::min<int64_t>(NMn, len);"));
    body.push_back(line("chk |= ((uint32_t)__builtin_popcount(f) ^ (uint32_t)cnt) | (len < 32 ? f >> len : 0u);"));
    body.push_back(line("f = (f & ((2u << (len - 1)) - 1)) | (1u << (len - 1));"));
    body.push_back(line("for (int64_t j = 0; j < cnt; ++j) {"));
    body.push_back(line("const int c = __builtin_ctz(f); f &= f - 1;"));
    body.push_back(line("const val_t s = vp[g * NMn + j];"));
    body.push_back(line(fmt::format("const val_t* __restrict dr = {} + (g * NMm + c) * {} + jo;", DB, LD)));
    body.push_back(line(fmas("dr").substr(1)));
    body.push_back(line("}"));
    body.push_back(line("}"));
    body.push_back(line("if (G % GPW != 0) chk |= (uint32_t)mp[W - 1] >> ((G % GPW) * NMm);"));
    body.push_back(line("}"));
    std::string store;
    for (int v = 0; v < vectors; ++v)
      store += vector_code ? fmt::format(" memcpy(orow + {}, &a{}, sizeof(vec_t));", v * lanes, v)
                           : fmt::format(" orow[{}] = a{};", v, v);
    body.push_back(line(store.substr(1)));
    body.push_back(line("}"));
    body.push_back(line("}"));
    body.push_back(line("}"));
    body.push_back(line("}"));
    return body;
  };

  Stmts nest;
  nest.push_back(line("const int64_t lo = (int64_t)((__int128)NR * tid / nt), hi = (int64_t)((__int128)NR * (tid + 1) / nt);"));
  const int ptile = nv * w;  // columns of the main pass's tile, the panel's stride
  if (vec && nv > 1) {
    // The thread's panel: every full tile of the dense rows, tile after tile (tile t's row q at
    // (t * NC + q) * ptile), packed once before the passes. Packed a tile per pass, it ran 6% slower on one
    // thread and 2-4% slower on two (1024^2 2:4, N = 128, 8-lane vectors: 1780 -> 1680 us, 850 -> 835 us); one
    // panel shared by the threads, each packing a share of the rows before a barrier, ran 4% slower at 512^2
    // (210 -> 218 us: each thread then reads the other's half from the other core's cache).
    nest.push_back(line(fmt::format("if ({} != {} && NK >= {}) {{", LD, ptile, ptile)));
    nest.push_back(line(fmt::format("val_t* __restrict mine = nm_pp + (size_t)tid * NC * (NK / {0}) * {0};", ptile)));
    nest.push_back(line("for (int64_t q = 0; q < NC; ++q)"));
    nest.push_back(line(fmt::format("for (int64_t t = 0; t < NK / {0}; ++t) memcpy(mine + (t * NC + q) * {0}, {1} + q * {2} + t * {0}, "
                                    "{0} * sizeof(val_t));", ptile, DB, LD)));
    nest.push_back(line("}"));
  }
  // An opaque 1 (the main pass multiplies its value vectors by it so that their lane splats stay splats).
  nest.push_back(line("static const volatile val_t nm_one_v = 1; const val_t nm_one = nm_one_v; (void)nm_one;"));
  nest.push_back(line("uint32_t chk = 0;  // nonzero once a mask word of this share is not a good n:m mask"));
  nest.push_back(line("int64_t jo = 0;"));
  for (const auto& s : pass(nv, vec)) nest.push_back(s);
  if (vec && nv > 1)
    for (const auto& s : pass(1, true)) nest.push_back(s);
  if (nv * w > 1)
    for (const auto& s : pass(1, false)) nest.push_back(s);
  nest.push_back(line("if (chk) bad = 1;"));

  Schedule s = sched;
  s.private_output = false;  // p is an output index: threads write disjoint rows
  Stmts frame = thread_frame(spec, s, nest, true);
  if (linear) {
    // dst[r * C + c] = src[c * S + r] for r < R, c < C, in 16 x 16 tiles, each thread a share of the rows.
    auto transpose = [](const std::string& dst, const std::string& src, const std::string& rows,
                        const std::string& cols, const std::string& src_stride) {
      Stmts tr{line("const int tid = omp_get_thread_num(), nt = omp_get_num_threads();"),
               line(fmt::format("const int64_t R = {}, C = {}, SS = {};", rows, cols, src_stride)),
               line(fmt::format("val_t* __restrict dst = {}; const val_t* __restrict src = {};", dst, src)),
               line("const int64_t nrt = (R + 15) / 16;"),
               line("for (int64_t rt = nrt * tid / nt; rt < nrt * (tid + 1) / nt; ++rt)"),
               line("  for (int64_t ct = 0; ct < C; ct += 16) {"),
               line("    const int64_t re = std::min<int64_t>(R, rt * 16 + 16), ce = std::min<int64_t>(C, ct + 16);"),
               line("    for (int64_t r = rt * 16; r < re; ++r)"),
               line("      for (int64_t c = ct; c < ce; ++c) dst[r * C + c] = src[c * SS + r];"),
               line("  }")};
      return loops::parallel("nthreads", tr);
    };
    // Dt: the dense operand with k contiguous; Ot: the result by rows of A. Scratch kept by the calling thread
    // from call to call (fresh pages per call cost as much as the transposes), dropped past 64 MB.
    Stmts pre{
        line("static thread_local struct NmScratch { val_t* p = nullptr; size_t n = 0; ~NmScratch() { free(p); } } scratch;"),
        line("const size_t scratch_need = (size_t)(NC * NK + NR * NK) + 1;"),
        line("if (scratch.n < scratch_need) { free(scratch.p); scratch.p = (val_t*)malloc(scratch_need * sizeof(val_t)); "
             "scratch.n = scratch.p ? scratch_need : 0; }"),
        line("if (!scratch.p) return SCORCH_STATUS_NO_MEMORY;"),
        line("val_t* __restrict Dt = scratch.p;"),
        line("val_t* __restrict Ot = scratch.p + NC * NK;"),
        transpose("Dt", fmt::format("t{}_data", D), "NC", "NK", fmt::format("t{}_st0", D))};
    frame.insert(frame.begin() + 1, pre.begin(), pre.end());
    frame.insert(frame.end() - 2, transpose("out", "Ot", "NK", "NR", "NK"));
    frame.insert(frame.end() - 1,
                 line("if (scratch.n * sizeof(val_t) > ((size_t)64 << 20)) { free(scratch.p); scratch.p = nullptr; scratch.n = 0; }"));
  }
  // The packed panel of dense rows (the passes above), aligned to cache lines (a panel row then starts a
  // line: 16-byte alignment cost more than packing gained); the calling thread keeps it from call to call,
  // dropped past 64 MB.
  if (vec && nv > 1) {
    Stmts panel{line("static thread_local struct NmPanel { val_t* p = nullptr; size_t n = 0; ~NmPanel() { free(p); } } nm_panel;"),
                line("const size_t nm_threads = args->num_threads > 0 ? (size_t)args->num_threads : 1;"),
                line(fmt::format("const size_t nm_panel_need = {0} != {1} ? nm_threads * (size_t)(NC * (NK / {1}) * {1}) : 0;", LD, nv * w)),
                line("if (nm_panel_need > 0 && nm_panel.n < nm_panel_need) {"),
                line("free(nm_panel.p); const size_t k = nm_panel_need;"),
                line("nm_panel.p = (val_t*)aligned_alloc(64, (k * sizeof(val_t) + 63) / 64 * 64); nm_panel.n = nm_panel.p ? k : 0;"),
                line("if (!nm_panel.p) return SCORCH_STATUS_NO_MEMORY;"),
                line("}"),
                line("val_t* __restrict nm_pp = nm_panel.p;")};
    frame.insert(frame.begin(), panel.begin(), panel.end());
    frame.insert(frame.end() - 1,
                 line("if (nm_panel.n * sizeof(val_t) > ((size_t)64 << 20)) { free(nm_panel.p); nm_panel.p = nullptr; nm_panel.n = 0; }"));
  }
  b.insert(b.end(), frame.begin(), frame.end());
  out.reasons.push_back(fmt::format(
      "operand t{} walked natively as {}:{} groups: the mask's bits give each group's coordinates, 1 row x {} vectors "
      "of the dense operand's {} in registers{}",
      A, m.n, m.m, nv, linear ? "rows (transposed once)" : "columns", vec ? "" : " (scalar target)"));
  out.reasons.push_back("rows split equally among threads; the dense rows of a chunk of groups stay in L1 while the rows walk them");
  return out;
}

}  // namespace scorch
