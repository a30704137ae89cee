// A kernel spec names a kernel completely: the statement in canonical index notation, each operand's storage
// (a level format, or "strided" for an ordinary dense tensor), the output's storage, the value type and the
// index width. Its text form is what any process needs to rebuild the kernel:
//   out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=dense(0),compressed(1); t1=strided; out=strided; f32; i32
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "format/format.h"
#include "ir/expr.h"

namespace scorch {

struct Storage {
  std::optional<Format> format;  // empty: strided dense tensor
  bool strided() const { return !format.has_value(); }
  std::string str() const { return format ? format->str() : "strided"; }
};

struct KernelSpec {
  ir::Statement stmt;
  std::vector<Storage> operands;  // one per tensor of the statement
  Storage output;
  bool f64 = false;    // values: double, else float
  bool idx64 = false;  // index buffers: int64, else int32

  std::string str() const;
  static KernelSpec parse(const std::string& text);
  int operand_ndim(int t) const;
};

}  // namespace scorch
