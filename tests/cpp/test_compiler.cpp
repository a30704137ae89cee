// The compiler core without torch: parsing, lattices, schedules, and JIT-compiled kernels run on raw arrays.
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
#include <random>

#include "common/error.h"
#include "common/hash.h"
#include "ir/parser.h"
#include "lower/kernel_spec.h"
#include "lower/merge_lattice.h"
#include "lower/schedule.h"
#include "runtime/jit.h"
#include "runtime/target.h"
#include "test_util.h"

namespace scorch {
namespace {

using test::error_of;
using test::Jit;

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
  EXPECT_NE(error_of([] { ir::parse_einsum("ij;jk", {2, 2}); }).find("found ';'\n  ij;jk\n    ^"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("i\xc3\xa9,jk", {2, 2}); }).find("non-ASCII"), std::string::npos);
  EXPECT_NE(error_of([] { ir::parse_einsum("ij,jk->ik,", {2, 2}); }).find("unexpected character"), std::string::npos);
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

TEST(Parser, BroadcastShapesFollowTorchEinsum) {
  using Shapes = std::vector<std::vector<int64_t>>;
  // Size 1 stretches to the index's size elsewhere; nothing to change gives an empty answer.
  EXPECT_EQ(ir::broadcast_shapes("ij,j->i", {{6, 5}, {1}}, {true, false}), (Shapes{{6, 5}, {5}}));
  EXPECT_EQ(ir::broadcast_shapes("ij,ij->ij", {{6, 5}, {6, 1}}, {true, false}), (Shapes{{6, 5}, {6, 5}}));
  EXPECT_TRUE(ir::broadcast_shapes("ij,j->i", {{6, 5}, {5}}, {true, false}).empty());
  EXPECT_TRUE(ir::broadcast_shapes("ij,j->i", {{6, 1}, {1}}, {true, false}).empty());
  // "..." aligned from the right; an operand with fewer dimensions there gains leading ones.
  EXPECT_EQ(ir::broadcast_shapes("...j,...j->...", {{2, 6, 5}, {5}}, {false, false}),
            (Shapes{{2, 6, 5}, {2, 6, 5}}));
  EXPECT_EQ(ir::broadcast_shapes("i...,i...->i...", {{3, 4}, {3}}, {false, false}), (Shapes{{3, 4}, {3, 4}}));
  EXPECT_EQ(ir::broadcast_shapes("...ij,j->...i", {{2, 1, 4, 5}, {1}}, {false, false}),
            (Shapes{{2, 1, 4, 5}, {5}}));
  // Sizes that do not broadcast, or an equation that does not fit the shapes: left to the parser's checks.
  EXPECT_TRUE(ir::broadcast_shapes("ij,j->i", {{6, 5}, {4}}, {true, false}).empty());
  EXPECT_TRUE(ir::broadcast_shapes("ij,j->i", {{6, 5, 2}, {1}}, {true, false}).empty());
  EXPECT_TRUE(ir::broadcast_shapes("ij,j,k->i", {{6, 5}, {1}}, {true, false}).empty());
  EXPECT_TRUE(ir::broadcast_shapes("ii,i->i", {{1, 6}, {6}}, {false, false}).empty());  // a diagonal: one size
  // A sparse operand that would change is named.
  const std::string e = error_of([] { ir::broadcast_shapes("ij,ij->ij", {{1, 5}, {6, 5}}, {true, false}); });
  EXPECT_NE(e.find("operand 0 is sparse and would have to broadcast from shape [1, 5] to [6, 5]"), std::string::npos) << e;
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
  // The columns short of a full tile: vectors of registers when the target has them (the last one loading only
  // the columns left, vload_upto), else a small array.
  if (spmm.find("vload(") != std::string::npos) {
    EXPECT_NE(spmm.find("vload_upto("), std::string::npos) << spmm;
    EXPECT_EQ(spmm.find("tacc[jj] +="), std::string::npos) << spmm;
  } else {
    EXPECT_NE(spmm.find("tacc[jj] +="), std::string::npos) << spmm;
  }
  EXPECT_NE(spmm.find("#pragma omp simd"), std::string::npos);
  // SpMV: the row's sum is kept in a register and stored once.
  const std::string spmv = kernel_source("out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32");
  EXPECT_NE(spmv.find("lacc +="), std::string::npos) << spmv;
  EXPECT_EQ(spmv.find("torch"), std::string::npos);
  EXPECT_NE(spmv.find("const int64_t t1_st0 = 1;"), std::string::npos) << spmv;
}

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
  // Register counts (block kernels size their tiles by them): 16 up to AVX2, 32 with AVX-512.
  EXPECT_EQ(v3.vector_registers, 16);
  EXPECT_EQ(resolve_target("generic").vector_registers, 16);
  const VectorShape v4 = resolve_target("x86-64-v4").vector_shape();
  EXPECT_EQ(v4.vector_registers, 32);
  EXPECT_EQ(v4.vector_bytes, 64);
  EXPECT_EQ(v3.vector_shape().registers(), 16);
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

// --- Checked loads and linear merges (issue 10, items 1, 2 and 4).

// SpMV y = A x on raw CSR arrays with buffer lengths; returns the kernel's status.
int run_checked_spmv(const std::vector<int32_t>& pos, const std::vector<int32_t>& crd, int64_t cols, double* y,
                     int threads) {
  auto k = get_kernel("out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f64; i32");
  const std::vector<double> vals(crd.size(), 1.0), x(static_cast<size_t>(cols), 1.0);
  void* inputs[] = {(void*)pos.data(), (void*)crd.data(), (void*)vals.data(), (void*)x.data()};
  const int64_t lengths[] = {static_cast<int64_t>(pos.size()), static_cast<int64_t>(crd.size()),
                             static_cast<int64_t>(vals.size()), cols};
  const int64_t sizes[] = {static_cast<int64_t>(pos.size()) - 1, cols}, strides[] = {1};
  scorch_kernel_args args{inputs, sizes, strides, y, 0, nullptr, nullptr, threads, 0, lengths};
  return k->fn(&args);
}

TEST_F(Jit, OutOfRangeIndicesGiveAStatusNotACrash) {
  double y[2] = {0, 0};
  EXPECT_EQ(run_checked_spmv({0, 2, 3}, {0, 2, 1}, 3, y, 2), SCORCH_STATUS_OK);
  EXPECT_EQ(y[0], 2);
  EXPECT_EQ(y[1], 1);
  for (int32_t bad : {3, -1, 100000000, INT32_MIN})
    EXPECT_EQ(run_checked_spmv({0, 2, 3}, {0, bad, 1}, 3, y, 2), SCORCH_STATUS_BAD_INDEX) << bad;
  // pos entries past the crd buffer, negative, or decreasing.
  for (const auto& pos : std::vector<std::vector<int32_t>>{{0, 4, 3}, {0, -2, 3}, {0, 1000000000, 3}})
    EXPECT_EQ(run_checked_spmv(pos, {0, 2, 1}, 3, y, 2), SCORCH_STATUS_BAD_INDEX) << pos[1];
  // No column at all, yet a stored coordinate.
  EXPECT_EQ(run_checked_spmv({0, 1, 1}, {0}, 0, y, 1), SCORCH_STATUS_BAD_INDEX);
}

TEST_F(Jit, MergesNoticeCoordinatesTheyCannotMatch) {
  // y = a + d with a dense d: the dense loop matches a's coordinates in order; an unsorted or out-of-range
  // one is left over, and reported.
  auto k = get_kernel("out(i0) = t0(i0) + t1(i0); t0=compressed(0); t1=strided; out=strided; f32; i64");
  auto run = [&](std::vector<int64_t> crd) {
    const int64_t pos[] = {0, static_cast<int64_t>(crd.size())};
    const std::vector<float> av(crd.size(), 1.f), d(4, 0.f);
    std::vector<float> y(4, 0.f);
    void* inputs[] = {(void*)pos, (void*)crd.data(), (void*)av.data(), (void*)d.data()};
    const int64_t lengths[] = {2, static_cast<int64_t>(crd.size()), static_cast<int64_t>(av.size()), 4};
    const int64_t sizes[] = {4};
    scorch_kernel_args args{inputs, sizes, nullptr, y.data(), 0, nullptr, nullptr, 1, 0, lengths};
    return k->fn(&args);
  };
  EXPECT_EQ(run({0, 3}), SCORCH_STATUS_OK);
  EXPECT_EQ(run({3, 0}), SCORCH_STATUS_BAD_INDEX);
  EXPECT_EQ(run({0, 9}), SCORCH_STATUS_BAD_INDEX);
}

std::string many_term_spec(int n, const std::string& fmt) {
  std::string rhs, ops;
  for (int q = 0; q < n; ++q) {
    rhs += fmt::format("{}t{}(i0,i1)", q ? " + " : "", q);
    ops += fmt::format("t{}={}; ", q, fmt);
  }
  return fmt::format("out(i0,i1) = {}; {}out={}; f32; i32", rhs, ops, fmt);
}

TEST(Codegen, SumsOfManySparseOperandsAreLinear) {
  for (const std::string fmt : {"csr", "coo", "dcsr"}) {
    const size_t s8 = kernel_source(many_term_spec(8, fmt)).size();
    const size_t s16 = kernel_source(many_term_spec(16, fmt)).size();
    const size_t s32 = kernel_source(many_term_spec(32, fmt)).size();
    const size_t s64 = kernel_source(many_term_spec(64, fmt)).size();
    EXPECT_LT(s64, 8 * s8) << fmt;                          // 2^n lattice points would be far beyond
    EXPECT_LT(s64 - s32, 5 * (s16 - s8)) << fmt;            // equal steps, about equal growth
  }
  // A union of three stays a lattice; four or more are merged in one loop.
  EXPECT_EQ(kernel_source(many_term_spec(3, "csr")).find("? in_range("), std::string::npos);
  const std::string src = kernel_source(many_term_spec(64, "csr"));
  EXPECT_NE(src.find("k63l1 < ke63l1 ? in_range(t63_crd1[k63l1], N1, bad) : N1;"), std::string::npos);
}

TEST_F(Jit, SumOf64CompressedVectors) {
  // v_q has entries at q, q + 64, q + 128 (value q + 1) and at 7 (value 1): the sum is known in closed form.
  const int n = 64;
  std::string rhs, ops;
  for (int q = 0; q < n; ++q) {
    rhs += fmt::format("{}t{}(i0)", q ? " + " : "", q);
    ops += fmt::format("t{}=compressed(0); ", q);
  }
  auto k = get_kernel(fmt::format("out(i0) = {}; {}out=strided; f64; i64", rhs, ops));
  std::vector<std::vector<int64_t>> pos(n), crd(n);
  std::vector<std::vector<double>> vals(n);
  std::vector<void*> inputs;
  std::vector<int64_t> lengths;
  for (int q = 0; q < n; ++q) {
    std::vector<int64_t> c{q, q + 64, q + 128};
    if (q != 7) c.push_back(7);
    std::sort(c.begin(), c.end());
    crd[q] = c;
    pos[q] = {0, static_cast<int64_t>(c.size())};
    for (int64_t x : c) vals[q].push_back(x == 7 && q != 7 ? 1.0 : q + 1.0);
    for (void* p : {(void*)pos[q].data(), (void*)crd[q].data(), (void*)vals[q].data()}) inputs.push_back(p);
    for (int64_t len : {int64_t{2}, static_cast<int64_t>(c.size()), static_cast<int64_t>(c.size())}) lengths.push_back(len);
  }
  std::vector<double> y(192, 0.0);
  const int64_t sizes[] = {192};
  scorch_kernel_args args{inputs.data(), sizes, nullptr, y.data(), 0, nullptr, nullptr, 1, 0, lengths.data()};
  ASSERT_EQ(k->fn(&args), SCORCH_STATUS_OK);
  for (int i = 0; i < 192; ++i) {
    const double expect = (i % 64) + 1.0 + (i == 7 ? 63.0 : 0.0);
    EXPECT_EQ(y[i], expect) << i;
  }
  // An out-of-range coordinate in the last operand is caught inside the linear merge too.
  crd[63][2] = 1000;
  ASSERT_EQ(k->fn(&args), SCORCH_STATUS_BAD_INDEX);
}


// --- Levels are capabilities (issue 12, point 1): a level kind defined only here is compiled and run.

// Row begin/end arrays (the 4-array CSR of some BLAS libraries): parent p's children are positions
// beg[p] .. end[p] - 1 of crd, so rows may be stored out of order or with gaps. The lowerer asks it how to
// walk it (LevelKind::walk, position_range) and never sees its name.
class BeginEndLevel final : public LevelKind {
 public:
  using LevelKind::LevelKind;
  std::string name() const override { return "begin_end"; }
  std::vector<std::string> buffer_names() const override { return {"beg", "end", "crd"}; }
  bool supports(LevelProperties p) const override { return p.ordered && p.unique; }
  std::vector<int64_t> pack(std::span<const int64_t> parents, std::span<const int64_t> coords, int64_t,
                            std::vector<std::vector<int64_t>>& out) const override {
    const int64_t np = static_cast<int64_t>(parents.size()) - 1;
    std::vector<int64_t> children;
    for (int64_t p = 0; p < np; ++p) {
      out[0].push_back(static_cast<int64_t>(out[2].size()));
      for (int64_t t = parents[p]; t < parents[p + 1]; ++t) {
        out[2].push_back(coords[t]);
        children.push_back(t);
      }
      out[1].push_back(static_cast<int64_t>(out[2].size()));
    }
    children.push_back(parents[np]);
    return children;
  }
  int64_t validate(std::span<const IndexSpan> b, int64_t parents, int64_t size, const std::string& where) const override {
    SCORCH_CHECK(b[0].size == parents && b[1].size == parents, "{}: beg/end need one entry per parent", where);
    for (int64_t k = 0; k < b[2].size; ++k)
      SCORCH_CHECK(b[2][k] >= 0 && b[2][k] < size, "{}: crd[{}] out of range", where, k);
    return b[2].size;
  }
  void for_each_child(std::span<const IndexSpan> b, int64_t, int64_t parent,
                      const std::function<void(int64_t, int64_t)>& f) const override {
    for (int64_t k = b[0][parent]; k < b[1][parent]; ++k) f(b[2][k], k);
  }
  // How the compiler walks it: an iterated level whose range comes from two buffers (clamped by the kernel).
  LevelWalk walk() const override { return LevelWalk::iterate; }
  std::pair<std::string, std::string> position_range(const LevelBufferName& buf, const std::string& pb,
                                                     const std::string& pe) const override {
    return {buf("beg") + "[" + pb + "]", buf("end") + "[" + pe + " - 1]"};
  }
  std::string implied_positions(const LevelBufferName& buf, const std::string& parents) const override {
    return "(" + parents + " > 0 ? (int64_t)" + buf("end") + "[" + parents + " - 1] : 0)";
  }
};

TEST_F(Jit, ToyLevelKindIsCompiledAndRun) {
  if (!has_level_kind("begin_end"))
    register_level_kind("begin_end", [](LevelProperties p) { return std::make_shared<BeginEndLevel>(p); });
  // [[1 0 2] [0 0 0] [0 3 0]], rows stored out of order in crd: row 2 first, then row 0.
  const int32_t beg[] = {1, 3, 0}, end[] = {3, 3, 1}, crd[] = {1, 0, 2};
  const double vals[] = {3, 1, 2}, x[] = {1, 2, 3};
  const std::string fmt = "dense(0),begin_end(1)";
  // y = A x and Y = A B: the lowerer's dense loop locates rows, the toy level iterates each row.
  auto spmv = get_kernel("out(i0) = t0(i0,i1) * t1(i1); t0=" + fmt + "; t1=strided; out=strided; f64; i32");
  EXPECT_NE(spmv->loop_ir.find("t0_beg1["), std::string::npos) << spmv->loop_ir;
  double y[3] = {0, 0, 0};
  void* inputs[] = {(void*)beg, (void*)end, (void*)crd, (void*)vals, (void*)x};
  const int64_t sizes[] = {3, 3}, strides[] = {1};
  const int64_t lengths[] = {3, 3, 3, 3, 3};
  scorch_kernel_args args{inputs, sizes, strides, y, 0, nullptr, nullptr, 2, 0, lengths};
  ASSERT_EQ(spmv->fn(&args), 0);
  EXPECT_EQ(y[0], 7);
  EXPECT_EQ(y[1], 0);
  EXPECT_EQ(y[2], 6);
  // A row range outside crd is clamped and reported, not read.
  const int32_t bad_end[] = {3, 3, 9};
  void* bad_inputs[] = {(void*)beg, (void*)bad_end, (void*)crd, (void*)vals, (void*)x};
  scorch_kernel_args bad{bad_inputs, sizes, strides, y, 0, nullptr, nullptr, 1, 0, lengths};
  EXPECT_EQ(spmv->fn(&bad), SCORCH_STATUS_BAD_INDEX);
  // SpMM with the register-tiled inner loop, 2 x 19 right-hand side.
  auto spmm = get_kernel("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=" + fmt + "; t1=strided; out=strided; f64; i32");
  std::vector<double> B(3 * 19), C(3 * 19, 0.0);
  for (size_t q = 0; q < B.size(); ++q) B[q] = static_cast<double>(q % 7) - 3;
  void* in2[] = {(void*)beg, (void*)end, (void*)crd, (void*)vals, (void*)B.data()};
  const int64_t sizes2[] = {3, 19, 3}, len2[] = {3, 3, 3, 3, 57};
  scorch_kernel_args a2{in2, sizes2, strides, C.data(), 0, nullptr, nullptr, 2, 0, len2};
  ASSERT_EQ(spmm->fn(&a2), 0);
  const double A[3][3] = {{1, 0, 2}, {0, 0, 0}, {0, 3, 0}};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 19; ++j) {
      double ref = 0;
      for (int k = 0; k < 3; ++k) ref += A[i][k] * B[k * 19 + j];
      EXPECT_EQ(C[i * 19 + j], ref) << i << "," << j;
    }
}

}  // namespace
}  // namespace scorch

namespace scorch {
namespace {

// Error messages carry bytes from outside (a compiler's output cut at a byte count, dlerror() text): Python
// decodes them as UTF-8, so the error keeps well-formed text and replaces the rest (helper-55).
TEST(Errors, MessagesAreValidUtf8) {
  EXPECT_EQ(valid_utf8("plain"), "plain");
  EXPECT_EQ(valid_utf8("option \xE2\x80\x98-Wx\xE2\x80\x99"), "option \xE2\x80\x98-Wx\xE2\x80\x99");  // kept
  EXPECT_EQ(valid_utf8("cut \xE2\x80"), "cut \xEF\xBF\xBD\xEF\xBF\xBD");  // a character cut at the end
  EXPECT_EQ(valid_utf8("a\xFF" "b\x8B"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  EXPECT_EQ(valid_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  EXPECT_EQ(valid_utf8("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");  // four bytes
  const Error e(ErrorKind::runtime, "compiler said: \xFE\xFF");
  EXPECT_EQ(std::string(e.what()), "compiler said: \xEF\xBF\xBD\xEF\xBF\xBD");
}

}  // namespace
}  // namespace scorch
