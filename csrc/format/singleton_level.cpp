// Singleton level: exactly one child per parent position, its coordinate in crd[p]. Used under a
// non-unique compressed level to store the remaining coordinates of COO tuples.
#include "common/error.h"
#include "format/level.h"

namespace scorch {
namespace {

class SingletonLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "singleton"; }
  std::vector<std::string> buffer_names() const override { return {"crd"}; }
  bool supports(LevelProperties) const override { return true; }
  // One child per parent, at the parent's own position.
  bool one_child_per_parent() const override { return true; }
  LevelWalk walk() const override { return properties().ordered ? LevelWalk::iterate : LevelWalk::none; }
  bool range_from_buffers() const override { return false; }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    auto& crd = out[0];
    crd.resize(static_cast<size_t>(np));
    for (int64_t p = 0; p < np; ++p) {
      SCORCH_CHECK(parents[p + 1] - parents[p] == 1,
                   "a singleton level needs exactly one coordinate per parent position, but parent {} has {}; "
                   "the level above it must be non-unique",
                   p, parents[p + 1] - parents[p]);
      crd[p] = coords[parents[p]];
    }
    return {parents.begin(), parents.end()};
  }

  IndexReport find_bad_index(std::span<const IndexSpan> b, std::span<const std::string> names, int64_t parent_count,
                             int64_t size, const std::string&) const override {
    const IndexSpan& crd = b[0];
    for (int64_t k = 0; k < crd.size; ++k)
      if (crd[k] < 0 || crd[k] >= size)
        return {fmt::format("index buffer {} holds coordinate {} at position {}, outside [0, {})", names[0], crd[k], k,
                            size)};
    return {"", parent_count};
  }

  int64_t validate(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                   const std::string& where) const override {
    const IndexSpan& crd = b[0];
    SCORCH_CHECK(crd.size == parent_count, "{}: crd has {} entries, expected one per parent position ({})", where,
                 crd.size, parent_count);
    for (int64_t k = 0; k < parent_count; ++k) {
      SCORCH_CHECK(crd[k] >= 0 && crd[k] < size, "{}: coordinate crd[{}]={} is out of range [0, {})", where, k,
                         crd[k], size);
    }
    return parent_count;
  }

  int64_t check_lengths(std::span<const IndexSpan> b, int64_t parent_count, int64_t,
                        const std::string& where) const override {
    SCORCH_CHECK(b[0].size == parent_count, "{}: crd has {} entries, expected {}", where, b[0].size, parent_count);
    return parent_count;
  }

  void for_each_child(std::span<const IndexSpan> b, int64_t, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    f(b[0][parent], parent);
  }
};

}  // namespace

LevelKindPtr make_singleton_level(LevelProperties props) { return std::make_shared<SingletonLevel>(props); }

}  // namespace scorch
