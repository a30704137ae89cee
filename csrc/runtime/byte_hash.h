// A fast 64-bit hash of a byte range, for checks that must read every byte on a hot path: whether a cached
// operand's data changed behind its version counter (the region op's data inputs, torch.sparse members).
// Not for security (no chosen-collision resistance) and not stored anywhere: the value may change between
// versions of Scorch, never between runs of one build or between the instruction sets below (which give
// bit-identical results, tested).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace scorch {

// Which implementation computes the hash. `best` is the widest this CPU runs (chosen once per process).
enum class HashIsa { best, portable, avx2, avx512 };

uint64_t byte_hash(const void* data, size_t n, uint64_t seed, HashIsa isa = HashIsa::best);

// The implementations this CPU can run, by name ("portable", "avx2", "avx512"), and the one `best` picks.
std::vector<std::string> byte_hash_isas();
std::string byte_hash_best();
HashIsa byte_hash_isa_named(const std::string& name);  // throws scorch::Error on an unknown or unrunnable name

}  // namespace scorch
