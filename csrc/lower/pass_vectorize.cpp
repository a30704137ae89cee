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
// Under VectorShape::soft_gathers, a row's sum over stored positions (For::gather_sum) is rewritten too, its
// loads through coordinates built from scalar loads (soft_gather_sum below).
#include <map>

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

// Variables replaced by expressions (each in parentheses): the loop variable by a lane's position, or a row
// sum's constant declarations by their definitions.
class Substitute : public Mutator {
 public:
  explicit Substitute(std::map<std::string, ExprPtr> by) : by_(std::move(by)) {}
  Substitute(const std::string& var, ExprPtr e) : by_{{var, std::move(e)}} {}
  ExprPtr mutate_Var(const std::shared_ptr<const Var>& n) override {
    auto it = by_.find(n->name);
    return it == by_.end() ? n : paren(it->second);
  }

 private:
  std::map<std::string, ExprPtr> by_;
};

// The vector of a value at lanes [base + offset, base + offset + w) of the loop variable: loads along the
// variable become vector loads, everything else stays (scalars broadcast in the vector arithmetic).
class VectorValue : public Mutator {
 public:
  VectorValue(std::string var, std::string base, int offset) : var_(std::move(var)), base_(std::move(base)), offset_(offset) {}
  ExprPtr mutate_Load(const std::shared_ptr<const Load>& n) override {
    if (!mentions(n->index, var_)) return n;
    Substitute sub(var_, loops::var(base_));
    ExprPtr addr = unary(UnOp::address_of, load(n->base, sub.mutate(n->index)));
    if (offset_ != 0) addr = add(addr, integer(offset_));
    return call("vload", {addr});
  }

 private:
  std::string var_, base_;
  int offset_;
};

// An index that reads consecutive elements as `var` steps: var, or var plus something that does not depend
// on it.
bool along(const ExprPtr& index, const std::string& var) {
  const Expr* e = index.get();
  while (const auto* p = dynamic_cast<const Paren*>(e)) e = p->a.get();
  if (const auto* v = dynamic_cast<const Var*>(e)) return v->name == var;
  const auto* b = dynamic_cast<const Binary*>(e);
  if (!b || b->op != BinOp::add) return false;
  return (along(b->a, var) && !mentions(b->b, var)) || (along(b->b, var) && !mentions(b->a, var));
}

// The vector of a row sum's value at lanes [base + offset, base + offset + w): loads along the variable become
// vector loads; every other load that depends on it (through a coordinate) becomes a vector built from one
// scalar load per lane, declared before the sum (`gathers`); the rest stays scalar and broadcasts.
class GatherValue : public Mutator {
 public:
  GatherValue(std::string var, std::string base, int offset, int lanes, std::string prefix, Stmts& gathers)
      : var_(std::move(var)), base_(std::move(base)), offset_(offset), w_(lanes), prefix_(std::move(prefix)),
        gathers_(gathers) {}
  ExprPtr mutate_Load(const std::shared_ptr<const Load>& n) override {
    if (!mentions(n->index, var_)) return n;
    if (along(n->index, var_)) return VectorValue(var_, base_, offset_).mutate(n);
    Exprs items;
    for (int q = 0; q < w_; ++q)
      items.push_back(cast("val_t", Substitute(var_, add(var(base_), integer(offset_ + q))).mutate(n)));
    const std::string name = fmt::format("{}{}", prefix_, gathers_.size());
    gathers_.push_back(decl("const vec_t", name, init_list(std::move(items))));
    return var(name);
  }

 private:
  std::string var_, base_;
  int offset_, w_;
  std::string prefix_;
  Stmts& gathers_;
};

class Vectorize : public Mutator {
 public:
  Vectorize(int lanes, bool soft_gathers) : w_(lanes), soft_gathers_(soft_gathers) {}

  Stmts mutate_For(const std::shared_ptr<const For>& n0) override {
    const auto n = mutate_children(n0);
    if (n->gather_sum && soft_gathers_) return soft_gather_sum(n);
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

  // A row's sum over stored positions whose loads through coordinates the C++ compiler would make gather
  // instructions (the loop's simd pragma), where the target measured vectors built from scalar loads faster:
  //     for (p = k; p < ke; ++p) { const int64_t i1 = crd[p]; lacc += vals[p] * x[i1]; }
  // becomes two vector accumulators over pairs of vectors, then the scalar loop over the rest:
  //     { vec_t s0 = {}, s1 = {}; int64_t pb = k;
  //       for (; pb + 2w <= ke; pb += 2w) { const vec_t g0 = {x[crd[pb + 0]], ...}; s0 += vload(&vals[pb]) * g0;
  //                                          const vec_t g1 = {...}; s1 += vload(&vals[pb] + w) * g1; }
  //       if (pb + w <= ke) { ...the first half...; pb += w; }
  //       lacc += lanes(s0 + s1);
  //       for (p = pb; p < ke; ++p) { ...as before... } }
  // Loads along p become vector loads, the others one scalar load per lane. A loop of another shape (a
  // statement that is not a constant declaration before the sum, p used outside a load) is left as it was.
  Stmts soft_gather_sum(const std::shared_ptr<const For>& n) const {
    const auto* cond = dynamic_cast<const Binary*>(n->cond.get());
    const auto* sum = n->body.empty() ? nullptr : dynamic_cast<const Assign*>(n->body.back().get());
    const auto* target = sum ? dynamic_cast<const Var*>(sum->lhs.get()) : nullptr;
    if (n->step != 1 || !n->begin || !cond || cond->op != BinOp::lt || !sum || sum->op != AssignOp::add || !target ||
        target->name != n->reduction)
      return {n};
    std::map<std::string, ExprPtr> defs;
    for (size_t i = 0; i + 1 < n->body.size(); ++i) {
      const auto* d = dynamic_cast<const Decl*>(n->body[i].get());
      if (!d || d->type.rfind("const ", 0) != 0 || d->inits.size() != d->names.size()) return {n};
      for (size_t j = 0; j < d->names.size(); ++j) {
        if (!d->inits[j] || d->names[j].find('[') != std::string::npos) return {n};
        defs[d->names[j]] = Substitute(defs).mutate(d->inits[j]);
      }
    }
    const ExprPtr value = Substitute(defs).mutate(sum->rhs);
    const ExprPtr hi = cond->b;
    Stmts halves[2];
    for (int half = 0; half < 2; ++half) {
      Stmts& h = halves[half];
      ExprPtr v = GatherValue(n->var, "pb", half * w_, w_, fmt::format("g{}_", half), h).mutate(value);
      if (h.empty() || mentions(v, n->var)) return {n};  // nothing gathered, or p outside a load
      h.push_back(assign(var(fmt::format("s{}", half)), v, AssignOp::add));
    }
    Stmts step = halves[0];
    step.insert(step.end(), halves[1].begin(), halves[1].end());
    // One more vector when w or more entries are left: rows a little longer than 2w (DLMC's 512x512 layers,
    // ~51 a row under 16 lanes) otherwise left up to 2w - 1 entries to the scalar loop, one dependent
    // addition each, and ran 20% slower than the compiler's gathers.
    Stmts one = halves[0];
    one.push_back(assign(var("pb"), integer(w_), AssignOp::add));
    Stmts vec{decl("vec_t", {"s0", "s1"}, Exprs(2, init_list({}))),
              decl("int64_t", "pb", n->begin),
              for_step("pb", nullptr, le(add(var("pb"), integer(2 * w_)), hi), 2 * w_, step),
              if_then(le(add(var("pb"), integer(w_)), hi), one),
              decl("const vec_t", "ss", add(var("s0"), var("s1"))),
              assign(var(n->reduction), lanes("ss", 0, w_), AssignOp::add),
              for_range(n->var, var("pb"), hi, n->body)};
    return {block(vec)};
  }

  int w_;
  bool soft_gathers_;
};

}  // namespace

void vectorize(KernelIR& k) {
  if (k.native || k.machine.vector_bytes <= 0) return;
  k.nest = Vectorize(k.machine.vector_bytes / (k.spec->f64 ? 8 : 4), k.machine.soft_gathers).mutate(k.nest);
}

}  // namespace scorch::passes
