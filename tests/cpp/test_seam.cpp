// The C++ parts of the seam (issue 11, point 5): planning a call (lower/plan.h), gradients (lower/differentiate.h),
// reduction scopes (ir/split_reductions.h), the kernel frame (lower/kernel_frame.h) and the run-time settings
// (runtime/settings.h). Nothing here compiles a kernel: the frame is checked as loop IR text.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "ir/parser.h"
#include "ir/split_reductions.h"
#include "lower/differentiate.h"
#include "lower/kernel_frame.h"
#include "lower/kernel_spec.h"
#include "lower/loop_ir.h"
#include "lower/plan.h"
#include "lower/schedule.h"
#include "runtime/settings.h"

namespace scorch {
namespace {

using Strings = std::vector<std::string>;
using Sizes = std::vector<int64_t>;

// The error a call raises: its kind and message, or nothing.
struct Raised {
  bool raised = false;
  ErrorKind kind = ErrorKind::runtime;
  std::string what;
};

template <typename F>
Raised raised_by(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {true, e.kind(), e.what()};
  }
  return {};
}

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

std::string joined(const Strings& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

const std::string kCsr = "dense(0),compressed(1)";
const std::string kCsc = "dense(1),compressed(0)";

ir::Statement spmv() { return ir::parse_index_notation("y(i) = A(i,j) * x(j)", {"A", "x"}); }
ir::Statement add() { return ir::parse_index_notation("C(i,j) = A(i,j) + B(i,j)", {"A", "B"}); }

// ---------------------------------------------------------------------------------------------------------
// make_plan

TEST(Plan, SpmvKeepsOperandsAndHasADenseOutput) {
  const Plan p = make_plan(spmv(), {{"csr", {4, 5}, 7}, {"strided", {5}, 5}}, "", false, false);
  EXPECT_EQ(p.spec, "out(i0) = t0(i0,i1) * t1(i1); t0=" + kCsr + "; t1=strided; out=strided; f32; i32");
  EXPECT_EQ(p.convert, (Strings{"", ""}));
  EXPECT_EQ(p.out_format, "strided");
  EXPECT_EQ(p.var_sizes, (Sizes{4, 5}));
  EXPECT_EQ(p.out_shape, (Sizes{4}));
  ASSERT_FALSE(p.reasons.empty());
  EXPECT_TRUE(contains(joined(p.reasons), "output is dense")) << joined(p.reasons);
  // The spec is a kernel spec's text: it parses back to itself.
  EXPECT_EQ(KernelSpec::parse(p.spec).str(), p.spec);
}

TEST(Plan, SpmmHasADenseOutputAndTheRightSizes) {
  const auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  const Plan p = make_plan(st, {{"csr", {4, 5}, 7}, {"strided", {5, 3}, 15}}, "", true, true);
  EXPECT_EQ(p.spec, "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=" + kCsr + "; t1=strided; out=strided; f64; i64");
  EXPECT_EQ(p.out_format, "strided");
  EXPECT_EQ(p.var_sizes, (Sizes{4, 3, 5}));  // i, k, then the summed j
  EXPECT_EQ(p.out_shape, (Sizes{4, 3}));
  EXPECT_FALSE(p.reasons.empty());
}

TEST(Plan, ProductOfSparseOperandsHasASparseOutput) {
  const auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  const Plan p = make_plan(st, {{"csr", {4, 5}, 7}, {"csr", {5, 3}, 6}}, "", false, false);
  EXPECT_EQ(p.out_format, kCsr);
  EXPECT_EQ(p.convert, (Strings{"", ""}));
  EXPECT_EQ(p.out_shape, (Sizes{4, 3}));
  EXPECT_TRUE(contains(p.spec, "out=" + kCsr)) << p.spec;
  EXPECT_TRUE(contains(joined(p.reasons), "sparse output stored as csr")) << joined(p.reasons);
}

TEST(Plan, SumOfSparseTermsIsSparseButNotWithADenseTerm) {
  Plan p = make_plan(add(), {{"csr", {4, 5}, 7}, {"csr", {4, 5}, 6}}, "", false, false);
  EXPECT_EQ(p.out_format, kCsr);
  EXPECT_TRUE(contains(joined(p.reasons), "output takes the format of A")) << joined(p.reasons);
  p = make_plan(add(), {{"csr", {4, 5}, 7}, {"strided", {4, 5}, 20}}, "", false, false);
  EXPECT_EQ(p.out_format, "strided");
  EXPECT_FALSE(p.reasons.empty());
}

TEST(Plan, SampledProductTakesTheSamplingOperandsFormat) {
  const auto st = ir::parse_index_notation("C(i,j) = S(i,j) * A(i,k) * B(k,j)", {"S", "A", "B"});
  const Plan p = make_plan(st, {{"coo", {4, 5}, 7}, {"strided", {4, 3}, 12}, {"strided", {3, 5}, 15}}, "", false, false);
  EXPECT_EQ(p.out_format, "compressed[nonunique](0),singleton(1)");  // S's format (COO)
  EXPECT_EQ(p.var_sizes, (Sizes{4, 5, 3}));
  EXPECT_TRUE(contains(joined(p.reasons), "output takes the format of S")) << joined(p.reasons);
}

TEST(Plan, ConflictingLevelOrderConvertsTheCheapestOperand) {
  // A is CSR (i before j), B is CSC (j before i): no loop order walks both in storage order.
  Plan p = make_plan(add(), {{"csr", {4, 5}, 7}, {"csc", {4, 5}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{"", kCsr}));  // B stores fewer values: B is re-sorted
  EXPECT_TRUE(contains(p.spec, "t0=" + kCsr + "; t1=" + kCsr)) << p.spec;
  EXPECT_TRUE(contains(joined(p.reasons), "B converted from csc to csr")) << joined(p.reasons);

  p = make_plan(add(), {{"csr", {4, 5}, 3}, {"csc", {4, 5}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{kCsc, ""}));  // now A is the cheaper one
  EXPECT_TRUE(contains(p.spec, "t0=" + kCsc + "; t1=" + kCsc)) << p.spec;
  EXPECT_TRUE(contains(joined(p.reasons), "A converted from csr to csc")) << joined(p.reasons);

  // The same through a transposed access: A(i,j) * B(j,i), both CSR.
  const auto st = ir::parse_index_notation("C(i,j) = A(i,j) * B(j,i)", {"A", "B"});
  p = make_plan(st, {{"csr", {4, 4}, 9}, {"csr", {4, 4}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{"", kCsc}));
  p = make_plan(st, {{"csr", {4, 4}, 5}, {"csr", {4, 4}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{kCsc, ""}));
}

TEST(Plan, CompatibleOrdersConvertNothing) {
  // CSR times CSC in an SpGEMM: the loop order i, k, j walks both.
  const auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  const Plan p = make_plan(st, {{"csr", {4, 5}, 7}, {"csc", {5, 3}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{"", ""}));
}

TEST(Plan, UncompilableFormatsAndRepeatedIndicesAreConverted) {
  Plan p = make_plan(spmv(), {{"bsr(2,2)", {4, 6}, 8}, {"strided", {6}, 6}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{kCsr, ""}));
  EXPECT_TRUE(contains(joined(p.reasons), "A (bsr(2,2)) converted to")) << joined(p.reasons);

  p = make_plan(ir::parse_index_notation("y(i) = A(i,i)", {"A"}), {{"csr", {4, 4}, 3}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{"strided"}));
  EXPECT_TRUE(contains(p.spec, "t0=strided")) << p.spec;

  // One tensor read in two conflicting orders: no conversion helps, it is densified.
  p = make_plan(ir::parse_index_notation("C(i,j) = A(i,j) * A(j,i)", {"A"}), {{"csr", {4, 4}, 3}}, "", false, false);
  EXPECT_EQ(p.convert, (Strings{"strided"}));
  EXPECT_TRUE(contains(joined(p.reasons), "A densified: its accesses need conflicting orders")) << joined(p.reasons);
}

TEST(Plan, ExplicitOutputFormatIsHonoured) {
  // SpMV would infer a dense output; a compressed vector was asked for.
  Plan p = make_plan(spmv(), {{"csr", {4, 5}, 7}, {"strided", {5}, 5}}, "compressed(0)", false, false);
  EXPECT_EQ(p.out_format, "compressed(0)");
  EXPECT_TRUE(contains(p.spec, "out=compressed(0)")) << p.spec;
  // A preset name is expanded.
  const auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  p = make_plan(st, {{"csr", {4, 5}, 7}, {"strided", {5, 3}, 15}}, "csr", false, false);
  EXPECT_EQ(p.out_format, kCsr);
  // A sum of sparse terms would infer sparse; dense was asked for ("dense" and "strided" both mean it).
  p = make_plan(add(), {{"csr", {4, 5}, 7}, {"csr", {4, 5}, 6}}, "dense", false, false);
  EXPECT_EQ(p.out_format, "strided");
  EXPECT_TRUE(contains(joined(p.reasons), "output requested dense")) << joined(p.reasons);
  p = make_plan(add(), {{"csr", {4, 5}, 7}, {"csr", {4, 5}, 6}}, "strided", false, false);
  EXPECT_EQ(p.out_format, "strided");
  EXPECT_TRUE(contains(p.spec, "out=strided")) << p.spec;
}

// Every requested output format leaves a reason in the plan, as every inferred one does (found missing for
// "strided" and sparse formats while writing these tests; fixed in plan.cpp).
TEST(Plan, ExplicitOutputFormatGivesAReason) {
  Plan p = make_plan(spmv(), {{"csr", {4, 5}, 7}, {"strided", {5}, 5}}, "compressed(0)", false, false);
  EXPECT_FALSE(p.reasons.empty());
  p = make_plan(add(), {{"csr", {4, 5}, 7}, {"csr", {4, 5}, 6}}, "strided", false, false);
  EXPECT_FALSE(p.reasons.empty());
}

TEST(Plan, HugeSparseOutputDropsItsDenseLevel) {
  // A CSR result with 2^31 rows but 4 stored operand values would allocate 2^31 + 1 row positions.
  const auto st = ir::parse_einsum("ij,jk->ik", {2, 2});
  const Plan p = make_plan(st, {{"csr", {int64_t{1} << 31, 5}, 2}, {"csr", {5, 3}, 2}}, "", false, false);
  EXPECT_EQ(p.out_format, "compressed(0),compressed(1)");
  EXPECT_EQ(p.out_shape, (Sizes{int64_t{1} << 31, 3}));
  EXPECT_TRUE(contains(joined(p.reasons), "stored as dcsr rather than csr")) << joined(p.reasons);
}

TEST(Plan, ShapeMismatchesAreValueErrors) {
  Raised r = raised_by([] { make_plan(spmv(), {{"csr", {4, 5}, 7}, {"strided", {6}, 6}}, "", false, false); });
  ASSERT_TRUE(r.raised);
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, "index 'j' has size 6 here but 5 elsewhere")) << r.what;

  r = raised_by([] { make_plan(add(), {{"csr", {4, 5}, 7}, {"csr", {4, 6}, 6}}, "", false, false); });
  ASSERT_TRUE(r.raised);
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, "index 'j' has size 6 here but 5 elsewhere")) << r.what;

  r = raised_by([] { make_plan(add(), {{"strided", {4, 5, 2}, 40}, {"csr", {4, 5}, 6}}, "", false, false); });
  ASSERT_TRUE(r.raised);
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, "A has 3 dimensions but is indexed with 2")) << r.what;

  r = raised_by([] { make_plan(spmv(), {{"csr", {4, 5}, 7}}, "", false, false); });
  ASSERT_TRUE(r.raised);
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, "the statement uses 2 operands, 1 were given")) << r.what;
}

// ---------------------------------------------------------------------------------------------------------
// differentiate

std::string grad(const ir::Statement& st, int tensor, bool with_pattern) {
  const auto g = differentiate(st, tensor, with_pattern);
  return g ? g->canonical() : "none";
}

TEST(Differentiate, ProductSpmv) {
  const auto st = spmv();  // t0 = A, t1 = x; G = t2, pattern = t3
  // dA(i,j) = G(i) * x(j), and sampled at A's pattern.
  EXPECT_EQ(grad(st, 0, false), "out(i0,i1) = t2(i0) * t1(i1)");
  EXPECT_EQ(grad(st, 0, true), "out(i0,i1) = t3(i0,i1) * (t2(i0) * t1(i1))");
  // dx(j) = sum_i G(i) * A(i,j).
  EXPECT_EQ(grad(st, 1, false), "out(i0) = t2(i1) * t0(i1,i0)");
  const auto g = differentiate(st, 0, true);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->tensor_names, (Strings{"A", "x", "grad_output", "pattern"}));
  EXPECT_EQ(g->str(), "out(d0,d1) = pattern(d0,d1) * (grad_output(d0) * x(d1))");
}

TEST(Differentiate, SumTermByTermWithAConstantFactor) {
  const auto st = ir::parse_index_notation("y(i) = A(i,j) * x(j) + 3 * b(i)", {"A", "x", "b"});
  EXPECT_EQ(grad(st, 0, false), "out(i0,i1) = t3(i0) * t1(i1)");
  EXPECT_EQ(grad(st, 1, false), "out(i0) = t3(i1) * t0(i1,i0)");
  EXPECT_EQ(grad(st, 2, false), "out(i0) = t3(i0) * 3.0");
  // A difference negates; a negation is kept as one.
  const auto diff = ir::parse_index_notation("y(i) = b(i) - 2 * c(i)", {"b", "c"});
  EXPECT_EQ(grad(diff, 1, false), "out(i0) = t2(i0) * -2.0");
  const auto neg = ir::parse_index_notation("y(i) = -(A(i,j) * x(j))", {"A", "x"});
  EXPECT_EQ(grad(neg, 0, false), "out(i0,i1) = t2(i0) * -t1(i1)");
}

TEST(Differentiate, RepeatedOperandSumsItsContributions) {
  // y = A .* A - x: dA = 2 G A, as two contributions each sampled at the pattern; dx = -G.
  const auto st = ir::parse_index_notation("y(i) = A(i,j) * A(i,j) - x(i)", {"A", "x"});
  EXPECT_EQ(grad(st, 0, true), "out(i0,i1) = t3(i0,i1) * (t2(i0) * t0(i0,i1)) + t3(i0,i1) * (t2(i0) * t0(i0,i1))");
  EXPECT_EQ(grad(st, 1, true), "out(i0) = t3(i0) * (t2(i0) * -1.0)");
  // Gradients are run as kernels: their canonical text parses back to itself.
  for (int t = 0; t < 2; ++t) {
    const std::string text = grad(st, t, true);
    EXPECT_EQ(ir::parse_index_notation(text, {"t0", "t1", "t2", "t3"}).canonical(), text);
  }
}

TEST(Differentiate, ScalarOperand) {
  const auto st = ir::parse_index_notation("y(i) = s * x(i)", {"s", "x"});
  EXPECT_EQ(grad(st, 0, false), "out() = t2(i0) * t1(i0)");
}

TEST(Differentiate, IndependentTensorGivesNothing) {
  const auto st = ir::parse_index_notation("y(i) = A(i,j) * x(j)", {"A", "x", "unused"});
  EXPECT_FALSE(differentiate(st, 2, false).has_value());
  EXPECT_FALSE(differentiate(st, 2, true).has_value());
}

TEST(Differentiate, RepeatedIndexIsAValueError) {
  const auto st = ir::parse_index_notation("y(i) = A(i,i) * x(i)", {"A", "x"});
  const Raised r = raised_by([&] { differentiate(st, 0, false); });
  ASSERT_TRUE(r.raised);
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, "cannot differentiate with respect to A: it is indexed with a repeated index")) << r.what;
  // The other operand is fine.
  EXPECT_EQ(grad(st, 1, false), "out(i0) = t2(i0) * t0(i0,i0)");
}

// ---------------------------------------------------------------------------------------------------------
// split_reductions

struct StepText {
  std::string stmt;
  std::vector<int> operands;
  bool operator==(const StepText&) const = default;
};

void PrintTo(const StepText& s, std::ostream* os) {
  *os << s.stmt << " on";
  for (int o : s.operands) *os << " " << o;
}

std::vector<StepText> steps(const std::string& text, const Strings& names) {
  std::vector<StepText> out;
  for (const auto& s : ir::split_reductions(ir::parse_index_notation(text, names)))
    out.push_back({s.stmt.canonical(), s.operands});
  return out;
}

const Strings kNames = {"A", "B", "x", "b", "c"};  // tensors 0..4; temporaries are 5, 6, ...

TEST(SplitReductions, ReductionInsideATermIsSplitOff) {
  EXPECT_EQ(steps("y(i) = A(i,j) * x(j) + b(i)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1)", {0, 2}}, {"out(i0) = t0(i0) + t1(i0)", {5, 3}}}));
  // The steps' local tensor names are the global ones.
  const auto s = ir::split_reductions(ir::parse_index_notation("y(i) = A(i,j) * x(j) + b(i)", kNames));
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].stmt.tensor_names, (Strings{"A", "x"}));
  EXPECT_EQ(s[1].stmt.tensor_names, (Strings{"temporary 1", "b"}));
}

TEST(SplitReductions, WholeRightSideIsOneStep) {
  EXPECT_EQ(steps("y(i) = A(i,j) * x(j)", kNames), (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1)", {0, 2}}}));
  EXPECT_EQ(steps("y(i) = A(i,j) * x(j) * b(i)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1) * t2(i0)", {0, 2, 3}}}));
  // j is used in both terms: its scope is the whole sum.
  EXPECT_EQ(steps("y(i) = A(i,j) * x(j) + B(i,j)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1) + t2(i0,i1)", {0, 2, 1}}}));
}

// An index used by one factor of a product whose other factors vary over indices of their own is summed over
// that factor first; without such other indices the product stays one loop nest.
TEST(SplitReductions, OneFactorsOwnIndexIsSummedOverIt) {
  EXPECT_EQ(steps("y() = x(i) * b(j)", kNames),
            (std::vector<StepText>{{"out() = t0(i0)", {2}}, {"out() = t0() * t1(i1)", {5, 3}}}));
  EXPECT_EQ(steps("y(i) = A(i,j) * B(i,k)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1)", {0}}, {"out(i0) = t0(i0) * t1(i0,i2)", {5, 1}}}));
  EXPECT_EQ(steps("y() = A(i,j) * x(j)", kNames), (std::vector<StepText>{{"out() = t0(i0,i1) * t1(i1)", {0, 2}}}));
  // With sizes: a temporary over more than kMaxFactorTemporary elements is not made.
  const auto st = ir::parse_index_notation("y(j) = A(i,j) * b(k)", kNames);
  std::vector<int64_t> sizes(st.var_names.size(), 5);
  EXPECT_EQ(ir::split_reductions(st, sizes).size(), 3u);  // sum_i A, sum_k b, their product
  const auto j = std::find(st.var_names.begin(), st.var_names.end(), "j") - st.var_names.begin();
  sizes[static_cast<size_t>(j)] = ir::kMaxFactorTemporary + 1;
  const auto big = ir::split_reductions(st, sizes);
  ASSERT_EQ(big.size(), 2u);
  EXPECT_EQ(big[0].operands, (std::vector<int>{3}));  // (b's sum only; A is read in the product)
}

TEST(SplitReductions, NestedScopes) {
  // A reduction over a lone access is still the term's own: y(i) = (sum_j A(i,j)) + b(i).
  EXPECT_EQ(steps("y(i) = A(i,j) + b(i)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1)", {0}}, {"out(i0) = t0(i0) + t1(i0)", {5, 3}}}));
  // Two independent terms: one temporary each, then their difference.
  EXPECT_EQ(steps("y(i) = A(i,j) * x(j) - B(i,k) * x(k)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1)", {0, 2}},
                                   {"out(i0) = t0(i0,i2) * t1(i2)", {1, 2}},
                                   {"out(i0) = t0(i0) - t1(i0)", {5, 6}}}));
  // A sum inside a product: k is summed in the inner term, j over the whole right side.
  EXPECT_EQ(steps("y(i) = (A(i,j) * B(j,k) * x(k) + b(j)) * c(i,j)", kNames),
            (std::vector<StepText>{{"out(i0,i1) = t0(i0,i1) * t1(i1,i2) * t2(i2)", {0, 1, 2}},
                                   {"out(i0) = (t0(i0,i1) + t1(i1)) * t2(i0,i1)", {5, 3, 4}}}));
  // Three levels: the deepest scope (k) first, then j, whose term uses the first temporary.
  EXPECT_EQ(steps("y(i) = A(i,j) * (B(j,k) * x(k) + b(j)) + c(i)", kNames),
            (std::vector<StepText>{{"out(i1) = t0(i1,i2) * t1(i2)", {1, 2}},
                                   {"out(i0) = t0(i0,i1) * (t1(i1) + t2(i1))", {0, 5, 3}},
                                   {"out(i0) = t0(i0) + t1(i0)", {6, 4}}}));
  // A scalar output: the reduction over i spans both terms, j only the first.
  EXPECT_EQ(steps("y() = A(i,j) * x(j) + b(i)", kNames),
            (std::vector<StepText>{{"out(i0) = t0(i0,i1) * t1(i1)", {0, 2}}, {"out() = t0(i0) + t1(i0)", {5, 3}}}));
}

TEST(SplitReductions, StepsPlanAfterAReparse) {
  // The executor re-parses each step's canonical text; every step must plan with its operands' shapes.
  const Strings names = {"A", "B", "x", "b", "c"};
  const std::vector<Sizes> shapes = {{4, 5}, {5, 6}, {6}, {5}, {4}};
  const auto st = ir::parse_index_notation("y(i) = A(i,j) * (B(j,k) * x(k) + b(j)) + c(i)", names);
  std::vector<Sizes> all = shapes;
  for (const auto& s : ir::split_reductions(st)) {
    std::vector<OperandDesc> ops;
    Strings local;
    for (int g : s.operands) {
      local.push_back("t" + std::to_string(local.size()));
      int64_t numel = 1;
      for (int64_t d : all[g]) numel *= d;
      ops.push_back({"strided", all[g], numel});
    }
    const Plan p = make_plan(ir::parse_index_notation(s.stmt.canonical(), local), ops, "", false, false);
    all.push_back(p.out_shape);
  }
  ASSERT_EQ(all.size(), shapes.size() + 3);
  EXPECT_EQ(all[5], (Sizes{5}));  // B x, over j
  EXPECT_EQ(all[6], (Sizes{4}));  // A (B x + b), over i
  EXPECT_EQ(all[7], (Sizes{4}));  // y
}

// ---------------------------------------------------------------------------------------------------------
// The kernel frame (no kernel is compiled: the loop IR is printed and read).

struct Frame {
  KernelSpec spec;
  Schedule sched;
  std::string args, parallel, serial;
};

Frame frame_of(const std::string& spec_text) {
  Frame f;
  f.spec = KernelSpec::parse(spec_text);
  f.sched = make_schedule(f.spec);
  f.args = loops::print(unpack_arguments(f.spec));
  const loops::Stmts nest{loops::line("NEST_MARKER;")};
  f.parallel = loops::print(thread_frame(f.spec, f.sched, nest, true));
  f.serial = loops::print(thread_frame(f.spec, f.sched, nest, false));
  return f;
}

// The nest sits once, inside the thread region, which `code` closes before its epilogue.
void expect_nest_inside_region(const std::string& code) {
  EXPECT_EQ(count(code, "NEST_MARKER;"), 1u) << code;
  EXPECT_EQ(count(code, "#pragma omp parallel num_threads(nthreads)"), 1u) << code;
  const size_t region = code.find("#pragma omp parallel"), nest = code.find("NEST_MARKER;"),
               ret = code.find("return args->status;");
  EXPECT_LT(region, nest) << code;
  EXPECT_LT(nest, ret) << code;
  EXPECT_LT(code.find("const int tid = omp_get_thread_num();"), nest) << code;
}

const std::string kSpmvSpec = "out(i0) = t0(i0,i1) * t1(i1); t0=" + kCsr + "; t1=strided; out=strided; f32; i32";

TEST(KernelFrame, UnpackArgumentsNamesEveryBufferInAbiOrder) {
  const Frame f = frame_of(kSpmvSpec);
  const std::string& a = f.args;
  EXPECT_TRUE(contains(a, "const int64_t N0 = args->sizes[0];")) << a;
  EXPECT_TRUE(contains(a, "const int64_t N1 = args->sizes[1];")) << a;
  // CSR: the dense level has no buffers; the compressed level's pos and crd, then the values.
  EXPECT_TRUE(contains(a, "t0_pos1 = (const idx_t*)args->inputs[0];")) << a;
  EXPECT_TRUE(contains(a, "t0_crd1 = (const idx_t*)args->inputs[1];")) << a;
  EXPECT_TRUE(contains(a, "t0_vals = (const val_t*)args->inputs[2];")) << a;
  EXPECT_TRUE(contains(a, "t0_crd1_n = args->lengths ? args->lengths[1] : (int64_t)t0_pos1[(1 * N0)];")) << a;
  EXPECT_TRUE(contains(a, "t1_data = (const val_t*)args->inputs[3];")) << a;
  EXPECT_TRUE(contains(a, "const int64_t t1_st0 = 1;")) << a;
  // The dense output.
  EXPECT_TRUE(contains(a, "val_t* __restrict out = (val_t*)args->out_dense;")) << a;
  EXPECT_TRUE(contains(a, "const int64_t os0 = 1;")) << a;
  EXPECT_TRUE(contains(a, "const int64_t out_numel = 1 * N0;")) << a;
}

TEST(KernelFrame, StridedOperandsAreRowMajorWithALiteralUnitStride) {
  const Frame f = frame_of("out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i2,i1); t0=" + kCsr +
                           "; t1=strided; t2=strided; out=" + kCsr + "; f32; i32");
  EXPECT_TRUE(contains(f.args, "const int64_t t1_st1 = 1;")) << f.args;
  EXPECT_TRUE(contains(f.args, "const int64_t t1_st0 = 1 * N2;")) << f.args;
  EXPECT_TRUE(contains(f.args, "const int64_t t2_st1 = 1;")) << f.args;
  EXPECT_TRUE(contains(f.args, "const int64_t t2_st0 = 1 * N1;")) << f.args;
  EXPECT_TRUE(contains(f.args, "t2_data = (const val_t*)args->inputs[4];")) << f.args;
  // A sparse output has no dense `out`.
  EXPECT_FALSE(contains(f.args, "out_numel")) << f.args;
  EXPECT_FALSE(contains(f.args, "args->out_dense")) << f.args;
}

TEST(KernelFrame, ParallelAndSerialThreadCounts) {
  const Frame f = frame_of(kSpmvSpec);
  ASSERT_TRUE(f.sched.parallel);
  ASSERT_FALSE(f.sched.private_output);
  EXPECT_TRUE(contains(f.parallel, "int nthreads = args->num_threads > 0 ? args->num_threads : 1;")) << f.parallel;
  EXPECT_TRUE(contains(f.serial, "int nthreads = 1;")) << f.serial;
  EXPECT_FALSE(contains(f.serial, "args->num_threads")) << f.serial;
  for (const std::string* code : {&f.parallel, &f.serial}) {
    expect_nest_inside_region(*code);
    // A dense output without a reduction outside: every thread writes `out` directly.
    EXPECT_TRUE(contains(*code, "val_t* __restrict o = out;")) << *code;
    EXPECT_FALSE(contains(*code, "priv")) << *code;
    EXPECT_FALSE(contains(*code, "Stream")) << *code;
    EXPECT_TRUE(contains(*code, "if (bad_index) args->status = SCORCH_STATUS_BAD_INDEX;")) << *code;
  }
}

TEST(KernelFrame, OuterReductionGetsPrivateCopiesSummedAfter) {
  // A^T x with A in CSR: the outer loop is A's row, summed over, so each thread has its own output copy.
  const Frame f = frame_of("out(i0) = t0(i1,i0) * t1(i1); t0=" + kCsr + "; t1=strided; out=strided; f32; i32");
  ASSERT_TRUE(f.sched.private_output);
  for (const std::string* code : {&f.parallel, &f.serial}) {
    expect_nest_inside_region(*code);
    EXPECT_TRUE(contains(*code, "val_t** priv = (val_t**)calloc(nthreads, sizeof(val_t*));")) << *code;
    EXPECT_TRUE(contains(*code, "val_t* __restrict o = tid == 0 ? out : (val_t*)calloc(")) << *code;
    EXPECT_TRUE(contains(*code, "out[q] += priv[t][q];")) << *code;
    EXPECT_GT(code->find("out[q] += priv[t][q];"), code->find("NEST_MARKER;")) << *code;
    EXPECT_TRUE(contains(*code, "free(priv);")) << *code;
  }
  // Only a parallel frame falls back to one thread when the copies would be too big.
  EXPECT_TRUE(contains(f.parallel, "if (out_numel > (int64_t{1} << 24)) nthreads = 1;")) << f.parallel;
  EXPECT_FALSE(contains(f.serial, "out_numel > (int64_t{1} << 24)")) << f.serial;
}

TEST(KernelFrame, SparseOutputStreamsAndWorkspace) {
  // SpGEMM: a sparse output whose last variable is reached inside the reduction, through a row workspace.
  const Frame f = frame_of("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=" + kCsr + "; t1=" + kCsr + "; out=" + kCsr +
                           "; f32; i32");
  ASSERT_EQ(f.sched.output, OutputMode::workspace);
  ASSERT_EQ(f.sched.workspace_var, 1);
  for (const std::string* code : {&f.parallel, &f.serial}) {
    expect_nest_inside_region(*code);
    EXPECT_TRUE(contains(*code, "Stream* streams = (Stream*)calloc(nthreads, sizeof(Stream));")) << *code;
    EXPECT_TRUE(contains(*code, "Stream& st = streams[tid];")) << *code;
    EXPECT_TRUE(contains(*code, "val_t* ws_val = (val_t*)calloc(N1 ? N1 : 1, sizeof(val_t));")) << *code;
    EXPECT_LT(code->find("ws_val = "), code->find("NEST_MARKER;")) << *code;
    EXPECT_GT(code->find("free(ws_val);"), code->find("NEST_MARKER;")) << *code;
    EXPECT_TRUE(contains(*code, "if (!join_streams(streams, nthreads, 2, args))")) << *code;
    EXPECT_GT(code->find("join_streams"), code->find("NEST_MARKER;")) << *code;
    EXPECT_FALSE(contains(*code, "val_t* __restrict o =")) << *code;
  }
}

TEST(KernelFrame, AppendedSparseOutputHasStreamsButNoWorkspace) {
  const Frame f = frame_of("out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=" + kCsr + "; t1=" + kCsr + "; out=" + kCsr +
                           "; f32; i32");
  ASSERT_EQ(f.sched.output, OutputMode::append);
  EXPECT_TRUE(contains(f.parallel, "Stream& st = streams[tid];")) << f.parallel;
  EXPECT_TRUE(contains(f.parallel, "join_streams(streams, nthreads, 2, args)")) << f.parallel;
  EXPECT_FALSE(contains(f.parallel, "ws_val")) << f.parallel;
}

TEST(KernelFrame, SampledOutputIsWrittenInPlace) {
  // SDDMM: the output has S's pattern, so there are no streams; values go to the sampled buffer.
  const Frame f = frame_of("out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i2,i1); t0=" + kCsr +
                           "; t1=strided; t2=strided; out=" + kCsr + "; f32; i32");
  ASSERT_EQ(f.sched.output, OutputMode::sampled);
  for (const std::string* code : {&f.parallel, &f.serial}) {
    expect_nest_inside_region(*code);
    EXPECT_TRUE(contains(*code, "val_t* __restrict sampled_out = (val_t*)args->out_dense;")) << *code;
    EXPECT_FALSE(contains(*code, "Stream")) << *code;
    EXPECT_FALSE(contains(*code, "join_streams")) << *code;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Settings

// Sets (or, with nullptr, unsets) an environment variable for one scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() { set(old_ ? old_->c_str() : nullptr); }
  void set(const char* value) {
    if (value) setenv(name_, value, 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

template <typename F>
void expect_bad(F&& read, const char* var, const std::string& value) {
  const Raised r = raised_by(read);
  ASSERT_TRUE(r.raised) << var << "='" << value << "' was accepted";
  EXPECT_EQ(r.kind, ErrorKind::value);
  EXPECT_TRUE(contains(r.what, var)) << r.what;
  EXPECT_TRUE(contains(r.what, "'" + value + "'")) << r.what;
}

TEST(Settings, DispatchMode) {
  ScopedEnv env("SCORCH_DISPATCH", nullptr);
  EXPECT_EQ(dispatch_mode(), DispatchMode::automatic);
  env.set("");
  EXPECT_EQ(dispatch_mode(), DispatchMode::automatic);
  env.set("sparse");
  EXPECT_EQ(dispatch_mode(), DispatchMode::sparse);
  env.set(" dense\n");  // surrounding blanks are ignored
  EXPECT_EQ(dispatch_mode(), DispatchMode::dense);
  env.set("auto");
  EXPECT_EQ(dispatch_mode(), DispatchMode::automatic);
  for (const char* bad : {"Sparse", "DENSE", "1", "sparse,dense", "dens"}) {
    env.set(bad);
    expect_bad([] { dispatch_mode(); }, "SCORCH_DISPATCH", bad);
    expect_bad([] { dispatch_mode(); }, "SCORCH_DISPATCH", bad);  // still refused: no bad value is cached
  }
  env.set("dense");  // a change after a refusal is read again
  EXPECT_EQ(dispatch_mode(), DispatchMode::dense);
  env.set(nullptr);
  EXPECT_EQ(dispatch_mode(), DispatchMode::automatic);
  EXPECT_STREQ(dispatch_mode_name(DispatchMode::automatic), "auto");
  EXPECT_STREQ(dispatch_mode_name(DispatchMode::sparse), "sparse");
  EXPECT_STREQ(dispatch_mode_name(DispatchMode::dense), "dense");
}

TEST(Settings, DenseCrossoverOverride) {
  ScopedEnv env("SCORCH_DENSE_CROSSOVER", nullptr);
  EXPECT_FALSE(dense_crossover_override().has_value());
  env.set("0.3");
  EXPECT_EQ(dense_crossover_override(), std::optional<double>(0.3));
  env.set("1");
  EXPECT_EQ(dense_crossover_override(), std::optional<double>(1.0));
  env.set(" 1e-3 ");
  EXPECT_EQ(dense_crossover_override(), std::optional<double>(0.001));
  for (const char* bad : {"0", "-0.1", "1.5", "0.3x", "abc", "nan", "inf", "0.3 0.4"}) {
    env.set(bad);
    expect_bad([] { dense_crossover_override(); }, "SCORCH_DENSE_CROSSOVER", bad);
  }
  env.set("0.25");
  EXPECT_EQ(dense_crossover_override(), std::optional<double>(0.25));
  env.set("");
  EXPECT_FALSE(dense_crossover_override().has_value());
}

TEST(Settings, DebugLevel) {
  ScopedEnv env("SCORCH_DEBUG", nullptr);
  EXPECT_EQ(debug_level(), 0);
  env.set("1");
  EXPECT_EQ(debug_level(), 1);
  env.set("2");
  EXPECT_EQ(debug_level(), 2);
  env.set(" 3 ");
  EXPECT_EQ(debug_level(), 3);
  env.set("0");
  EXPECT_EQ(debug_level(), 0);
  for (const char* bad : {"-1", "+1", "1.0", "yes", "true", "2x", "99999999999"}) {
    env.set(bad);
    expect_bad([] { debug_level(); }, "SCORCH_DEBUG", bad);
  }
  env.set("2");
  EXPECT_EQ(debug_level(), 2);
  env.set(nullptr);
  EXPECT_EQ(debug_level(), 0);
}

TEST(Settings, VariablesAreIndependent) {
  ScopedEnv dispatch("SCORCH_DISPATCH", "sparse"), debug("SCORCH_DEBUG", "bad"), cross("SCORCH_DENSE_CROSSOVER", "0.5");
  // A bad SCORCH_DEBUG does not affect the other readers.
  EXPECT_EQ(dispatch_mode(), DispatchMode::sparse);
  EXPECT_EQ(dense_crossover_override(), std::optional<double>(0.5));
  expect_bad([] { debug_level(); }, "SCORCH_DEBUG", "bad");
}

}  // namespace
}  // namespace scorch
