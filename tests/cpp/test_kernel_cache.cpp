// The kernel cache (runtime/jit.cpp) trusts nothing on disk: every entry is verified against its manifest
// before it is loaded, damaged or foreign entries are rebuilt under the key's lock, temporaries of dead
// processes are removed, and compiles are bounded in time. Moved out of test_compiler.cpp, which holds the
// compiler's own tests.
#include <gtest/gtest.h>

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>

#include <fmt/format.h>

#include "common/error.h"
#include "common/hash.h"
#include "runtime/jit.h"
#include "runtime/target.h"
#include "test_util.h"

namespace scorch {
namespace {

using test::error_of;
using test::Jit;
using test::read_all;


// A scratch directory of one test: its kernel cache and any compiler script.
std::string fresh_dir(const std::string& name) { return test::scratch_dir("jit-" + name); }

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void spit(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << data;
}

// An executable compiler wrapper: target probes (-dM) and --version go to c++; a compile runs `body` first.
std::string compiler_script(const std::string& dir, const std::string& body) {
  const std::string path = dir + "/cxx.sh";
  spit(path, "#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in -dM|--version) exec c++ \"$@\";; esac; done\n" + body +
                 "\nexec c++ \"$@\"\n");
  ::chmod(path.c_str(), 0755);
  return path;
}

// Environment variables set for one scope, restored after.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, std::string>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      setenv(name, value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old) setenv(name.c_str(), old->c_str(), 1);
      else unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::string scale_spec(int c) { return fmt::format("out(i0) = t0(i0) * {}.0; t0=strided; out=strided; f64; i64", c); }

double run_scale(const CompiledKernel& k, double x) {
  double in[1] = {x}, out[1] = {0};
  void* inputs[] = {(void*)in};
  const int64_t sizes[] = {1}, strides[] = {1};
  scorch_kernel_args args{inputs, sizes, strides, out, 0, nullptr, nullptr, 1, 0};
  EXPECT_EQ(k.fn(&args), 0);
  return out[0];
}

std::string key_of(const CompiledKernel& k) {
  const auto slash = k.library_path.rfind('/');
  return k.library_path.substr(slash + 1, k.library_path.size() - slash - 4);
}

TEST_F(Jit, EntryHasAManifestRecordingTheLibrary) {
  const std::string dir = fresh_dir("manifest");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir}};
  const auto k = get_kernel_uncached(scale_spec(11));
  EXPECT_TRUE(k->compiled);
  EXPECT_EQ(run_scale(*k, 2), 22);
  const std::string key = key_of(*k), lib = read_all(k->library_path);
  const std::string manifest = read_all(dir + "/" + key + ".json");
  EXPECT_NE(manifest.find("\"key\": \"" + key + "\""), std::string::npos) << manifest;
  EXPECT_NE(manifest.find(fmt::format("\"library_bytes\": {},", lib.size())), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("\"library_hash\": \"" + content_hash(lib) + "\""), std::string::npos) << manifest;
  EXPECT_NE(manifest.find(scale_spec(11)), std::string::npos) << manifest;
  // Only the entry, its source and its lock remain: the private copy that was loaded is gone.
  EXPECT_EQ(files_in(dir), (std::vector<std::string>{key + ".cpp", key + ".json", key + ".lock", key + ".so"}));
  // A second look verifies and loads, without compiling.
  const auto again = get_kernel_uncached(scale_spec(11));
  EXPECT_FALSE(again->compiled);
  EXPECT_EQ(run_scale(*again, 3), 33);
}

TEST_F(Jit, TruncatedLibraryIsRebuiltNotLoaded) {
  // A plain dlopen of this file dies of SIGBUS; the entry must be rebuilt instead, and SCORCH_DEBUG says so.
  const std::string dir = fresh_dir("truncated");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir}};
  const auto k = get_kernel_uncached(scale_spec(12));
  const std::string lib = read_all(k->library_path);
  ASSERT_GT(lib.size(), 8192u);
  ASSERT_EQ(::truncate(k->library_path.c_str(), 4096), 0);
  std::shared_ptr<const CompiledKernel> again;
  {
    ScopedEnv debug{{"SCORCH_DEBUG", "1"}};
    ::testing::internal::CaptureStderr();
    again = get_kernel_uncached(scale_spec(12));
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(said.find(fmt::format("not trusted, rebuilt: its library is 4096 bytes, the manifest records {}",
                                    lib.size())),
              std::string::npos)
        << said;
  }
  EXPECT_TRUE(again->compiled);
  EXPECT_EQ(run_scale(*again, 2), 24);
  EXPECT_EQ(read_all(k->library_path).size(), lib.size());
  EXPECT_FALSE(get_kernel_uncached(scale_spec(12))->compiled);  // repaired for good
}

TEST_F(Jit, ForeignLibraryUnderAKeyIsRebuilt) {
  // Another kernel's valid library under this key: alone, and with its manifest copied along.
  const std::string dir = fresh_dir("foreign");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir}};
  const auto mine = get_kernel_uncached(scale_spec(13));
  const auto other = get_kernel_uncached(scale_spec(17));
  const std::string my_manifest = dir + "/" + key_of(*mine) + ".json";
  const std::string other_manifest = dir + "/" + key_of(*other) + ".json";

  spit(mine->library_path, read_all(other->library_path));
  auto k = get_kernel_uncached(scale_spec(13));
  EXPECT_TRUE(k->compiled);
  EXPECT_EQ(run_scale(*k, 1), 13);  // not 17

  spit(mine->library_path, read_all(other->library_path));
  spit(my_manifest, read_all(other_manifest));
  k = get_kernel_uncached(scale_spec(13));
  EXPECT_TRUE(k->compiled);
  EXPECT_EQ(run_scale(*k, 1), 13);
  EXPECT_NE(read_all(my_manifest).find(key_of(*mine)), std::string::npos);
}

TEST_F(Jit, GarbledOrMissingManifestIsRebuilt) {
  const std::string dir = fresh_dir("manifest-damage");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir}};
  const auto k = get_kernel_uncached(scale_spec(14));
  const std::string manifest_path = dir + "/" + key_of(*k) + ".json";
  const std::string manifest = read_all(manifest_path);
  for (const std::string& bad : {std::string("garbage"), std::string(""), manifest.substr(0, manifest.size() / 2),
                                 manifest + " ", std::string("{\"library_bytes\": 99999999999999999999}")}) {
    spit(manifest_path, bad);
    const auto again = get_kernel_uncached(scale_spec(14));
    EXPECT_TRUE(again->compiled) << bad;
    EXPECT_EQ(run_scale(*again, 1), 14);
    EXPECT_EQ(read_all(manifest_path), manifest);
  }
  ASSERT_EQ(::unlink(manifest_path.c_str()), 0);
  EXPECT_TRUE(get_kernel_uncached(scale_spec(14))->compiled);
  // A library that is not a regular file (here a directory) is replaced too.
  ASSERT_EQ(::unlink(k->library_path.c_str()), 0);
  ASSERT_EQ(::mkdir(k->library_path.c_str(), 0755), 0);
  EXPECT_NE(error_of([&] { get_kernel_uncached(scale_spec(14)); }), "");  // rename cannot replace a directory
  ASSERT_EQ(::rmdir(k->library_path.c_str()), 0);
  EXPECT_EQ(run_scale(*get_kernel_uncached(scale_spec(14)), 1), 14);
}

TEST_F(Jit, OrphanTemporariesAreRemovedWhenTheLockIsTaken) {
  const std::string dir = fresh_dir("orphans");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir}};
  const auto k = get_kernel_uncached(scale_spec(15));
  const std::string key = key_of(*k);
  // What a compile killed mid-way leaves: no entry, the source, temporaries named after a dead process.
  ASSERT_EQ(::unlink(k->library_path.c_str()), 0);
  ASSERT_EQ(::unlink((dir + "/" + key + ".json").c_str()), 0);
  const std::string dead = "999999999", alive = std::to_string(::getppid());  // not ours: ours is in use
  for (const std::string& name : {key + ".so.tmp." + dead + ".so", key + ".cpp.tmp." + dead, key + ".json.tmp." + dead,
                                  key + ".load." + dead + ".3.so", key + ".so.tmp." + alive + ".so",
                                  key + ".cpp.tmp." + alive, "0123456789abcdef0123456789abcdef.so.tmp." + dead + ".so"})
    spit(dir + "/" + name, "partial");
  // A live PID on an old temporary: the PID was reused (or is another machine's); older than the timeout, it goes.
  struct timeval old_times[2] = {{1000000000, 0}, {1000000000, 0}};
  ASSERT_EQ(::utimes((dir + "/" + key + ".cpp.tmp." + alive).c_str(), old_times), 0);

  const auto again = get_kernel_uncached(scale_spec(15));
  EXPECT_TRUE(again->compiled);
  EXPECT_EQ(run_scale(*again, 1), 15);
  // Left: the entry, the recent temporary of a live process, and another key's temporary (its own lock's business).
  EXPECT_EQ(files_in(dir), (std::vector<std::string>{"0123456789abcdef0123456789abcdef.so.tmp." + dead + ".so",
                                                     key + ".cpp", key + ".json", key + ".lock",
                                                     key + ".so", key + ".so.tmp." + alive + ".so"}));
}

TEST_F(Jit, CompileTimeoutIsAClearErrorAndReleasesTheLock) {
  const std::string dir = fresh_dir("timeout");
  const std::string marker = dir + "/hang";
  spit(marker, "");
  const std::string cxx = compiler_script(dir, "if [ -e '" + marker + "' ]; then sleep 60; fi");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir + "/cache"}, {"CXX", cxx}, {"SCORCH_COMPILE_TIMEOUT", "1.5"}};
  const std::string e = error_of([] { get_kernel(scale_spec(16)); });
  EXPECT_NE(e.find("timed out after 1.5 s"), std::string::npos) << e;
  EXPECT_NE(e.find("SCORCH_COMPILE_TIMEOUT"), std::string::npos) << e;
  // The lock is free (another open of it can take it at once) and no temporary library is left.
  int locks = 0;
  for (const auto& name : files_in(dir + "/cache")) {
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
    if (name.size() < 5 || name.substr(name.size() - 5) != ".lock") continue;
    const int fd = ::open((dir + "/cache/" + name).c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0) << name;
    ::close(fd);
    ++locks;
  }
  EXPECT_EQ(locks, 1);
  // The same kernel (same compiler command, same key, same lock) builds once the compiler behaves.
  ::unlink(marker.c_str());
  const auto k = get_kernel(scale_spec(16));
  EXPECT_TRUE(k->compiled);
  EXPECT_EQ(run_scale(*k, 1), 16);
}

TEST_F(Jit, CompilerDoesNotInheritTheLock) {
  // The compiler fails if any descriptor it was given is a lock of this cache.
  const std::string dir = fresh_dir("cloexec");
  const std::string cxx = compiler_script(
      dir, "for f in /proc/$$/fd/*; do case \"$(readlink \"$f\")\" in '" + dir + "/cache/'*.lock) echo \"inherited "
           "$(readlink \"$f\")\"; exit 1;; esac; done");
  ScopedEnv env{{"SCORCH_CACHE_DIR", dir + "/cache"}, {"CXX", cxx}};
  std::shared_ptr<const CompiledKernel> k;
  const std::string e = error_of([&] { k = get_kernel(scale_spec(18)); });
  ASSERT_EQ(e, "");
  EXPECT_TRUE(k->compiled);
  EXPECT_EQ(run_scale(*k, 1), 18);
}

TEST_F(Jit, EnvironmentIsParsedStrictly) {
  const std::string spec = scale_spec(19);
  for (const auto& [name, value] :
       std::vector<std::pair<const char*, std::string>>{{"SCORCH_DEBUG", "yes"}, {"SCORCH_DEBUG", "-1"},
                                                        {"SCORCH_DEBUG", "1.5"}, {"SCORCH_COMPILE_TIMEOUT", "abc"},
                                                        {"SCORCH_COMPILE_TIMEOUT", "-5"}, {"SCORCH_COMPILE_TIMEOUT", "inf"},
                                                        {"SCORCH_COMPILE_TIMEOUT", "10s"}, {"SCORCH_SANITIZE", "yes"},
                                                        {"SCORCH_SANITIZE", "2"}}) {
    ScopedEnv env{{name, value}};
    const std::string e = error_of([&] { get_kernel(spec); });
    EXPECT_NE(e.find(fmt::format("{}='{}'", name, value)), std::string::npos) << name << "=" << value << ": " << e;
  }
  ScopedEnv ok{{"SCORCH_DEBUG", " 0 "}, {"SCORCH_COMPILE_TIMEOUT", "120"}, {"SCORCH_SANITIZE", "0"}};
  EXPECT_EQ(run_scale(*get_kernel(spec), 1), 19);
}

TEST_F(Jit, SanitizedKernelsHaveTheirOwnEntries) {
  const std::string spec = scale_spec(20);
  const bool asan = ::dlsym(RTLD_DEFAULT, "__asan_init") != nullptr;
  std::shared_ptr<const CompiledKernel> plain;
  {
    ScopedEnv env{{"SCORCH_SANITIZE", "0"}};
    plain = get_kernel(spec);
  }
  ScopedEnv env{{"SCORCH_SANITIZE", "1"}};
  if (!asan) {
    // Loading a sanitized kernel here would abort the process; it is a clear error instead.
    const std::string e = error_of([&] { get_kernel(spec); });
    EXPECT_NE(e.find("SCORCH_SANITIZE=1"), std::string::npos) << e;
    EXPECT_NE(e.find("LD_PRELOAD"), std::string::npos) << e;
    return;
  }
  const auto sanitized = get_kernel(spec);
  EXPECT_NE(sanitized->library_path, plain->library_path);
  EXPECT_NE(read_all(sanitized->library_path.substr(0, sanitized->library_path.size() - 3) + ".json")
                .find("-fsanitize=address,undefined"),
            std::string::npos);
  EXPECT_EQ(run_scale(*sanitized, 1), 20);
}

}  // namespace
}  // namespace scorch
