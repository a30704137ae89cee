#include "codegen/emit_cpp.h"

#include <fmt/format.h>

#include "codegen/kernel_abi.h"

namespace scorch {

namespace {

const char* kPreamble = R"(#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <omp.h>
#include <type_traits>
#include <unistd.h>

namespace {

// Bytes of this CPU's per-core L2 cache (read where the kernel runs; 256 KB when the system does not say).
// Register-tiled loops prefetch the dense rows they gather only when those rows outgrow it.
inline int64_t l2_cache_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (v > 0) return (int64_t)v;
#endif
    return (int64_t)262144;
  }();
  return bytes;
}

// Bytes of this CPU's L1 data cache (32 KB when the system does not say): blocks sized to stay in it.
inline int64_t l1_cache_bytes() {
  static const int64_t bytes = [] {
#ifdef _SC_LEVEL1_DCACHE_SIZE
    const long v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (v > 0) return (int64_t)v;
#endif
    return (int64_t)32768;
  }();
  return bytes;
}

#if SCORCH_VECTOR_BYTES > 0
// Vectors as wide as the target's registers (GCC vector extension): register tiles of dense output columns.
typedef val_t vec_t __attribute__((vector_size(SCORCH_VECTOR_BYTES)));
inline vec_t vload(const val_t* p) {
  vec_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
// The n values at p (n < lanes) in the first lanes. Read as one vector when the whole of it lies before `end`
// (the operand's last element + 1), which is every row of a row-major operand but its last: the lanes past n
// then hold the next row's values, which the caller never stores. Else lane by lane, the rest zero.
inline vec_t vload_upto(const val_t* p, int64_t n, const val_t* end) {
  if (end - p >= (int64_t)(sizeof(vec_t) / sizeof(val_t))) return vload(p);
  vec_t v = {};
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}
#endif

// Output stream of one thread: coordinate tuples and values, grown by doubling.
struct Stream {
  int64_t n, cap;
  int64_t* crd;
  val_t* val;
  int failed;
};

inline void push(Stream& s, const int64_t* c, int nd, val_t v) {
  // Once growing failed, the rest is dropped: the kernel reports no memory. Trying again at every entry made
  // a result too large for memory a system call per entry, minutes before the error.
  if (s.failed) return;
  if (s.n == s.cap) {
    const int64_t cap = s.cap ? 2 * s.cap : 1024;
    int64_t* crd = (int64_t*)realloc(s.crd, (size_t)(cap * (nd ? nd : 1)) * sizeof(int64_t));
    if (crd) s.crd = crd;
    val_t* val = (val_t*)realloc(s.val, (size_t)cap * sizeof(val_t));
    if (val) s.val = val;
    if (!crd || !val) { s.failed = 1; return; }
    s.cap = cap;
  }
  for (int d = 0; d < nd; ++d) s.crd[s.n * nd + d] = c[d];
  s.val[s.n++] = v;
}

// Concatenate the threads' streams, in thread order, into [ndim][nnz] coordinates and values.
int join_streams(Stream* streams, int nthreads, int nd, scorch_kernel_args* args) {
  int64_t total = 0;
  int ok = 1;
  for (int t = 0; t < nthreads; ++t) { total += streams[t].n; ok &= !streams[t].failed; }
  args->out_nnz = total;
  args->out_coords = (int64_t*)malloc((size_t)(total * nd + 1) * sizeof(int64_t));
  args->out_vals = malloc((size_t)(total + 1) * sizeof(val_t));
  ok &= args->out_coords != nullptr && args->out_vals != nullptr;
  int64_t at = 0;
  for (int t = 0; t < nthreads; ++t) {
    const Stream& s = streams[t];
    if (ok) {
      for (int64_t q = 0; q < s.n; ++q)
        for (int d = 0; d < nd; ++d) args->out_coords[d * total + at + q] = s.crd[q * nd + d];
      if (s.n) memcpy((val_t*)args->out_vals + at, s.val, (size_t)s.n * sizeof(val_t));
    }
    at += s.n;
    free(s.crd);
    free(s.val);
  }
  return ok;
}

// Checked loads (kernel_abi.h). A coordinate is used only inside [0, n) and a segment [k, ke) only inside
// [0, len]; anything else sets the thread's bad flag and is replaced (by 0, or an empty segment), so loops
// keep their shape and no access leaves its buffer. n > 0 wherever a coordinate is loaded: the entry checks
// refuse a non-empty crd buffer of a level of extent 0. Branch-free: a compare and a select.
inline int64_t in_range(int64_t c, int64_t n, int& bad) {
  const bool ok = (uint64_t)c < (uint64_t)n;
  bad |= !ok;
  return ok ? c : 0;
}

inline void segment(int64_t& k, int64_t& ke, int64_t len, int& bad) {
  const bool ok = (uint64_t)k <= (uint64_t)ke && (uint64_t)ke <= (uint64_t)len;
  bad |= !ok;
  k = ok ? k : 0;
  ke = ok ? ke : 0;
}

// A coordinate or segment checked already (coords_in_range, rows_in_range) and read from its buffer again:
// kept inside its range by a compare and a select, with no flag set. Between the check and the read only a
// data race can change it (a caller writing the buffer in place while the kernel runs, which the caller must
// not do): the race may then give a wrong result, but no access leaves its buffer. Cheaper than in_range and
// segment: nothing to record, so no dependency from one load to the next.
inline int64_t kept_in(int64_t c, int64_t n) { return (uint64_t)c < (uint64_t)n ? c : 0; }

inline void kept_segment(int64_t& k, int64_t& ke, int64_t len) {
  const uint64_t e = std::min<uint64_t>((uint64_t)ke, (uint64_t)len);
  k = (int64_t)std::min<uint64_t>((uint64_t)k, e);
  ke = (int64_t)e;
}

// All coordinates of a segment [k, ke) of a crd buffer checked at once, before the loop that uses them: the
// loop then loads them unchecked. The largest coordinate, read as unsigned (a negative one becomes huge),
// must be below n; that is one vectorizable max reduction over data the loop reads next from L1, instead of
// a compare and a select per coordinate. Any coordinate out of range sets the thread's bad flag and empties
// the segment (as segment() does), so the loop reads nothing built from it. [k, ke) must lie inside the
// buffer (a segment() result, or positions derived from one).
template <typename I>
inline void coords_in_range(const I* __restrict c, int64_t k, int64_t& ke, int64_t n, int& bad) {
  typedef typename std::make_unsigned<I>::type U;
  // Every value of I below n, as U: n itself when it fits, else all non-negative values of I.
  const U lim = (U)std::min<uint64_t>((uint64_t)n, (uint64_t)std::numeric_limits<I>::max() + 1);
  U m = 0;
  for (int64_t q = k; q < ke; ++q) m = std::max(m, (U)c[q]);
  const bool ok = k >= ke || m < lim;
  bad |= !ok;
  ke = ok ? ke : k;
}

// A thread's rows [lo, hi) of a CSR-like level (pos has the row pointers, crd the coordinates) checked once,
// before the rows are visited: pos must not decrease over the rows, their segments must lie inside the crd
// buffer, and every coordinate in them must be below n. Then every segment [pos[i], pos[i + 1]) of these rows
// lies inside [pos[lo], pos[hi]) and holds only coordinates in range, so the rows' loops load positions and
// coordinates unchecked: one pass over the thread's share (vectorizable, data the rows read next) instead of a
// segment check and a coordinate check per row, whose loop exits cost a branch misprediction each on short
// rows. False (and bad set) when anything is out of place: the caller then visits no row.
template <typename I>
inline bool rows_in_range(const I* __restrict pos, const I* __restrict crd, int64_t lo, int64_t hi, int64_t len,
                          int64_t n, int& bad) {
  int dec = 0;
  for (int64_t i = lo; i < hi; ++i) dec |= pos[i + 1] < pos[i];
  const int64_t b = pos[lo];
  int64_t e = pos[hi];
  const bool ok = !dec && (uint64_t)b <= (uint64_t)e && (uint64_t)e <= (uint64_t)len;
  bad |= !ok;
  if (!ok) return false;
  const int64_t all = e;
  coords_in_range(crd, b, e, n, bad);
  return e == all;
}

// A thread's private copy of a chunk of rows' positions and coordinates (rows_snapshot), grown as needed and
// freed when the thread's rows are done (snapshot_free).
struct RowsSnapshot {
  idx_t* pos;
  idx_t* crd;
  int64_t pos_cap, crd_cap;
};

inline void snapshot_free(RowsSnapshot& s) {
  free(s.pos);
  free(s.crd);
}

// rows_in_range on a copy: rows [lo, hi)'s positions pos[lo..hi] and the coordinates they bound are copied into
// the thread's snapshot, and the copy is checked. The rows then read the copy (spos, scrd: addressed as the
// buffers are, by row and by position) without a check per load. Reading the caller's buffers once is what
// makes that safe: a value checked and then read again could differ, if a thread wrote the buffer in place
// during the call (the caller's data race), and a coordinate or a position read again unchecked then reached
// out of bounds. The copy stays in cache for the rows (a chunk is a fraction of L2). Where the copy cannot be
// allocated the buffers themselves are checked and used (as rows_in_range does).
template <typename I>
inline bool rows_snapshot(const I* __restrict pos, const I* __restrict crd, int64_t lo, int64_t hi, int64_t len,
                          int64_t n, int& bad, RowsSnapshot& s, const I*& spos, const I*& scrd) {
  spos = pos;
  scrd = crd;
  if (hi - lo + 1 > s.pos_cap) {
    const int64_t cap = std::max<int64_t>(hi - lo + 1, 2 * s.pos_cap);
    I* p = (I*)realloc(s.pos, (size_t)cap * sizeof(I));
    if (!p) return rows_in_range(pos, crd, lo, hi, len, n, bad);
    s.pos = p;
    s.pos_cap = cap;
  }
  // The positions copied, then checked on the copy, with a compiler barrier between: checked in the copying
  // loop, the vectorized comparison P[k + 1] < P[k] loaded pos twice (at i and at i + 1) instead of reading
  // the copy, so a value a racing writer changed between the two loads was stored unchecked (a 0 in the
  // middle of the copy: a row running over the coordinates' copy, SIGSEGV in test_hostile's racing SpMM,
  // about 1 run in 6). The positions are a small part of a chunk (rows, not entries).
  I* __restrict P = s.pos;
  for (int64_t i = lo; i <= hi; ++i) P[i - lo] = pos[i];
  __asm__ __volatile__("" ::: "memory");  // the check reads the copy, never the caller's buffer again
  int dec = 0;
  for (int64_t k = 0; k < hi - lo; ++k) dec |= P[k + 1] < P[k];
  const int64_t b = P[0], e = P[hi - lo];
  const bool ok = !dec && (uint64_t)b <= (uint64_t)e && (uint64_t)e <= (uint64_t)len;
  bad |= !ok;
  if (!ok) return false;
  if (e - b > s.crd_cap) {
    const int64_t cap = std::max<int64_t>(e - b, 2 * s.crd_cap);
    I* c = (I*)realloc(s.crd, (size_t)cap * sizeof(I));
    if (!c) return rows_in_range(pos, crd, lo, hi, len, n, bad);
    s.crd = c;
    s.crd_cap = cap;
  }
  I* __restrict C = s.crd;
  typedef typename std::make_unsigned<I>::type U;
  const U lim = (U)std::min<uint64_t>((uint64_t)n, (uint64_t)std::numeric_limits<I>::max() + 1);
  U m = 0;
  for (int64_t q = b; q < e; ++q) {
    const I v = crd[q];
    C[q - b] = v;
    m = std::max(m, (U)v);
  }
  const bool in = b >= e || m < lim;
  bad |= !in;
  if (!in) return false;
  spos = P - lo;
  scrd = C - b;
  return true;
}

// Stored entries per chunk of a thread's rows: the chunk's coordinates and values take about a quarter of L2,
// so the chunk's check leaves its coordinates cached for its rows.
inline int64_t chunk_entries() {
  static const int64_t n = std::max<int64_t>(1024, l2_cache_bytes() / (4 * (int64_t)(sizeof(idx_t) + sizeof(val_t))));
  return n;
}

// The end of the chunk of rows that starts at row lo of a share ending at hi (lo < hi): the last row end
// within `entries` stored entries of pos[lo], at least lo + 1. pos is not checked yet (the chunk is checked
// next): a binary search that only narrows an index inside (lo, hi], whatever pos holds.
inline int64_t chunk_end(const idx_t* pos, int64_t lo, int64_t hi, int64_t entries) {
  const int64_t target = (int64_t)pos[lo] + entries;
  int64_t a = lo + 1, b = hi;
  while (a < b) {
    const int64_t m = a + (b - a + 1) / 2;
    if ((int64_t)pos[m] <= target) a = m; else b = m - 1;
  }
  return a;
}

// First row of thread t's share when rows [0, n) are split so that each thread gets about the same number of
// nonzeros according to the row pointers pos[0..n].
inline int64_t balanced_bound(const idx_t* pos, int64_t n, int t, int nt) {
  if (t <= 0) return 0;
  if (t >= nt) return n;
  const int64_t target = (int64_t)((__int128)pos[n] * t / nt);
  return std::lower_bound(pos, pos + n + 1, (idx_t)target) - pos;
}

}  // namespace
)";

}  // namespace

std::string emit_cpp(const KernelSpec& spec, const LoweredKernel& kernel, int vector_bytes) {
  std::string src = "// Generated by Scorch. Kernel spec:\n//   " + spec.str() + "\n";
  src += fmt::format("typedef {} val_t;\ntypedef {} idx_t;\n", spec.f64 ? "double" : "float",
                     spec.idx64 ? "int64_t" : "int32_t");
  src += fmt::format("#define SCORCH_VECTOR_BYTES {}\n", vector_bytes);
  src = "#include <cstdint>\n" + src;
  src += std::string(kKernelAbiSource) + "\n";
  src += kPreamble;
  src += "\nextern \"C\" int scorch_kernel(scorch_kernel_args* args) {\n";
  src += loops::print(kernel.body, 1);
  src += "}\n\nextern \"C\" void scorch_kernel_free(void* p) { free(p); }\n";
  return src;
}

}  // namespace scorch
