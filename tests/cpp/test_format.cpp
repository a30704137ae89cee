// The format layer: presets, text form, pack/validate/unpack round trips, error messages, and a toy level
// kind defined only here to show that storage.cpp relies on the LevelKind interface alone.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>


#include "common/error.h"
#include "format/format.h"
#include "format/storage.h"

namespace scorch {
namespace {

std::vector<IndexSpan> spans(const std::vector<std::vector<int64_t>>& bufs) {
  std::vector<IndexSpan> s;
  for (const auto& b : bufs) s.emplace_back(b);
  return s;
}

// Expect `f` to throw a scorch::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(FormatText, PresetsHaveCanonicalForms) {
  EXPECT_EQ(Format::preset("csr", 2).str(), "dense(0),compressed(1)");
  EXPECT_EQ(Format::preset("csc", 2).str(), "dense(1),compressed(0)");
  EXPECT_EQ(Format::preset("dcsc", 2).str(), "compressed(1),compressed(0)");
  EXPECT_EQ(Format::preset("coo", 3).str(), "compressed[nonunique](0),singleton[nonunique](1),singleton(2)");
  EXPECT_EQ(Format::preset("csf", 3).str(), "compressed(0),compressed(1),compressed(2)");
  const int64_t b[2] = {2, 3};
  EXPECT_EQ(Format::preset("bsr", 2, b).str(), "dense(0/2),compressed(1/3),dense(0%2),dense(1%3)");
}

TEST(FormatText, ParseRoundTripsAndShortNames) {
  for (const char* name : {"dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr(2,3)"}) {
    const Format f = Format::parse(name, 2);
    EXPECT_EQ(Format::parse(f.str(), 2), f) << name;
    // 2-D CSF is the same format as DCSR, and is named so.
    EXPECT_EQ(f.short_name(), std::string(name) == "csf" ? "dcsr" : name);
  }
  EXPECT_EQ(Format::parse(" dense( 1 ) , compressed(0)", 2).short_name(), "csc");
  EXPECT_EQ(Format::parse("compressed(1),dense(0)", 2).short_name(), "compressed(1),dense(0)");
}


TEST(FormatText, Errors) {
  expect_error([] { Format::parse("dense(0) compressed(1)", 2); }, "expected ',' or the end");
  expect_error([] { Format::parse("dense(0),compresed(1)", 2); }, "unknown level kind 'compresed'");
  expect_error([] { Format::parse("csx", 2); }, "unknown format 'csx'");
  expect_error([] { Format::parse("dense(0),compressed(2)", 2); }, "dimension 2 does not exist");
  expect_error([] { Format::parse("dense(0),dense(0)", 2); }, "must store dimension 0 exactly once");
  expect_error([] { Format::parse("dense[nonunique](0),dense(1)", 2); }, "cannot be non-unique");
  expect_error([] { Format::parse("compressed[sorted](0)", 1); }, "unknown level property 'sorted'");
  expect_error([] { Format::parse("csr", 1); }, "needs at least 2 dimensions");
  expect_error([] { Format::parse("bsr(0,2)", 2); }, "block size");
  expect_error([] { Format::parse("", 2); }, "empty format");
  try {
    Format::parse("dense(0),compressed(1", 2);
    FAIL();
  } catch (const Error& e) {
    // The caret sits under the end of the text, where ')' is missing.
    const std::string msg = e.what();
    EXPECT_NE(msg.find("expected ')'\n  dense(0),compressed(1\n  " + std::string(21, ' ') + "^"), std::string::npos)
        << msg;
  }
}

TEST(Pack, CsrSortsAndSumsDuplicates) {
  const Format f = Format::preset("csr", 2);
  const int64_t shape[2] = {3, 4};
  // (2,1) (0,3) (0,0) (2,1) -> rows 0: {0,3}; 2: {1}
  const std::vector<int64_t> coords = {2, 0, 0, 2, /*cols*/ 1, 3, 0, 1};
  Packed p = pack(f, shape, coords, 4);
  ASSERT_EQ(p.buffers.size(), 2u);
  EXPECT_EQ(p.buffers[0], (std::vector<int64_t>{0, 2, 2, 3}));
  EXPECT_EQ(p.buffers[1], (std::vector<int64_t>{0, 3, 1}));
  EXPECT_EQ(p.value_count, 3);
  EXPECT_EQ(p.value_pos, (std::vector<int64_t>{2, 1, 0, 2}));
  const auto back = unpack(f, shape, spans(p.buffers), p.value_count);
  EXPECT_EQ(back, (std::vector<int64_t>{0, 0, 2, /*cols*/ 0, 3, 1}));
}

TEST(Pack, DenseLevelsTooLargeForMemoryAreRefusedBeforeAllocating) {
  // 2^40 rows: the dense row level and the compressed pos would need terabytes; a dcsr needs neither.
  const int64_t shape[2] = {int64_t{1} << 40, 4};
  expect_error([&] { pack(Format::preset("csr", 2), shape, std::vector<int64_t>{5, 1}, 1); },
               "GiB for the index arrays of its leading dense levels");
  Packed p = pack(Format::preset("dcsr", 2), shape, std::vector<int64_t>{5, 1}, 1);
  EXPECT_EQ(p.value_count, 1);
  // Dense blocks under a compressed level follow the stored blocks, not the whole extent: 16 blocks of 256x256
  // in a 65536x65536 BSR (an estimate that counted every entry as a block would ask for terabytes here).
  constexpr int64_t kBlocks = 16, kB = 256;
  std::vector<int64_t> coords(2 * kBlocks * kB * kB);
  const int64_t n = kBlocks * kB * kB;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t b = k / (kB * kB), r = (k / kB) % kB, c = k % kB;
    coords[k] = b * 4096 + r;
    coords[n + k] = b * 4096 + c;
  }
  const int64_t big[2] = {65536, 65536};
  const int64_t block[2] = {kB, kB};
  Packed q = pack(Format::preset("bsr", 2, block), big, coords, n);
  EXPECT_EQ(q.value_count, n);
}

TEST(Pack, OutOfRangeAndShapeErrors) {
  const Format f = Format::preset("csr", 2);
  const int64_t shape[2] = {3, 4};
  expect_error([&] { pack(f, shape, std::vector<int64_t>{0, 4}, 1); }, "coordinate 4 in dimension 1 of size 4");
  expect_error([&] { pack(f, shape, std::vector<int64_t>{-1, 0}, 1); }, "index out of range");
  const int64_t neg[2] = {-1, 4};
  expect_error([&] { pack(f, neg, std::vector<int64_t>{}, 0); }, "non-negative");
  const int64_t odd[2] = {3, 4};
  const int64_t b[2] = {2, 2};
  expect_error([&] { pack(Format::preset("bsr", 2, b), odd, std::vector<int64_t>{}, 0); }, "not divisible");
}

TEST(Validate, CatchesBrokenBuffers) {
  const Format f = Format::preset("csr", 2);
  const int64_t shape[2] = {2, 3};
  using V = std::vector<std::vector<int64_t>>;
  validate(f, shape, spans(V{{0, 1, 2}, {2, 0}}), 2);
  expect_error([&] { validate(f, shape, spans(V{{0, 2, 1}, {2}}), 1); }, "non-decreasing");
  expect_error([&] { validate(f, shape, spans(V{{0, 2, 2}, {2, 1}}), 2); }, "sorted and unique");
  expect_error([&] { validate(f, shape, spans(V{{0, 2, 2}, {1, 1}}), 2); }, "repeats");
  expect_error([&] { validate(f, shape, spans(V{{0, 1, 2}, {0, 3}}), 2); }, "out of range");
  expect_error([&] { validate(f, shape, spans(V{{0, 1, 2}, {0}}), 1); }, "crd has 1 entries but pos[-1] is 2");
  expect_error([&] { validate(f, shape, spans(V{{-1, 1, 2}, {0, 1}}), 2); }, "pos[0] must be 0, got -1");
  expect_error([&] { validate(f, shape, spans(V{{0, 1}, {0}}), 1); }, "pos has 2 entries, expected 3");
  expect_error([&] { validate(f, shape, spans(V{{0, 1, 2}, {0, 1}}), 5); }, "values has 5 entries");
  expect_error([&] { validate(f, shape, spans(V{{0, 1, 2}}), 2); }, "stores 2 index buffers, got 1");
  // COO: the singleton level alone cannot see that whole tuples are out of order; the tuple check does.
  const Format coo = Format::preset("coo", 2);
  validate(coo, shape, spans(V{{0, 2}, {0, 1}, {1, 0}}), 2);
  expect_error([&] { validate(coo, shape, spans(V{{0, 2}, {0, 0}, {1, 0}}), 2); }, "not sorted");
  expect_error([&] { validate(coo, shape, spans(V{{0, 2}, {1, 1}, {2, 2}}), 2); }, "duplicated");
}

// After a kernel met a bad index, each level names the first bad value in its own buffers (compressed and
// singleton read tolerantly, past broken lengths); kinds without their own report fall back to validate.
TEST(Validate, LevelsReportTheirOwnBadIndices) {
  using V = std::vector<std::vector<int64_t>>;
  const std::vector<std::string> names = {"pos1", "crd1"};
  const auto csr = Format::preset("csr", 2);
  const LevelKind& compressed = *csr.levels()[1].kind;
  // pos past crd's length, with crd also too short for pos[-1]: the tolerant read still names pos1.
  auto r = compressed.find_bad_index(spans(V{{0, 5, 2}, {1, 0}}), names, 2, 3, "");
  EXPECT_NE(r.problem.find("pos1 holds 5 at position 1, outside [0, 2]"), std::string::npos) << r.problem;
  r = compressed.find_bad_index(spans(V{{0, 2, 1}, {1, 0}}), names, 2, 3, "");
  EXPECT_NE(r.problem.find("pos1 decreases"), std::string::npos) << r.problem;
  r = compressed.find_bad_index(spans(V{{0, 1, 2}, {1, 7}}), names, 2, 3, "");
  EXPECT_NE(r.problem.find("crd1 holds coordinate 7 at position 1, outside [0, 3)"), std::string::npos) << r.problem;
  r = compressed.find_bad_index(spans(V{{0, 1, 2}, {1, 0}}), names, 2, 3, "");
  EXPECT_EQ(r.problem, "");
  EXPECT_EQ(r.positions, 2);
  const LevelKind& singleton = *Format::preset("coo", 2).levels()[1].kind;
  r = singleton.find_bad_index(spans(V{{0, -4}}), std::vector<std::string>{"crd1"}, 2, 3, "");
  EXPECT_NE(r.problem.find("crd1 holds coordinate -4 at position 1"), std::string::npos) << r.problem;
  // bitmap has no report of its own: validate's message, naming the level.
  const Format bm = Format::parse("bitmap", 2);
  r = bm.levels()[1].kind->find_bad_index(spans(V{{0, 2, 4}, {9, 0, 1, 1 << 8}}), names, 2, 40, "level 1");
  EXPECT_NE(r.problem.find("past the level's size 40"), std::string::npos) << r.problem;
  EXPECT_EQ(r.problem.rfind("level 1", 0), 0u) << r.problem;
  r = bm.levels()[1].kind->find_bad_index(spans(V{{0, 2, 4}, {9, 0, 1, 1 << 7}}), names, 2, 40, "level 1");
  EXPECT_EQ(r.problem, "");
  EXPECT_EQ(r.positions, 4);
}

// Random round trips through every preset, 1-D to 3-D.
TEST(Pack, RandomRoundTrips) {
  std::mt19937_64 rng(7);
  struct Case {
    std::string fmt;
    std::vector<int64_t> shape;
  };
  const std::vector<Case> cases = {
      {"csr", {7, 5}},   {"csc", {7, 5}},     {"coo", {7, 5}},   {"dcsr", {7, 5}},    {"dcsc", {1, 9}},
      {"csf", {4, 3, 5}}, {"coo", {4, 3, 5}}, {"csr", {2, 3, 4}}, {"bsr(2,3)", {6, 9}}, {"dense", {3, 4}},
      {"coo", {11}},     {"csf", {11}},       {"csr", {0, 4}},   {"csc", {3, 0}},     {"compressed(2),dense(0),compressed(1)", {3, 4, 5}}};
  for (const auto& c : cases) {
    const int nd = static_cast<int>(c.shape.size());
    const Format f = Format::parse(c.fmt, nd);
    int64_t numel = 1;
    for (auto s : c.shape) numel *= s;
    for (int64_t nnz : {int64_t{0}, int64_t{1}, numel / 3, numel}) {
      if (numel == 0 && nnz > 0) continue;
      std::vector<int64_t> coords(static_cast<size_t>(nd * nnz));
      std::set<std::vector<int64_t>> uniq;
      for (int64_t k = 0; k < nnz; ++k) {
        std::vector<int64_t> t;
        for (int d = 0; d < nd; ++d) {
          coords[d * nnz + k] = static_cast<int64_t>(rng() % c.shape[d]);
          t.push_back(coords[d * nnz + k]);
        }
        uniq.insert(t);
      }
      Packed p = pack(f, c.shape, coords, nnz);
      const auto s = spans(p.buffers);
      validate(f, c.shape, s, p.value_count);
      const auto back = unpack(f, c.shape, s, p.value_count);
      // Every input tuple is found at its value position.
      for (int64_t k = 0; k < nnz; ++k)
        for (int d = 0; d < nd; ++d)
          ASSERT_EQ(back[d * p.value_count + p.value_pos[k]], coords[d * nnz + k]) << c.fmt;
      // Each position's row-major dense offset (what to_dense scatters to) is its unpacked coordinates'.
      const auto offsets = dense_offsets(f, c.shape, s, p.value_count);
      ASSERT_EQ(offsets.size(), static_cast<size_t>(p.value_count)) << c.fmt;
      for (int64_t q = 0; q < p.value_count; ++q) {
        int64_t off = 0;
        for (int d = 0; d < nd; ++d) off = off * c.shape[d] + back[d * p.value_count + q];
        ASSERT_EQ(offsets[q], off) << c.fmt << " position " << q;
      }
      // Formats without dense levels store exactly the distinct tuples.
      if (f.str().find("dense") == std::string::npos)
        EXPECT_EQ(p.value_count, static_cast<int64_t>(uniq.size())) << c.fmt;
    }
  }
}

// A toy level kind (the built-in bitmap kind is format/bitmap_level.cpp): a per-parent bitmap of present coordinates plus a running count. It keeps buffers
// ("pos", "mask") that no built-in kind has, and the generic machinery must handle it unchanged.
class BitmapLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "toy_bitmap"; }
  std::vector<std::string> buffer_names() const override { return {"pos", "mask"}; }
  bool supports(LevelProperties p) const override { return p.ordered && p.unique; }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t size,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    out[0].assign(1, 0);
    out[1].assign(static_cast<size_t>(np * size), 0);
    std::vector<int64_t> children;
    for (int64_t p = 0; p < np; ++p) {
      for (int64_t t = parents[p]; t < parents[p + 1]; ++t) {
        if (t == parents[p] || coords[t] != coords[t - 1]) {
          out[1][p * size + coords[t]] = 1;
          children.push_back(t);
        }
      }
      out[0].push_back(static_cast<int64_t>(children.size()));
    }
    children.push_back(parents[np]);
    return children;
  }
  int64_t validate(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                   const std::string& where) const override {
    SCORCH_CHECK(b[1].size == parent_count * size, "{}: mask has the wrong length", where);
    SCORCH_CHECK(b[0].size == parent_count + 1, "{}: pos has the wrong length", where);
    for (int64_t p = 0; p < parent_count; ++p) {
      int64_t n = 0;
      for (int64_t i = 0; i < size; ++i) n += b[1][p * size + i];
      SCORCH_CHECK(b[0][p + 1] - b[0][p] == n, "{}: pos disagrees with mask", where);
    }
    return b[0][parent_count];
  }
  void for_each_child(std::span<const IndexSpan> b, int64_t size, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    int64_t k = b[0][parent];
    for (int64_t i = 0; i < size; ++i)
      if (b[1][parent * size + i]) f(i, k++);
  }
};

// n:m and bitmap level kinds: text, packing with padding, round trips, and broken buffers.
TEST(StructuredLevels, TextAndPresets) {
  const int64_t nm[2] = {2, 4};
  EXPECT_EQ(Format::preset("nm", 2, nm).str(), "dense(0),nm[2:4](1)");
  EXPECT_EQ(Format::parse("nm(2,4)", 2).str(), "dense(0),nm[2:4](1)");
  EXPECT_EQ(Format::parse("dense(0),nm[2:4](1)", 2).short_name(), "nm(2,4)");
  EXPECT_EQ(Format::parse("dense(1),nm[1:4](0)", 2).short_name(), "dense(1),nm[1:4](0)");
  EXPECT_EQ(Format::parse("nm(4,8)", 3).str(), "dense(0),dense(1),nm[4:8](2)");
  EXPECT_EQ(Format::parse("bitmap", 2).str(), "dense(0),bitmap(1)");
  EXPECT_EQ(Format::parse("dense(0),bitmap(1)", 2).short_name(), "bitmap");
  EXPECT_EQ(Format::parse("bitmap(1),nm[2:4](0)", 2).str(), "bitmap(1),nm[2:4](0)");
  EXPECT_EQ(Format::parse("dense(0),nm[2:4](1)", 2).buffer_names(), (std::vector<std::string>{"mask1"}));
  EXPECT_EQ(Format::parse("bitmap", 2).buffer_names(), (std::vector<std::string>{"pos1", "mask1"}));
  expect_error([] { Format::parse("dense(0),nm(1)", 2); }, "expected '['");
  expect_error([] { Format::parse("dense(0),nm[3:2](1)", 2); }, "1 <= n <= m <= 32");
  expect_error([] { Format::parse("dense(0),nm[0:4](1)", 2); }, "1 <= n <= m <= 32");
  expect_error([] { Format::parse("dense(0),nm[2:33](1)", 2); }, "1 <= n <= m <= 32");
  expect_error([] { Format::parse("dense(0),nm[2,4](1)", 2); }, "expected ':'");
  expect_error([] { Format::parse("dense(0),bitmap[nonunique](1)", 2); }, "cannot be non-unique");
  expect_error([] { Format::parse("nm(2)", 2); }, "expected ','");
}

TEST(StructuredLevels, NmPacksWithPaddingAndValidates) {
  const Format f = Format::parse("nm(2,4)", 2);
  // Row 0: 1 . 2 . | . 3 . . | 5      row 1: empty but for (1,4), (1,5)
  const int64_t shape[2] = {2, 9};
  const std::vector<int64_t> coords = {0, 0, 0, 0, 1, 1, /*cols*/ 0, 2, 5, 8, 4, 5};
  Packed p = pack(f, shape, coords, 6);
  // Five stored positions per row: 2 + 2 + min(2, 1).
  EXPECT_EQ(p.value_count, 10);
  ASSERT_EQ(p.buffers.size(), 1u);
  // Row 0: 0b0101 | (0b0011 << 4) | (1 << 8); row 1: 0b0011 | (0b0011 << 4) | (1 << 8).
  EXPECT_EQ(p.buffers[0], (std::vector<int64_t>{5 | 3 << 4 | 1 << 8, 3 | 3 << 4 | 1 << 8}));
  EXPECT_EQ(p.value_pos, (std::vector<int64_t>{0, 1, 3, 4, 7, 8}));
  validate(f, shape, spans(p.buffers), p.value_count);
  const auto back = unpack(f, shape, spans(p.buffers), p.value_count);
  EXPECT_EQ(back, (std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1, 1, 1, 1, /*cols*/ 0, 2, 4, 5, 8, 0, 1, 4, 5, 8}));
  using V = std::vector<std::vector<int64_t>>;
  // Three coordinates in one group of an n:m = 2:4 level cannot be packed.
  expect_error([&] { pack(f, shape, std::vector<int64_t>{0, 0, 0, 0, 1, 2}, 3); }, "not 2:4 sparse");
  expect_error([&] { validate(f, shape, spans(V{{7 | 3 << 4 | 1 << 8, 0}}), 10); }, "marks 3 coordinates");
  expect_error([&] { validate(f, shape, spans(V{{5 | 3 << 4 | 2 << 8, 0}}), 10); }, "past the end");
  expect_error([&] { validate(f, shape, spans(V{{5 | 3 << 4 | 1 << 8 | 1 << 12, 0}}), 10); }, "past the last group");
  expect_error([&] { validate(f, shape, spans(V{{5 | 3 << 4 | 1 << 8}}), 10); }, "mask has 1 entries, expected 2");
  expect_error([&] { validate(f, shape, spans(V{{int64_t{1} << 40, 0}}), 10); }, "does not fit in 32 bits");
  expect_error([&] { validate(f, shape, spans(V{{5 | 3 << 4 | 1 << 8, 3 | 3 << 4 | 1 << 8}}), 9); }, "values has 9");
  // m = 3: ten 3-bit fields to a word, bits 30 and 31 unused.
  const Format f3 = Format::parse("dense(0),nm[1:3](1)", 2);
  const int64_t shape3[2] = {1, 33};
  int64_t ones = 0;
  for (int g = 0; g < 10; ++g) ones |= int64_t{1} << (3 * g);
  validate(f3, shape3, spans(V{{ones, 1}}), 11);
  expect_error([&] { validate(f3, shape3, spans(V{{ones | int64_t{1} << 30, 1}}), 11); }, "past the last group");
}

TEST(StructuredLevels, BitmapPacksAndValidates) {
  const Format f = Format::parse("bitmap", 2);
  const int64_t shape[2] = {2, 40};
  const std::vector<int64_t> coords = {1, 0, 0, 1, /*cols*/ 39, 3, 0, 0};
  Packed p = pack(f, shape, coords, 4);
  EXPECT_EQ(p.buffers[0], (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(p.buffers[1], (std::vector<int64_t>{9, 0, 1, 1 << 7}));
  EXPECT_EQ(p.value_pos, (std::vector<int64_t>{3, 1, 0, 2}));
  const auto back = unpack(f, shape, spans(p.buffers), p.value_count);
  EXPECT_EQ(back, (std::vector<int64_t>{0, 0, 1, 1, /*cols*/ 0, 3, 0, 39}));
  using V = std::vector<std::vector<int64_t>>;
  expect_error([&] { validate(f, shape, spans(V{{0, 3, 4}, {9, 0, 1, 1 << 7}}), 4); }, "but its mask marks 2");
  expect_error([&] { validate(f, shape, spans(V{{0, 2, 4}, {9, 0, 1, 1 << 8}}), 4); }, "past the level's size 40");
  expect_error([&] { validate(f, shape, spans(V{{0, 2, 4}, {9, 0, 1}}), 4); }, "mask has 3 entries");
  expect_error([&] { validate(f, shape, spans(V{{1, 2, 4}, {9, 0, 1, 1 << 7}}), 4); }, "pos[0] must be 0");
  // Bit 31 set: the word is negative in an int32 buffer and still means coordinate 31.
  const int64_t shape32[2] = {1, 32};
  Packed q = pack(f, shape32, std::vector<int64_t>{0, 31}, 1);
  EXPECT_EQ(q.buffers[1], (std::vector<int64_t>{INT32_MIN}));
  EXPECT_EQ(unpack(f, shape32, spans(q.buffers), 1), (std::vector<int64_t>{0, 31}));
}

// Random round trips of n:m (2:4, 4:8, 1:4, 3:5 over odd sizes) and bitmap, alone and mixed with other kinds.
TEST(StructuredLevels, RandomRoundTrips) {
  std::mt19937_64 rng(11);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> cases = {
      {"nm(2,4)", {5, 13}}, {"nm(4,8)", {3, 17}}, {"nm(1,4)", {4, 4}}, {"dense(0),nm[3:5](1)", {2, 11}},
      {"nm(2,4)", {0, 8}},  {"nm(2,4)", {3, 0}},  {"nm(2,4)", {1, 1}}, {"bitmap", {6, 70}}, {"bitmap", {1, 1}},
      {"bitmap", {0, 3}},   {"bitmap(1),nm[2:4](0)", {9, 5}}, {"dense(1),nm[1:4](0)", {7, 3}},
      {"compressed(0),bitmap(1)", {5, 33}}, {"nm(2,4)", {2, 3, 10}}, {"nm[4:8](1),bitmap(0)", {3, 3}},
      {"nm[2:4](1),compressed(0)", {6, 9}}};
  for (const auto& [text, shape] : cases) {
    const int nd = static_cast<int>(shape.size());
    const Format f = Format::parse(text, nd);
    int64_t numel = 1;
    for (auto s : shape) numel *= s;
    std::set<std::vector<int64_t>> picked;
    // Random tuples, admitted only while every n:m level can hold them: under each coordinate of the levels
    // above it, at most n distinct coordinates per group of m (a level above others sees a coordinate once).
    std::map<std::vector<int64_t>, std::set<int64_t>> seen;
    bool padded = false;
    for (int64_t t = 0; t < numel; ++t) {
      std::vector<int64_t> c(nd);
      int64_t r = t;
      for (int d = nd; d-- > 0;) {
        c[d] = r % shape[d];
        r /= shape[d];
      }
      if (rng() % 3 == 0) continue;
      bool fits = true;
      std::vector<std::pair<std::vector<int64_t>, int64_t>> marks;
      for (size_t l = 0; l < f.levels().size(); ++l) {
        const auto [gn, gm] = f.levels()[l].kind->structured_groups();
        if (gm == 0) continue;
        padded = true;
        std::vector<int64_t> key{static_cast<int64_t>(l)};
        for (size_t u = 0; u < l; ++u) key.push_back(c[f.levels()[u].expr.dim]);
        const int64_t x = c[f.levels()[l].expr.dim];
        key.push_back(x / gm);
        const auto& have = seen[key];
        if (!have.count(x) && static_cast<int>(have.size()) >= gn) fits = false;
        marks.emplace_back(key, x);
      }
      if (!fits) continue;
      for (const auto& [key, x] : marks) seen[key].insert(x);
      picked.insert(c);
    }
    const int64_t nnz = static_cast<int64_t>(picked.size());
    std::vector<int64_t> coords(static_cast<size_t>(nd * nnz));
    int64_t k = 0;
    for (const auto& c : picked) {
      for (int d = 0; d < nd; ++d) coords[d * nnz + k] = c[d];
      ++k;
    }
    Packed p = pack(f, shape, coords, nnz);
    validate(f, shape, spans(p.buffers), p.value_count);
    const auto back = unpack(f, shape, spans(p.buffers), p.value_count);
    // Every input tuple comes back at its value position; other positions are padding.
    for (int64_t t = 0; t < nnz; ++t)
      for (int d = 0; d < nd; ++d) EXPECT_EQ(back[d * p.value_count + p.value_pos[t]], coords[d * nnz + t]) << text;
    if (!padded) EXPECT_EQ(p.value_count, nnz) << text;
  }
}

TEST(LevelInterface, ToyLevelKindWorksThroughTheGenericMachinery) {
  if (!has_level_kind("toy_bitmap"))
    register_level_kind("toy_bitmap", [](LevelProperties p) { return std::make_shared<BitmapLevel>(p); });
  expect_error([] { register_level_kind("toy_bitmap", nullptr); }, "already registered");
  const Format f = Format::parse("dense(0),toy_bitmap(1)", 2);
  EXPECT_EQ(f.str(), "dense(0),toy_bitmap(1)");
  EXPECT_EQ(f.buffer_names(), (std::vector<std::string>{"pos1", "mask1"}));
  const int64_t shape[2] = {3, 4};
  const std::vector<int64_t> coords = {2, 0, 0, 2, 1, 3, 0, 1};  // (2,1) (0,3) (0,0) (2,1)
  Packed p = pack(f, shape, coords, 4);
  EXPECT_EQ(p.buffers[0], (std::vector<int64_t>{0, 2, 2, 3}));
  EXPECT_EQ(p.buffers[1], (std::vector<int64_t>{1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0}));
  validate(f, shape, spans(p.buffers), p.value_count);
  EXPECT_EQ(unpack(f, shape, spans(p.buffers), p.value_count), (std::vector<int64_t>{0, 0, 2, 0, 3, 1}));
  auto broken = p.buffers;
  broken[1][1] = 1;
  expect_error([&] { validate(f, shape, spans(broken), p.value_count); }, "pos disagrees with mask");
  // Composes with built-in levels in any position, including above a compressed level.
  const Format g = Format::parse("toy_bitmap(1),compressed(0)", 2);
  Packed q = pack(g, shape, coords, 4);
  validate(g, shape, spans(q.buffers), q.value_count);
  EXPECT_EQ(unpack(g, shape, spans(q.buffers), q.value_count), (std::vector<int64_t>{0, 2, 0, /*cols*/ 0, 1, 3}));
}

// A bitmap's mask and an n:m level's mask and positions are built for every parent whatever the data: under
// a dense level of 2^20 rows, 2^34 columns need 2^29 mask words a row (a bitmap) or 2^33 positions (2:4).
TEST(Pack, FixedStorageUnderDenseLevelsCountsInTheMemoryCheck) {
  const int64_t shape[2] = {int64_t{1} << 20, int64_t{1} << 34};
  for (const char* text : {"dense(0),bitmap(1)", "dense(0),nm[2:4](1)"})
    expect_error([&] { pack(Format::parse(text, 2), shape, std::vector<int64_t>{5, 1}, 1); },
                 "entries the next level stores under each");
  // The same columns under a compressed row level: nothing fixed per row, packed.
  const int64_t small[2] = {4, int64_t{1} << 34};
  EXPECT_EQ(pack(Format::parse("compressed(0),compressed(1)", 2), small, std::vector<int64_t>{1, 7}, 1).value_count, 1);
}

// A unique level under a non-unique one, with levels below it: one position per distinct prefix through
// it, the deeper levels' entries grouped under it (not the prefix repeated once per tuple).
TEST(Pack, UniqueLevelUnderNonUniqueGroupsTheTuplesBelowIt) {
  const Format f = Format::parse("compressed[nonunique](0),singleton(1),compressed(2)", 3);
  const int64_t shape[3] = {3, 4, 5};
  // (0,1,2), (0,1,4), (2,0,1), (0,1,3), (2,3,0): (0,1) holds three entries, (2,0) and (2,3) one each.
  const std::vector<int64_t> coords{0, 0, 2, 0, 2, /*k*/ 1, 1, 0, 1, 3, /*l*/ 2, 4, 1, 3, 0};
  const Packed p = pack(f, shape, coords, 5);
  EXPECT_EQ(p.buffers[0], (std::vector<int64_t>{0, 3}));           // pos0: three (i, k) prefixes
  EXPECT_EQ(p.buffers[1], (std::vector<int64_t>{0, 2, 2}));        // crd0
  EXPECT_EQ(p.buffers[2], (std::vector<int64_t>{1, 0, 3}));        // crd1
  EXPECT_EQ(p.buffers[3], (std::vector<int64_t>{0, 3, 4, 5}));     // pos2
  EXPECT_EQ(p.buffers[4], (std::vector<int64_t>{2, 3, 4, 1, 0}));  // crd2
  EXPECT_EQ(p.value_count, 5);
  EXPECT_EQ(p.value_pos, (std::vector<int64_t>{0, 2, 3, 1, 4}));
  validate(f, shape, spans(p.buffers), p.value_count);
  // The layout that repeats (0, 1) under the unique singleton is refused.
  const std::vector<std::vector<int64_t>> repeated{{0, 2}, {0, 0}, {1, 1}, {0, 1, 2}, {2, 4}};  // (0,1,2), (0,1,4)
  expect_error([&] { validate(f, shape, spans(repeated), 2); }, "stores the coordinates (0, 1) twice: (0, 1)");
  // A repeat with a position of an empty segment between the two is refused as well (out of order).
  const int64_t small[3] = {1, 2, 2};
  const std::vector<std::vector<int64_t>> apart{{0, 3}, {0, 0, 0}, {0, 1, 0}, {0, 1, 1, 2}, {0, 1}};
  expect_error([&] { validate(f, small, spans(apart), 2); }, "stores the coordinates (0, 1) before (0, 0)");
  // A dense level under a non-unique one: one position per distinct i, a dense row of j under it.
  const Format g = Format::parse("compressed[nonunique](0),dense(1),compressed(2)", 3);
  const int64_t gshape[3] = {1, 3, 2};
  const Packed q = pack(g, gshape, std::vector<int64_t>{0, 0, /*j*/ 0, 2, /*k*/ 1, 0}, 2);
  EXPECT_EQ(q.buffers[0], (std::vector<int64_t>{0, 1}));     // pos0
  EXPECT_EQ(q.buffers[1], (std::vector<int64_t>{0}));        // crd0
  EXPECT_EQ(q.buffers[2], (std::vector<int64_t>{0, 1, 1, 2}));  // pos2
  EXPECT_EQ(q.buffers[3], (std::vector<int64_t>{1, 0}));     // crd2
  validate(g, gshape, spans(q.buffers), q.value_count);
}

// A container's memory limit (cgroup v2 memory.max or v1 memory.limit_in_bytes) lowers what pack() may plan
// for; "max" and a limit above physical memory leave physical memory.
TEST(Pack, MemoryLimitReadsTheProcessCgroup) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / fmt::format("scorch-cgroup-test-{}", ::getpid());
  fs::remove_all(root);
  auto write = [&](const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  };
  const long double physical = memory_limit_bytes(root / "none", root / "nothing");
  ASSERT_GT(physical, 0);
  write(root / "proc-v2", "0::/box/one\n");
  write(root / "sys/box/one/memory.max", "1073741824\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v2", root / "sys"), 1073741824.0L);
  write(root / "sys/box/one/memory.max", "max\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v2", root / "sys"), physical);
  write(root / "proc-v1", "9:cpu:/\n4:memory:/box/two\n");
  write(root / "sys/memory/box/two/memory.limit_in_bytes", "2147483648\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v1", root / "sys"), 2147483648.0L);
  write(root / "sys/memory/box/two/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  EXPECT_EQ(memory_limit_bytes(root / "proc-v1", root / "sys"), physical);
  // A container sees its own group at the mount's root.
  write(root / "sys/memory.max", "536870912\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v1", root / "sys"), 536870912.0L);
  write(root / "sys/memory.max", "garbage\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v1", root / "sys"), physical);
  // A limit on a parent group holds for its children; v1 lines may name several controllers.
  write(root / "proc-v2-deep", "0::/box/one/two\n");
  write(root / "sys/box/one/two/memory.max", "max\n");
  write(root / "sys/box/one/memory.max", "1073741824\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v2-deep", root / "sys"), 1073741824.0L);
  write(root / "proc-v1-multi", "7:cpu,memory:/box/three\n");
  write(root / "sys/memory/box/three/memory.limit_in_bytes", "3221225472\n");
  EXPECT_EQ(memory_limit_bytes(root / "proc-v1-multi", root / "sys"), 3221225472.0L);
  fs::remove_all(root);
}

// The process's own limits (ulimit -v / -d) lower it too: set below physical memory here and put back.
TEST(Pack, MemoryLimitReadsTheProcessLimits) {
  const long double physical = memory_limit_bytes("/nonexistent-cgroup", "/nonexistent-root");
  ASSERT_GT(physical, 0);
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit old;
    ASSERT_EQ(::getrlimit(resource, &old), 0);
    const rlim_t cap = rlim_t{3} << 40;  // 3 TiB: above what this process uses, and above any
    if (old.rlim_max != RLIM_INFINITY && old.rlim_max < cap) continue;  // (a harder limit set outside: skip)
    struct rlimit lower = old;
    lower.rlim_cur = static_cast<rlim_t>(std::min<long double>(physical / 2 + (1 << 30), cap));
    ASSERT_EQ(::setrlimit(resource, &lower), 0);
    const long double seen = memory_limit_bytes("/nonexistent-cgroup", "/nonexistent-root");
    ASSERT_EQ(::setrlimit(resource, &old), 0);
    EXPECT_EQ(seen, static_cast<long double>(lower.rlim_cur)) << "resource " << resource;
  }
}

}  // namespace
}  // namespace scorch
