#include "common/error.h"

namespace scorch {

void throw_error(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

void throw_assert(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(ErrorKind::runtime,
              fmt::format("scorch internal error: {} ({}:{}, failed: {}). Please report it.", msg, file, line, cond));
}

}  // namespace scorch
