// Sparse outputs assembled inside the kernel (assemble.h): Gustavson's row-by-row product and the merge of two
// operands' rows, each writing the output's pos, crd and values directly.
#include "lower/assemble.h"

#include <fmt/format.h>

#include <functional>
#include <utility>

#include "common/error.h"
#include "lower/form_text.h"
#include "lower/kernel_frame.h"

namespace scorch {

using forms::distinct_vars;
using forms::product_factors;
using forms::push_lines;
using forms::subst;
using loops::Stmts;

bool csr_like(const Format& f) {
  const auto& ls = f.levels();
  if (f.ndim() != 2 || ls.size() != 2) return false;
  for (const auto& l : ls) {
    if (l.expr.part != LevelExpr::Part::whole) return false;
    if (!l.kind->properties().ordered || !l.kind->properties().unique) return false;
  }
  if (ls[0].kind->walk() != LevelWalk::locate || !ls[0].kind->buffer_names().empty()) return false;
  const LevelKind& c = *ls[1].kind;
  return c.walk() == LevelWalk::iterate && c.prefix_positions() &&
         c.buffer_names() == std::vector<std::string>{"pos", "crd"};
}

namespace {

// A linear combination: every term of the sum (through +, - and negation) a product with exactly one access.
bool linear_terms(const ir::ExprPtr& e, std::vector<const ir::Expr*>& accesses) {
  switch (e->kind) {
    case ir::ExprKind::add:
    case ir::ExprKind::sub: return linear_terms(e->a, accesses) && linear_terms(e->b, accesses);
    case ir::ExprKind::neg: return linear_terms(e->a, accesses);
    default: {
      std::vector<const ir::Expr*> acc;
      double scale = 1;
      if (!product_factors(e, acc, scale) || acc.size() != 1) return false;
      accesses.push_back(acc[0]);
      return true;
    }
  }
}

// The value of a linear combination where only the accesses in `present` are stored, each rendered by
// `text`: terms of absent accesses are left out (not multiplied by 0, so an infinite coefficient of an absent
// entry gives no NaN). Empty when no term is left.
std::string present_value(const ir::ExprPtr& e, const std::function<bool(const ir::Expr*)>& present,
                          const std::function<std::string(const ir::Expr*)>& text) {
  switch (e->kind) {
    case ir::ExprKind::access: return present(e.get()) ? text(e.get()) : "";
    case ir::ExprKind::literal: return "((val_t)" + ir::format_literal(e->value) + ")";
    case ir::ExprKind::neg: {
      const std::string a = present_value(e->a, present, text);
      return a.empty() ? "" : "(-" + a + ")";
    }
    case ir::ExprKind::mul: {
      const std::string a = present_value(e->a, present, text), b = present_value(e->b, present, text);
      return a.empty() || b.empty() ? "" : "(" + a + " * " + b + ")";
    }
    case ir::ExprKind::add:
    case ir::ExprKind::sub: {
      const std::string a = present_value(e->a, present, text), b = present_value(e->b, present, text);
      const char* op = e->kind == ir::ExprKind::add ? " + " : " - ";
      if (a.empty()) return b.empty() ? "" : e->kind == ir::ExprKind::add ? b : "(-" + b + ")";
      if (b.empty()) return a;
      return "(" + a + op + b + ")";
    }
  }
  return "";
}

// Per-thread buffers, the output's row positions and the flags of the region, before it.
const char* kPrologue = R"(int nthreads = args->num_threads > 0 ? args->num_threads : 1;
// A thread's buffers kept from one call to the next (a slot per thread number, taken and put back atomically, so
// calls running at once never share one): its entries' buffers and the dense workspace (kept zero between rows),
// whose pages are then not faulted in and cleared again at every call. Buffers past kKeepEntries are not kept.
struct Scratch { idx_t* crd; val_t* val; int64_t cap; val_t* wv; unsigned char* wf; uint64_t* wb; int64_t wcols; };
static Scratch* scratch_slots[64];
const int64_t kKeepEntries = (int64_t)1 << 23;
// One thread's entries: its rows' coordinates and values, in row order.
struct Chunk { idx_t* crd; val_t* val; int64_t n, cap; int failed; Scratch* s; };
Chunk* chunks = (Chunk*)calloc(nthreads, sizeof(Chunk));
int64_t* shares = (int64_t*)calloc(nthreads + 1, sizeof(int64_t));
idx_t* out_pos = (idx_t*)malloc((size_t)(R + 1) * sizeof(idx_t));
int64_t* ub = $UB_ALLOC;
if (!chunks || !shares || !out_pos || !ub) { free(chunks); free(shares); free(out_pos); free(ub); return SCORCH_STATUS_NO_MEMORY; }
out_pos[0] = 0;
ub[0] = 0;
idx_t* out_crd = nullptr;
val_t* out_val = nullptr;
int64_t total = 0;
int bad_index = 0, input_bad = 0, failed = 0, too_many = 0, given = 0;)";

// After each thread computed its rows: thread 0's buffers grow into the result, the others are copied in,
// and row counts become positions. Inside the region.
const char* kGather = R"(#pragma omp barrier
#pragma omp single
{
  int64_t t = 0;
  for (int q = 0; q < nt; ++q) { shares[q] = t; t += chunks[q].n; failed |= chunks[q].failed; }
  total = t;
  if (!ok || failed) {
  } else if (sizeof(idx_t) < 8 && total > (int64_t)std::numeric_limits<idx_t>::max()) {
    too_many = 1;
  } else if (chunks[0].cap > kKeepEntries || !chunks[0].s) {
    // Thread 0's buffers are not kept: they grow into the result (realloc of a large block remaps its pages,
    // so thread 0's entries are not copied).
    idx_t* c0 = (idx_t*)realloc(chunks[0].crd, (size_t)(total + 1) * sizeof(idx_t));
    if (c0) chunks[0].crd = c0;
    val_t* v0 = (val_t*)realloc(chunks[0].val, (size_t)(total + 1) * sizeof(val_t));
    if (v0) chunks[0].val = v0;
    if (c0 && v0) { out_crd = c0; out_val = v0; chunks[0].crd = nullptr; chunks[0].val = nullptr; chunks[0].cap = 0; given = 1; }
    else failed = 1;
  } else {
    out_crd = (idx_t*)malloc((size_t)(total + 1) * sizeof(idx_t));
    out_val = (val_t*)malloc((size_t)(total + 1) * sizeof(val_t));
    if (!out_crd || !out_val) { free(out_crd); free(out_val); out_crd = nullptr; out_val = nullptr; failed = 1; }
  }
}
// Each thread copies its entries in (the result's pages first touched by the threads together).
if (out_crd) {
  const int64_t off = shares[tid];
  if (ch.n > 0 && !(tid == 0 && given)) {
    memcpy(out_crd + off, ch.crd, (size_t)ch.n * sizeof(idx_t));
    memcpy(out_val + off, ch.val, (size_t)ch.n * sizeof(val_t));
  }
  int64_t at = off;
  for (int64_t i = lo; i < hi; ++i) { at += (int64_t)out_pos[i + 1]; out_pos[i + 1] = (idx_t)at; }
}
if (ch.s && ch.cap <= kKeepEntries) {
  ch.s->crd = ch.crd; ch.s->val = ch.val; ch.s->cap = ch.cap;
} else {
  free(ch.crd); free(ch.val);
  if (ch.s) { ch.s->crd = nullptr; ch.s->val = nullptr; ch.s->cap = 0; }
}
if (ch.s) {
  Scratch* none = nullptr;
  if (tid >= 64 || !__atomic_compare_exchange_n(&scratch_slots[tid], &none, ch.s, false, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
    free(ch.s->crd); free(ch.s->val); free(ch.s->wv); free(ch.s->wf); free(ch.s->wb); free(ch.s);
  }
}
if (bad) __atomic_store_n(&bad_index, 1, __ATOMIC_RELAXED);)";

// After the region: the result handed over (assemble.h's protocol) or everything freed.
const char* kEpilogue = R"(free(ub);
free(chunks);
free(shares);
if (bad_index || failed || (!out_crd && !too_many)) {
  free(out_crd); free(out_val); free(out_pos);
  return bad_index ? SCORCH_STATUS_BAD_INDEX : SCORCH_STATUS_NO_MEMORY;
}
if (too_many) {  // more entries than idx_t counts: the caller says so
  free(out_pos);
  args->out_nnz = total;
  return SCORCH_STATUS_OK;
}
void** out_buffers = (void**)malloc(2 * sizeof(void*));
if (!out_buffers) { free(out_crd); free(out_val); free(out_pos); return SCORCH_STATUS_NO_MEMORY; }
out_buffers[0] = out_pos;
out_buffers[1] = out_crd;
args->out_coords = (int64_t*)out_buffers;
args->out_vals = out_val;
args->out_nnz = total;
return SCORCH_STATUS_OK;)";

// Gustavson: the region's body from the row checks to the thread's rows computed (before kGather).
const char* kGustavson = R"(const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
int bad = 0;
// 1. Both operands' rows checked once, equal shares: every later read is unchecked.
{
  const int64_t lo = (int64_t)((__int128)J * tid / nt), hi = (int64_t)((__int128)J * (tid + 1) / nt);
  if (!rows_in_range(bp, bc, lo, hi, bc_n, C, bad)) __atomic_store_n(&input_bad, 1, __ATOMIC_RELAXED);
}
const int64_t r0 = (int64_t)((__int128)R * tid / nt), r1 = (int64_t)((__int128)R * (tid + 1) / nt);
if (!rows_in_range(ap, ac, r0, r1, ac_n, J, bad)) __atomic_store_n(&input_bad, 1, __ATOMIC_RELAXED);
#pragma omp barrier
const bool ok = !__atomic_load_n(&input_bad, __ATOMIC_RELAXED);
// 2. Each row's upper bound (the multiply-adds it takes), then their prefix sum ub[i + 1].
{
  int64_t s = 0;
  for (int64_t i = r0; i < r1; ++i) {
    int64_t f = 0;
    if (ok)
      for (int64_t k = ap[i]; k < (int64_t)ap[i + 1]; ++k) { const int64_t j = ac[k]; f += (int64_t)bp[j + 1] - (int64_t)bp[j]; }
    ub[i + 1] = f;
    s += f;
  }
  shares[tid + 1] = s;
}
#pragma omp barrier
{
  int64_t at = 0;
  for (int t = 0; t < tid; ++t) at += shares[t + 1];
  for (int64_t i = r0; i < r1; ++i) { at += ub[i + 1]; ub[i + 1] = at; }
}
#pragma omp barrier
// Rows split so that each thread has about the same number of multiply-adds.
const int64_t F = ub[R];
const int64_t lo = tid == 0 ? 0 : std::lower_bound(ub, ub + R + 1, (int64_t)((__int128)F * tid / nt)) - ub;
int64_t hi = tid + 1 == nt ? R : std::lower_bound(ub, ub + R + 1, (int64_t)((__int128)F * (tid + 1) / nt)) - ub;
if (!ok) hi = lo;
// 3. This thread's rows into its own buffers; each row's count into out_pos[i + 1].
Chunk& ch = chunks[tid];
ch.s = tid < 64 ? __atomic_exchange_n(&scratch_slots[tid], (Scratch*)nullptr, __ATOMIC_ACQ_REL) : nullptr;
if (!ch.s) ch.s = (Scratch*)calloc(1, sizeof(Scratch));
if (ch.s) { ch.crd = ch.s->crd; ch.val = ch.s->val; ch.cap = ch.s->cap; ch.s->crd = nullptr; ch.s->val = nullptr; }
val_t* wv = nullptr;         // dense workspace: a value, a byte and a bit per output column (at first use)
uint64_t* wb = nullptr;
unsigned char* wf = nullptr;
if (ch.s && ch.s->wv && ch.s->wcols == C) { wv = ch.s->wv; wf = ch.s->wf; wb = ch.s->wb; }
else if (ch.s) { free(ch.s->wv); free(ch.s->wf); free(ch.s->wb); }
if (ch.s) { ch.s->wv = nullptr; ch.s->wf = nullptr; ch.s->wb = nullptr; ch.s->wcols = 0; }
idx_t* hk = nullptr;         // hash table: keys (-1: empty) and values, hcap slots (grown as needed)
val_t* hv = nullptr;
int64_t hcap = 0;
const int64_t l2 = l2_cache_bytes();
// Lists sorted by rank: up to 8 vectors of coordinates (the target's vector width; 8 without vectors).
constexpr int64_t kRankLanes = SCORCH_VECTOR_BYTES >= (int)sizeof(idx_t) ? SCORCH_VECTOR_BYTES / sizeof(idx_t) : 1;
constexpr int64_t kRankMax = 8 * kRankLanes;
const bool dense_fits = C * (int64_t)sizeof(val_t) + C / 8 <= l2;
int64_t n = 0;
for (int64_t i = lo; i < hi; ++i) {
  const int64_t a0 = ap[i], a1 = ap[i + 1];
  const int64_t u = ub[i + 1] - ub[i];
  const int64_t most = u < C ? u : C;  // entries the row can have
  if (n + most > ch.cap) {
    // First the thread's upper bound (its rows' multiply-adds, or columns times rows if fewer), so that the
    // buffers need not grow, up to 2^24 entries; past that, doubling.
    const int64_t bound = (int64_t)std::min<double>((double)(ub[hi] - ub[lo]), (double)C * (double)(hi - lo));
    int64_t cap = std::max<int64_t>(2 * ch.cap, std::max<int64_t>(4096, std::min<int64_t>(bound, (int64_t)1 << 24)));
    if (cap < n + most) cap = n + most;
    if (n == 0) { free(ch.crd); free(ch.val); ch.crd = nullptr; ch.val = nullptr; }  // kept buffers: nothing to copy
    idx_t* c2 = (idx_t*)realloc(ch.crd, (size_t)cap * sizeof(idx_t));
    if (c2) ch.crd = c2;
    val_t* v2 = (val_t*)realloc(ch.val, (size_t)cap * sizeof(val_t));
    if (v2) ch.val = v2;
    if (!c2 || !v2) { ch.failed = 1; break; }
    ch.cap = cap;
  }
  idx_t* __restrict oc = ch.crd + n;
  val_t* __restrict ov = ch.val + n;
  int64_t m = 0;
  if (u == 0) {
  } else if (a1 - a0 == 1) {
    // One entry: the row is B's row scaled, already sorted.
    const int64_t j = ac[a0];
    const val_t x = $SCALEav[a0];
    for (int64_t k = bp[j]; k < (int64_t)bp[j + 1]; ++k) { oc[m] = bc[k]; ov[m] = x * bv[k]; ++m; }
  } else {
    int64_t H = 16;
    while (H < 2 * most) H *= 2;
    if (!dense_fits && H * (int64_t)(sizeof(idx_t) + sizeof(val_t)) <= l2 / 2) {
      // Hash table of H >= 2 * most slots (linear probing), sized to the row: it stays in cache where the
      // dense workspace would not.
      if (H > hcap) {
        free(hk); free(hv);
        hk = (idx_t*)malloc((size_t)H * sizeof(idx_t));
        hv = (val_t*)malloc((size_t)H * sizeof(val_t));
        hcap = hk && hv ? H : 0;
        if (!hcap) { ch.failed = 1; break; }
        memset(hk, 0xff, (size_t)H * sizeof(idx_t));
      }
      const int sh = 64 - __builtin_ctzll((unsigned long long)H);
      const uint64_t mask = (uint64_t)H - 1;
      for (int64_t k = a0; k < a1; ++k) {
        const int64_t j = ac[k];
        const val_t x = $SCALEav[k];
        for (int64_t q = bp[j]; q < (int64_t)bp[j + 1]; ++q) {
          const idx_t c = bc[q];
          uint64_t h = ((uint64_t)c * 0x9E3779B97F4A7C15ull) >> sh;
          for (;;) {
            const idx_t key = hk[h];
            if (key == c) { hv[h] += x * bv[q]; break; }
            if (key < 0) { hk[h] = c; hv[h] = x * bv[q]; oc[m++] = c; break; }
            h = (h + 1) & mask;
          }
        }
      }
      std::sort(oc, oc + m);
      for (int64_t w = 0; w < m; ++w) {
        const idx_t c = oc[w];
        uint64_t h = ((uint64_t)c * 0x9E3779B97F4A7C15ull) >> sh;
        while (hk[h] != c) h = (h + 1) & mask;
        ov[w] = hv[h];
      }
      memset(hk, 0xff, (size_t)H * sizeof(idx_t));
    } else {
      // Dense workspace over the columns: a value per column, zero wherever no product landed (reading a row
      // back zeroes it again), so every product is added without asking whether its column is new. The row's
      // span comes from the first and last columns of B's rows. A row expected to fill its span densely (its
      // upper bound at least an eighth of the span) only adds and sets a byte per column (bytes, not bits:
      // no store waits on a neighbour's), then reads the span's bytes back 8 at a time. Other rows also list
      // each column and count it when its bit was clear, branch-free (whether a column is new is as good as
      // random, so a branch on it mispredicts).
      if (!wv) {
        wv = (val_t*)calloc((size_t)(C ? C : 1), sizeof(val_t));
        wf = (unsigned char*)calloc((size_t)C + 8, 1);
        wb = (uint64_t*)calloc((size_t)(C / 64 + 1), sizeof(uint64_t));
        if (!wv || !wf || !wb) { ch.failed = 1; break; }
      }
      int64_t cmin = C, cmax = -1;
      for (int64_t k = a0; k < a1; ++k) {
        const int64_t j = ac[k];
        if (bp[j] == bp[j + 1]) continue;
        const int64_t f = bc[bp[j]], l = bc[bp[j + 1] - 1];
        cmin = f < cmin ? f : cmin;
        cmax = l > cmax ? l : cmax;
      }
      const int64_t span = cmax - cmin + 1;
      bool scan;
      if (8 * u >= span) {
        for (int64_t k = a0; k < a1; ++k) {
          const int64_t j = ac[k];
          const val_t x = $SCALEav[k];
          for (int64_t q = bp[j]; q < (int64_t)bp[j + 1]; ++q) {
            const int64_t c = bc[q];
            wv[c] += x * bv[q];
            wf[c] = 1;
          }
        }
        scan = true;
      } else {
        for (int64_t k = a0; k < a1; ++k) {
          const int64_t j = ac[k];
          const val_t x = $SCALEav[k];
          for (int64_t q = bp[j]; q < (int64_t)bp[j + 1]; ++q) {
            const int64_t c = bc[q];
            const uint64_t word = wb[c >> 6], bit = (uint64_t)1 << (c & 63);
            wv[c] += x * bv[q];
            oc[m] = (idx_t)c;
            m += (word & bit) == 0;
            wb[c >> 6] = word | bit;
          }
        }
        // Sorted columns. A short list (up to kRankMax, a few vectors of coordinates) is sorted by rank: each
        // column's place is the count of smaller ones, every pair compared in vectors without a branch. Scanning
        // the span's words or sorting mispredicts a branch about once per column (a word holding one or not, a
        // comparison), which on rows of a few scattered columns (citation graphs) cost more than the products.
        // Longer lists: the span's words of bits read back, unless they outnumber a few times what sorting the
        // list takes (m log2 m), as for a handful of columns far apart; then the list is sorted.
        if (m > 1 && m <= kRankMax) {
          idx_t cols[kRankMax + kRankLanes];
          memcpy(cols, oc, (size_t)m * sizeof(idx_t));
          const int64_t mr = (m + kRankLanes - 1) / kRankLanes * kRankLanes;
          for (int64_t w = m; w < mr; ++w) cols[w] = std::numeric_limits<idx_t>::max();  // never smaller
          for (int64_t w = 0; w < m; ++w) {
            const idx_t c = cols[w];
            idx_t r = 0;
            for (int64_t x = 0; x < mr; ++x) r += cols[x] < c;
            oc[r] = c; ov[r] = wv[c]; wv[c] = 0; wb[c >> 6] = 0;
          }
        } else if (m > 1 && (cmax >> 6) - (cmin >> 6) + 1 < 4 * m * (64 - __builtin_clzll((unsigned long long)m))) {
          int64_t w = 0;
          for (int64_t g = cmin >> 6; g <= (cmax >> 6); ++g) {
            uint64_t bits = wb[g];
            if (!bits) continue;
            wb[g] = 0;
            do {
              const int64_t c = (g << 6) + __builtin_ctzll(bits);
              bits &= bits - 1;
              oc[w] = (idx_t)c; ov[w] = wv[c]; wv[c] = 0; ++w;
            } while (bits);
          }
        } else {
          if (m > 1) std::sort(oc, oc + m);
          for (int64_t w = 0; w < m; ++w) { const int64_t c = oc[w]; ov[w] = wv[c]; wv[c] = 0; wb[c >> 6] = 0; }
        }
        scan = false;
      }
      if (scan) {
        m = 0;
        for (int64_t g = cmin & ~(int64_t)7; g <= cmax; g += 8) {
          uint64_t bytes;
          memcpy(&bytes, wf + g, 8);
          if (!bytes) continue;
          memset(wf + g, 0, 8);
          do {
            const int64_t c = g + (__builtin_ctzll(bytes) >> 3);
            bytes &= bytes - 1;
            oc[m] = (idx_t)c; ov[m] = wv[c]; wv[c] = 0; ++m;
          } while (bytes);
        }
      }
    }
  }
  out_pos[i + 1] = (idx_t)m;
  n += m;
}
ch.n = n;
if (ch.s && !ch.failed && wv) { ch.s->wv = wv; ch.s->wf = wf; ch.s->wb = wb; ch.s->wcols = C; }
else { free(wv); free(wf); free(wb); }
free(hk); free(hv);)";

// Merge: the region's body from the row checks to the thread's rows computed (before kGather).
const char* kMerge = R"(const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
int bad = 0;
// 1. Both operands' rows checked once, equal shares: every later read is unchecked.
{
  const int64_t r0 = (int64_t)((__int128)R * tid / nt), r1 = (int64_t)((__int128)R * (tid + 1) / nt);
  if (!rows_in_range(ap, ac, r0, r1, ac_n, C, bad) || !rows_in_range(bp, bc, r0, r1, bc_n, C, bad))
    __atomic_store_n(&input_bad, 1, __ATOMIC_RELAXED);
}
#pragma omp barrier
const bool ok = !__atomic_load_n(&input_bad, __ATOMIC_RELAXED);
// 2. Rows split so that each thread has about the same number of entries of both operands.
auto first_row = [&](int t) -> int64_t {
  if (t <= 0) return 0;
  if (t >= nt) return R;
  const int64_t all = ((int64_t)ap[R] - (int64_t)ap[0]) + ((int64_t)bp[R] - (int64_t)bp[0]);
  const int64_t target = (int64_t)((__int128)all * t / nt);
  int64_t a = 0, b = R;  // the first row i with entries before it >= target
  while (a < b) {
    const int64_t mid = a + (b - a) / 2;
    if (((int64_t)ap[mid] - (int64_t)ap[0]) + ((int64_t)bp[mid] - (int64_t)bp[0]) < target) a = mid + 1;
    else b = mid;
  }
  return a;
};
const int64_t lo = ok ? first_row(tid) : 0;
int64_t hi = ok ? first_row(tid + 1) : 0;
// 3. This thread's rows into its own buffers, of at least the entries both operands store in them.
Chunk& ch = chunks[tid];
ch.s = tid < 64 ? __atomic_exchange_n(&scratch_slots[tid], (Scratch*)nullptr, __ATOMIC_ACQ_REL) : nullptr;
if (!ch.s) ch.s = (Scratch*)calloc(1, sizeof(Scratch));
if (ch.s) { ch.crd = ch.s->crd; ch.val = ch.s->val; ch.cap = ch.s->cap; ch.s->crd = nullptr; ch.s->val = nullptr; }
{
  const int64_t cap = 1 + (lo < hi ? ((int64_t)ap[hi] - (int64_t)ap[lo]) + ((int64_t)bp[hi] - (int64_t)bp[lo]) : 0);
  if (!ch.s || ch.cap < cap) {
    free(ch.crd); free(ch.val);
    ch.crd = (idx_t*)malloc((size_t)cap * sizeof(idx_t));
    ch.val = (val_t*)malloc((size_t)cap * sizeof(val_t));
    ch.cap = cap;
  }
  if (!ch.s || !ch.crd || !ch.val) { ch.failed = 1; hi = lo; }
}
int64_t n = 0;
for (int64_t i = lo; i < hi; ++i) {
  int64_t ka = ap[i], kb = bp[i];
  const int64_t kae = ap[i + 1], kbe = bp[i + 1];
  idx_t* __restrict oc = ch.crd + n;
  val_t* __restrict ov = ch.val + n;
  int64_t m = 0;
  while (ka < kae && kb < kbe) {
    const idx_t ca = ac[ka], cb = bc[kb];
    if (ca < cb) { oc[m] = ca; ov[m] = $ONLY_A; ++ka; }
    else if (cb < ca) { oc[m] = cb; ov[m] = $ONLY_B; ++kb; }
    else { oc[m] = ca; ov[m] = $BOTH; ++ka; ++kb; }
    ++m;
  }
  for (; ka < kae; ++ka, ++m) { oc[m] = ac[ka]; ov[m] = $ONLY_A; }
  for (; kb < kbe; ++kb, ++m) { oc[m] = bc[kb]; ov[m] = $ONLY_B; }
  out_pos[i + 1] = (idx_t)m;
  n += m;
}
ch.n = n;)";

}  // namespace

std::optional<AssembleMatch> match_assembled(const KernelSpec& spec) {
  const ir::Statement& st = spec.stmt;
  if (spec.output.strided() || !csr_like(*spec.output.format) || st.out_vars.size() != 2 ||
      st.out_vars[0] == st.out_vars[1])
    return std::nullopt;
  const auto out_lv = level_vars(*spec.output.format, st.out_vars);
  auto csr_access = [&](const ir::Expr* a) {
    const Storage& s = spec.operands[a->tensor];
    return !s.strided() && distinct_vars(a) && csr_like(*s.format);
  };
  auto lv = [&](const ir::Expr* a) { return level_vars(*spec.operands[a->tensor].format, a->vars); };

  // Gustavson: a product of two row-stored operands (and constants) whose levels chain p -> q -> r.
  {
    std::vector<const ir::Expr*> acc;
    double scale = 1;
    if (product_factors(st.rhs, acc, scale) && acc.size() == 2 && csr_access(acc[0]) && csr_access(acc[1])) {
      for (int first = 0; first < 2; ++first) {
        const ir::Expr* a = acc[first];
        const ir::Expr* b = acc[1 - first];
        const auto la = lv(a), lb = lv(b);
        if (la[0] == out_lv[0] && la[1] == lb[0] && lb[1] == out_lv[1] && la[1] != out_lv[0] && la[1] != out_lv[1]) {
          AssembleMatch m;
          m.form = AssembleMatch::Form::gustavson;
          m.a = a->tensor;
          m.b = b->tensor;
          m.p = out_lv[0];
          m.q = la[1];
          m.r = out_lv[1];
          return m;
        }
      }
    }
  }
  // Merge: a linear combination of two row-stored operands with the output's level variables.
  {
    std::vector<const ir::Expr*> acc;
    if (linear_terms(st.rhs, acc) && acc.size() == 2 && csr_access(acc[0]) && csr_access(acc[1]) &&
        acc[0]->access_id != acc[1]->access_id && lv(acc[0]) == out_lv && lv(acc[1]) == out_lv) {
      AssembleMatch m;
      m.form = AssembleMatch::Form::merge;
      m.a = acc[0]->tensor;
      m.b = acc[1]->tensor;
      m.p = out_lv[0];
      m.q = out_lv[1];
      return m;
    }
  }
  return std::nullopt;
}

LoweredKernel lower_assembled(const KernelSpec& spec, const Schedule& sched, const AssembleMatch& m,
                              const VectorShape& machine) {
  (void)sched;
  (void)machine;  // the loops here are scalar: what they wait on is memory, not arithmetic
  LoweredKernel out;
  out.sparse_output = true;
  out.assembled_output = true;
  out.body = unpack_arguments(spec);
  const bool gus = m.form == AssembleMatch::Form::gustavson;
  auto buf = [](int t, const char* name) { return fmt::format("t{}_{}1", t, name); };
  const std::vector<std::pair<std::string, std::string>> names = {
      {"$A_POS", buf(m.a, "pos")}, {"$A_CRD", buf(m.a, "crd")}, {"$A_VALS", fmt::format("t{}_vals", m.a)},
      {"$B_POS", buf(m.b, "pos")}, {"$B_CRD", buf(m.b, "crd")}, {"$B_VALS", fmt::format("t{}_vals", m.b)},
      {"$R", fmt::format("N{}", m.p)}, {"$J", fmt::format("N{}", m.q)}, {"$C", fmt::format("N{}", gus ? m.r : m.q)}};
  Stmts& b = out.body;
  push_lines(b, subst(R"(// Sparse output assembled in place ($FORM): CSR pos, crd and values written by the kernel.
const int64_t R = $R, C = $C;
const int64_t J = $J; (void)J;
const idx_t* __restrict ap = $A_POS;
const idx_t* __restrict ac = $A_CRD;
const val_t* __restrict av = $A_VALS;
const idx_t* __restrict bp = $B_POS;
const idx_t* __restrict bc = $B_CRD;
const val_t* __restrict bv = $B_VALS;
const int64_t ac_n = $A_CRD_n, bc_n = $B_CRD_n;)",
                      [&] {
                        auto v = names;
                        v.insert(v.begin(), {"$FORM", gus ? "Gustavson" : "merge of rows"});
                        v.insert(v.begin(), {"$B_CRD_n", buf(m.b, "crd") + "_n"});
                        v.insert(v.begin(), {"$A_CRD_n", buf(m.a, "crd") + "_n"});
                        return v;
                      }()));
  push_lines(b, subst(kPrologue, {{"$UB_ALLOC", gus ? "(int64_t*)malloc((size_t)(R + 1) * sizeof(int64_t))"
                                                    : "(int64_t*)malloc(sizeof(int64_t))"}}));
  Stmts region;
  if (gus) {
    std::vector<const ir::Expr*> acc;
    double scale = 1;
    product_factors(spec.stmt.rhs, acc, scale);
    const std::string s = scale == 1 ? "" : "((val_t)" + ir::format_literal(scale) + ") * ";
    push_lines(region, subst(kGustavson, {{"$SCALE", s}}));
  } else {
    const ir::ExprPtr& e = spec.stmt.rhs;
    std::vector<const ir::Expr*> acc;
    linear_terms(e, acc);
    const ir::Expr* ea = acc[0];
    const ir::Expr* eb = acc[1];
    auto render = [&](bool has_a, bool has_b) {
      return present_value(
          e, [&](const ir::Expr* x) { return (x == ea && has_a) || (x == eb && has_b); },
          [&](const ir::Expr* x) { return std::string(x == ea ? "av[ka]" : "bv[kb]"); });
    };
    const std::string both = render(true, true), only_a = render(true, false), only_b = render(false, true);
    SCORCH_ASSERT(!both.empty() && !only_a.empty() && !only_b.empty(), "a linear combination keeps its terms");
    push_lines(region, subst(kMerge, {{"$ONLY_A", only_a}, {"$ONLY_B", only_b}, {"$BOTH", both}}));
  }
  push_lines(region, kGather);
  b.push_back(loops::parallel("nthreads", region));
  push_lines(b, kEpilogue);

  if (gus) {
    out.reasons.push_back(fmt::format(
        "sparse output assembled in the kernel (Gustavson): rows of {} times rows of {}, a workspace per row "
        "(B's row scaled for one entry, a dense workspace when it fits L2, else a hash table sized to the row), "
        "columns sorted or scanned, CSR written directly (no coordinate stream, join or packing)",
        spec.stmt.tensor_names[m.a], spec.stmt.tensor_names[m.b]));
    out.reasons.push_back("rows split among threads by their multiply-adds (upper bounds from the row pointers)");
  } else {
    out.reasons.push_back(fmt::format(
        "sparse output assembled in the kernel (merge of rows of {} and {}): CSR written directly (no coordinate "
        "stream, join or packing)",
        spec.stmt.tensor_names[m.a], spec.stmt.tensor_names[m.b]));
    out.reasons.push_back("rows split among threads by the entries both operands store");
  }
  return out;
}

}  // namespace scorch
