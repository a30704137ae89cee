// SDDMM's sampled dot products written natively (sampled_dot.h).
#include "lower/sampled_dot.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <sstream>

#include "lower/assemble.h"
#include "lower/form_text.h"
#include "lower/kernel_frame.h"

namespace scorch {

using forms::distinct_vars;
using forms::product_factors;
using forms::push_lines;
using forms::subst;
using loops::Stmts;

std::optional<SampledDotMatch> match_sampled_dot(const KernelSpec& spec, const Schedule& sched,
                                                 const VectorShape& machine) {
  const ir::Statement& st = spec.stmt;
  if (sched.output != OutputMode::sampled || machine.vector_bytes <= 0 || machine.tile_vectors <= 0) return std::nullopt;
  if (spec.output.strided() || !csr_like(*spec.output.format) || st.out_vars.size() != 2) return std::nullopt;
  std::vector<const ir::Expr*> acc;
  double scale = 1;
  if (!product_factors(st.rhs, acc, scale) || acc.size() != 3) return std::nullopt;
  SampledDotMatch m;
  const ir::Expr* sa = nullptr;
  for (const ir::Expr* a : acc)
    if (a->tensor == sched.sampled_tensor) sa = a;
  if (!sa || !distinct_vars(sa) || spec.operands[sa->tensor].strided() || !csr_like(*spec.operands[sa->tensor].format))
    return std::nullopt;
  const auto lv = level_vars(*spec.operands[sa->tensor].format, sa->vars);
  m.s = sa->tensor;
  m.p = lv[0];
  m.q = lv[1];
  for (const ir::Expr* a : acc) {
    if (a == sa) continue;
    if (!spec.operands[a->tensor].strided() || !distinct_vars(a) || a->tensor == m.s) return std::nullopt;
    const int first = a->vars[0], last = a->vars[1];
    if (last == m.p || last == m.q) return std::nullopt;  // the summed variable must be contiguous (last)
    if (m.k >= 0 && last != m.k) return std::nullopt;
    m.k = last;
    if (first == m.p && m.p_op < 0) m.p_op = a->tensor;
    else if (first == m.q && m.q_op < 0) m.q_op = a->tensor;
    else return std::nullopt;
  }
  if (m.p_op < 0 || m.q_op < 0 || m.p_op == m.q_op || m.k == m.p || m.k == m.q) return std::nullopt;
  return m;
}

// How many entries ahead Q's rows are prefetched (rounded to whole groups).
constexpr int kPrefetchEntries = 16;

LoweredKernel lower_sampled_dot(const KernelSpec& spec, const Schedule& sched, const SampledDotMatch& m,
                                const VectorShape& machine) {
  (void)sched;
  LoweredKernel out;
  out.sparse_output = true;
  // Every value of the output is stored below (the caller need not zero it first): S's rows by the threads,
  // and the positions outside them (before pos[0], from pos[R] to the end of the values) by the code before.
  out.overwrites_output = true;
  out.body = unpack_arguments(spec);
  // Where S's values are among the kernel's input pointers: their length is the output's.
  int vals_at = spec.operands[m.s].format->buffer_count();
  for (int t = 0; t < m.s; ++t) vals_at += spec.operands[t].strided() ? 1 : spec.operands[t].format->buffer_count() + 1;
  const int elem = spec.f64 ? 8 : 4;
  const int w = machine.vector_bytes / elem;
  const int g = std::max(1, machine.tile_vectors / 2);
  std::vector<const ir::Expr*> acc;
  double scale = 1;
  product_factors(spec.stmt.rhs, acc, scale);
  const std::string sv = scale == 1 ? "sv[e + $G]" : "((val_t)" + ir::format_literal(scale) + " * sv[e + $G])";
  // The lanes of a vector summed as a balanced tree.
  std::function<std::string(int, int, const std::string&)> tree = [&](int lo, int n, const std::string& v) -> std::string {
    if (n == 1) return fmt::format("{}[{}]", v, lo);
    return fmt::format("({} + {})", tree(lo, n / 2, v), tree(lo + n / 2, n - n / 2, v));
  };
  // Whether n entries' sums are reduced together (a power of two of at least 2, at most the lanes).
  auto butterfly = [&](int n) { return n >= 2 && n <= w && (n & (n - 1)) == 0 && (w & (w - 1)) == 0; };
  // The code for `n` entries at once starting at position e (n = G in the main loop, 1 for the rest).
  auto entries = [&](int n, bool prefetch) {
    std::string c;
    for (int x = 0; x < n; ++x) c += fmt::format("const val_t* __restrict q{0} = Qd + kept_in(sc[e + {0}], NQ) * K;\n", x);
    if (n > 1 && prefetch) {
      // The rows of the group kPrefetchEntries entries ahead: far enough for their misses to overlap this
      // group's work and the next ones' (one group ahead, the loads of a random row from memory were still
      // in flight when it was read: 1.4-2x slower on a Q of 17-537 MB, a hand-written loop on this Zen 5).
      const int ahead = std::max(1, kPrefetchEntries / n) * n;
      c += "if (pf) {\n";
      for (int x = 0; x < n; ++x)
        c += fmt::format("  if (e + {0} + {1} < pend) {{ const char* f = (const char*)(Qd + (int64_t)sc[e + {0} + {1}] * K); "
                         "for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(f + b); }}\n", ahead, x);
      c += "}\n";
    }
    std::string decl = "vec_t ";
    for (int x = 0; x < n; ++x) decl += fmt::format("{}a{}_0 = {{}}, a{}_1 = {{}}", x ? ", " : "", x, x);
    c += decl + ";\nint64_t kk = 0;\n";
    c += fmt::format("for (; kk + {0} <= K; kk += {0}) {{\n  const vec_t x0 = vload(pr + kk), x1 = vload(pr + kk + {1});\n", 2 * w, w);
    for (int x = 0; x < n; ++x)
      c += fmt::format("  a{0}_0 += x0 * vload(q{0} + kk); a{0}_1 += x1 * vload(q{0} + kk + {1});\n", x, w);
    c += "}\n";
    c += fmt::format("if (kk + {0} <= K) {{\n  const vec_t x0 = vload(pr + kk);\n", w);
    for (int x = 0; x < n; ++x) c += fmt::format("  a{0}_0 += x0 * vload(q{0} + kk);\n", x);
    c += fmt::format("  kk += {};\n}}\n", w);
    if (butterfly(n)) {
      // The n sums reduced together: pairs of vectors folded into one (each half of the result a half-sum of
      // one vector), until one vector holds n segments of w / n lanes, entry x's in segment x; then each segment
      // folded onto its first lane. n - 1 + log2(w / n) shuffle-adds for the n entries, not w - 1 adds each.
      std::vector<std::string> cur;
      for (int x = 0; x < n; ++x) {
        c += fmt::format("const vec_t t{0} = a{0}_0 + a{0}_1;\n", x);
        cur.push_back(fmt::format("t{}", x));
      }
      int seg = w, level = 0;
      while (cur.size() > 1) {
        const int h = seg / 2, per = w / seg;  // segments of `seg` lanes in each input vector
        std::vector<int> lo_m, hi_m;
        for (int l = 0; l < w; ++l) {
          const int out_seg = l / h, within = l % h;
          const int src = out_seg < per ? 0 : 1, sseg = out_seg < per ? out_seg : out_seg - per;
          lo_m.push_back(src * w + sseg * seg + within);
          hi_m.push_back(src * w + sseg * seg + h + within);
        }
        std::vector<std::string> next;
        for (size_t j = 0; j + 1 < cur.size(); j += 2) {
          const std::string v = fmt::format("u{}_{}", level, j / 2);
          c += fmt::format("const vec_t {0} = __builtin_shufflevector({1}, {2}, {3}) + __builtin_shufflevector({1}, {2}, {4});\n",
                           v, cur[j], cur[j + 1], fmt::join(lo_m, ", "), fmt::join(hi_m, ", "));
          next.push_back(v);
        }
        cur = next;
        seg = h;
        ++level;
      }
      std::string r = cur[0];
      for (; seg > 1; seg /= 2, ++level) {
        const int h = seg / 2;
        std::vector<int> m;
        for (int l = 0; l < w; ++l) m.push_back(l % seg < h ? l + h : l);
        const std::string v = fmt::format("u{}_0", level);
        c += fmt::format("const vec_t {0} = {1} + __builtin_shufflevector({1}, {1}, {2});\n", v, r, fmt::join(m, ", "));
        r = v;
      }
      for (int x = 0; x < n; ++x) {
        c += fmt::format("{{\n  val_t d = {}[{}];\n", r, x * (w / n));
        c += fmt::format("  for (int64_t r = kk; r < K; ++r) d += pr[r] * q{0}[r];\n", x);
        c += fmt::format("  sampled_out[e + {}] = {} * d;\n}}\n", x, subst(sv, {{"$G", std::to_string(x)}}));
      }
      return c;
    }
    for (int x = 0; x < n; ++x) {
      c += fmt::format("{{\n  const vec_t t = a{0}_0 + a{0}_1;\n  val_t d = {1};\n", x, tree(0, w, "t"));
      c += fmt::format("  for (int64_t r = kk; r < K; ++r) d += pr[r] * q{0}[r];\n", x);
      c += fmt::format("  sampled_out[e + {}] = {} * d;\n}}\n", x, subst(sv, {{"$G", std::to_string(x)}}));
    }
    return c;
  };
  std::string code = R"(// SDDMM: $G entries of a row at a time, S's value applied to each dot product once.
const int64_t R = $R, NQ = $NQ, K = $K;
const idx_t* __restrict sp = $S_POS;
const idx_t* __restrict sc = $S_CRD;
const val_t* __restrict sv = $S_VALS;
const val_t* __restrict Pd = $P_DATA;
const val_t* __restrict Qd = $Q_DATA;
const int64_t sc_n = $S_CRD_n;
val_t* __restrict sampled_out = (val_t*)args->out_dense;  // the sampling operand's size
int nthreads = args->num_threads > 0 ? args->num_threads : 1;
int bad_index = 0;
const int64_t row_bytes = K * (int64_t)sizeof(val_t);
{  // the output's positions outside S's rows (none when pos[0] == 0 and pos[R] is the values' length)
  const int64_t out_n = args->lengths ? args->lengths[$VALS_AT] : (int64_t)sp[R];
  const int64_t head = std::min<int64_t>(std::max<int64_t>(sp[0], 0), out_n);
  const int64_t tail = std::min<int64_t>(std::max<int64_t>(sp[R], head), out_n);
  for (int64_t e = 0; e < head; ++e) sampled_out[e] = 0;
  for (int64_t e = tail; e < out_n; ++e) sampled_out[e] = 0;
}
// Q's rows are gathered by S's columns: prefetched ahead when they outgrow half of L2.
const bool pf = (double)NQ * (double)row_bytes > (double)l2_cache_bytes() / 2;
#pragma omp parallel num_threads(nthreads)
{
  const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
  int bad = 0;
  const int64_t lo = balanced_bound(sp, R, tid, nt);
  int64_t hi = balanced_bound(sp, R, tid + 1, nt);
  if (!rows_in_range(sp, sc, lo, hi, sc_n, NQ, bad)) hi = lo;
  // Positions and coordinates are read again below, after their check: kept inside their buffers
  // (kept_segment, kept_in), so that a caller writing them during the call cannot make a read or a write
  // leave them.
  int64_t pbegin = sp[lo], pend = sp[hi];
  kept_segment(pbegin, pend, sc_n);
  // Long rows against a Q larger than half of L2 go in 2-D tiles: a block of rows (their P rows a quarter of
  // L2) visits Q one column range at a time (half of L2), each row's entries in that range found by binary
  // search, so every Q row is fetched once per block from beyond L2 instead of once per entry. Only when the
  // rows are long enough that a row still has a group of entries per column range on average, and only
  // when each row's columns are sorted (checked here: the search needs it).
  const int64_t col_tile = std::max<int64_t>(1, (l2_cache_bytes() / 2) / std::max<int64_t>(1, row_bytes));
  const int64_t row_tile = std::max<int64_t>(1, (l2_cache_bytes() / 4) / std::max<int64_t>(1, row_bytes));
  const int64_t col_tiles = (NQ + col_tile - 1) / col_tile;
  bool tiled = pf && col_tiles > 1 && pend - pbegin >= (hi - lo) * col_tiles * $G;
  for (int64_t i = lo; tiled && i < hi; ++i) {
    int64_t b = sp[i], be = sp[i + 1];
    kept_segment(b, be, sc_n);
    for (int64_t e = b + 1; e < be; ++e)
      if (sc[e - 1] >= sc[e]) { tiled = false; break; }
  }
  if (tiled) {
    for (int64_t b0 = lo; b0 < hi; b0 += row_tile) {
      const int64_t b1 = std::min(hi, b0 + row_tile);
      for (int64_t c0 = 0; c0 < NQ; c0 += col_tile) {
        for (int64_t i = b0; i < b1; ++i) {
          const val_t* __restrict pr = Pd + i * K;
          int64_t b = sp[i], be = sp[i + 1];
          kept_segment(b, be, sc_n);
          int64_t e = std::lower_bound(sc + b, sc + be, (idx_t)c0) - sc;
          const int64_t ee = std::lower_bound(sc + e, sc + be, (idx_t)std::min(NQ, c0 + col_tile)) - sc;
$TILED_ROW
        }
      }
    }
  } else {
    for (int64_t i = lo; i < hi; ++i) {
      const val_t* __restrict pr = Pd + i * K;
      int64_t e = sp[i], ee = sp[i + 1];
      kept_segment(e, ee, sc_n);
$ROW
    }
  }
  if (bad) __atomic_store_n(&bad_index, 1, __ATOMIC_RELAXED);
}
if (bad_index) return SCORCH_STATUS_BAD_INDEX;
return SCORCH_STATUS_OK;)";
  auto indent = [](const std::string& t, int n) {
    std::string o, pad(n, ' ');
    std::istringstream in(t);
    for (std::string l; std::getline(in, l);) o += pad + l + "\n";
    if (!o.empty()) o.pop_back();
    return o;
  };
  // One row's entries e..ee: groups of G sharing P's row, then one at a time; `prefetch`: the Q rows of the
  // next entries are prefetched (when Q outgrows half of L2), not in a 2-D tile (Q's column range is in L2).
  auto row = [&](bool prefetch, int ind) {
    return indent(fmt::format("for (; e + {0} <= ee; e += {0}) {{\n{1}\n}}\nfor (; e < ee; ++e) {{\n{2}\n}}", g,
                              indent(entries(g, prefetch), 2), indent(entries(1, false), 2)), ind);
  };
  code = subst(code, {{"$TILED_ROW", row(false, 10)}, {"$ROW", row(true, 6)}});
  code = subst(code, {{"$S_CRD_n", fmt::format("t{}_crd1_n", m.s)},
                      {"$S_POS", fmt::format("t{}_pos1", m.s)},
                      {"$S_CRD", fmt::format("t{}_crd1", m.s)},
                      {"$S_VALS", fmt::format("t{}_vals", m.s)},
                      {"$P_DATA", fmt::format("t{}_data", m.p_op)},
                      {"$Q_DATA", fmt::format("t{}_data", m.q_op)},
                      {"$R", fmt::format("N{}", m.p)},
                      {"$NQ", fmt::format("N{}", m.q)},
                      {"$K", fmt::format("N{}", m.k)},
                      {"$G", std::to_string(g)},
                      {"$VALS_AT", std::to_string(vals_at)}});
  // The parallel region as loop IR, the rest as lines.
  const size_t open = code.find("#pragma omp parallel");
  const size_t body_start = code.find("{\n", open) + 2;
  const size_t body_end = code.rfind("\n}\nif (bad_index)");
  push_lines(out.body, code.substr(0, open));
  Stmts region;
  push_lines(region, code.substr(body_start, body_end - body_start));
  out.body.push_back(loops::parallel("nthreads", region));
  push_lines(out.body, code.substr(body_end + 3));
  out.reasons.push_back(fmt::format(
      "sampled dot products (SDDMM) natively: {0} entries of a row at a time, two {1}-lane accumulators each, S's "
      "value applied once per entry, the next entries' rows of {2} prefetched when it outgrows half of L2, or "
      "long rows in 2-D tiles (a block of rows by a column range of {2} in L2)",
      g, w, spec.stmt.tensor_names[m.q_op]));
  out.reasons.push_back(fmt::format("outer loop split among threads by nonzeros of {}", spec.stmt.tensor_names[m.s]));
  return out;
}

}  // namespace scorch
