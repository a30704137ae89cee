// Compressed level: pos[p]..pos[p+1] delimit parent p's children, crd holds their coordinates. Non-unique
// compressed levels (the top of COO) keep one child per tuple, so repeated coordinates are allowed.
#include "common/error.h"
#include "format/level.h"

namespace scorch {
namespace {

class CompressedLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "compressed"; }
  std::vector<std::string> buffer_names() const override { return {"pos", "crd"}; }
  bool supports(LevelProperties) const override { return true; }
  // Parent p's children are positions pos[p] .. pos[p + 1] - 1.
  LevelWalk walk() const override { return properties().ordered ? LevelWalk::iterate : LevelWalk::none; }
  std::pair<std::string, std::string> position_range(const LevelBufferName& buf, const std::string& pb,
                                                     const std::string& pe) const override {
    return {buf("pos") + "[" + pb + "]", buf("pos") + "[" + pe + "]"};
  }
  bool prefix_positions() const override { return true; }
  std::string implied_positions(const LevelBufferName& buf, const std::string& parents) const override {
    return "(int64_t)" + buf("pos") + "[" + parents + "]";
  }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    auto& pos = out[0];
    auto& crd = out[1];
    pos.assign(1, 0);
    pos.reserve(static_cast<size_t>(np + 1));
    crd.reserve(static_cast<size_t>(parents[np] - parents[0]));
    std::vector<int64_t> children;
    children.reserve(crd.capacity() + 1);
    const bool unique = properties().unique;
    for (int64_t p = 0; p < np; ++p) {
      for (int64_t t = parents[p]; t < parents[p + 1]; ++t) {
        if (!unique || t == parents[p] || coords[t] != coords[t - 1]) {
          crd.push_back(coords[t]);
          children.push_back(t);
        }
      }
      pos.push_back(static_cast<int64_t>(crd.size()));
    }
    children.push_back(parents[np]);
    return children;
  }

  IndexReport find_bad_index(std::span<const IndexSpan> b, std::span<const std::string> names, int64_t parent_count,
                             int64_t size, const std::string&) const override {
    const IndexSpan& pos = b[0];
    const IndexSpan& crd = b[1];
    for (int64_t p = 0; p <= parent_count && p < pos.size; ++p) {
      if (pos[p] < 0 || pos[p] > crd.size)
        return {fmt::format("index buffer {} holds {} at position {}, outside [0, {}] (the length of {})", names[0],
                            pos[p], p, crd.size, names[1])};
      if (p > 0 && pos[p] < pos[p - 1])
        return {fmt::format("index buffer {} decreases: {} at position {} after {}", names[0], pos[p], p, pos[p - 1])};
    }
    for (int64_t k = 0; k < crd.size; ++k)
      if (crd[k] < 0 || crd[k] >= size)
        return {fmt::format("index buffer {} holds coordinate {} at position {}, outside [0, {})", names[1], crd[k], k,
                            size)};
    return {"", crd.size};
  }

  int64_t validate(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                   const std::string& where) const override {
    const IndexSpan& pos = b[0];
    const IndexSpan& crd = b[1];
    SCORCH_CHECK(pos.size == parent_count + 1, "{}: pos has {} entries, expected {} (parent positions + 1)", where,
                 pos.size, parent_count + 1);
    SCORCH_CHECK(pos[0] == 0, "{}: pos[0] must be 0, got {}", where, pos[0]);
    for (int64_t p = 0; p < parent_count; ++p) {
      SCORCH_CHECK(pos[p] <= pos[p + 1], "{}: pos must be non-decreasing, but pos[{}]={} > pos[{}]={}", where, p,
                   pos[p], p + 1, pos[p + 1]);
    }
    SCORCH_CHECK(crd.size == pos[parent_count], "{}: crd has {} entries but pos[-1] is {}", where, crd.size,
                 pos[parent_count]);
    const bool ordered = properties().ordered, unique = properties().unique;
    for (int64_t p = 0; p < parent_count; ++p) {
      for (int64_t k = pos[p]; k < pos[p + 1]; ++k) {
        const int64_t c = crd[k];
        SCORCH_CHECK(c >= 0 && c < size, "{}: coordinate crd[{}]={} is out of range [0, {})", where, k, c,
                           size);
        if (k == pos[p]) continue;
        const int64_t prev = crd[k - 1];
        if (ordered && unique) {
          SCORCH_CHECK(prev < c, "{}: coordinates under parent {} must be sorted and unique, but crd[{}]={} {} crd[{}]={}",
                       where, p, k - 1, prev, prev == c ? "repeats as" : "is followed by", k, c);
        } else if (ordered) {
          SCORCH_CHECK(prev <= c, "{}: coordinates under parent {} must be sorted, but crd[{}]={} > crd[{}]={}", where,
                       p, k - 1, prev, k, c);
        }
      }
    }
    if (unique && !ordered) {
      std::vector<int64_t> seen(static_cast<size_t>(size), -1);
      for (int64_t p = 0; p < parent_count; ++p) {
        for (int64_t k = pos[p]; k < pos[p + 1]; ++k) {
          SCORCH_CHECK(seen[crd[k]] != p, "{}: duplicate coordinate {} under parent {}", where, crd[k], p);
          seen[crd[k]] = p;
        }
      }
    }
    return pos[parent_count];
  }

  int64_t check_lengths(std::span<const IndexSpan> b, int64_t parent_count, int64_t,
                        const std::string& where) const override {
    SCORCH_CHECK(b[0].size == parent_count + 1, "{}: pos has {} entries, expected {}", where, b[0].size, parent_count + 1);
    SCORCH_CHECK(b[0][0] == 0, "{}: pos[0] must be 0, got {}", where, b[0][0]);
    SCORCH_CHECK(b[1].size == b[0][parent_count], "{}: crd has {} entries but pos[-1] is {}", where, b[1].size,
                 b[0][parent_count]);
    return b[0][parent_count];
  }

  void for_each_child(std::span<const IndexSpan> b, int64_t, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    for (int64_t k = b[0][parent]; k < b[0][parent + 1]; ++k) f(b[1][k], k);
  }
};

}  // namespace

LevelKindPtr make_compressed_level(LevelProperties props) { return std::make_shared<CompressedLevel>(props); }

}  // namespace scorch
