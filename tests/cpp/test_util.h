// Helpers the C++ test programs share.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <string>

namespace scorch::test {

// The message of the exception `f` throws, "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A file's bytes ("" when it cannot be read).
inline std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Tests that compile kernels: a kernel cache of their own under gtest's temporary directory, unless
// SCORCH_CACHE_DIR says where.
class Jit : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::getenv("SCORCH_CACHE_DIR"))
      setenv("SCORCH_CACHE_DIR", (std::string(::testing::TempDir()) + "/scorch-cache").c_str(), 1);
  }
};

}  // namespace scorch::test
