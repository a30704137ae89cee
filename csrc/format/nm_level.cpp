// n:m level (structured sparsity): the level's coordinates come in groups of m consecutive ones and each group
// stores exactly n of them (a last, shorter group of r < m coordinates stores min(n, r)). A group with fewer
// nonzeros is padded with stored zeros at its lowest free coordinates, so every parent owns the same number
// of positions, S = n * (size / m) + min(n, size % m), and position p * S + g * n + j is the j-th stored
// coordinate of group g under parent p: no positions buffer is needed.
//
// Which coordinates a group stores is an m-bit field of a buffer named "mask" (bit c set: coordinate g*m + c
// stored), floor(32 / m) fields to a 32-bit word, each parent's words contiguous (mask_words in level.h).
// Why a mask and not one small index per stored value: it costs m bits per group instead of n index entries
// (2:4: 4 bits per two float values where int32 indices would double the bytes of the values, and index
// buffers here are int32 or int64), it cannot hold repeated or unsorted coordinates, and a kernel decodes it
// with bit operations (count trailing zeros, clear lowest bit) instead of a load per value. Written in
// format text as nm[n:m], e.g. "dense(0),nm[2:4](1)".
#include <bit>

#include "common/error.h"
#include "format/level.h"

namespace scorch {
namespace {

class NmLevel final : public LevelKind {
 public:
  NmLevel(LevelProperties props, int n, int m) : LevelKind(props), n_(n), m_(m) {}
  std::string name() const override { return fmt::format("nm[{}:{}]", n_, m_); }
  std::vector<std::string> buffer_names() const override { return {"mask"}; }
  bool supports(LevelProperties props) const override { return props.ordered && props.unique; }
  std::pair<int, int> structured_groups() const override { return {n_, m_}; }

  // Stored coordinates of group g (how many) for a level of extent `size`.
  int64_t slots(int64_t g, int64_t size) const {
    const int64_t len = std::min<int64_t>(m_, size - g * m_);
    return std::min<int64_t>(n_, len);
  }
  int64_t per_parent(int64_t size) const { return n_ * (size / m_) + std::min<int64_t>(n_, size % m_); }
  int64_t groups(int64_t size) const { return (size + m_ - 1) / m_; }
  int64_t words(int64_t size) const { return mask_words(groups(size), m_); }
  int64_t fixed_entries_per_parent(int64_t size) const override { return words(size) + per_parent(size); }
  uint32_t field(std::span<const IndexSpan> b, int64_t parent, int64_t g, int64_t size) const {
    const int64_t per = 32 / m_;
    const uint32_t w = static_cast<uint32_t>(b[0][parent * words(size) + g / per]);
    return (w >> ((g % per) * m_)) & static_cast<uint32_t>((uint64_t{1} << m_) - 1);
  }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t size,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    const int64_t S = per_parent(size), G = groups(size), W = words(size), per = 32 / m_;
    std::vector<uint32_t> mask(static_cast<size_t>(np * W), 0);
    std::vector<int64_t> children(static_cast<size_t>(np * S + 1));
    for (int64_t p = 0; p < np; ++p) {
      int64_t t = parents[p];
      const int64_t end = parents[p + 1];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t lo = g * m_, hi = std::min<int64_t>(size, lo + m_);
        // The group's coordinates (a level above others repeats a coordinate once per tuple below it).
        uint32_t bits = 0;
        for (int64_t u = t; u < end && coords[u] < hi; ++u) bits |= uint32_t{1} << (coords[u] - lo);
        int64_t count = std::popcount(bits);
        SCORCH_CHECK(count <= slots(g, size),
                     "not {}:{} sparse: coordinates {}..{} under parent position {} hold {} nonzeros; a {}:{} level "
                     "stores at most {} of every {}",
                     n_, m_, lo, hi - 1, p, count, n_, m_, n_, m_);
        // Padding: the lowest free coordinates, stored as zeros.
        for (int64_t c = 0; count < slots(g, size); ++c)
          if (!(bits >> c & 1)) bits |= uint32_t{1} << c, ++count;
        mask[p * W + g / per] |= bits << ((g % per) * m_);
        int64_t q = p * S + g * n_;
        for (uint32_t rest = bits; rest; rest &= rest - 1, ++q) {
          children[q] = t;
          while (t < end && coords[t] == lo + std::countr_zero(rest)) ++t;
        }
      }
      SCORCH_ASSERT(t == end, "n:m level got unsorted or out-of-range coordinates");
    }
    children[np * S] = parents[np];
    // Words as signed 32-bit values: the same entries in int32 and int64 buffers.
    out[0].assign(mask.begin(), mask.end());
    for (auto& w : out[0]) w = static_cast<int32_t>(static_cast<uint32_t>(w));
    return children;
  }

  int64_t validate(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                   const std::string& where) const override {
    const int64_t positions = check_lengths(b, parent_count, size, where);
    const int64_t G = groups(size), W = words(size), per = 32 / m_;
    for (int64_t k = 0; k < b[0].size; ++k) {
      const int64_t v = b[0][k];
      SCORCH_CHECK(v >= INT32_MIN && v <= int64_t{UINT32_MAX}, "{}: mask[{}]={} does not fit in 32 bits", where, k, v);
    }
    // Bits above the last whole field of a word (32 is not a multiple of m) must be zero.
    if (per * m_ < 32)
      for (int64_t k = 0; k < b[0].size; ++k)
        SCORCH_CHECK((static_cast<uint32_t>(b[0][k]) >> (per * m_)) == 0,
                     "{}: mask word {} has bits set past the last group (bits {} and up are unused)", where, k, per * m_);
    for (int64_t p = 0; p < parent_count; ++p) {
      for (int64_t g = 0; g < G; ++g) {
        const uint32_t f = field(b, p, g, size);
        const int64_t len = std::min<int64_t>(m_, size - g * m_);
        SCORCH_CHECK(len == 32 || (f >> len) == 0,
                     "{}: the mask of group {} under parent position {} marks coordinates past the end ({} of {})",
                     where, g, p, g * m_ + (31 - std::countl_zero(f)), size);
        SCORCH_CHECK(std::popcount(f) == slots(g, size),
                     "{}: the mask of group {} under parent position {} marks {} coordinates; an {}:{} level stores "
                     "exactly {} per group (padding with zeros)",
                     where, g, p, std::popcount(f), n_, m_, slots(g, size));
      }
      // Fields of the last word past the last group must be zero.
      if (W > 0 && G % per != 0) {
        const uint32_t w = static_cast<uint32_t>(b[0][p * W + W - 1]);
        SCORCH_CHECK((w >> ((G % per) * m_)) == 0, "{}: mask word {} has bits set past the last group", where,
                     p * W + W - 1);
      }
    }
    return positions;
  }

  int64_t check_lengths(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                        const std::string& where) const override {
    SCORCH_CHECK(b[0].size == parent_count * words(size),
                 "{}: mask has {} entries, expected {} ({} parent positions x {} words of {} groups of {})", where,
                 b[0].size, parent_count * words(size), parent_count, words(size), groups(size), m_);
    return parent_count * per_parent(size);
  }

  void for_each_child(std::span<const IndexSpan> b, int64_t size, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    int64_t q = parent * per_parent(size);
    for (int64_t g = 0; g < groups(size); ++g) {
      int64_t k = 0;
      for (uint32_t rest = field(b, parent, g, size); rest && k < slots(g, size); rest &= rest - 1, ++k)
        f(g * m_ + std::countr_zero(rest), q + g * n_ + k);
    }
  }

 private:
  int n_, m_;
};

}  // namespace

LevelKindPtr make_nm_level(LevelProperties props, std::span<const int64_t> params) {
  SCORCH_CHECK(params.size() == 2, "an n:m level takes two parameters, n and m (e.g. nm[2:4])");
  const int64_t n = params[0], m = params[1];
  SCORCH_CHECK(m >= 1 && m <= 32 && n >= 1 && n <= m,
               "an n:m level needs 1 <= n <= m <= 32 (n of every m coordinates stored), got {}:{}", n, m);
  return std::make_shared<NmLevel>(props, static_cast<int>(n), static_cast<int>(m));
}

}  // namespace scorch
