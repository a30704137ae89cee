// runtime/byte_hash: every implementation this CPU runs gives the same value, and the changes a cache check
// must see (one bit anywhere, two stripes or blocks swapped, zeros appended) change it.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/error.h"
#include "runtime/byte_hash.h"

namespace scorch {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<unsigned char> b(n);
  for (auto& c : b) c = static_cast<unsigned char>(g());
  return b;
}

std::vector<HashIsa> isas() {
  std::vector<HashIsa> out;
  for (const auto& name : byte_hash_isas()) out.push_back(byte_hash_isa_named(name));
  return out;
}

TEST(ByteHash, EveryImplementationGivesTheSameValue) {
  ASSERT_FALSE(byte_hash_isas().empty());
  EXPECT_EQ(byte_hash_isas().front(), "portable");
  const auto bytes = random_bytes(40000, 1);
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 2200; n += 7) lengths.push_back(n);
  for (size_t k : {1, 2, 3, 16, 31}) {
    for (size_t d : {0, 1, 8, 9, 1023}) lengths.push_back(k * 1024 + d);
  }
  for (size_t n : lengths)
    for (size_t offset : {0, 1, 3, 8}) {  // unaligned starts too
      const uint64_t want = byte_hash(bytes.data() + offset, n, 7, HashIsa::portable);
      for (HashIsa isa : isas()) EXPECT_EQ(byte_hash(bytes.data() + offset, n, 7, isa), want) << n << " " << offset;
      EXPECT_EQ(byte_hash(bytes.data() + offset, n, 7), want);
    }
}

TEST(ByteHash, EverySingleBitFlipIsSeen) {
  const size_t n = 5 * 1024 + 37;  // whole blocks and a tail
  auto bytes = random_bytes(n, 2);
  for (HashIsa isa : isas()) {
    const uint64_t h = byte_hash(bytes.data(), n, 0, isa);
    for (size_t i = 0; i < n; i += (i < 2048 ? 1 : 13))
      for (int bit : {0, 5, 7}) {
        bytes[i] ^= static_cast<unsigned char>(1u << bit);
        EXPECT_NE(byte_hash(bytes.data(), n, 0, isa), h) << "byte " << i << " bit " << bit;
        bytes[i] ^= static_cast<unsigned char>(1u << bit);
      }
  }
}

TEST(ByteHash, MovedDataIsSeen) {
  // A refilled buffer often holds the same values at other places: rows of a batch in another order.
  const size_t n = 8 * 1024 + 24;
  const auto bytes = random_bytes(n, 3);
  for (HashIsa isa : isas()) {
    const uint64_t h = byte_hash(bytes.data(), n, 0, isa);
    auto swapped = [&](size_t a, size_t b, size_t len) {
      auto c = bytes;
      std::swap_ranges(c.begin() + a, c.begin() + a + len, c.begin() + b);
      return byte_hash(c.data(), n, 0, isa);
    };
    EXPECT_NE(swapped(0, 64, 64), h);        // two stripes of a block
    EXPECT_NE(swapped(0, 8, 8), h);          // two words of a stripe
    EXPECT_NE(swapped(0, 1024, 1024), h);    // two blocks
    EXPECT_NE(swapped(64, 2048 + 64, 64), h);  // the same stripe of two blocks
    EXPECT_NE(swapped(8 * 1024, 8 * 1024 + 8, 8), h);  // two words of the tail
  }
  // Zeros moved within a mostly-zero buffer (a bag of words refilled with another request's counts).
  std::vector<unsigned char> a(4096, 0), b(4096, 0);
  a[100] = 1;
  b[1124] = 1;  // the same place in the next block
  EXPECT_NE(byte_hash(a.data(), a.size(), 0), byte_hash(b.data(), b.size(), 0));
}

TEST(ByteHash, LengthAndSeedCount) {
  const std::vector<unsigned char> zeros(3000, 0);
  std::vector<uint64_t> seen;
  for (size_t n : {0, 1, 8, 1024, 1025, 2048, 3000}) seen.push_back(byte_hash(zeros.data(), n, 0));
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::unique(seen.begin(), seen.end()), seen.end());
  EXPECT_NE(byte_hash(zeros.data(), 2048, 0), byte_hash(zeros.data(), 2048, 1));
}

TEST(ByteHash, NamesAreChecked) {
  EXPECT_EQ(byte_hash_isa_named(""), HashIsa::best);
  EXPECT_EQ(byte_hash_isa_named("portable"), HashIsa::portable);
  EXPECT_THROW(byte_hash_isa_named("sse9"), Error);
  EXPECT_EQ(byte_hash_isas().back(), byte_hash_best());
}

}  // namespace
}  // namespace scorch
