// The region op's kernel prediction (region_kernels.h) against what its run path hands the executor, and the
// table of measured decisions (measured_choice.h). Needs the torch op library (no kernel is compiled or run).
#include <thread>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "torch/executor.h"
#include "torch/measured_choice.h"
#include "torch/region.h"
#include "torch/region_kernels.h"

namespace glue = scorch::torch_glue;

namespace {

// The spec the sparse path would run for these operands: its equation and operands as region_sparse_call gives
// them (compressed through the cache), planned as run_einsum plans them.
std::string run_path_spec(const std::string& text, const std::vector<at::Tensor>& operands) {
  auto [equation, ops] = glue::region_sparse_call(text, operands);
  std::vector<scorch::OperandDesc> descs;
  bool idx64 = false, f64 = false;
  for (const auto& o : ops) {
    descs.push_back(o.desc());
    idx64 = idx64 || glue::needs_index64(o.format, o.sparse() ? o.nnz() : 0, o.shape);
    f64 = f64 || o.values.scalar_type() == at::kDouble;
  }
  return glue::plan_einsum(equation, descs, "strided", f64, idx64).spec;
}

std::string operand(const std::string& letters, const std::string& kind) {
  return "[\"" + letters + "\",\"" + kind + "\",false,true,0,false]";
}

std::string program(const std::vector<std::string>& operands, const std::string& out, const std::string& extra = "") {
  std::string s = "{\"operands\":[";
  for (size_t k = 0; k < operands.size(); ++k) s += (k ? "," : "") + operands[k];
  return s + "],\"out\":\"" + out + "\",\"coef\":1,\"frozen\":false,\"name\":\"t\"" + extra + "}";
}

double density(const at::Tensor& t) {
  return static_cast<double>(at::count_nonzero(t).item<int64_t>()) / static_cast<double>(t.numel());
}

at::Tensor sparse_rand(std::vector<int64_t> shape, double keep, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::rand(shape, gen);
  return x * (at::rand(shape, gen) < keep).to(at::kFloat);
}

}  // namespace

// A linear with a sparse activation: x(b,k) sparse, W(n,k) dense -> y(b,n). The forward and both gradient
// programs (W's walks x by columns: col_major) as predicted equal what the run path plans.
TEST(RegionKernels, PredictionMatchesTheRunPathForwardAndGradients) {
  const std::string text = program({operand("bk", "sparse"), operand("nk", "dense")}, "bn");
  const at::Tensor x = sparse_rand({48, 40}, 0.3, 1), w = at::rand({24, 40}), g = at::rand({48, 24});
  const double dx = density(x);
  const auto specs = glue::region_kernel_specs(text, {{48, 40}, {24, 40}}, at::kFloat, {false, true}, {dx, 1.0});
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0], run_path_spec(text, {x, w}));
  const glue::RegionGradient rg = glue::region_gradient(text, 1);
  ASSERT_EQ(rg.operands, (std::vector<int>{-1, 0}));
  EXPECT_NE(rg.text.find("col_major"), std::string::npos) << rg.text;
  EXPECT_EQ(specs[1], run_path_spec(rg.text, {g, x}));
  // x's gradient program has no compressed operand: nothing more is compiled when it is asked for too
  EXPECT_EQ(glue::region_kernel_specs(text, {{48, 40}, {24, 40}}, at::kFloat, {true, true}, {dx, 1.0}), specs);
  // without the gradients, the forward's only
  EXPECT_EQ(glue::region_kernel_specs(text, {{48, 40}, {24, 40}}, at::kFloat, {}, {dx, 1.0}),
            std::vector<std::string>{specs[0]});
}

// A product whose output feeds a ReLU (grad_out sparse), with a bias (an addend): the forward is its
// product's, the weight's gradient takes the output gradient compressed, with its estimated density.
TEST(RegionKernels, SparseOutputGradientAndAddends) {
  const std::string text = program({operand("bk", "dense"), operand("nk", "sparse"), operand("n", "add")}, "bn",
                                   ",\"grad_out\":\"sparse\"");
  const at::Tensor x = at::rand({32, 40}), w = sparse_rand({24, 40}, 0.2, 2), bias = at::rand({24});
  const at::Tensor g = sparse_rand({32, 24}, 0.4, 3);
  const double dw = density(w), dg = density(g);
  const auto specs = glue::region_kernel_specs(text, {{32, 40}, {24, 40}, {24}}, at::kDouble, {true, true, true},
                                               {1.0, dw, 1.0}, dg);
  ASSERT_GE(specs.size(), 2u);
  EXPECT_EQ(specs[0], run_path_spec(text, {x.to(at::kDouble), w.to(at::kDouble), bias.to(at::kDouble)}));
  const glue::RegionGradient gx = glue::region_gradient(text, 0), gw = glue::region_gradient(text, 1);
  std::vector<std::string> want{specs[0]};
  for (const auto& rg : {gx, gw}) {
    std::vector<at::Tensor> args;
    for (int j : rg.operands) args.push_back((j < 0 ? g : j == 0 ? x : w).to(at::kDouble));
    const std::string s = run_path_spec(rg.text, args);
    if (std::find(want.begin(), want.end(), s) == want.end()) want.push_back(s);
  }
  EXPECT_EQ(specs, want);
}

TEST(RegionKernels, AllDenseProgramRunsNoKernel) {
  const std::string text = program({operand("bk", "dense"), operand("nk", "dense")}, "bn");
  EXPECT_TRUE(glue::region_kernel_specs(text, {{4, 5}, {6, 5}}, at::kFloat).empty());
}

TEST(RegionKernels, ShapesThatDoNotFitAreValueErrors) {
  const std::string text = program({operand("bk", "sparse"), operand("nk", "dense")}, "bn");
  auto kind_of = [&](auto&& f) -> std::optional<scorch::ErrorKind> {
    try {
      f();
    } catch (const scorch::Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  EXPECT_EQ(kind_of([&] { glue::region_kernel_specs(text, {{4, 5}}, at::kFloat); }), scorch::ErrorKind::value);
  EXPECT_EQ(kind_of([&] { glue::region_kernel_specs(text, {{4, 5, 1}, {6, 5}}, at::kFloat); }),
            scorch::ErrorKind::value);
  EXPECT_EQ(kind_of([&] { glue::region_kernel_specs(text, {{4, 5}, {6, 5}}, at::kFloat, {true}); }),
            scorch::ErrorKind::value);
  EXPECT_EQ(kind_of([&] { glue::region_kernel_specs(text, {{4, 5}, {6, 5}}, at::kFloat, {}, {2.0, 1.0}); }),
            scorch::ErrorKind::value);
}

TEST(MeasuredChoices, KeepsTheFasterPathPerKey) {
  glue::MeasuredChoices t;
  EXPECT_FALSE(t.known({1, 2}).has_value());
  EXPECT_TRUE(t.record({1, 2}, {2.0, 1.0, false}));   // dense faster
  EXPECT_FALSE(t.record({1, 3}, {1.0, 2.0, false}));  // kernel faster
  EXPECT_EQ(t.known({1, 2}), std::optional<bool>(true));
  EXPECT_EQ(t.known({1, 3}), std::optional<bool>(false));
  const auto s = t.stats();
  EXPECT_EQ(s.measured, 2);
  EXPECT_EQ(s.kept_dense, 1);
  EXPECT_EQ(s.contended, 0);
}

TEST(MeasuredChoices, ContendedDecisionsAreMeasuredAgainABoundedNumberOfTimes) {
  glue::MeasuredChoices t(std::chrono::milliseconds(0));
  t.record({7}, {1.0, 2.0, /*contended=*/true});
  int handed_back = 0;
  for (int i = 0; i < 10; ++i) {
    if (t.known({7}).has_value()) continue;
    ++handed_back;
    t.record({7}, {1.0, 2.0, true});  // still busy
  }
  EXPECT_EQ(handed_back, glue::MeasuredChoices::kMaxRemeasures);
  EXPECT_EQ(t.known({7}), std::optional<bool>(false));
  EXPECT_EQ(t.stats().remeasured, glue::MeasuredChoices::kMaxRemeasures);
  // an uncontended measurement settles it for good
  glue::MeasuredChoices u(std::chrono::milliseconds(0));
  u.record({8}, {2.0, 1.0, true});
  EXPECT_FALSE(u.known({8}).has_value());
  u.record({8}, {2.0, 1.0, false});
  for (int i = 0; i < 5; ++i) EXPECT_EQ(u.known({8}), std::optional<bool>(true));
  // not before the wait is over
  glue::MeasuredChoices w(std::chrono::hours(1));
  w.record({9}, {1.0, 2.0, true});
  EXPECT_EQ(w.known({9}), std::optional<bool>(false));
}

TEST(MeasuredChoices, TimingTakesTheBestAndFlagsASpread) {
  const glue::Timing quiet = glue::timing_of({1.0, 1.1, 1.2}, {3.0, 3.1, 2.9});
  EXPECT_DOUBLE_EQ(quiet.kernel_ms, 1.0);
  EXPECT_DOUBLE_EQ(quiet.dense_ms, 2.9);
  EXPECT_FALSE(quiet.contended);
  EXPECT_TRUE(glue::timing_of({1.0, 1.6, 1.0}, {3.0, 3.0, 3.0}).contended);
  EXPECT_TRUE(glue::timing_of({1.0, 1.0, 1.0}, {3.0, 3.0, 4.6}).contended);
  EXPECT_EQ(glue::size_bucket(1), 0);
  EXPECT_EQ(glue::size_bucket(64), 6);
  EXPECT_EQ(glue::size_bucket(65), 7);
  // Densities by a third of an octave: 4.5% and 0.1% apart (a 5% bucket held both), 0 on its own.
  EXPECT_EQ(glue::density_bucket(1.0), 0);
  EXPECT_EQ(glue::density_bucket(0.5), -3);
  EXPECT_EQ(glue::density_bucket(0.11), glue::density_bucket(0.12));
  EXPECT_NE(glue::density_bucket(0.045), glue::density_bucket(0.001));
  EXPECT_NE(glue::density_bucket(0.001), glue::density_bucket(0.00005));
  EXPECT_LT(glue::density_bucket(0.0), glue::density_bucket(1e-12));
  const int owner = 0;
  const auto key = glue::bucket_key(&owner, 0, {{'i', 100}, {'j', 60}}, {0.11}, 2);
  EXPECT_EQ(key, glue::bucket_key(&owner, 0, {{'i', 120}, {'j', 64}}, {0.12}, 2));  // same buckets
  EXPECT_NE(key, glue::bucket_key(&owner, 0, {{'i', 130}, {'j', 60}}, {0.11}, 2));  // i: 128 < 130
  EXPECT_NE(key, glue::bucket_key(&owner, 0, {{'i', 100}, {'j', 60}}, {0.16}, 2));
  EXPECT_NE(key, glue::bucket_key(&owner, 1, {{'i', 100}, {'j', 60}}, {0.11}, 2));
  EXPECT_NE(key, glue::bucket_key(&owner, 0, {{'i', 100}, {'j', 60}}, {0.11}, 1));
}

// Clocks the paths below move by hand: `work` spends wall and CPU time alike, `stall` only wall time (the
// process off the CPU: another process on the core, a SIGSTOP), so the tests do not depend on the machine's load.
struct FakeClocks {
  double wall = 0, cpu = 0;
  glue::Clocks clocks{[this] { return wall; }, [this] { return cpu; }};
  void work(double ms) { wall += ms, cpu += ms; }
  void stall(double ms) { wall += ms; }
};

// A path many times slower than the other at its first timed run is not run again (it would cost seconds),
// and such a timing is not contended.
TEST(MeasuredChoices, AFarSlowerPathRunsOnce) {
  FakeClocks c;
  int kernel_runs = 0, dense_runs = 0;
  const glue::Timing slow_dense = glue::time_both([&] { ++kernel_runs, c.work(1); },
                                                  [&] { ++dense_runs, c.work(30); }, c.clocks);
  EXPECT_EQ(dense_runs, 1);  // its warm-up, timed
  EXPECT_EQ(kernel_runs, 2);  // warm-up and one timed run
  EXPECT_DOUBLE_EQ(slow_dense.kernel_ms, 1);
  EXPECT_DOUBLE_EQ(slow_dense.dense_ms, 30);
  EXPECT_FALSE(slow_dense.contended);
  kernel_runs = dense_runs = 0;
  const glue::Timing slow_kernel = glue::time_both([&] { ++kernel_runs, c.work(30); },
                                                   [&] { ++dense_runs, c.work(1); }, c.clocks);
  EXPECT_EQ(kernel_runs, 2);
  EXPECT_EQ(dense_runs, 2);
  EXPECT_GT(slow_kernel.kernel_ms, slow_kernel.dense_ms);
  EXPECT_FALSE(slow_kernel.contended);
  kernel_runs = dense_runs = 0;
  glue::time_both([&] { ++kernel_runs, c.work(2); }, [&] { ++dense_runs, c.work(3); }, c.clocks);  // close: all runs
  EXPECT_EQ(kernel_runs, 1 + glue::MeasuredChoices::kRepeats);
  EXPECT_EQ(dense_runs, 1 + glue::MeasuredChoices::kRepeats);
  // The real clocks: a close call runs every repeat whatever the machine's load.
  kernel_runs = dense_runs = 0;
  glue::time_both([&] { ++kernel_runs; }, [&] { ++dense_runs; });
  EXPECT_EQ(kernel_runs, 1 + glue::MeasuredChoices::kRepeats);
  EXPECT_EQ(dense_runs, 1 + glue::MeasuredChoices::kRepeats);
}

// A run during which the process was off the CPU decides nothing alone: the faster path is still found, from
// full timings marked contended (measured again later). helper-43 F7: a stop during the kernel's first timed
// run kept the dense path for good.
TEST(MeasuredChoices, AStalledRunIsNoEvidence) {
  FakeClocks c;
  int kernel_runs = 0, dense_runs = 0;
  const glue::Timing kernel_stalled = glue::time_both(
      [&] {
        if (++kernel_runs == 2) c.stall(40), c.work(0.6);  // its first timed run
        else c.work(1);
      },
      [&] { ++dense_runs, c.work(3); }, c.clocks);
  EXPECT_EQ(kernel_runs, 1 + glue::MeasuredChoices::kRepeats);
  EXPECT_EQ(dense_runs, 1 + glue::MeasuredChoices::kRepeats);
  EXPECT_DOUBLE_EQ(kernel_stalled.kernel_ms, 1);
  EXPECT_DOUBLE_EQ(kernel_stalled.dense_ms, 3);
  EXPECT_TRUE(kernel_stalled.contended);
  kernel_runs = dense_runs = 0;
  const glue::Timing dense_stalled = glue::time_both([&] { ++kernel_runs, c.work(3); },
                                                     [&] {
                                                       if (++dense_runs == 1) c.stall(40), c.work(0.6);
                                                       else c.work(1);
                                                     },
                                                     c.clocks);
  EXPECT_EQ(dense_runs, 1 + glue::MeasuredChoices::kRepeats);
  EXPECT_GT(dense_stalled.kernel_ms, dense_stalled.dense_ms);
  EXPECT_TRUE(dense_stalled.contended);
  // A run with its CPU share just above the line, or too short to judge, is evidence.
  kernel_runs = dense_runs = 0;
  glue::time_both([&] { ++kernel_runs, c.stall(15), c.work(16); }, [&] { ++dense_runs, c.work(1); }, c.clocks);
  EXPECT_EQ(kernel_runs, 2);
  kernel_runs = dense_runs = 0;
  glue::time_both([&] { ++kernel_runs, c.stall(0.4); }, [&] { ++dense_runs, c.work(0.01); }, c.clocks);
  EXPECT_EQ(kernel_runs, 2);
  EXPECT_TRUE(glue::timing_of({1.0}, {2.0}, true).contended);
}

// A pattern that must keep an entry in every fiber along a letter (a softmax's masked probabilities read under
// the mask): the letter survives the text round trip and the gradient programs, bad letters are ValueErrors, and
// a pattern with an empty fiber sends the call to the dense path (which carries the factor's NaN through).
TEST(RegionProgram, NonemptyPatternsAreKeptCheckedAndRunDenseWhenAFiberIsEmpty) {
  const std::string text = program({operand("ij", "dense"), "[\"ij\",\"pattern\",false,false,0,false]",
                                    operand("jk", "dense")},
                                   "ik", ",\"nonempty\":[[1,\"j\"]]");
  const glue::RegionProgram& p = glue::region_program(text);
  ASSERT_TRUE(p.has_nonempty);
  EXPECT_EQ(p.operands[1].nonempty, 'j');
  EXPECT_EQ(glue::region_program(p.text()).operands[1].nonempty, 'j');
  for (int k : {0, 2}) {
    const glue::RegionProgram& g = glue::region_program(glue::region_gradient(text, k).text);
    const auto pattern = std::find_if(g.operands.begin(), g.operands.end(), [](const glue::RegionOperand& o) {
      return o.kind == glue::RegionOperand::Kind::pattern;
    });
    ASSERT_NE(pattern, g.operands.end());
    EXPECT_EQ(pattern->nonempty, 'j') << "gradient of operand " << k;
  }
  auto error_kind = [](const std::string& extra) -> std::optional<scorch::ErrorKind> {
    try {
      glue::region_program(program({operand("ij", "dense"), "[\"ij\",\"pattern\",false,false,0,false]"}, "i", extra));
    } catch (const scorch::Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  for (const char* bad : {",\"nonempty\":[[0,\"j\"]]", ",\"nonempty\":[[1,\"k\"]]", ",\"nonempty\":[[1,\"ij\"]]",
                          ",\"nonempty\":[[2,\"j\"]]", ",\"nonempty\":[[1]]", ",\"nonempty\":\"j\""})
    EXPECT_EQ(error_kind(bad), scorch::ErrorKind::value) << bad;

  at::Tensor probabilities = at::rand({5, 4});
  at::Tensor mask = at::rand({5, 4}) < 0.5;
  mask.select(1, 0).fill_(true);
  const at::Tensor v = at::rand({4, 3});
  mask.select(0, 2).fill_(false);
  probabilities.select(0, 2).fill_(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(glue::region_choose(text, {probabilities, mask, v}), "dense");
  const at::Tensor out = glue::run_region(text, {probabilities, mask, v}, "sparse");
  EXPECT_TRUE(out.select(0, 2).isnan().all().item<bool>());
  EXPECT_FALSE(out.narrow(0, 0, 2).isnan().any().item<bool>());
}
