// Kernel bundles (runtime/bundle.h): built with the compiler, loaded and run with none, refused when damaged,
// foreign or beyond this CPU. Each test runs in a process of its own (gtest_discover_tests + ctest), so the
// environment changes and registrations below do not leak between tests.
#include <gtest/gtest.h>

#include <dirent.h>
#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <unistd.h>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/hash.h"
#include "runtime/bundle.h"
#include "runtime/cpu_features.h"
#include "runtime/fileio.h"
#include "runtime/jit.h"
#include "runtime/settings.h"
#include "test_util.h"

namespace scorch {
namespace {

const std::string kSpmv = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f64; i32";
const std::string kAdd = "out(i0) = t0(i0) + t1(i0); t0=compressed(0); t1=compressed(0); out=compressed(0); f32; i64";

using test::error_of;
using test::read_all;

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

class Bundle : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::scratch_dir("bundle-test");
    setenv("SCORCH_CACHE_DIR", (dir_ + "/cache").c_str(), 1);
    path_ = dir_ + ".kernels";
  }
  void TearDown() override { std::remove(path_.c_str()); }
  // The header line and manifest rewritten by `edit`, with the header's hash made consistent again: a bundle
  // that is well formed but says something else.
  std::string rehashed(const std::string& bytes, const std::string& from, const std::string& to) {
    const auto nl = bytes.find('\n');
    std::string body = bytes.substr(nl + 1);
    const auto at = body.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    body.replace(at, from.size(), to);
    std::istringstream head(bytes.substr(0, nl));
    std::string magic, version, mbytes, lbytes, hash;
    head >> magic >> version >> mbytes >> lbytes >> hash;
    const size_t m = std::stoul(mbytes) + to.size() - from.size();
    return fmt::format("{} {} {} {} {}\n", magic, version, m, lbytes, content_hash(body)) + body;
  }
  std::string dir_, path_;
};

TEST_F(Bundle, BuiltThenLoadedWithNoCompilerAndRun) {
  const BundleInfo built = build_kernel_bundle({kSpmv, kAdd, kSpmv}, path_);
  ASSERT_EQ(built.kernels.size(), 2u);  // repeats dropped
  EXPECT_EQ(built.kernels[0].spec, kSpmv);

  // No compiler, no JIT, no disk cache from here on.
  setenv("CXX", "/nonexistent/c++", 1);
  setenv("SCORCH_JIT", "0", 1);
  const std::string missing = error_of([] { get_kernel(kSpmv); });
  EXPECT_NE(missing.find(kSpmv), std::string::npos) << missing;
  EXPECT_NE(missing.find("SCORCH_JIT=0"), std::string::npos) << missing;

  EXPECT_FALSE(kernel_available(kSpmv));
  EXPECT_EQ(load_kernel_bundle(path_), 2);
  EXPECT_EQ(load_kernel_bundle(path_), 2);  // the same bytes again: nothing more
  EXPECT_TRUE(kernel_available(kSpmv));
  const auto k = get_kernel(kSpmv);
  EXPECT_EQ(k.get(), find_bundled_kernel(kSpmv).get());
  EXPECT_EQ(k->library_path, path_);
  EXPECT_FALSE(k->sparse_output);
  // [[1 0 2] [0 0 0] [0 3 0]] @ [1 2 3] = [7 0 6]
  const int32_t pos[] = {0, 2, 2, 3}, crd[] = {0, 2, 1};
  const double vals[] = {1, 2, 3}, x[] = {1, 2, 3};
  double y[3] = {0, 0, 0};
  void* inputs[] = {(void*)pos, (void*)crd, (void*)vals, (void*)x};
  const int64_t sizes[] = {3, 3}, strides[] = {1};
  scorch_kernel_args args{inputs, sizes, strides, y, 0, nullptr, nullptr, 2, 0, nullptr};
  ASSERT_EQ(k->fn(&args), 0);
  EXPECT_EQ(y[0], 7);
  EXPECT_EQ(y[1], 0);
  EXPECT_EQ(y[2], 6);

  // A sparse output comes back through the bundle's own free function.
  const auto add = get_kernel(kAdd);
  EXPECT_TRUE(add->sparse_output);
  const int64_t apos[] = {0, 2}, acrd[] = {1, 3}, bpos[] = {0, 2}, bcrd[] = {0, 3};
  const float av[] = {1, 2}, bv[] = {3, 4};
  void* add_inputs[] = {(void*)apos, (void*)acrd, (void*)av, (void*)bpos, (void*)bcrd, (void*)bv};
  const int64_t add_sizes[] = {4};
  scorch_kernel_args a2{add_inputs, add_sizes, nullptr, nullptr, 0, nullptr, nullptr, 1, 0, nullptr};
  ASSERT_EQ(add->fn(&a2), 0);
  EXPECT_EQ(a2.out_nnz, 3);
  add->free_fn(a2.out_coords);
  add->free_fn(a2.out_vals);

  // What this process used, and where it came from.
  EXPECT_EQ(used_kernel_specs(), (std::vector<std::string>{kSpmv, kAdd}));
  ASSERT_EQ(bundled_kernels().size(), 2u);
  EXPECT_EQ(bundled_kernels()[1].first, kAdd);

  // A spec the bundle does not hold: a runtime error that names it, never a compile.
  const std::string other = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32";
  const std::string e = error_of([&] { get_kernel(other); });
  EXPECT_NE(e.find(other), std::string::npos) << e;
  EXPECT_NE(e.find("1 bundle loaded, 2 kernels"), std::string::npos) << e;
  // With the JIT allowed but no compiler, the compiler's failure is reported with the spec.
  setenv("SCORCH_JIT", "1", 1);
  const std::string e2 = error_of([&] { get_kernel(other); });
  EXPECT_EQ(e2.rfind("scorch: compiling a kernel failed", 0), 0u) << e2;
  EXPECT_NE(e2.find(other), std::string::npos) << e2;
  unsetenv("CXX");
  unsetenv("SCORCH_JIT");
}

TEST_F(Bundle, BothLoadingRoutesMapTheCheckedBytes) {
  build_kernel_bundle({kSpmv}, path_);
  std::string library;
  parse_kernel_bundle(read_all(path_), path_, &library);
  for (const bool memfd : {true, false}) {
    std::string how;
    void* h = load_bundle_library_for_test(library, path_, memfd, how);
    ASSERT_NE(h, nullptr);
    EXPECT_EQ(how.rfind(memfd ? "memfd" : "private copy", 0), 0u) << how;
    const auto* count = static_cast<const int*>(::dlsym(h, "scorch_bundle_count"));
    ASSERT_NE(count, nullptr);
    EXPECT_EQ(*count, 1);
  }
  // The private copy was unlinked once mapped: the cache directory holds no library.
  DIR* d = ::opendir((dir_ + "/cache").c_str());
  ASSERT_NE(d, nullptr);
  int files = 0;
  while (dirent* e = ::readdir(d)) files += e->d_name[0] != '.';
  ::closedir(d);
  EXPECT_EQ(files, 0);
}

TEST_F(Bundle, FirstBundleToRegisterASpecKeepsIt) {
  const std::string other = path_ + ".2";
  build_kernel_bundle({kSpmv}, path_);
  build_kernel_bundle({kAdd, kSpmv}, other);
  EXPECT_EQ(load_kernel_bundle(path_), 1);
  EXPECT_EQ(load_kernel_bundle(other), 2);
  const auto all = bundled_kernels();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], std::make_pair(kSpmv, path_));
  EXPECT_EQ(all[1], std::make_pair(kAdd, other));
  EXPECT_EQ(find_bundled_kernel(kSpmv)->library_path, path_);
  EXPECT_NE(bundle_summary().find("2 bundles loaded, 2 kernels"), std::string::npos) << bundle_summary();
  std::remove(other.c_str());
}

TEST_F(Bundle, DamagedOrForeignBundlesAreRefused) {
  build_kernel_bundle({kSpmv}, path_);
  const std::string good = read_all(path_);
  EXPECT_NO_THROW(parse_kernel_bundle(good, "b"));
  const auto refused = [](const std::string& bytes) { return error_of([&] { parse_kernel_bundle(bytes, "b"); }); };

  std::string flipped = good;
  flipped[flipped.size() - 100] ^= 0x01;  // one bit of the library
  EXPECT_NE(refused(flipped).find("damaged"), std::string::npos) << refused(flipped);
  flipped = good;
  flipped[good.find("kernels 1") + 3] ^= 0x20;  // one letter of the manifest
  EXPECT_NE(refused(flipped).find("damaged"), std::string::npos) << refused(flipped);
  EXPECT_NE(refused(good.substr(0, good.size() - 1)).find("truncated"), std::string::npos);
  EXPECT_NE(refused(good + "x").find("truncated, or something appended"), std::string::npos);
  EXPECT_NE(refused("\x7f" "ELF").find("not a Scorch kernel bundle"), std::string::npos);
  EXPECT_NE(refused("").find("not a Scorch kernel bundle"), std::string::npos);
  std::string v2 = good;
  v2.replace(std::strlen("SCORCH-KERNEL-BUNDLE "), 1, "2");
  EXPECT_NE(refused(v2).find("format version 2"), std::string::npos) << refused(v2);

  // Well formed (hash consistent) but not what this Scorch generates: refused before anything is loaded.
  const std::string spec_f32 = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32";
  write_all(path_, rehashed(good, kSpmv, spec_f32));
  std::string e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("different Scorch version or lowering"), std::string::npos) << e;
  EXPECT_TRUE(bundled_kernels().empty());
  write_all(path_, rehashed(good, "t0=csr;", "t0=nonsense;"));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("does not take the spec"), std::string::npos) << e;
  // An extra field: another manifest layout.
  write_all(path_, rehashed(good, "kernels 1\n", "signature none\nkernels 1\n"));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("where 'kernels' belongs"), std::string::npos) << e;
  // Code for another architecture.
  write_all(path_, rehashed(good, std::string("arch ") + host_arch(), "arch sparc64"));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("holds sparc64 code"), std::string::npos) << e;
  // A feature this build cannot check is refused, not ignored.
  write_all(path_, rehashed(good, "\nisa ", "\nisa quantum-mmx "));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("cannot check"), std::string::npos) << e;
  EXPECT_NE(e.find("quantum-mmx"), std::string::npos) << e;
  // A manifest whose line endings became CRLF: the carriage return is shown, not left invisible.
  write_all(path_, rehashed(good, "scorch-kernel-bundle-3\n", "scorch-kernel-bundle-3\r\n"));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("has format 'scorch-kernel-bundle-3\\r'"), std::string::npos) << e;
  // A library that is not one, or one cut short, its hash made consistent: refused (a ValueError) before
  // dlopen, which faulted (SIGBUS) on the segments past the end of a truncated one.
  {
    const auto nl = good.find('\n');
    std::istringstream head(good.substr(0, nl));
    std::string magic, version, mbytes, lbytes, hash;
    head >> magic >> version >> mbytes >> lbytes >> hash;
    const std::string manifest = good.substr(nl + 1, std::stoul(mbytes));
    const std::string library = good.substr(nl + 1 + manifest.size());
    auto resealed = [&](const std::string& lib) {
      const std::string body = manifest + lib;
      return fmt::format("{} {} {} {} {}\n", magic, version, mbytes, lib.size(), content_hash(body)) + body;
    };
    write_all(path_, resealed(std::string(4096, 'x')));
    e = error_of([&] { load_kernel_bundle(path_); });
    EXPECT_NE(e.find("refused: its library is damaged: it is not an ELF file"), std::string::npos) << e;
    for (size_t keep : {library.size() / 2, library.size() - 1, size_t{100}, size_t{10}}) {
      write_all(path_, resealed(library.substr(0, keep)));
      e = error_of([&] { load_kernel_bundle(path_); });
      EXPECT_NE(e.find("refused: its library is damaged"), std::string::npos) << keep << ": " << e;
      EXPECT_EQ(fileio::elf_problem(library.substr(0, keep)).empty(), false) << keep;
    }
    EXPECT_EQ(fileio::elf_problem(library), "");
  }
  // The gather form must be one of the two.
  write_all(path_, rehashed(good, "\ngathers ", "\ngathers sometimes-"));
  e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("gathers 'sometimes-"), std::string::npos) << e;
  EXPECT_TRUE(bundled_kernels().empty());
  EXPECT_NE(error_of([&] { load_kernel_bundle(dir_ + "/no-such-bundle"); }).find("cannot read"), std::string::npos);
}

TEST_F(Bundle, InstructionSetsBeyondThisCpuAreRefused) {
  if (std::string(host_arch()) != "x86_64") GTEST_SKIP() << "x86-64 only";
  EXPECT_TRUE(check_cpu_features({"sse2"}).missing.empty());
  EXPECT_EQ(check_cpu_features({"no-such-feature"}).unknown, std::vector<std::string>{"no-such-feature"});
  if (check_cpu_features({"avx512f"}).missing.empty()) GTEST_SKIP() << "this CPU has AVX-512";
  // Built for a target this CPU cannot run (allowed: the bundle is meant for another machine), then refused
  // here by name, before its code is mapped.
  const BundleInfo b = build_kernel_bundle({kSpmv}, path_, "x86-64-v4");
  EXPECT_EQ(b.vector_bytes, 64);
  const std::string e = error_of([&] { load_kernel_bundle(path_); });
  EXPECT_NE(e.find("avx512f"), std::string::npos) << e;
  EXPECT_NE(e.find("x86-64-v4"), std::string::npos) << e;
  EXPECT_TRUE(bundled_kernels().empty());
}

TEST(Settings, JitSwitchIsStrict) {
  setenv("SCORCH_JIT", "0", 1);
  EXPECT_FALSE(jit_enabled());
  setenv("SCORCH_JIT", "yes", 1);
  const std::string e = error_of([] { jit_enabled(); });
  EXPECT_NE(e.find("SCORCH_JIT='yes'"), std::string::npos) << e;
  unsetenv("SCORCH_JIT");
  EXPECT_TRUE(jit_enabled());
}

}  // namespace
}  // namespace scorch
