// The compiler core without torch: parsing, lattices, schedules, and JIT-compiled kernels run on raw arrays.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "common/error.h"
#include "ir/parser.h"
#include "lower/kernel_spec.h"
#include "lower/merge_lattice.h"
#include "lower/schedule.h"
#include "runtime/jit.h"
#include "runtime/target.h"

namespace scorch {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Parser, EinsumExplicitAndImplicit) {
  auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  EXPECT_EQ(st.canonical(), "out(i0,i1) = t0(i0,i2) * t1(i2,i1)");
  st = ir::parse_einsum("ij,jk", {2, 2});  // implicit: i, k in alphabetical order
  EXPECT_EQ(st.canonical(), "out(i0,i1) = t0(i0,i2) * t1(i2,i1)");
  st = ir::parse_einsum("ba,ac", {2, 2});  // implicit output "bc"
  EXPECT_EQ(st.str(), "out(b,c) = operand 0(b,a) * operand 1(a,c)");
  st = ir::parse_einsum("...ij,...jk->...ik", {3, 3});
  EXPECT_EQ(st.canonical(), "out(i0,i1,i2) = t0(i0,i1,i3) * t1(i0,i3,i2)");
  st = ir::parse_einsum("ij->", {2});
  EXPECT_EQ(st.canonical(), "out() = t0(i0,i1)");
}

TEST(Parser, EinsumErrorsPointAtTheMistake) {
  EXPECT_NE(error_of([] { ir::parse_einsum("ij,jk->iq", {2, 2}); }).find("output index 'q' appears in no operand\n  ij,jk->iq\n          ^"),
            std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("ij,jkl->ik", {2, 2}); }).find("operand 1 has 2 dimensions but 3 subscripts"),
            std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("ij,jk->ii", {2, 2}); }).find("appears twice"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("ij;jk", {2, 2}); }).find("unexpected character"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("ij,jk,k", {2, 2}); }).find("more operands"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("i.j", {2}); }).find("expected '...'"), std::string::npos);
}

TEST(Parser, IndexNotation) {
  auto st = ir::parse_index_notation("y(i) = A(i,j) * x(j) + 2 * b(i)", {"A", "x", "b"});
  EXPECT_EQ(st.canonical(), "out(i0) = t0(i0,i1) * t1(i1) + 2.0 * t2(i0)");
  EXPECT_EQ(st.str(), "out(i) = A(i,j) * x(j) + 2.0 * b(i)");
  st = ir::parse_index_notation("C(i,j) = -(A(i,j) - B(i,j)) * s", {"A", "B", "s"});
  EXPECT_EQ(st.canonical(), "out(i0,i1) = -(t0(i0,i1) - t1(i0,i1)) * t2()");
  // The canonical form parses back to itself.
  auto again = ir::parse_index_notation(st.canonical(), {"t0", "t1", "t2"});
  EXPECT_EQ(again.canonical(), st.canonical());
  const std::string e = error_of([] { ir::parse_index_notation("y(i) = A(i,j) * z(j)", {"A", "x"}); });
  EXPECT_NE(e.find("unknown tensor 'z'\n  y(i) = A(i,j) * z(j)\n                  ^"), std::string::npos) << e;
  EXPECT_NE(error_of([] { ir::parse_index_notation("y(i) = A(i,j) *", {"A"}); }).find("expected a tensor access"),
            std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_index_notation("y(k) = A(i,j)", {"A"}); }).find("does not appear"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_index_notation("y(i) = A(i,j)", {"A"}, {3}); }).find("has 3 dimensions but is indexed with 2"),
            std::string::npos);
}

TEST(Parser, SizesAreChecked) {
  auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  EXPECT_EQ(ir::infer_var_sizes(st, {{3, 4}, {4, 5}}), (std::vector<int64_t>{3, 5, 4}));
  const std::string e = error_of([&] { ir::infer_var_sizes(st, {{3, 4}, {6, 5}}); });
  EXPECT_NE(e.find("index 'j' has size 6 here but 4 elsewhere\n  ij,jk->ik\n     ^"), std::string::npos) << e;
}

TEST(Lattice, ProductIntersectsSumUnites) {
  auto st = ir::parse_index_notation("y(i) = a(i) * b(i) + c(i)", {"a", "b", "c"});
  auto all_sparse = [](const ir::Expr&) { return true; };
  auto l = build_lattice(st.rhs, all_sparse);
  ASSERT_EQ(l.size(), 3u);
  EXPECT_EQ(l[0].iterators, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(l[1].iterators, (std::vector<int>{0, 1}));
  EXPECT_EQ(l[2].iterators, (std::vector<int>{2}));
  // With c dense, the sum is present everywhere: one region needs a, b and one is c alone (always).
  auto l2 = build_lattice(st.rhs, [](const ir::Expr& a) { return a.tensor != 2; });
  ASSERT_EQ(l2.size(), 2u);
  EXPECT_EQ(l2[0].iterators, (std::vector<int>{0, 1}));
  EXPECT_TRUE(l2[1].iterators.empty());
}

TEST(Schedule, ClassicKernels) {
  auto sched = [](const std::string& s) {
    auto spec = KernelSpec::parse(s);
    return make_schedule(spec).str(spec.stmt);
  };
  // SpMM: rows, then the row's nonzeros, then the dense columns innermost.
  EXPECT_EQ(sched("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f32; i32"),
            "order: i0 i2 i1; output: dense; parallel outer loop");
  // SpGEMM into CSR: the output's columns come inside the reduction, so a row workspace.
  EXPECT_EQ(sched("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=csr; out=csr; f32; i32"),
            "order: i0 i2 i1; output: workspace over i1; parallel outer loop");
  // SDDMM: the output has the sampling operand's pattern: values written at its positions.
  EXPECT_EQ(sched("out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i2,i1); t0=csr; t1=strided; t2=strided; out=csr; f32; i32"),
            "order: i0 i1 i2; output: sampled; parallel outer loop");
  // Two sparse factors: their intersection, appended (writing one's whole pattern would store zeros).
  EXPECT_EQ(sched("out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=csr; t1=csr; out=csr; f32; i32"),
            "order: i0 i1; output: append; parallel outer loop");
  // A sum is not bounded by one operand's pattern: appended.
  EXPECT_EQ(sched("out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=csr; t1=csr; out=csr; f32; i32"),
            "order: i0 i1; output: append; parallel outer loop");
  // CSC SpMV: the outer loop is a reduction, so private outputs.
  EXPECT_EQ(sched("out(i0) = t0(i0,i1) * t1(i1); t0=csc; t1=strided; out=strided; f64; i64"),
            "order: i1 i0; output: dense; parallel outer loop with private outputs");
  // Conflicting orders cannot be scheduled without a conversion.
  EXPECT_NE(error_of([&] { sched("out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=csr; t1=csc; out=strided; f32; i32"); })
                .find("no loop order"),
            std::string::npos);
}

TEST(KernelSpec, RoundTrip) {
  const std::string s = "out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=dense(0),compressed(1); t1=compressed[nonunique](0),singleton(1); out=dense(0),compressed(1); f64; i64";
  EXPECT_EQ(KernelSpec::parse(s).str(), s);
  EXPECT_NE(error_of([] { KernelSpec::parse("out(i0) = t0(i0); t0=compressed(0); out=strided; f16; i32"); }).find("f32 or f64"),
            std::string::npos);
}

TEST(Codegen, RegisterTilesAndLocalSums) {
  // SpMM: a tile of output columns accumulates in registers across the row's nonzeros.
  const std::string spmm = kernel_source("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f32; i32");
  EXPECT_NE(spmm.find("tacc[jj] +="), std::string::npos) << spmm;
  EXPECT_NE(spmm.find("#pragma omp simd"), std::string::npos);
  // SpMV: the row's sum is kept in a register and stored once.
  const std::string spmv = kernel_source("out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32");
  EXPECT_NE(spmv.find("lacc +="), std::string::npos) << spmv;
  EXPECT_EQ(spmv.find("torch"), std::string::npos);
  EXPECT_NE(spmv.find("const int64_t t1_st0 = 1;"), std::string::npos) << spmv;
}

class Jit : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::getenv("SCORCH_CACHE_DIR")) setenv("SCORCH_CACHE_DIR", (std::string(::testing::TempDir()) + "/scorch-cache").c_str(), 1);
  }
};

TEST_F(Jit, SpmvOnRawArrays) {
  // [[1 0 2] [0 0 0] [0 3 0]] @ [1 2 3] = [7 0 6]
  const int32_t pos[] = {0, 2, 2, 3}, crd[] = {0, 2, 1};
  const double vals[] = {1, 2, 3}, x[] = {1, 2, 3};
  double y[3] = {0, 0, 0};
  auto k = get_kernel("out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f64; i32");
  void* inputs[] = {(void*)pos, (void*)crd, (void*)vals, (void*)x};
  const int64_t sizes[] = {3, 3}, strides[] = {1};
  scorch_kernel_args args{inputs, sizes, strides, y, 0, nullptr, nullptr, 2, 0};
  ASSERT_EQ(k->fn(&args), 0);
  EXPECT_EQ(y[0], 7);
  EXPECT_EQ(y[1], 0);
  EXPECT_EQ(y[2], 6);
  EXPECT_EQ(get_kernel(k->spec).get(), k.get());  // the in-process cache
}

TEST_F(Jit, SparseAddProducesTheUnion) {
  // a = [0 1 0 2], b = [3 0 0 4] as 1-D compressed vectors; a + b = [3 1 0 6] in any order
  const int64_t apos[] = {0, 2}, acrd[] = {1, 3}, bpos[] = {0, 2}, bcrd[] = {0, 3};
  const float av[] = {1, 2}, bv[] = {3, 4};
  auto k = get_kernel("out(i0) = t0(i0) + t1(i0); t0=compressed(0); t1=compressed(0); out=compressed(0); f32; i64");
  void* inputs[] = {(void*)apos, (void*)acrd, (void*)av, (void*)bpos, (void*)bcrd, (void*)bv};
  const int64_t sizes[] = {4};
  scorch_kernel_args args{inputs, sizes, nullptr, nullptr, 0, nullptr, nullptr, 1, 0};
  ASSERT_EQ(k->fn(&args), 0);
  ASSERT_EQ(args.out_nnz, 3);
  std::vector<std::pair<int64_t, float>> got;
  for (int64_t q = 0; q < args.out_nnz; ++q) got.emplace_back(args.out_coords[q], static_cast<float*>(args.out_vals)[q]);
  EXPECT_EQ(got, (std::vector<std::pair<int64_t, float>>{{0, 3.f}, {1, 1.f}, {3, 6.f}}));
  k->free_fn(args.out_coords);
  k->free_fn(args.out_vals);
}

TEST_F(Jit, CompilerFailureIsReported) {
  // A compiler that fails outright is named when the target is resolved.
  setenv("CXX", "false", 1);
  std::string e = error_of([] { get_kernel("out(i0) = t0(i0) * 3.0; t0=strided; out=strided; f64; i64"); });
  EXPECT_NE(e.find("false"), std::string::npos) << e;
  // CXX with arguments is split into words; here the preprocessor works and the link fails.
  setenv("CXX", "c++ -Wl,--scorch-no-such-option", 1);
  e = error_of([] { get_kernel("out(i0) = t0(i0) * 5.0; t0=strided; out=strided; f64; i64"); });
  unsetenv("CXX");
  EXPECT_NE(e.find("compiling a kernel failed"), std::string::npos) << e;
  EXPECT_NE(e.find("source: "), std::string::npos) << e;
}

TEST_F(Jit, TargetsResolveToTheirInstructionSets) {
  const Target v2 = resolve_target("x86-64-v2"), v3 = resolve_target("x86-64-v3");
  if (v3.arch != "x86_64") GTEST_SKIP() << "not an x86-64 compiler";
  EXPECT_EQ(v3.vector_bytes, 32);
  EXPECT_EQ(v2.vector_bytes, 16);
  EXPECT_EQ(resolve_target("x86-64-v4").vector_bytes, 64);
  EXPECT_EQ(resolve_target("scalar").vector_bytes, 0);
  EXPECT_NE(v2.fingerprint, v3.fingerprint);
  EXPECT_NE(std::find(v3.features.begin(), v3.features.end(), "avx2"), v3.features.end());
  EXPECT_NE(error_of([] { resolve_target("x86-64-v3; rm -rf /"); }).find("bad Scorch target"), std::string::npos);
  EXPECT_NE(error_of([] { resolve_target("no-such-cpu-name"); }).find("does not accept"), std::string::npos);
}

TEST_F(Jit, OneKernelTwoTargetsTwoCacheEntries) {
  const std::string spec = "out(i0) = t0(i0) * 7.0; t0=strided; out=strided; f64; i64";
  set_target("x86-64-v2");
  const auto a = get_kernel(spec);
  set_target("scalar");
  const auto b = get_kernel(spec);
  set_target("");
  EXPECT_NE(a->library_path, b->library_path);
  EXPECT_EQ(a->target, "x86-64-v2");
  EXPECT_EQ(b->target, "scalar");
}

}  // namespace
}  // namespace scorch
