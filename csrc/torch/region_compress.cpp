#include "region_compress.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>

#include <ATen/core/dispatch/Dispatcher.h>

#include "convert.h"
#include "region_kernels.h"
#include "runtime/settings.h"

namespace scorch::torch_glue {
namespace {

// Rows of a contiguous float or double tensor of rank >= 2 (the last dimension is a row) handed to `f(begin,
// end)` in parallel, each chunk at least SCORCH_THREAD_GRAIN elements; false when the tensor is not such.
template <typename F>
bool over_rows(const at::Tensor& t, F&& f) {
  if (t.dim() < 2 || !t.is_contiguous() || t.numel() == 0 || t.size(-1) == 0 ||
      (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble))
    return false;
  const int64_t cols = t.size(-1), rows = t.numel() / cols;
  at::parallel_for(0, rows, std::max<int64_t>(1, thread_grain() / cols), f);
  return true;
}

// Whether x is kept: any nonzero, or under a ReLU anything not <= 0 (a positive value or a NaN).
template <typename T>
inline bool kept(T x, bool relu) {
  return relu ? !(x <= T(0)) : x != T(0);
}

constexpr int64_t kWord = 32;  // entries tested at a time by kept_bits

// Bit b set when x[b] is kept (b < n <= kWord). A whole word goes through 16-byte vectors of the compiler's
// generic vector type (every target has them): a compare per vector, its lanes masked to their bits and
// or-ed together; a partial word, and compilers without the extension, one entry at a time.
template <typename T>
inline uint32_t kept_bits_scalar(const T* x, int64_t n, bool relu) {
  uint32_t bits = 0;
  for (int64_t b = 0; b < n; ++b) bits |= static_cast<uint32_t>(kept(x[b], relu)) << b;
  return bits;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
template <typename T>
inline uint32_t kept_bits(const T* x, int64_t n, bool relu) {
  if (n < kWord) return kept_bits_scalar(x, n, relu);
  using I = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int kLanes = static_cast<int>(16 / sizeof(T));
  typedef T vt __attribute__((vector_size(16)));
  typedef I vi __attribute__((vector_size(16)));
  vi lane_bit;  // lane l of the vector at offset g * kLanes stands for bit g * kLanes + l
  for (int l = 0; l < kLanes; ++l) lane_bit[l] = I{1} << l;
  const vt zero = {};
  vi acc = {};
  for (int g = 0; g < kWord / kLanes; ++g) {
    vt y;
    std::memcpy(&y, x + g * kLanes, sizeof(vt));
    const vi k = relu ? ~(vi)(y <= zero) : (vi)(y != zero);  // all ones where kept (NaN: not <= 0, and != 0)
    acc |= k & (lane_bit << static_cast<I>(g * kLanes));
  }
  uint32_t bits = 0;
  for (int l = 0; l < kLanes; ++l) bits |= static_cast<uint32_t>(acc[l]);
  return bits;
}
#else
template <typename T>
inline uint32_t kept_bits(const T* x, int64_t n, bool relu) {
  return kept_bits_scalar(x, n, relu);
}
#endif

}  // namespace

// Activations are measured on every call: count_nonzero is a generic reduction, this is one pass. With
// `row_counts`, each row's count is kept too (when the tensor is rows of a contiguous float or double one).
double density_of(const at::Tensor& t, at::Tensor* row_counts, bool relu) {
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  std::atomic<int64_t> count{0};
  const bool floating = single_or_double(t);
  const bool rows_ok = floating && t.dim() >= 2 && t.is_contiguous() && t.size(-1) > 0 &&
                       n < std::numeric_limits<int32_t>::max();
  int32_t* per_row = nullptr;
  if (row_counts && rows_ok) {
    *row_counts = at::empty({n / t.size(-1)}, at::kInt);
    per_row = row_counts->data_ptr<int32_t>();
  }
  const bool done = floating && AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "region_density", [&] {
    const scalar_t* x = t.data_ptr<scalar_t>();
    const int64_t cols = t.dim() ? t.size(-1) : 1;
    return over_rows(t, [&](int64_t b, int64_t e) {
      int64_t c = 0;
      for (int64_t r = b; r < e; ++r) {
        int32_t in_row = 0;
        if (relu) {
          for (int64_t j = 0; j < cols; ++j) in_row += kept(x[r * cols + j], true);
        } else {
          for (int64_t j = 0; j < cols; ++j) in_row += x[r * cols + j] != scalar_t(0);
        }
        if (per_row) per_row[r] = in_row;
        c += in_row;
      }
      count += c;
    });
  });
  if (!done && row_counts) *row_counts = at::Tensor();
  if (!done) {
    const at::Tensor counted = relu ? (t > 0).logical_or(t.isnan()) : t;
    return static_cast<double>(at::count_nonzero(counted).item<int64_t>()) / static_cast<double>(n);
  }
  return static_cast<double>(count.load()) / static_cast<double>(n);
}

// CSR of a contiguous float or double tensor of rank >= 2 (the leading dimensions are the dense outer levels,
// flattened into rows), built in two passes over its rows: count each row's nonzeros, then write them. The
// buffers scorch::pack makes (positions, coordinates; int32), without its sort of coordinates, which a
// dense source gives in order anyway. An activation is compressed on every call: this is that cost.
std::optional<Operand> compress_rows(const at::Tensor& src, const FormatRef& f, const at::Tensor& counts, bool relu) {
  if (src.dim() < 2 || src.numel() >= std::numeric_limits<int32_t>::max() || !src.is_contiguous() ||
      (src.scalar_type() != at::kFloat && src.scalar_type() != at::kDouble))
    return std::nullopt;
  const int64_t cols = src.size(-1), rows = cols ? src.numel() / cols : 0;
  std::atomic<bool> short_row{false};
  at::Tensor pos = at::empty({rows + 1}, at::kInt), crd, values;
  int32_t* p = pos.data_ptr<int32_t>();
  p[0] = 0;
  const bool done = AT_DISPATCH_FLOATING_TYPES(src.scalar_type(), "region_compress", [&] {
    const scalar_t* x = src.data_ptr<scalar_t>();
    if (counts.defined() && counts.numel() == rows) {  // counted with the density: no first pass
      const int32_t* n = counts.data_ptr<int32_t>();
      for (int64_t r = 0; r < rows; ++r) p[r + 1] = n[r];
    } else if (!over_rows(src, [&](int64_t b, int64_t e) {
          for (int64_t r = b; r < e; ++r) {
            int32_t c = 0;
            for (int64_t j = 0; j < cols; ++j) c += kept(x[r * cols + j], relu);
            p[r + 1] = c;
          }
        }))
      return false;
    for (int64_t r = 0; r < rows; ++r) p[r + 1] += p[r];
    crd = at::empty({p[rows]}, at::kInt);
    values = at::empty({p[rows]}, src.options());
    int32_t* c = crd.data_ptr<int32_t>();
    scalar_t* v = values.data_ptr<scalar_t>();
    // By words of kept-bits: each run of 32 entries is tested without a branch per entry (kept_bits), and
    // only its set bits are written, the lowest first. An activation's zeros are scattered at random, so a
    // branch on each entry would be mispredicted about as often as it is taken; writing every entry at the
    // row's next free slot (the form this replaces) stores twice per entry, kept or not.
    over_rows(src, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        int64_t w = p[r];
        const int64_t end = p[r + 1];  // (never passed: the counts are of the same entries, or written since)
        const scalar_t* row = x + r * cols;
        for (int64_t j0 = 0; j0 < cols && w < end; j0 += kWord) {
          const int64_t n = std::min<int64_t>(kWord, cols - j0);
          for (uint32_t bits = kept_bits(row + j0, n, relu); bits && w < end; bits &= bits - 1) {
            const int64_t j = j0 + __builtin_ctz(bits);
            c[w] = static_cast<int32_t>(j);
            v[w++] = row[j];  // under a ReLU a kept entry is relu(y) = y
          }
        }
        if (w < end) short_row.store(true, std::memory_order_relaxed);
      }
    });
    return true;
  });
  if (!done) return std::nullopt;
  // A row holding fewer entries than it was counted with was written meanwhile (another thread pruning a
  // weight in place while a call compresses it): the rest of its slots would hold whatever the allocation
  // held (helper-46: coordinates like -1076831901, or NaN results). Compressed again from a snapshot, counted
  // and filled from the same values: the old weight's entries, the new one's, or a mix, as a dense product
  // racing with the write would read.
  if (short_row.load()) return compress_rows(src.clone(), f, {}, relu);
  return Operand{&f, src.sizes().vec(), {pos, crd}, values};
}

Operand compress(const at::Tensor& src_in, const at::Tensor& counts, bool relu) {
  static const auto pack = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::pack", "").typed<
      std::tuple<std::vector<at::Tensor>, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::IntArrayRef,
                                                      c10::string_view, at::ScalarType)>();
  const int nd = static_cast<int>(src_in.dim());
  const FormatRef& f = region_compressed_format(nd);
  if (nd >= 2)
    if (auto fast = compress_rows(src_in, f, counts, relu)) return *fast;
  const at::Tensor src = relu ? at::relu(src_in) : src_in;  // the other paths compress the ReLU's output
  if (nd == 0) return Operand{&f, {}, {}, src.reshape({1}).clone()};
  const at::Tensor idx = src.nonzero().t().contiguous();
  c10::List<std::optional<at::Tensor>> index;
  for (int d = 0; d < nd; ++d) index.push_back(idx[d]);
  const at::Tensor values = at::index(src, index);
  auto [buffers, packed] = pack.call(idx, values, src.sizes(), f.text, at::kInt);
  return Operand{&f, src.sizes().vec(), std::move(buffers), packed};
}

namespace {

// One 8x8 tile of the transpose below, through a local array the compiler keeps in registers: eight short
// runs read, eight written, instead of 64 single elements at a large stride.
template <typename T>
inline void transpose_tile(const T* __restrict src, T* __restrict dst, int64_t rows, int64_t cols, int64_t i0,
                           int64_t j0) {
  constexpr int kTile = 8;
  T t[kTile][kTile];
  for (int j = 0; j < kTile; ++j)
    for (int i = 0; i < kTile; ++i) t[i][j] = src[(j0 + j) * rows + i0 + i];
  for (int i = 0; i < kTile; ++i)
    for (int j = 0; j < kTile; ++j) dst[(i0 + i) * cols + j0 + j] = t[i][j];
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
// Floats: each 4x4 quarter of the tile by shuffles of four-lane vectors (the compiler's generic vector type:
// 16 bytes, which every target has), four loads and four stores instead of 16 of each.
template <>
inline void transpose_tile<float>(const float* __restrict src, float* __restrict dst, int64_t rows, int64_t cols,
                                  int64_t i0, int64_t j0) {
  typedef float v4 __attribute__((vector_size(16)));
  for (int qi = 0; qi < 8; qi += 4)
    for (int qj = 0; qj < 8; qj += 4) {
      v4 a, b, c, d;
      std::memcpy(&a, src + (j0 + qj + 0) * rows + i0 + qi, sizeof(v4));
      std::memcpy(&b, src + (j0 + qj + 1) * rows + i0 + qi, sizeof(v4));
      std::memcpy(&c, src + (j0 + qj + 2) * rows + i0 + qi, sizeof(v4));
      std::memcpy(&d, src + (j0 + qj + 3) * rows + i0 + qi, sizeof(v4));
      const v4 ab0 = __builtin_shufflevector(a, b, 0, 4, 1, 5), ab1 = __builtin_shufflevector(a, b, 2, 6, 3, 7);
      const v4 cd0 = __builtin_shufflevector(c, d, 0, 4, 1, 5), cd1 = __builtin_shufflevector(c, d, 2, 6, 3, 7);
      const v4 r[4] = {__builtin_shufflevector(ab0, cd0, 0, 1, 4, 5), __builtin_shufflevector(ab0, cd0, 2, 3, 6, 7),
                       __builtin_shufflevector(ab1, cd1, 0, 1, 4, 5), __builtin_shufflevector(ab1, cd1, 2, 3, 6, 7)};
      for (int k = 0; k < 4; ++k) std::memcpy(dst + (i0 + qi + k) * cols + j0 + qj, &r[k], sizeof(v4));
    }
}
#endif

// dst (rows x cols, row-major) = the transpose of src (cols x rows, row-major): 64x64 blocks shared among the
// threads (a block's source lines stay cached while it is written), each by 8x8 tiles, the edges one by one.
// Measured on 512x2048 floats, one thread: 0.57 ms by 8x8 scalar tiles (0.42-0.50 ms with the vector tiles),
// against 1.1-1.5 ms element by element in blocks and torch's strided copy.
template <typename T>
void transpose_blocks(const T* src, T* dst, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 64, kTile = 8;
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, thread_grain() / (kBlock * kBlock));
  at::parallel_for(0, row_blocks * col_blocks, grain, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t bi = (blk / col_blocks) * kBlock, bj = (blk % col_blocks) * kBlock;
      const int64_t ei = std::min(rows, bi + kBlock), ej = std::min(cols, bj + kBlock);
      int64_t i = bi;
      for (; i + kTile <= ei; i += kTile) {
        int64_t j = bj;
        for (; j + kTile <= ej; j += kTile) transpose_tile(src, dst, rows, cols, i, j);
        for (int64_t r = i; r < i + kTile; ++r)
          for (int64_t c = j; c < ej; ++c) dst[r * cols + c] = src[c * rows + r];
      }
      for (; i < ei; ++i)
        for (int64_t c = bj; c < ej; ++c) dst[i * cols + c] = src[c * rows + i];
    }
  });
}

}  // namespace

at::Tensor row_major(const at::Tensor& t) {
  if (t.dim() != 2 || t.is_contiguous() || t.stride(0) != 1 || t.stride(1) != t.size(0) ||
      (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble))
    return t.contiguous();
  RECORD_FUNCTION("scorch::row_major", std::vector<c10::IValue>());
  at::Tensor out = at::empty(t.sizes(), t.options());
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "region_row_major", [&] {
    transpose_blocks(t.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), t.size(0), t.size(1));
  });
  return out;
}

}  // namespace scorch::torch_glue
