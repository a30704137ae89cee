// A stable content hash for cache keys and content checks (not for security against a chosen collision:
// the cache directory is the user's own).
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace scorch {

// 128-bit FNV-1a (two 64-bit lanes with different offsets), as 32 hex digits.
inline std::string content_hash(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h1 = 1469598103934665603ULL, h2 = 7809847782465536322ULL;
  for (size_t i = 0; i < n; ++i) {
    h1 = (h1 ^ p[i]) * 1099511628211ULL;
    h2 = (h2 ^ p[i]) * 1099511628211ULL + 0x9e3779b97f4a7c15ULL;
  }
  return fmt::format("{:016x}{:016x}", h1, h2);
}

inline std::string content_hash(const std::string& data) { return content_hash(data.data(), data.size()); }

}  // namespace scorch
