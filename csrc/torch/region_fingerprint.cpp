// The fingerprint of a cached region operand, and the whole-tensor reads beside it (region_fingerprint.h).
#include "region_fingerprint.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace scorch::torch_glue {
namespace {

constexpr int64_t kFingerprint = 32;  // entries spread over a tensor (and a nonzero after each)

// The fingerprint: kFingerprint elements spread evenly over the tensor, and after each the first nonzero within
// kSeek elements, as raw bytes (NaN-safe), read at element offsets fixed when the entry is made. The nonzeros
// matter for pruned weights: a fused optimizer step (torch's fused Adam, AdamW, SGD) writes the parameter
// without moving its version counter, and in a masked fine-tune it changes only the stored values, while the
// spread entries of a 99%-zero weight are mostly zeros that never change.
constexpr int64_t kSeek = 4096;

// The element offset (in units of the element, from data_ptr) of flat index `flat` in row-major order.
int64_t offset_of(int64_t flat, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  int64_t offset = 0;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    offset += (flat % sizes[d]) * strides[d];
    flat /= sizes[d];
  }
  return offset;
}

}  // namespace

std::vector<int64_t> fingerprint_offsets(const at::Tensor& t, bool seek) {
  std::vector<int64_t> out;
  const int64_t n = t.numel();
  if (n == 0) return out;
  const int64_t k = std::min(kFingerprint, n);
  const size_t elem = t.element_size();
  const auto* base = static_cast<const uint8_t*>(t.data_ptr());
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  const bool contiguous = t.is_contiguous();
  // (-0.0 is a zero: a pruned weight's zeros are often x * 0 of negative x. Little-endian: the sign bit is the
  // last byte's top bit.)
  const uint8_t last_mask = at::isFloatingType(t.scalar_type()) ? 0x7f : 0xff;
  auto nonzero = [&](int64_t offset) {
    const uint8_t* p = base + offset * static_cast<int64_t>(elem);
    return (p[elem - 1] & last_mask) != 0 || std::any_of(p, p + elem - 1, [](uint8_t b) { return b != 0; });
  };
  for (int64_t i = 0; i < k; ++i) {
    const int64_t flat = i * (n - 1) / std::max<int64_t>(k - 1, 1);
    const int64_t offset = offset_of(flat, sizes, strides);
    out.push_back(offset);
    if (!seek || nonzero(offset)) continue;  // (the spread entry is itself a nonzero)
    const int64_t end = std::min({n, flat + kSeek, i + 1 < k ? (i + 1) * (n - 1) / (k - 1) : n});
    for (int64_t f = flat + 1; f < end; ++f) {
      const int64_t o = contiguous ? f : offset_of(f, sizes, strides);
      if (nonzero(o)) {
        out.push_back(o);
        break;
      }
    }
  }
  return out;
}

std::vector<uint8_t> read_fingerprint(const at::Tensor& t, const std::vector<int64_t>& offsets) {
  const size_t elem = t.element_size();
  const auto* base = static_cast<const uint8_t*>(t.data_ptr());
  std::vector<uint8_t> out(offsets.size() * elem);
  for (size_t i = 0; i < offsets.size(); ++i)
    std::memcpy(&out[i * elem], base + offsets[i] * static_cast<int64_t>(elem), elem);
  return out;
}


namespace {

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix(uint64_t h, uint64_t w) {
  h = (h ^ w) * kMul;
  return h ^ (h >> 29);
}

}  // namespace

uint64_t content_hash(const at::Tensor& t, HashIsa isa) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = c.numel() * c.element_size();
  constexpr size_t kChunk = size_t(1) << 18;  // 256 KB a chunk
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  if (chunks <= 1) return byte_hash(p, n, kMul, isa);
  std::vector<uint64_t> part(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const size_t at = static_cast<size_t>(k) * kChunk;
      part[k] = byte_hash(p + at, std::min(kChunk, n - at), static_cast<uint64_t>(k) + 1, isa);
    }
  });
  uint64_t h = kMul;
  for (uint64_t x : part) h = mix(h, x);
  return mix(h, n);
}

namespace {

// Whether n values hold an exponent with all bits set (an inf or a NaN). On x86-64 built for AVX2 and the
// baseline, the loader picking one by the CPU: the torch glue is compiled for the baseline, where this loop ran at a fraction
// of the bandwidth (it runs on every call for an activation).
#if defined(__x86_64__) && defined(__GNUC__)
#define SCORCH_SCAN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SCORCH_SCAN_CLONES  // other architectures: the compiler's baseline for them
#endif
SCORCH_SCAN_CLONES bool any_non_finite32(const uint32_t* p, int64_t n) {
  uint32_t b = 0;
  for (int64_t i = 0; i < n; ++i) b |= (p[i] & 0x7f800000u) == 0x7f800000u ? 0xffffffffu : 0u;
  return b != 0;
}

SCORCH_SCAN_CLONES bool any_non_finite64(const uint64_t* p, int64_t n) {
  uint64_t b = 0;
  for (int64_t i = 0; i < n; ++i) b |= (p[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull ? ~0ull : 0ull;
  return b != 0;
}

}  // namespace

// Whether t holds only finite values (split across torch's threads past 64K values: an activation is scanned at
// every call, and a megabyte of it takes a few microseconds per thread).
bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const at::Tensor c = t.detach();
  // Any permutation of a dense layout (a region's result comes back transposed) covers numel() elements from
  // data_ptr() on: scanned as they lie. ATen's isfinite costs tens of microseconds per call on such a view.
  const bool dense = c.is_contiguous() || c.is_non_overlapping_and_dense();
  if (dense && (c.scalar_type() == at::kFloat || c.scalar_type() == at::kDouble)) {
    const bool f32 = c.scalar_type() == at::kFloat;
    const void* base = c.data_ptr();
    std::atomic<bool> bad{false};
    at::parallel_for(0, c.numel(), int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
      const bool b = f32 ? any_non_finite32(static_cast<const uint32_t*>(base) + lo, hi - lo)
                         : any_non_finite64(static_cast<const uint64_t*>(base) + lo, hi - lo);
      if (b) bad.store(true, std::memory_order_relaxed);
    });
    return !bad.load();
  }
  return !c.is_floating_point() || at::isfinite(c).all().item<bool>();
}

}  // namespace scorch::torch_glue
