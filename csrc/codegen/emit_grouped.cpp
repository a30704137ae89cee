// The grouped product kernel's source (emit_grouped.h). The kernel text is fixed; only the value type, the
// vector width and the register tile are filled in, from the spec's dtype and the target's vector shape.
#include "codegen/emit_grouped.h"

#include <algorithm>

#include <fmt/format.h>

#include "codegen/kernel_abi.h"
#include "common/error.h"

namespace scorch {
namespace {

const char* kHead = R"(#include <algorithm>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <unistd.h>

namespace {

#if SCORCH_VECTOR_BYTES > 0
typedef val_t vec_t __attribute__((vector_size(SCORCH_VECTOR_BYTES)));
constexpr int kLanes = SCORCH_VECTOR_BYTES / (int)sizeof(val_t);
#else
typedef val_t vec_t;  // a scalar target: a "vector" is one value
constexpr int kLanes = 1;
#endif
inline vec_t vload(const val_t* p) {
  vec_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
constexpr int64_t kLine = 64;  // bytes a prefetch brings

// Rows of weights per block: a block of one panel (kNV vectors of columns) fills about half the L1 data cache
// (32 KB when the system does not say), at least 16 rows. The weights' rows are a power of two apart in the
// mixture of experts (2-4 KB): a block of many more rows would not stay in the L2 cache's sets either. Weights
// stored panel by panel (a block one contiguous piece, no set conflicts) take blocks of the whole L1 cache: timed
// on a 256 x 512 x 2048 product (2 threads, AVX-512 and AVX2 tiles), 4-6% faster than half of it, 7-14% faster
// than a quarter, the same as twice it.
int64_t block_rows(bool panelled) {
  static const long l1 = [] {
    long v = 32768;
#ifdef _SC_LEVEL1_DCACHE_SIZE
    if (const long s = sysconf(_SC_LEVEL1_DCACHE_SIZE); s > 0) v = s;
#endif
    return v;
  }();
  const int64_t bytes = panelled ? (int64_t)l1 : (int64_t)l1 / 2;
  return std::max<int64_t>(16, bytes / ((int64_t)kNV * kLanes * (int64_t)sizeof(val_t)));
}

// The kernel. For each unit (a group q and a range of output columns): the rows of group q times W[q] in
// those columns. Register tile: kMR rows x kNV vectors of accumulators. The weights are walked in blocks (rows
// k0 .. k0 + block_rows() of one panel of kNV vectors of columns), every row tile over a block before the
// next, so a block is read from memory once and from cache by the other row tiles; while a block is
// multiplied the next one -- the panel's next rows, the next panel, or at the unit's end the first block of
// the unit the threads take next -- is prefetched into L2, a few lines each k, spread over the row tiles:
// the weights stream in under the arithmetic instead of between products.
)";

const char* kBody = R"(
struct Prefetch {
  const char* base;  // row 0 of the panel to prefetch; null: none
  int64_t row_bytes; // bytes between its rows
  int64_t first, lines, step;  // the lines of each row this tile prefetches: first, first + step, ... < lines
};

template <int R, int V>
void tile(const val_t* __restrict a, int64_t lda, const val_t* __restrict w, int64_t ldw, val_t* __restrict c,
          int64_t ldc, int64_t K, const Prefetch& pf, bool add, const val_t* bias, bool relu) {
  vec_t acc[R][V];
  vec_t start[V];  // a first block starts from the bias (or zero), a later one from the output so far
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) start[j] = bias ? vload(bias + j * kLanes) : vec_t{};
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) acc[i][j] = add ? vload(c + i * ldc + j * kLanes) : start[j];
  const char* pfr = pf.base ? pf.base + pf.first * kLine : nullptr;
  for (int64_t k = 0; k < K; ++k) {
    const val_t* __restrict wr = w + k * ldw;
    vec_t b[V];
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) b[j] = vload(wr + j * kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const val_t s = a[i * lda + k];
#pragma GCC unroll 16
      for (int j = 0; j < V; ++j) acc[i][j] += s * b[j];
    }
    if (pfr) {
      for (int64_t l = 0; l < pf.lines - pf.first; l += pf.step) __builtin_prefetch(pfr + l * kLine, 0, 2);
      pfr += pf.row_bytes;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      vec_t v = acc[i][j];
      if (relu) v = v < 0 ? vec_t{} : v;  // NaN stays
      memcpy(c + i * ldc + j * kLanes, &v, sizeof v);
    }
}

// Columns left over after the full vectors (fewer than kLanes): one at a time.
void tail_columns(const val_t* a, int64_t lda, const val_t* w, int64_t ldw, val_t* c, int64_t ldc, int64_t M,
                  int64_t K, int64_t cols, const val_t* bias, bool relu) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      val_t s = bias ? bias[j] : val_t(0);
      for (int64_t k = 0; k < K; ++k) s += a[i * lda + k] * w[k * ldw + j];
      c[i * ldc + j] = relu && s < 0 ? val_t(0) : s;
    }
}

template <int V>
void tile_rows(int r, const val_t* a, int64_t lda, const val_t* w, int64_t ldw, val_t* c, int64_t ldc, int64_t K,
               const Prefetch& pf, bool add, const val_t* bias, bool relu) {
  switch (r) {
#define SCORCH_TILE_ROWS(n) \
    case n: if constexpr (n <= kMR) tile<n, V>(a, lda, w, ldw, c, ldc, K, pf, add, bias, relu); break;
    SCORCH_TILE_ROWS(1) SCORCH_TILE_ROWS(2) SCORCH_TILE_ROWS(3) SCORCH_TILE_ROWS(4)
    SCORCH_TILE_ROWS(5) SCORCH_TILE_ROWS(6) SCORCH_TILE_ROWS(7) SCORCH_TILE_ROWS(8)
#undef SCORCH_TILE_ROWS
    default: break;
  }
}

void tile_any(int r, int v, const val_t* a, int64_t lda, const val_t* w, int64_t ldw, val_t* c, int64_t ldc,
              int64_t K, const Prefetch& pf, bool add, const val_t* bias, bool relu) {
  switch (v) {
#define SCORCH_TILE_VECTORS(n) \
    case n: if constexpr (n <= kNV) tile_rows<n>(r, a, lda, w, ldw, c, ldc, K, pf, add, bias, relu); break;
    SCORCH_TILE_VECTORS(1) SCORCH_TILE_VECTORS(2) SCORCH_TILE_VECTORS(3) SCORCH_TILE_VECTORS(4)
#undef SCORCH_TILE_VECTORS
    default: break;
  }
}

// Column n of row 0 of weights whose panels (kNV vectors of columns each) are ps values apart: ps = the panel's
// columns for a plain (K x N) matrix, K x the panel's columns for one stored panel by panel (each panel's rows
// contiguous: a block of kc rows is one contiguous piece, which no cache set conflict evicts).
inline const val_t* column_of(const val_t* w, int64_t n, int64_t ps) {
  const int64_t NB = (int64_t)kNV * kLanes;
  return w + n / NB * ps + n % NB;
}

// One unit: rows a (M x K), weights w (K x cols, panels ps apart), plus bias (cols values, or null), into c. The weights are taken in blocks of kc rows of one
// panel, every row tile over a block before the next; the next block -- this panel's next rows, the next
// panel's first, or at the end `next`'s (cols_next columns of rows ldw apart, or null) -- is prefetched under it.
void unit_product(const val_t* a, int64_t lda, int64_t M, int64_t K, const val_t* w, int64_t ldw, int64_t ps,
                  int64_t cols,
                  const val_t* bias, val_t* c, int64_t ldc, const val_t* next, int64_t cols_next, int64_t kc,
                  bool relu) {
  const int64_t NB = (int64_t)kNV * kLanes;
  const int64_t tiles = (M + kMR - 1) / kMR;
  const int64_t full = cols / kLanes * kLanes;
  for (int64_t n0 = 0; n0 < full; n0 += NB) {
    const int64_t nb = std::min(NB, full - n0);
    const val_t* wp = column_of(w, n0, ps);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kb = std::min(kc, K - k0);
      const val_t* pw;
      int64_t pcols;
      if (k0 + kc < K) { pw = wp + (k0 + kc) * ldw; pcols = nb; }
      else if (n0 + NB < full) { pw = column_of(w, n0 + NB, ps); pcols = std::min(NB, full - n0 - NB); }
      else { pw = next; pcols = std::min(NB, cols_next); }
      const int64_t plines = pw ? (pcols * (int64_t)sizeof(val_t) + kLine - 1) / kLine : 0;
      const bool last = k0 + kc >= K;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMR;
        const Prefetch pf{t < plines ? (const char*)pw : nullptr, ldw * (int64_t)sizeof(val_t), t, plines, tiles};
        tile_any((int)std::min<int64_t>(kMR, M - m0), (int)(nb / kLanes), a + m0 * lda + k0, lda, wp + k0 * ldw,
                 ldw, c + m0 * ldc + n0, ldc, kb, pf, k0 > 0, bias && k0 == 0 ? bias + n0 : nullptr, relu && last);
      }
    }
  }
  if (full < cols)
    tail_columns(a, lda, column_of(w, full, ps), ldw, c + full, ldc, M, K, cols - full, bias ? bias + full : nullptr,
                 relu);
}

}  // namespace

// inputs: A (entries x K, rows lda apart), W (groups x K x N: group q at q * wq, rows ldw apart), starts and
// counts (int64 per group), units (int64 triples: group, first column, end column), in the order to run them,
// bias (groups x N, group q at q * bq, or null). sizes: groups, K, N, units, relu (0/1). strides: lda, wq, ldw,
// ldc, bq, ps (values between the panels of kNV vectors of columns: column_of; units start on a panel).
// out_dense: (entries x N, rows ldc apart), every element of every unit written.
extern "C" int scorch_kernel(scorch_kernel_args* args) {
  const val_t* A = (const val_t*)args->inputs[0];
  const val_t* W = (const val_t*)args->inputs[1];
  const int64_t* starts = (const int64_t*)args->inputs[2];
  const int64_t* counts = (const int64_t*)args->inputs[3];
  const int64_t* units = (const int64_t*)args->inputs[4];
  const val_t* bias = (const val_t*)args->inputs[5];
  const int64_t K = args->sizes[1], U = args->sizes[3];
  const bool relu = args->sizes[4] != 0;
  const int64_t lda = args->strides[0], wq = args->strides[1], ldw = args->strides[2], ldc = args->strides[3];
  const int64_t bq = args->strides[4], ps = args->strides[5];
  val_t* out = (val_t*)args->out_dense;
  int64_t next = 0;
  const int64_t kc = block_rows(ps != (int64_t)kNV * kLanes);
  const int nthreads = args->num_threads > 0 ? args->num_threads : 1;
#pragma omp parallel num_threads(nthreads)
  {
    for (;;) {
      int64_t u;
#pragma omp atomic capture
      u = next++;
      if (u >= U) break;
      const int64_t* un = units + 3 * u;
      int64_t peek;
#pragma omp atomic read
      peek = next;
      const val_t* pw = nullptr;
      int64_t pcols = 0;
      if (peek < U) {
        const int64_t* nx = units + 3 * peek;
        pw = column_of(W + nx[0] * wq, nx[1], ps);
        pcols = nx[2] - nx[1];
      }
      const int64_t q = un[0], lo = starts[q], m = counts[q];
      const val_t* bias_q = bias ? bias + q * bq + un[1] : nullptr;
      unit_product(A + lo * lda, lda, m, K, column_of(W + q * wq, un[1], ps), ldw, ps, un[2] - un[1], bias_q,
                   out + lo * ldc + un[1], ldc, pw, pcols, kc, relu);
    }
  }
  return SCORCH_STATUS_OK;
}
)";

}  // namespace

GroupedTile grouped_tile(const VectorShape& machine) {
  const int regs = machine.vector_bytes > 0 ? machine.registers() : 16;
  const int vbytes = std::max(machine.vector_bytes, 1);
  // Ranks a tile: the most accumulators; then a panel of whole cache lines (a row of a panel that splits lines
  // reads two lines for part of each); then the fewest loads per multiply-add (1 / rows broadcasts plus
  // 1 / vectors weight loads).
  auto better = [&](GroupedTile a, GroupedTile b) {
    if (a.rows * a.vectors != b.rows * b.vectors) return a.rows * a.vectors > b.rows * b.vectors;
    const bool a_lines = a.vectors * vbytes % 64 == 0, b_lines = b.vectors * vbytes % 64 == 0;
    if (a_lines != b_lines) return a_lines;
    return a.rows + a.vectors < b.rows + b.vectors ||  // 1/r + 1/v = (r + v) / rv at equal rv
           (a.rows + a.vectors == b.rows + b.vectors && a.rows > b.rows);
  };
  GroupedTile best;
  for (int v = 1; v <= 4; ++v)
    for (int r = 1; r <= 8; ++r)
      if (r * v + v + 1 <= regs && (best.rows == 0 || better({r, v}, best))) best = {r, v};
  return best;
}

bool is_grouped_product_spec(const std::string& spec) {
  return spec.rfind(std::string(kGroupedProductSpec) + " ", 0) == 0;
}

std::string grouped_product_source(const std::string& spec, const VectorShape& machine) {
  const std::string prefix = std::string(kGroupedProductSpec) + " ";
  SCORCH_CHECK(spec == prefix + "f32" || spec == prefix + "f64",
               "bad grouped product spec '{}': use '{}f32' or '{}f64'", spec, prefix, prefix);
  const bool f64 = spec == prefix + "f64";
  const GroupedTile t = grouped_tile(machine);
  std::string src = "#include <cstdint>\n// Generated by Scorch. Kernel spec:\n//   " + spec + "\n";
  src += fmt::format("typedef {} val_t;\n#define SCORCH_VECTOR_BYTES {}\n", f64 ? "double" : "float",
                     machine.vector_bytes);
  src += std::string(kKernelAbiSource) + "\n";
  src += fmt::format("constexpr int kMR = {}, kNV = {};  // the register tile\n", t.rows, t.vectors);
  src += kHead;
  src += kBody;
  src += "\nextern \"C\" void scorch_kernel_free(void* p) { (void)p; }\n";
  return src;
}

}  // namespace scorch
