// Bitmap level: one bit per coordinate says whether it is stored, and the stored ones are compact. Buffers:
// "pos" (as a compressed level's: parent p owns positions pos[p] .. pos[p+1]-1) and "mask", the bits, 32
// coordinates to a word (the low 32 bits of each entry), each parent's ceil(size / 32) words contiguous.
// Position pos[p] + j holds the j-th set bit of parent p's mask.
//
// Why pos as well as the bits: a parent's first position is then one load instead of a count over every
// word before it, and kernels can split parents among threads by stored entries. The bits cost size / 32
// words per parent whatever the density, against a crd entry per stored value for a compressed level: the
// bitmap is the smaller one above about 1/32 (int32) of density, and it cannot hold unsorted or repeated
// coordinates. Written in format text as bitmap, e.g. "dense(0),bitmap(1)".
#include <bit>

#include "common/error.h"
#include "format/level.h"

namespace scorch {
namespace {

class BitmapLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "bitmap"; }
  std::vector<std::string> buffer_names() const override { return {"pos", "mask"}; }
  bool supports(LevelProperties props) const override { return props.ordered && props.unique; }

  // Walked with a cursor over the parent's words, two at a time (a 64-bit chunk: word 2c in the low half, word
  // 2c + 1 in the high half): the row, the chunk index, what is left of the chunk's bits and the coordinate of
  // the lowest of them (count trailing zeros); the next stored coordinate clears that bit and moves on to the
  // next nonzero chunk. The move to the next chunk is a branch that mispredicts about once a chunk, so chunks
  // of 64 coordinates halve what sparse rows pay for it against single 32-bit words.
  // The words are read only within the parent's row (cur_W words, none when there is no parent; the high half
  // of a last, odd chunk is 0), so a mask that disagrees with pos cannot make the kernel read outside it: the
  // segment [pos[p], pos[p + 1]) bounds the positions, and a cursor that runs out of bits first holds
  // INT64_MAX, which the kernel's range check of the coordinate (or its final count) reports as bad.
  LevelWalk walk() const override { return LevelWalk::iterate; }
  std::pair<std::string, std::string> position_range(const LevelBufferName& buf, const std::string& pb,
                                                     const std::string& pe) const override {
    return {buf("pos") + "[" + pb + "]", buf("pos") + "[" + pe + "]"};
  }
  std::string implied_positions(const LevelBufferName& buf, const std::string& parents) const override {
    return "(int64_t)" + buf("pos") + "[" + parents + "]";
  }
  bool coordinate_cursor() const override { return true; }
  std::string cursor_start(const LevelBufferName& buf, const std::string& pb, const std::string& pe,
                           const std::string& n, const std::string& c) const override {
    return fmt::format(
        "const int64_t {0}_W = ({1} < {2}) ? ({3} + 31) / 32 : 0; const int64_t {0}_C = ({0}_W + 1) / 2; "
        "const idx_t* __restrict {0}_r = {4} + ({1} < {2} ? {1} : 0) * (({3} + 31) / 32); "
        "int64_t {0}_w = 0; uint64_t {0}_b = {0}_C > 0 ? {5} : 0u; "
        "while (!{0}_b && ++{0}_w < {0}_C) {0}_b = {5}; "
        "int64_t {0} = {0}_b ? {0}_w * 64 + __builtin_ctzll({0}_b) : INT64_MAX;",
        c, pb, pe, n, buf("mask"), chunk(c));
  }
  std::string cursor_advance(const std::string& c) const override {
    return fmt::format(
        "{0}_b &= {0}_b - 1; while (!{0}_b && ++{0}_w < {0}_C) {0}_b = {1}; "
        "{0} = {0}_b ? {0}_w * 64 + __builtin_ctzll({0}_b) : INT64_MAX;",
        c, chunk(c));
  }
  // Chunk <c>_w of the row: its two words, the second only when the row has it.
  static std::string chunk(const std::string& c) {
    return fmt::format("((uint64_t)(uint32_t){0}_r[2 * {0}_w] | (2 * {0}_w + 1 < {0}_W ? (uint64_t)(uint32_t){0}_r[2 * {0}_w + 1] << 32 : 0u))", c);
  }

  std::string cursor_done(const std::string& c) const override { return c + " == INT64_MAX"; }

  static int64_t words(int64_t size) { return mask_words(size, 1); }
  int64_t fixed_entries_per_parent(int64_t size) const override { return words(size); }
  static uint32_t word(const IndexSpan& s, int64_t k) { return static_cast<uint32_t>(s[k]); }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t size,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    const int64_t W = words(size);
    auto& pos = out[0];
    auto& mask = out[1];
    pos.assign(1, 0);
    mask.assign(static_cast<size_t>(np * W), 0);
    std::vector<int64_t> children;
    children.reserve(static_cast<size_t>(parents[np] - parents[0] + 1));
    for (int64_t p = 0; p < np; ++p) {
      for (int64_t t = parents[p]; t < parents[p + 1]; ++t) {
        if (t > parents[p] && coords[t] == coords[t - 1]) continue;
        mask[p * W + coords[t] / 32] |= int64_t{1} << (coords[t] % 32);
        children.push_back(t);
      }
      pos.push_back(static_cast<int64_t>(children.size()));
    }
    for (auto& w : mask) w = static_cast<int32_t>(static_cast<uint32_t>(w));
    children.push_back(parents[np]);
    return children;
  }

  int64_t validate(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                   const std::string& where) const override {
    const IndexSpan& pos = b[0];
    const IndexSpan& mask = b[1];
    SCORCH_CHECK(pos.size == parent_count + 1, "{}: pos has {} entries, expected {} (parent positions + 1)", where,
                 pos.size, parent_count + 1);
    SCORCH_CHECK(mask.size == parent_count * words(size), "{}: mask has {} entries, expected {} ({} words per parent)",
                 where, mask.size, parent_count * words(size), words(size));
    SCORCH_CHECK(pos[0] == 0, "{}: pos[0] must be 0, got {}", where, pos[0]);
    const int64_t W = words(size);
    for (int64_t k = 0; k < mask.size; ++k) {
      const int64_t v = mask[k];
      SCORCH_CHECK(v >= INT32_MIN && v <= int64_t{UINT32_MAX}, "{}: mask[{}]={} does not fit in 32 bits", where, k, v);
    }
    for (int64_t p = 0; p < parent_count; ++p) {
      int64_t count = 0;
      for (int64_t k = 0; k < W; ++k) count += std::popcount(word(mask, p * W + k));
      if (W > 0 && size % 32 != 0)
        SCORCH_CHECK((word(mask, p * W + W - 1) >> (size % 32)) == 0,
                     "{}: mask of parent position {} marks coordinates past the level's size {}", where, p, size);
      SCORCH_CHECK(pos[p + 1] - pos[p] == count,
                   "{}: pos gives parent position {} {} entries (pos[{}]={}, pos[{}]={}) but its mask marks {}", where,
                   p, pos[p + 1] - pos[p], p, pos[p], p + 1, pos[p + 1], count);
    }
    return pos[parent_count];
  }

  int64_t check_lengths(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                        const std::string& where) const override {
    SCORCH_CHECK(b[0].size == parent_count + 1, "{}: pos has {} entries, expected {}", where, b[0].size, parent_count + 1);
    SCORCH_CHECK(b[1].size == parent_count * words(size), "{}: mask has {} entries, expected {}", where, b[1].size,
                 parent_count * words(size));
    SCORCH_CHECK(b[0][0] == 0 && b[0][parent_count] >= 0, "{}: pos[0] must be 0 and pos[-1] non-negative", where);
    return b[0][parent_count];
  }

  void for_each_child(std::span<const IndexSpan> b, int64_t size, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    const int64_t W = words(size);
    int64_t q = b[0][parent];
    for (int64_t k = 0; k < W; ++k)
      for (uint32_t rest = word(b[1], parent * W + k); rest; rest &= rest - 1) f(k * 32 + std::countr_zero(rest), q++);
  }
};

}  // namespace

LevelKindPtr make_bitmap_level(LevelProperties props) { return std::make_shared<BitmapLevel>(props); }

}  // namespace scorch
