// The loop IR (loop_ir.h) and the passes of the lowering pipeline (pipeline.h): the IR's printer, visitor,
// mutator and dump; for each pass, the IR before and after it for a few kernels, saved as text under
// tests/cpp/golden/passes (SCORCH_UPDATE_GOLDEN=1 rewrites them), and what the pass must have changed,
// checked on the typed nodes.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <sys/stat.h>
#include <unistd.h>

#include "golden_corpus.h"
#include "test_util.h"
#include "lower/kernel_spec.h"
#include "lower/pipeline.h"
#include "lower/schedule.h"

namespace scorch {
namespace {

using namespace loops;

// ---------------------------------------------------------------------------------------------------------
// The IR itself.

TEST(LoopIr, PrintsEachNodeKind) {
  const ExprPtr i = var("i"), n = var("n");
  Stmts body{decl("const int64_t", "k", add(mul(i, integer(4)), integer(1))),
             assign(load(var("o"), var("k")), paren(mul(load(var("a"), var("k")), floating(2.0))), AssignOp::add),
             on_one_line({if_then(unary(UnOp::logical_not, var("ok")), {assign(var("bad"), integer(1), AssignOp::bit_or)}),
                          eval(call("f", {cast("int64_t", var("k")), select(boolean(true), integer(1), integer(2))}))})};
  Stmts prog{for_range("i", integer(0), n, body, false, "acc"),
             while_loop(land(lt(var("k"), var("ke")), ne(var("c"), integer(0))), {eval(unary(UnOp::pre_inc, var("k")))}),
             if_chain({eq(var("x"), integer(1)), nullptr}, {{comment("one")}, {line("raw();")}}),
             for_step("jo", integer(0), le(add(var("jo"), integer(8)), n), 8, {decl("vec_t", std::vector<std::string>{"a", "b"}, Exprs{init_list({}), nullptr})}),
             parallel(var("nt"), {block({eval(unary(UnOp::post_inc, var("q")))})})};
  EXPECT_EQ(print(prog),
            "#pragma omp simd reduction(+:acc)\n"
            "for (int64_t i = 0; i < n; ++i) {\n"
            "  const int64_t k = i * 4 + 1;\n"
            "  o[k] += (a[k] * 2.0);\n"
            "  if (!ok) bad |= 1; f((int64_t)k, true ? 1 : 2);\n"
            "}\n"
            "while (k < ke && c != 0) {\n"
            "  ++k;\n"
            "}\n"
            "if (x == 1) {\n"
            "  // one\n"
            "} else {\n"
            "  raw();\n"
            "}\n"
            "for (int64_t jo = 0; jo + 8 <= n; jo += 8) {\n"
            "  vec_t a = {}, b;\n"
            "}\n"
            "#pragma omp parallel num_threads(nt)\n"
            "{\n"
            "  {\n"
            "    q++;\n"
            "  }\n"
            "}\n");
}

TEST(LoopIr, VisitorSeesEveryNodeAndMutatorRebuildsOnlyWhatChanged) {
  const StmtPtr untouched = assign(var("x"), integer(1));
  Stmts prog{for_range("i", integer(0), var("n"), {assign(load(var("o"), var("i")), load(var("a"), var("i")), AssignOp::add)}),
             untouched};
  struct Count : Visitor {
    int vars = 0, loads = 0, fors = 0;
    void visit_Var(const Var&) override { ++vars; }
    void visit_Load(const Load& l) override {
      ++loads;
      visit_children(l);
    }
    void visit_For(const For& f) override {
      ++fors;
      visit_children(f);
    }
  } c;
  c.visit(prog);
  EXPECT_EQ(c.fors, 1);
  EXPECT_EQ(c.loads, 2);
  EXPECT_EQ(c.vars, 7);  // i (cond), n, o, i, a, i, x

  // Rename i to j everywhere: the loop is rebuilt, the statement without i is the same node.
  struct Rename : Mutator {
    ExprPtr mutate_Var(const std::shared_ptr<const Var>& v) override { return v->name == "i" ? var("j") : v; }
  } r;
  const Stmts out = r.mutate(prog);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_NE(out[0], prog[0]);
  EXPECT_EQ(out[1], untouched);
  EXPECT_EQ(print(out), "for (int64_t i = 0; j < n; ++i) {\n  o[j] += a[j];\n}\nx = 1;\n");
  // A mutator that changes nothing returns the same nodes.
  Mutator same;
  EXPECT_EQ(same.mutate(prog), prog);
}

TEST(LoopIr, DumpShowsTheTypedStructure) {
  const std::string d = dump({for_range("i", integer(0), var("n"), {eval(call("f", {var("i")}))}, true)});
  EXPECT_EQ(d,
            "For var=\"i\" step=1 simd reduction=\"\"\n"
            "  begin: Int value=0\n"
            "  cond: Binary op=<\n"
            "    a: Var name=\"i\"\n"
            "    b: Var name=\"n\"\n"
            "  body: Eval\n"
            "    e: Call fn=\"f\"\n"
            "      args: Var name=\"i\"\n");
  EXPECT_STREQ(kind_name(StmtKind::Parallel), "Parallel");
  EXPECT_STREQ(kind_name(ExprKind::InitList), "InitList");
}

// ---------------------------------------------------------------------------------------------------------
// The passes.

struct PipelineRun {
  std::vector<std::string> after;  // the IR's text after each pass
  passes::KernelIR last;
};

PipelineRun run(const std::string& text, const VectorShape& machine, bool native = false, int stop_after = 0) {
  static std::vector<std::unique_ptr<KernelSpec>> specs;  // the IR points at them
  static std::vector<std::unique_ptr<Schedule>> scheds;
  specs.push_back(std::make_unique<KernelSpec>(KernelSpec::parse(text)));
  scheds.push_back(std::make_unique<Schedule>(make_schedule(*specs.back())));
  PipelineRun r;
  r.last = run_pipeline(*specs.back(), *scheds.back(), machine,
                        [&](int, const std::string&, const std::string& ir) { r.after.push_back(ir); }, native,
                        stop_after);
  return r;
}

int pass_number(const std::string& name) {
  const auto& list = pipeline_passes();
  for (size_t q = 0; q < list.size(); ++q)
    if (name == list[q].name) return static_cast<int>(q) + 1;
  ADD_FAILURE() << "no pass " << name;
  return 0;
}

// The IR before and after `pass` for a corpus spec, compared with the saved files.
void expect_saved(const std::string& kernel, const std::string& spec, const std::string& pass, const VectorShape& machine) {
  const std::string dir = golden::golden_dir() + "/passes";
  const PipelineRun r = run(spec, machine);
  const int n = pass_number(pass);
  ASSERT_GE(static_cast<int>(r.after.size()), n);
  const std::string before = n >= 2 ? r.after[n - 2] : "", after = r.after[n - 1];
  const std::string stem = fmt::format("{}/{}.{:02d}-{}", dir, kernel, n, pass);
  if (golden::update_requested()) {
    ::mkdir(dir.c_str(), 0755);
    golden::write_text(stem + ".before.txt", before);
    golden::write_text(stem + ".after.txt", after);
    return;
  }
  EXPECT_EQ(golden::read_text(stem + ".before.txt"), before) << stem << ".before.txt";
  EXPECT_EQ(golden::read_text(stem + ".after.txt"), after) << stem << ".after.txt";
  EXPECT_NE(before, after) << pass << " changed nothing in " << kernel;
}

const VectorShape kV32{32, 8};
const char* kSpmv = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32";
const char* kSddmm = "out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i1,i2); t0=csr; t1=strided; t2=strided; out=csr; f32; i32";
const char* kSpgemm = "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=csr; out=csr; f32; i32";
const char* kAtx = "out(i0) = t0(i0,i1) * t1(i1); t0=csc; t1=strided; out=strided; f64; i64";

struct Kinds : Visitor {
  std::map<std::string, int> stmts, calls;
  int unit_stride_reductions = 0;
  void visit_For(const For& f) override {
    ++stmts["For"];
    unit_stride_reductions += f.unit_stride && !f.reduction.empty();
    visit_children(f);
  }
  void visit_Parallel(const Parallel& p) override {
    ++stmts["Parallel"];
    visit_children(p);
  }
  void visit_While(const While& w) override {
    ++stmts["While"];
    visit_children(w);
  }
  void visit_Call(const Call& c) override {
    ++calls[c.fn];
    visit_children(c);
  }
  void visit_Raw(const Raw& r) override { stmts["Raw:" + r.text] += 1; }
};

Kinds kinds_of(const Stmts& s) {
  Kinds k;
  k.visit(s);
  return k;
}

TEST(LoweringPasses, IterateMakesOneThreadsNest) {
  expect_saved("spgemm", kSpgemm, "iterate", kV32);
  const PipelineRun r = run(kSpgemm, kV32, false, pass_number("iterate"));
  EXPECT_TRUE(r.last.body.empty() && r.last.thread.empty());
  const Kinds k = kinds_of(r.last.nest);
  EXPECT_EQ(k.stmts.count("Parallel"), 0u);  // no thread region yet
  EXPECT_GE(k.stmts.at("For"), 2);           // rows, then each row's entries
  EXPECT_TRUE(r.last.parallel);              // the outer loop takes the thread's share
}

TEST(LoweringPasses, VectorizeTurnsUnitStrideReductionsIntoVectorAccumulators) {
  expect_saved("sddmm", kSddmm, "vectorize", kV32);
  const int n = pass_number("vectorize");
  const PipelineRun before = run(kSddmm, kV32, false, n - 1), after = run(kSddmm, kV32, false, n);
  EXPECT_EQ(kinds_of(before.last.nest).unit_stride_reductions, 1);
  EXPECT_EQ(kinds_of(before.last.nest).calls.count("vload"), 0u);
  EXPECT_EQ(kinds_of(after.last.nest).unit_stride_reductions, 0);
  EXPECT_EQ(kinds_of(after.last.nest).calls.at("vload"), 8);  // two operands along i2, four accumulators each
  // Scalar code: nothing to do, the loop keeps its pragma for the C++ compiler.
  const PipelineRun scalar = run(kSddmm, VectorShape{0, 0}, false, n);
  EXPECT_EQ(kinds_of(scalar.last.nest).unit_stride_reductions, 1);
}

TEST(LoweringPasses, OutputAssemblyWrapsTheNestInWhatTheOutputNeeds) {
  expect_saved("spgemm", kSpgemm, "output_assembly", kV32);
  expect_saved("atx", kAtx, "output_assembly", kV32);
  const PipelineRun r = run(kSpgemm, kV32, false, pass_number("output_assembly"));
  EXPECT_TRUE(r.last.nest.empty());
  const Kinds k = kinds_of(r.last.thread);
  EXPECT_EQ(k.stmts.at("Raw:Stream& st = streams[tid];"), 1);
  EXPECT_EQ(k.stmts.at("Raw:free(ws_val); free(ws_flag); free(ws_list);"), 1);
  EXPECT_EQ(kinds_of(r.last.teardown).stmts.at("Raw:free(streams);"), 1);
  const PipelineRun p = run(kAtx, kV32, false, pass_number("output_assembly"));  // outer reduction: private copies
  EXPECT_EQ(kinds_of(p.last.teardown).stmts.at("Raw:free(priv);"), 1);
}

TEST(LoweringPasses, ParallelizeMakesTheThreadRegion) {
  expect_saved("spmv", kSpmv, "parallelize", kV32);
  const PipelineRun r = run(kSpmv, kV32, false, pass_number("parallelize"));
  EXPECT_TRUE(r.last.thread.empty());
  ASSERT_FALSE(r.last.body.empty());
  int top_level_regions = 0;
  for (const auto& s : r.last.body) top_level_regions += s->kind == StmtKind::Parallel;
  EXPECT_EQ(top_level_regions, 1);
}

TEST(LoweringPasses, EntryUnpacksTheArgumentsFirst) {
  expect_saved("spmv", kSpmv, "entry", kV32);
  const PipelineRun r = run(kSpmv, kV32, false, pass_number("entry"));
  ASSERT_FALSE(r.last.body.empty());
  ASSERT_EQ(r.last.body[0]->kind, StmtKind::Raw);
  EXPECT_EQ(static_cast<const Raw&>(*r.last.body[0]).text, "const int64_t N0 = args->sizes[0]; (void)N0;");
}

TEST(LoweringPasses, NativeFormsComeOutWholeAndTheOtherPassesLeaveThem) {
  const PipelineRun r = run("out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=bsr(4,4); t1=strided; out=strided; f32; i32", kV32, true);
  ASSERT_EQ(r.after.size(), pipeline_passes().size());
  EXPECT_TRUE(r.last.native);
  for (size_t q = 1; q < r.after.size(); ++q) EXPECT_EQ(r.after[q], r.after[0]) << pipeline_passes()[q].name;
}

TEST(LoweringPasses, DumpsOneFilePerPassNamedByKernelAndNumber) {
  const std::string dir = test::scratch_dir("pass-dumps");
  const KernelSpec spec = KernelSpec::parse(kSpmv);
  const Schedule sched = make_schedule(spec);
  run_pipeline(spec, sched, kV32, dump_to_folder(dir + "/nested", "abc123", kSpmv));
  const auto& list = pipeline_passes();
  for (size_t q = 0; q < list.size(); ++q) {
    const std::string path = fmt::format("{}/nested/abc123.{:02d}-{}.txt", dir, q + 1, list[q].name);
    const std::string text = golden::read_text(path);
    EXPECT_NE(text.find(std::string("// spec: ") + kSpmv), std::string::npos) << path;
    EXPECT_NE(text.find("after pass " + std::to_string(q + 1) + ": " + list[q].name), std::string::npos) << path;
  }
  EXPECT_NE(golden::read_text(fmt::format("{}/nested/abc123.{:02d}-entry.txt", dir, list.size())).find("#pragma omp parallel"),
            std::string::npos);
}

}  // namespace
}  // namespace scorch
