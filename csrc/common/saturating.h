// Counts that saturate instead of wrapping: element counts of shapes that exist only sparsely (a 2^40 x 2^40
// matrix of three entries) overflow int64 when multiplied or summed, and a wrapped count reads as a tiny
// problem (helper-60: a 3-entry product was sent to the dense path, which tried to allocate 2^62 elements).
// For counts that are never negative; a result past INT64_MAX is INT64_MAX.
#pragma once

#include <cstdint>
#include <limits>

namespace scorch {

inline int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}

inline int64_t saturating_add(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}

}  // namespace scorch
