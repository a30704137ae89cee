// The level-format capability interface. A sparse tensor's storage is a stack of levels, one per storage
// dimension; each level kind decides which index buffers it keeps (e.g. pos/crd) and how a parent position
// expands into child positions. Packing, validation and unpacking in storage.cpp drive levels only through
// this interface, so a new level kind (see the toy kind in tests/cpp/test_format.cpp) needs no change there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace scorch {

// A read-only view of an index buffer that may hold int32 or int64 entries.
struct IndexSpan {
  const void* data = nullptr;
  int64_t size = 0;
  bool wide = true;  // int64 when true, int32 otherwise

  IndexSpan() = default;
  IndexSpan(const int64_t* d, int64_t n) : data(d), size(n), wide(true) {}
  IndexSpan(const int32_t* d, int64_t n) : data(d), size(n), wide(false) {}
  explicit IndexSpan(const std::vector<int64_t>& v) : IndexSpan(v.data(), static_cast<int64_t>(v.size())) {}
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// Properties a level promises about the coordinates under one parent position.
struct LevelProperties {
  bool ordered = true;  // coordinates under a parent are sorted
  bool unique = true;   // no coordinate repeats under a parent
  bool operator==(const LevelProperties&) const = default;
};

class LevelKind {
 public:
  explicit LevelKind(LevelProperties props) : props_(props) {}
  virtual ~LevelKind() = default;

  virtual std::string name() const = 0;
  // Names of the index buffers this level stores, in storage order ("pos", "crd", ...).
  virtual std::vector<std::string> buffer_names() const = 0;
  // Whether the level can be built with the given properties (e.g. a dense level is always ordered, unique).
  virtual bool supports(LevelProperties props) const = 0;

  // Build this level. The sorted, duplicate-free coordinate tuples are partitioned among the parent
  // positions: parent p owns tuples [parents[p], parents[p+1]). `coords[t]` is this level's coordinate of
  // tuple t and `size` the level's extent. Fills `out` (one vector per buffer name) and returns the
  // partition of the tuples among this level's positions, in the same form as `parents`.
  virtual std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords,
                                    int64_t size, std::vector<std::vector<int64_t>>& out) const = 0;

  // Check the buffers for `parent_count` parent positions; return the number of positions of this level.
  // `where` names the level in error messages.
  virtual int64_t validate(std::span<const IndexSpan> buffers, int64_t parent_count, int64_t size,
                           const std::string& where) const = 0;

  // Only the O(1) length checks of validate, for buffers already validated once (e.g. before each kernel
  // call). The default runs the full validation.
  virtual int64_t check_lengths(std::span<const IndexSpan> buffers, int64_t parent_count, int64_t size,
                                const std::string& where) const {
    return validate(buffers, parent_count, size, where);
  }

  // Call f(coordinate, child position) for each child of parent position `parent`, in storage order.
  virtual void for_each_child(std::span<const IndexSpan> buffers, int64_t size, int64_t parent,
                              const std::function<void(int64_t, int64_t)>& f) const = 0;

  const LevelProperties& properties() const { return props_; }

 private:
  LevelProperties props_;
};

using LevelKindPtr = std::shared_ptr<const LevelKind>;
using LevelFactory = std::function<LevelKindPtr(LevelProperties)>;

// The registry of level kinds by name. The built-in kinds (dense, compressed, singleton) are always there;
// register_level_kind adds another (it raises if the name is taken).
void register_level_kind(const std::string& name, LevelFactory factory);
LevelKindPtr make_level_kind(const std::string& name, LevelProperties props);
bool has_level_kind(const std::string& name);

// Factories of the built-in kinds, one file each.
LevelKindPtr make_dense_level(LevelProperties props);
LevelKindPtr make_compressed_level(LevelProperties props);
LevelKindPtr make_singleton_level(LevelProperties props);

}  // namespace scorch
