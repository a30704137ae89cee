// Pass: vectorisation. A reduction loop the iteration pass marked unit-stride (For::unit_stride: every load
// indexed by the loop variable reads consecutive elements) and that starts at 0,
//     for (i = 0; i < n; ++i) r += value(i);
// becomes four vector accumulators (independent dependency chains) over whole groups of 4 vectors, their
// lanes added into r, then the scalar loop over what is left:
//     { vec_t r0..r3 = {}; for (rb = 0; rb + 4w <= n; rb += 4w) r<q> += value'(rb + q*w); ...; r += lanes }
// (the lanes summed as a balanced tree)
//     for (i = (n / 4w) * 4w; i < n; ++i) r += value(i);
// where value' loads a vector at each load along i (vload(&x[... (rb) ...] + q*w)) and keeps the other
// loads as scalars, which broadcast. The vector width comes from the target (VectorShape); without vector
// registers nothing changes (the loop keeps its simd reduction pragma for the C++ compiler).
#include <fmt/format.h>

#include "lower/passes.h"

namespace scorch::passes {

namespace {

using namespace loops;

// Whether an expression reads variable `name`.
bool mentions(const ExprPtr& e, const std::string& name) {
  struct Finder : Visitor {
    const std::string& name;
    bool found = false;
    explicit Finder(const std::string& n) : name(n) {}
    void visit_Var(const Var& v) override { found |= v.name == name; }
  } f(name);
  f.visit(e);
  return f.found;
}

// `var` replaced by `(base)` in an index.
class Substitute : public Mutator {
 public:
  Substitute(std::string var, std::string base) : var_(std::move(var)), base_(std::move(base)) {}
  ExprPtr mutate_Var(const std::shared_ptr<const Var>& n) override {
    return n->name == var_ ? paren(loops::var(base_)) : n;
  }

 private:
  std::string var_, base_;
};

// The vector of a value at lanes [base + offset, base + offset + w) of the loop variable: loads along the
// variable become vector loads, everything else stays (scalars broadcast in the vector arithmetic).
class VectorValue : public Mutator {
 public:
  VectorValue(std::string var, std::string base, int offset) : var_(std::move(var)), base_(std::move(base)), offset_(offset) {}
  ExprPtr mutate_Load(const std::shared_ptr<const Load>& n) override {
    if (!mentions(n->index, var_)) return n;
    Substitute sub(var_, base_);
    ExprPtr addr = unary(UnOp::address_of, load(n->base, sub.mutate(n->index)));
    if (offset_ != 0) addr = add(addr, integer(offset_));
    return call("vload", {addr});
  }

 private:
  std::string var_, base_;
  int offset_;
};

class Vectorize : public Mutator {
 public:
  explicit Vectorize(int lanes) : w_(lanes) {}

  Stmts mutate_For(const std::shared_ptr<const For>& n0) override {
    const auto n = mutate_children(n0);
    // for (int64_t i = 0; i < hi; ++i) red += value;
    if (!n->unit_stride || n->reduction.empty() || n->step != 1 || n->body.size() != 1) return {n};
    const auto* begin = dynamic_cast<const Int*>(n->begin.get());
    const auto* cond = dynamic_cast<const Binary*>(n->cond.get());
    const auto* sum = dynamic_cast<const Assign*>(n->body[0].get());
    const auto* target = sum ? dynamic_cast<const Var*>(sum->lhs.get()) : nullptr;
    if (!begin || begin->value != 0 || !cond || cond->op != BinOp::lt || !sum || sum->op != AssignOp::add || !target ||
        target->name != n->reduction)
      return {n};
    const ExprPtr hi = cond->b;
    const int group = 4 * w_;
    Stmts sums;
    for (int q = 0; q < 4; ++q)
      sums.push_back(assign(var(fmt::format("r{}", q)), VectorValue(n->var, "rb", q * w_).mutate(sum->rhs), AssignOp::add));
    Stmts vec{decl("vec_t", {"r0", "r1", "r2", "r3"}, Exprs(4, init_list({}))),
              decl("int64_t", "rb", integer(0)),
              for_step("rb", nullptr, le(add(var("rb"), integer(group)), hi), group, sums),
              decl("const vec_t", "rs", add(paren(add(var("r0"), var("r1"))), paren(add(var("r2"), var("r3"))))),
              assign(var(n->reduction), lanes("rs", 0, w_), AssignOp::add)};
    // The rest, fewer than a group, as scalars.
    return {block(vec), for_range(n->var, mul(paren(div(hi, integer(group))), integer(group)), hi, n->body)};
  }

 private:
  // Lanes [lo, lo + count) of vector `v` added as a balanced tree: log2(w) dependent additions instead of w in
  // one chain. The sampled products of masked attention (a dot product of 64 per stored score, one group)
  // spent most of their time in that chain: 3.25 -> 2.12 ms native, 1.99 -> 1.70 ms x86-64-v3 (bench mask,
  // 4 heads, 2 threads, the generated kernel edited by hand).
  static ExprPtr lanes(const std::string& v, int lo, int count) {
    if (count == 1) return load(var(v), integer(lo));
    const int half = count / 2;
    return paren(add(lanes(v, lo, half), lanes(v, lo + half, count - half)));
  }

  int w_;
};

}  // namespace

void vectorize(KernelIR& k) {
  if (k.native || k.machine.vector_bytes <= 0) return;
  k.nest = Vectorize(k.machine.vector_bytes / (k.spec->f64 ? 8 : 4)).mutate(k.nest);
}

}  // namespace scorch::passes
