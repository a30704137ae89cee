// A tensor format: an ordered list of storage levels, each a level kind applied to a level expression of a
// tensor dimension (the whole dimension, or the block index d/b or in-block offset d%b of a blocked one).
// Mode order is the order of the levels; presets (CSR, CSC, COO, DCSR, DCSC, CSF, BSR) are just such lists.
// The canonical text form, e.g. "dense(0),compressed(1)" or "compressed[nonunique](0),singleton(1)", names a
// format completely and parses back to an equal format.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "format/level.h"

namespace scorch {

struct LevelExpr {
  enum class Part { whole, outer, inner };  // d, d / block, d % block
  int dim = 0;
  Part part = Part::whole;
  int64_t block = 1;

  int64_t extent(int64_t dim_size) const;          // the level's size
  int64_t apply(int64_t coord) const;              // dimension coordinate -> level coordinate
  std::string str() const;
  bool operator==(const LevelExpr&) const = default;
};

struct Level {
  LevelKindPtr kind;
  LevelExpr expr;
};

class Format {
 public:
  Format() = default;
  Format(int ndim, std::vector<Level> levels);  // checks that the levels cover each dimension exactly once

  // A preset name ("dense", "csr", "csc", "coo", "dcsr", "dcsc", "csf", "bsr(bh,bw)") or canonical text.
  static Format parse(const std::string& text, int ndim);
  static Format preset(const std::string& name, int ndim, std::span<const int64_t> block = {});

  int ndim() const { return ndim_; }
  const std::vector<Level>& levels() const { return levels_; }
  std::string str() const;
  // A short name when the format equals a preset ("csr", "coo", "bsr(2,2)"), else the canonical text.
  std::string short_name() const;

  // Level extents for the given tensor shape; raises if a blocked dimension is not divisible by its block.
  std::vector<int64_t> level_sizes(std::span<const int64_t> shape) const;
  // All buffer names, flattened over levels, e.g. {"pos1", "crd1"} for CSR (suffix = level number).
  std::vector<std::string> buffer_names() const;
  int buffer_count() const;
  bool all_dense() const;
  bool ordered() const;  // every level ordered
  bool unique() const;   // the last level is unique: no coordinate tuple is stored twice

  bool operator==(const Format& o) const { return str() == o.str(); }

 private:
  int ndim_ = 0;
  std::vector<Level> levels_;
};

}  // namespace scorch
