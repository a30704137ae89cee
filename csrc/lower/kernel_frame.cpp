#include "lower/kernel_frame.h"

#include <fmt/format.h>

#include <algorithm>

#include "lower/lower.h"
#include "lower/passes.h"

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
      // Its elements: how far a vector load may read (vload_upto, the last columns of an SpMM's tiles).
      b.push_back(line(fmt::format("const int64_t t{}_numel = {}; (void)t{}_numel;", t, stride, t)));
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
      if (kind.coordinate_cursor()) {
        // A level with no crd buffer (a bitmap): t<T>_crd<l>_n is its number of positions all the same, read
        // from its pos buffer (whose length the caller checked; one given in lengths is held to it too).
        const auto& bn = kind.buffer_names();
        const int pos_at = p - static_cast<int>(bn.size()) + static_cast<int>(std::find(bn.begin(), bn.end(), "pos") - bn.begin());
        b.push_back(line(fmt::format("if (args->lengths && args->lengths[{}] != {} + 1) return SCORCH_STATUS_BAD_INDEX;",
                                     pos_at, count)));
        b.push_back(line(fmt::format("const int64_t t{}_crd{}_n = {};", t, l, kind.implied_positions(names, count))));
        count = fmt::format("t{}_crd{}_n", t, l);
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
  // The two passes that build the frame of every general kernel (pass_output.cpp, pass_parallel.cpp).
  passes::KernelIR k;
  k.spec = &spec;
  k.sched = &sched;
  k.nest = nest;
  k.parallel = parallel;
  passes::output_assembly(k);
  passes::parallelize(k);
  return k.body;
}

}  // namespace scorch
