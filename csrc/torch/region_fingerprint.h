// The fingerprint that catches writes behind a tensor's version counter (a fused optimizer step), for the
// region op's cache of compressed operands (region.cpp): where to read it, and the bytes there.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "runtime/byte_hash.h"

namespace scorch::torch_glue {

// Element offsets (from data_ptr, any strides) of 32 elements spread evenly over t, and, with `seek`, after
// each one that is zero the first nonzero within the next 4096 elements (-0.0 counts as zero).
std::vector<int64_t> fingerprint_offsets(const at::Tensor& t, bool seek = true);

// The raw bytes of t's elements at `offsets` (NaN-safe: compared as bytes).
std::vector<uint8_t> read_fingerprint(const at::Tensor& t, const std::vector<int64_t>& offsets);

// A hash of every byte of t's elements (in row-major order, any strides): for caches that cannot trust the
// version counter at all, such as a torch.sparse tensor built from tensors the caller goes on writing (its
// members' counters are not theirs). Chunks hashed in parallel and combined in order: the same bytes give the
// same hash at any thread count. Reads t once at about the speed the caches deliver it (runtime/byte_hash.h; a
// non-contiguous t is copied first). `isa` picks the implementation (tests compare them).
uint64_t content_hash(const at::Tensor& t, HashIsa isa = HashIsa::best);

// Whether t holds only finite values (float and double scanned in place, split across torch's threads past
// 64K values; other dtypes through ATen): a region's check before it skips zeros eager would multiply.
bool all_finite(const at::Tensor& t);

}  // namespace scorch::torch_glue
