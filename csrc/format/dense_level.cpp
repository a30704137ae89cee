// Dense level: every coordinate 0..size-1 exists under every parent; no buffers. Child position of
// (parent p, coordinate i) is p * size + i.
#include "common/error.h"
#include "format/level.h"

namespace scorch {
namespace {

class DenseLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "dense"; }
  std::vector<std::string> buffer_names() const override { return {}; }
  bool supports(LevelProperties props) const override { return props.ordered && props.unique; }
  LevelWalk walk() const override { return LevelWalk::locate; }

  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t size,
                            std::vector<std::vector<int64_t>>&) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    std::vector<int64_t> children(static_cast<size_t>(np * size + 1));
    for (int64_t p = 0; p < np; ++p) {
      int64_t t = parents[p];
      const int64_t end = parents[p + 1];
      for (int64_t i = 0; i < size; ++i) {
        children[p * size + i] = t;
        while (t < end && coords[t] == i) ++t;
      }
      SCORCH_ASSERT(t == end, "dense level got unsorted or out-of-range coordinates");
    }
    children[np * size] = parents[np];
    return children;
  }

  int64_t validate(std::span<const IndexSpan> buffers, int64_t parent_count, int64_t size,
                   const std::string&) const override {
    SCORCH_ASSERT(buffers.empty(), "dense level has no buffers");
    return parent_count * size;
  }

  int64_t check_lengths(std::span<const IndexSpan> b, int64_t parent_count, int64_t size,
                        const std::string& where) const override {
    return validate(b, parent_count, size, where);
  }

  void for_each_child(std::span<const IndexSpan>, int64_t size, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    for (int64_t i = 0; i < size; ++i) f(i, parent * size + i);
  }
};

}  // namespace

LevelKindPtr make_dense_level(LevelProperties props) { return std::make_shared<DenseLevel>(props); }

}  // namespace scorch
