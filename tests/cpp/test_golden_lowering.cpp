// No-regression proof of lowering and codegen: every spec of the golden corpus (golden_corpus.h) is lowered
// and printed, and the C++ source must equal the one saved under tests/cpp/golden/. SCORCH_UPDATE_GOLDEN=1
// rewrites the saved files instead (then review them with git diff).
#include <gtest/gtest.h>

#include <sys/stat.h>

#include "codegen/emit_cpp.h"
#include "golden_corpus.h"
#include "lower/kernel_spec.h"
#include "lower/schedule.h"

namespace scorch {
namespace {

std::string generate(const char* text, const VectorShape& machine, bool native = true) {
  const KernelSpec spec = KernelSpec::parse(text);
  const Schedule sched = make_schedule(spec);
  const LoweredKernel k = native ? lower(spec, sched, machine) : lower_general(spec, sched, machine);
  return emit_cpp(spec, k, machine.vector_bytes);
}

// The line where two texts first differ, for a readable failure.
std::string first_difference(const std::string& want, const std::string& got) {
  std::istringstream a(want), b(got);
  std::string la, lb;
  for (int n = 1;; ++n) {
    const bool ea = !std::getline(a, la), eb = !std::getline(b, lb);
    if (ea && eb) return "identical";
    if (ea || eb || la != lb)
      return "line " + std::to_string(n) + ":\n  saved:     " + (ea ? "<end>" : la) + "\n  generated: " + (eb ? "<end>" : lb);
  }
}

// A generated source is its head (the spec, the value and index types, the vector width), the fixed
// preamble (the ABI struct and the helpers every kernel shares) and the kernel. The head and the kernel are
// saved per spec; the preamble once, and every source must contain it unchanged.
struct Parts {
  std::string head_and_kernel, preamble;
};

Parts split(const std::string& src) {
  const size_t abi = src.find("\n", src.find("#define SCORCH_VECTOR_BYTES")) + 1;
  const size_t kernel = src.find("\nextern \"C\" int scorch_kernel(");
  EXPECT_NE(kernel, std::string::npos) << src;
  return {src.substr(0, abi) + src.substr(kernel + 1), src.substr(abi, kernel + 1 - abi)};
}

TEST(GoldenLowering, GeneratedSourcesEqualTheSavedOnes) {
  const std::string dir = golden::golden_dir();
  const bool update = golden::update_requested();
  if (update) ::mkdir(dir.c_str(), 0755);
  const std::string preamble_path = dir + "/preamble.cpp";
  std::string preamble = update ? "" : golden::read_text(preamble_path);
  ASSERT_TRUE(update || !preamble.empty()) << "no golden preamble " << preamble_path << " (SCORCH_UPDATE_GOLDEN=1 writes it)";
  int checked = 0;
  for (const auto& c : golden::corpus()) {
    for (const auto& s : golden::shapes()) {
      if (!golden::applies(s, c)) continue;
      const std::string path = dir + "/" + c.name + "." + s.name + ".cpp";
      const Parts got = split(generate(c.spec, s.machine, c.native));
      if (update) {
        if (preamble.empty()) preamble = got.preamble;
        EXPECT_EQ(preamble, got.preamble) << c.name << ": the preamble differs between kernels";
        golden::write_text(path, got.head_and_kernel);
        continue;
      }
      const std::string want = golden::read_text(path);
      ASSERT_FALSE(want.empty()) << "no golden source " << path << " (SCORCH_UPDATE_GOLDEN=1 writes it)";
      EXPECT_EQ(want, got.head_and_kernel) << c.name << " (" << s.name << ") differs from " << path << " at "
                                           << first_difference(want, got.head_and_kernel);
      EXPECT_EQ(preamble, got.preamble) << c.name << " (" << s.name << "): preamble differs from " << preamble_path
                                        << " at " << first_difference(preamble, got.preamble);
      ++checked;
    }
  }
  if (update) golden::write_text(preamble_path, preamble);
  else EXPECT_EQ(checked, golden::expected_sources());
}

// The corpus covers what it claims: each saved source is a kernel of its kind (guards against a corpus
// that silently lost its register tiles, linear merges or native blocks).
TEST(GoldenLowering, CorpusCoversTheLoweringFeatures) {
  const VectorShape v32{32, 8};
  EXPECT_NE(generate("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f32; i32", v32).find("vec_t va0"),
            std::string::npos);
  EXPECT_NE(generate("out(i0,i1) = t0(i0,i1) + t1(i0,i1) + t2(i0,i1) + t3(i0,i1); t0=csr; t1=csr; t2=csr; t3=csr; out=csr; f32; i32", v32)
                .find("? in_range("),
            std::string::npos);
  EXPECT_NE(generate("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=csr; out=csr; f32; i32", v32, false).find("ws_list"),
            std::string::npos);
  EXPECT_NE(generate("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=bsr(4,4); t1=strided; out=strided; f32; i32", v32).find("kbe"),
            std::string::npos);
  // A long row's sum: the compiler's gathers (a simd reduction), or vectors built from scalar loads.
  const char* spmv = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32";
  const std::string hardware = generate(spmv, v32), soft = generate(spmv, VectorShape{32, 8, 16, true});
  EXPECT_NE(hardware.find("#pragma omp simd reduction(+:lacc)"), std::string::npos);
  EXPECT_EQ(hardware.find("const vec_t g0_0 = {"), std::string::npos);
  EXPECT_EQ(soft.find("#pragma omp simd reduction(+:lacc)"), std::string::npos);
  EXPECT_NE(soft.find("const vec_t g0_0 = {(val_t)t1_data[(t0_crd1[((pb + 0))]) * t1_st0]"), std::string::npos) << soft;
  // Its rows read a checked private copy of the chunk's positions and coordinates, not the buffers again.
  EXPECT_NE(soft.find("if (!rows_snapshot(t0_pos1, t0_crd1, lo0, hi0, t0_crd1_n, N1, bad, snap0, sp0, sc0))"), std::string::npos) << soft;
  EXPECT_NE(soft.find("const idx_t* __restrict t0_crd1 = sc0;"), std::string::npos) << soft;
  EXPECT_NE(soft.find("s0 += (vload(&t0_vals[((pb))]) * g0_0);"), std::string::npos) << soft;
}

}  // namespace
}  // namespace scorch
