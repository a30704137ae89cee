// The fingerprint of a cached region operand (region_fingerprint.h).
#include "region_fingerprint.h"

#include <algorithm>
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


}  // namespace scorch::torch_glue
