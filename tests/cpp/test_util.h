// Helpers the C++ test programs share.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

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

// A scratch directory of this test process, `<gtest's temporary directory>/scorch-<name>-<pid>`, made empty
// now and removed with everything in it when the process exits (ctest runs each test as its own process, so
// a run leaves nothing behind in /tmp; every run before this one left ten such folders).
inline std::string scratch_dir(const std::string& name) {
  namespace fs = std::filesystem;
  struct Remover {
    std::mutex mu;
    std::vector<fs::path> dirs;
    ~Remover() {
      std::error_code ec;
      for (const auto& d : dirs) fs::remove_all(d, ec);
    }
  };
  static Remover remover;
  std::string d = ::testing::TempDir();
  if (!d.empty() && d.back() == '/') d.pop_back();  // readlink() gives paths without "//"
  d += "/scorch-" + name + "-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(d, ec);
  fs::create_directories(d, ec);
  EXPECT_FALSE(ec) << d << ": " << ec.message();
  std::lock_guard<std::mutex> lock(remover.mu);
  remover.dirs.push_back(d);
  return d;
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
