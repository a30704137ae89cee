// Packing coordinates into a format's level buffers, validating buffers, and unpacking them back into
// coordinates. Values never pass through here: pack reports where each input value lands so the caller can
// scatter-add values of any dtype (which also sums duplicates), and unpack gives the coordinates of each
// stored value position.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "format/format.h"

namespace scorch {

struct Packed {
  std::vector<std::vector<int64_t>> buffers;  // flattened over levels, in Format::buffer_names() order
  std::vector<int64_t> value_pos;              // for each input coordinate tuple, its value position
  int64_t value_count = 0;                     // number of stored values (positions of the last level)
};

// `coords` is row-major [ndim][nnz]: coords[d * nnz + k] is coordinate d of nonzero k. Tuples may come in
// any order and repeat; repeats map to the same value position. Raises IndexError for a coordinate out of
// range.
Packed pack(const Format& format, std::span<const int64_t> shape, std::span<const int64_t> coords, int64_t nnz);

// Bytes of memory this process may use: physical memory, or its cgroup's limit when lower (v2 memory.max,
// v1 memory.limit_in_bytes; a container's limit). pack() refuses up front formats whose leading dense levels
// alone would exceed it. The paths are parameters for tests; 0 when nothing can be read.
long double memory_limit_bytes(const std::string& proc_cgroup = "/proc/self/cgroup",
                               const std::string& root = "/sys/fs/cgroup");

// Check buffers (flattened over levels) against the format and shape: lengths, pos monotonic, coordinates in
// range, sorted/unique where promised, and `value_count` equal to the number of stored positions.
void validate(const Format& format, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
              int64_t value_count);

// The number of stored values the buffers describe (the positions of the last level), from the length checks
// of validate.
int64_t stored_positions(const Format& format, std::span<const int64_t> shape, std::span<const IndexSpan> buffers);

// How error messages name level k of a format ("level 1 (compressed of dimension 1)").
std::string level_name(const Format& format, size_t k);

// Only the length checks of validate (O(levels) for the built-in kinds).
void check_lengths(const Format& format, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                   int64_t value_count);

// Coordinates of every stored value position, row-major [ndim][value_count]. Buffers must be valid.
std::vector<int64_t> unpack(const Format& format, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                            int64_t value_count);
// The same written into `out` (ndim * value_count elements, all overwritten): a caller's tensor, not a copy.
void unpack_into(const Format& format, std::span<const int64_t> shape, std::span<const IndexSpan> buffers,
                 int64_t value_count, std::span<int64_t> out);

// Each stored value position's offset in the row-major dense tensor of `shape`, [value_count]: what to_dense
// scatters into. Each level's offsets come from its parent's, so only the levels above the last hold arrays
// of their own (unpack's coordinates and parents for every level, then a coordinate per dimension, touched a
// gigabyte for a 4096^2 CSR at 90%: 430 ms, mostly page faults). The buffers are checked as unpack checks them.
std::vector<int64_t> dense_offsets(const Format& format, std::span<const int64_t> shape,
                                   std::span<const IndexSpan> buffers, int64_t value_count);

}  // namespace scorch
