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
#include <utility>
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

// How generated code walks a level: the compiler asks the level kind (LevelKind::walk and the expressions
// below) and never looks at its name, so a kind registered at run time is compiled too when it says how.
enum class LevelWalk {
  none,     // the compiler cannot walk it: the planner converts the operand first
  locate,   // every coordinate exists under every parent: position = parent * extent + coordinate (dense)
  iterate,  // each parent owns a range of positions; position k's coordinate is crd[k] (a buffer named "crd")
};

// The C++ name a kernel gives buffer `name` of the level being lowered ("pos" -> "t0_pos1").
using LevelBufferName = std::function<std::string(const std::string& name)>;

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

  // After a kernel met an index out of range: the first value in this level's buffers that lies outside what
  // the level allows, described with the buffers' names as the caller knows them (`names`, one per
  // buffer_names()), and the number of this level's positions. Unlike validate it trusts no length (it reads
  // only within the spans), so it can name the bad value even when the structure around it is broken too. The
  // default runs validate and reports its message, naming the level as `where`.
  struct IndexReport {
    std::string problem;    // empty when nothing is wrong in this level
    int64_t positions = 0;  // this level's positions, for the level below
  };
  virtual IndexReport find_bad_index(std::span<const IndexSpan> buffers, std::span<const std::string> names,
                                     int64_t parent_count, int64_t size, const std::string& where) const;

  // Call f(coordinate, child position) for each child of parent position `parent`, in storage order.
  virtual void for_each_child(std::span<const IndexSpan> buffers, int64_t size, int64_t parent,
                              const std::function<void(int64_t, int64_t)>& f) const = 0;

  // Entries pack() builds for each parent position whatever the data (a bitmap's mask words; an n:m level's
  // mask words and its n of every m positions), for the memory check before packing (storage.cpp). Levels
  // whose buffers follow the stored entries build none; a dense level's positions are counted by its walk.
  virtual int64_t fixed_entries_per_parent(int64_t size) const {
    (void)size;
    return 0;
  }
  // Exactly one position under each parent position (a singleton level): pack() groups the entries under a
  // non-unique level by the coordinates through such levels (storage.cpp).
  virtual bool one_child_per_parent() const { return false; }

  // Lowering capabilities (see LevelWalk). The expressions are C++ text over the level's buffer names.
  virtual LevelWalk walk() const { return LevelWalk::none; }
  // iterate: the positions [begin, end) under the parent positions [pb, pe) (contiguous parents).
  virtual std::pair<std::string, std::string> position_range(const LevelBufferName&, const std::string& pb,
                                                             const std::string& pe) const {
    return {pb, pe};
  }
  // iterate: whether position_range reads buffers (the kernel then clamps the range to the crd buffer, as a
  // bad buffer could give any range), and whether that range is pos[pb]..pos[pe] of a buffer named "pos"
  // (row pointers: parallel loops balance their shares by them).
  virtual bool range_from_buffers() const { return true; }
  virtual bool prefix_positions() const { return false; }
  // iterate: the number of positions of the level for `parents` parent positions, read from its buffers, for
  // callers that pass no buffer lengths.
  virtual std::string implied_positions(const LevelBufferName&, const std::string& parents) const { return parents; }
  // iterate, for a level that keeps no coordinate per position (a bitmap): the kernel holds the coordinate of
  // an iterator's current position in variables of its own (a cursor named `cur`: an int64_t `cur` and what
  // else the level needs, prefixed "cur_"), which the level declares and moves on with C++ statements. Such a
  // level is walked from one parent position at a time (its parent level unique) and never entered in the
  // middle of a parent's positions (no thread split by positions, no look-ahead by position).
  virtual bool coordinate_cursor() const { return false; }
  // Declare cursor `cur` at the first child of parent position `pb` when pb < pe (else at no child; the
  // caller reads it only while a position of the segment is left). `n` is the level's extent. A cursor past
  // the last stored coordinate holds a value >= n.
  virtual std::string cursor_start(const LevelBufferName&, const std::string& pb, const std::string& pe,
                                   const std::string& n, const std::string& cur) const {
    (void)pb, (void)pe, (void)n, (void)cur;
    return "";
  }
  // Move cursor `cur` on to the next stored coordinate of the same parent.
  virtual std::string cursor_advance(const std::string& cur) const {
    (void)cur;
    return "";
  }
  // A condition (C++ text) true when cursor `cur` has no stored coordinate left: after the last position of
  // its segment it must hold, else the level's buffers disagree (a bitmap's mask marks more than its pos).
  virtual std::string cursor_done(const std::string& cur) const {
    (void)cur;
    return "true";
  }
  // Structured groups (n:m): coordinates come in groups of `m`, each group stores exactly `n` of them (fewer in
  // a last, shorter group), position = parent * per_parent + group * n + rank in the group, and the stored
  // coordinates of each group are the set bits of an m-bit field in a buffer named "mask" (mask_fields()).
  // {0, 0} for every other kind. Native kernels (lower/nm.h) ask this, not the kind's name.
  virtual std::pair<int, int> structured_groups() const { return {0, 0}; }

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
LevelKindPtr make_bitmap_level(LevelProperties props);

// Kinds with integer parameters, written kind[a:b] in format text (n:m structured sparsity: nm[2:4]); their
// name() is that whole text, so a format's canonical text parses back to it.
using ParamLevelFactory = std::function<LevelKindPtr(LevelProperties, std::span<const int64_t>)>;
// The number of parameters kind `name` takes (0 for a kind without any, or an unknown name).
int level_kind_parameter_count(const std::string& name);
LevelKindPtr make_level_kind(const std::string& name, LevelProperties props, std::span<const int64_t> params);
LevelKindPtr make_nm_level(LevelProperties props, std::span<const int64_t> params);

// Bit fields of masks kept in index buffers (n:m and bitmap levels): each buffer entry holds 32 bits (its low
// 32 bits, so int32 and int64 buffers hold the same words); a row of `fields` fields of `width` bits each takes
// ceil(fields / (32 / width)) words, fields never straddle words.
inline int64_t mask_words(int64_t fields, int width) {
  const int64_t per = 32 / width;
  return (fields + per - 1) / per;
}

}  // namespace scorch
