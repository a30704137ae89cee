#include "lower/kernel_frame.h"

#include <fmt/format.h>

#include "lower/lower.h"

namespace scorch {

using loops::line;
using loops::Stmts;

int input_pointer_count(const KernelSpec& spec) {
  int n = 0;
  for (const auto& s : spec.operands) n += s.strided() ? 1 : s.format->buffer_count() + 1;
  return n;
}

Stmts unpack_arguments(const KernelSpec& spec) {
  Stmts b;
  const auto& st = spec.stmt;
  for (int v = 0; v < st.num_vars(); ++v) b.push_back(line(fmt::format("const int64_t N{0} = args->sizes[{0}]; (void)N{0};", v)));
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(st.rhs, acc);
  int p = 0;
  for (size_t t = 0; t < spec.operands.size(); ++t) {
    const Storage& op = spec.operands[t];
    if (op.strided()) {
      b.push_back(line(fmt::format("const val_t* __restrict t{}_data = (const val_t*)args->inputs[{}];", t, p++)));
      // Strided operands arrive contiguous (row-major), so strides follow from the sizes and the last is the
      // literal 1 the vectorizer needs.
      const ir::Expr* first = nullptr;
      for (const ir::Expr* a : acc)
        if (a->tensor == static_cast<int>(t) && !first) first = a;
      const int nd = first ? static_cast<int>(first->vars.size()) : 0;
      std::string stride = "1";
      for (int d = nd; d-- > 0;) {
        b.push_back(line(fmt::format("const int64_t t{}_st{} = {};", t, d, stride)));
        stride += fmt::format(" * N{}", first->vars[d]);
      }
      continue;
    }
    const auto& levels = op.format->levels();
    const ir::Expr* first = nullptr;
    for (const ir::Expr* a : acc)
      if (a->tensor == static_cast<int>(t) && !first) first = a;
    // Positions of each level so far: the length of a crd buffer when the caller gives no lengths.
    std::string count = "1";
    // The level's extent: its dimension's size, or the number of blocks (d/b), or the block size (d%b).
    auto extent = [&](size_t l) -> std::string {
      const LevelExpr& x = levels[l].expr;
      const std::string n = fmt::format("N{}", first->vars[x.dim]);
      switch (x.part) {
        case LevelExpr::Part::whole: return n;
        case LevelExpr::Part::outer: return fmt::format("({} / {})", n, x.block);
        case LevelExpr::Part::inner: return std::to_string(x.block);
      }
      return n;
    };
    for (size_t l = 0; l < levels.size(); ++l) {
      const LevelKind& kind = *levels[l].kind;
      auto names = [&](const std::string& n) { return fmt::format("t{}_{}{}", t, n, l); };
      for (const auto& name : kind.buffer_names()) {
        b.push_back(line(fmt::format("const idx_t* __restrict t{}_{}{} = (const idx_t*)args->inputs[{}];", t, name, l, p)));
        if (name == "crd") {
          // t<T>_crd<l>_n: entries of the crd buffer, which every segment of the level is clamped to.
          const std::string implied = kind.implied_positions(names, count);
          b.push_back(line(fmt::format("const int64_t t{0}_crd{1}_n = args->lengths ? args->lengths[{2}] : {3};", t, l, p, implied)));
          count = fmt::format("t{}_crd{}_n", t, l);
          // Every coordinate of a level of extent 0 is out of range (and 0 could not stand in for it).
          if (first && levels[l].expr.dim < static_cast<int>(first->vars.size()))
            b.push_back(line(fmt::format("if ({} == 0 && {} > 0) return SCORCH_STATUS_BAD_INDEX;", extent(l), count)));
        }
        ++p;
      }
      if (kind.walk() == LevelWalk::locate && first && levels[l].expr.dim < static_cast<int>(first->vars.size()))
        count = fmt::format("({} * {})", count, extent(l));
    }
    b.push_back(line(fmt::format("const val_t* __restrict t{}_vals = (const val_t*)args->inputs[{}];", t, p++)));
  }
  if (spec.output.strided()) {
    b.push_back(line("val_t* __restrict out = (val_t*)args->out_dense;"));
    std::string numel = "1";
    for (size_t d = st.out_vars.size(); d-- > 0;) {
      b.push_back(line(fmt::format("const int64_t os{} = {};", d, numel)));
      numel += fmt::format(" * N{}", st.out_vars[d]);
    }
    b.push_back(line(fmt::format("const int64_t out_numel = {}; (void)out_numel;", numel)));
  }
  return b;
}

Stmts thread_frame(const KernelSpec& spec, const Schedule& sched, const Stmts& nest, bool parallel) {
  // Sparse outputs come back through per-thread streams, except a sampled one, written in place.
  const bool sparse_output = !spec.output.strided() && sched.output != OutputMode::sampled;
  // bad: this thread met an index value out of range (kernel_abi.h); reported after the region.
  Stmts region{line("const int tid = omp_get_thread_num();"), line("const int nt = omp_get_num_threads();"),
               line("(void)tid; (void)nt;"), line("int bad = 0;")};
  if (sparse_output) region.push_back(line("Stream& st = streams[tid];"));
  if (spec.output.strided() && sched.private_output) {
    region.push_back(line("val_t* __restrict o = tid == 0 ? out : (val_t*)calloc(out_numel ? out_numel : 1, sizeof(val_t));"));
    region.push_back(line("priv[tid] = o;"));
    region.push_back(line("if (tid != 0 && !o) { args->status = SCORCH_STATUS_NO_MEMORY; }  // out itself is null when empty"));
    region.push_back(line("else {"));
  } else if (spec.output.strided()) {
    region.push_back(line("val_t* __restrict o = out;"));
    region.push_back(line("{"));
  } else {
    region.push_back(line("{"));
  }
  if (sched.output == OutputMode::workspace) {
    const std::string n = fmt::format("N{}", sched.workspace_var);
    region.push_back(line(fmt::format("val_t* ws_val = (val_t*)calloc({0} ? {0} : 1, sizeof(val_t));", n)));
    region.push_back(line(fmt::format("unsigned char* ws_flag = (unsigned char*)calloc({0} ? {0} : 1, 1);", n)));
    region.push_back(line(fmt::format("int64_t* ws_list = (int64_t*)malloc(({0} ? {0} : 1) * sizeof(int64_t));", n)));
    region.push_back(line("int64_t ws_n = 0;"));
    region.push_back(line("if (!ws_val || !ws_flag || !ws_list) { args->status = SCORCH_STATUS_NO_MEMORY; } else {"));
    region.insert(region.end(), nest.begin(), nest.end());
    region.push_back(line("}"));
    region.push_back(line("free(ws_val); free(ws_flag); free(ws_list);"));
  } else {
    region.insert(region.end(), nest.begin(), nest.end());
  }
  region.push_back(line("}"));
  region.push_back(line("if (bad) __atomic_store_n(&bad_index, 1, __ATOMIC_RELAXED);"));

  Stmts b{line(fmt::format("int nthreads = {};", parallel ? "args->num_threads > 0 ? args->num_threads : 1" : "1"))};
  if (sched.output == OutputMode::sampled)
    b.push_back(line("val_t* __restrict sampled_out = (val_t*)args->out_dense;  // the sampling operand's size"));
  if (sched.private_output && parallel)
    b.push_back(line("if (out_numel > (int64_t{1} << 24)) nthreads = 1;  // private copies would be too big"));
  if (sparse_output) {
    b.push_back(line("Stream* streams = (Stream*)calloc(nthreads, sizeof(Stream));"));
    b.push_back(line("if (!streams) return SCORCH_STATUS_NO_MEMORY;"));
  }
  if (sched.private_output) {
    b.push_back(line("val_t** priv = (val_t**)calloc(nthreads, sizeof(val_t*));"));
    b.push_back(line("if (!priv) return SCORCH_STATUS_NO_MEMORY;"));
  }
  b.push_back(line("int bad_index = 0;"));
  b.push_back(loops::parallel("nthreads", region));
  if (sched.private_output) {
    b.push_back(loops::for_range("t", "1", "nthreads",
                                 {line("if (!priv[t]) continue;"),
                                  loops::for_range("q", "0", "out_numel", {line("out[q] += priv[t][q];")}),
                                  line("free(priv[t]);")}));
    b.push_back(line("free(priv);"));
  }
  if (sparse_output) {
    b.push_back(line(fmt::format("if (!join_streams(streams, nthreads, {}, args)) args->status = SCORCH_STATUS_NO_MEMORY;", spec.stmt.out_vars.size())));
    b.push_back(line("free(streams);"));
  }
  // A bad index outranks a failed allocation: it is the caller's to report, with the buffer at fault.
  b.push_back(line("if (bad_index) args->status = SCORCH_STATUS_BAD_INDEX;"));
  b.push_back(line("return args->status;"));
  return b;
}

}  // namespace scorch
