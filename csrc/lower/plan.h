// Planning a call: given the statement and what each operand is (its storage, shape and number of stored
// values), decide which operands to convert so that one loop order walks every sparse operand in storage
// order (converting the cheapest), infer the output's format, and produce the kernel spec to run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/expr.h"

namespace scorch {

struct OperandDesc {
  std::string format;  // canonical format text, or "strided" for a dense tensor
  std::vector<int64_t> shape;
  int64_t nnz = 0;     // stored values (numel for strided)
};

struct Plan {
  std::string spec;                  // the kernel to run
  std::vector<std::string> convert;  // per operand: "" to keep, "strided" to densify, else a format's text
  std::string out_format;            // "strided" or a format's text
  std::vector<int64_t> var_sizes;
  std::vector<int64_t> out_shape;
  std::vector<std::string> reasons;
};

// `out_format`: "" to infer, "strided" for a dense result, or a format (preset or text) for the output's rank.
Plan make_plan(const ir::Statement& st, const std::vector<OperandDesc>& operands, const std::string& out_format,
               bool f64, bool idx64);

}  // namespace scorch
