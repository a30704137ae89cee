// The grouped runner (chain.h): a chain of region programs run grouped by one sparse 2-D factor S(p, q) of its
// first step, in ATen ops. The nonzeros of S are sorted by group q; the rows p of each group are gathered and
// every step runs on them; an intermediate is kept as the rows of its groups only, never as the dense
// (p, q, rest) tensor that is zero outside S; the last step's rows are scattered back (or summed over groups).
//
// Two layouts, chosen from the group sizes:
// - padded: the groups padded to the largest, (groups, slots, rest): each step is one batched product. A padding
//   slot reads row 0, but the first step multiplies by S's value there (0), every later step multiplies by an
//   intermediate, and the elementwise ops keep 0 (f(0) = 0): padding slots stay zero.
// - ragged: the entries of S sorted by group, (entries, rest): each group's rows are a slice, and each step is
//   one product per group on its slice (no padding work; one small call per group).
// Padding pays while it wastes little: one batched call instead of one per group.
#include <algorithm>
#include <numeric>

#include "chain.h"
#include "common/error.h"

namespace scorch::torch_glue {
namespace {

// Padded while the padded slots are at most this many times the entries (plus one per group).
constexpr double kMaxPadding = 1.5;

bool has(const std::string& s, char c) { return c != 0 && s.find(c) != std::string::npos; }

std::string without(const std::string& s, char a, char b) {
  std::string out;
  for (char c : s)
    if (c != a && c != b) out += c;
  return out;
}

struct Groups {
  bool padded = false;
  int64_t groups = 0, most = 0, entries = 0;
  at::Tensor qs, ps;   // (entries) each entry's group and row, sorted by group
  at::Tensor slot;     // padded: each entry's slot in its group
  at::Tensor rows;     // padded: (groups, most) each slot's row (0 on padding); ragged: ps
  at::Tensor cols;     // padded: (groups, most) each slot's group; ragged: qs
  at::Tensor vals;     // S's value per slot (0 on padding) or per entry; undefined: all ones (ragged pattern)
  std::vector<int64_t> counts, starts;
};

// One operand of a step as the runner holds it: gathered by rows (p, and q when it has both), the groups along
// its first dimension (q only), or whole.
struct Held {
  enum class How { rows, groups, whole } how;
  at::Tensor t;
  std::string letters;  // of `t` without the layout's leading group/row letters
};

// The rows of `t` (letters `lt`, p among them) gathered in the layout: leading (groups, slots) or (entries).
at::Tensor gather_rows(const at::Tensor& t, const std::string& lt, char p, char q, const Groups& g) {
  const int64_t ip = static_cast<int64_t>(lt.find(p));
  if (has(lt, q)) {
    const at::Tensor m = t.movedim({ip, static_cast<int64_t>(lt.find(q))}, {0, 1});
    return m.index({g.rows, g.cols});
  }
  const at::Tensor m = t.movedim(ip, 0);
  if (!g.padded) return m.index_select(0, g.ps);
  std::vector<int64_t> shape{g.groups, g.most};
  for (int64_t d = 1; d < m.dim(); ++d) shape.push_back(m.size(d));
  return m.index_select(0, g.rows.reshape({-1})).view(shape);
}

Groups group_entries(const at::Tensor& S, bool pattern, at::ScalarType dtype) {
  Groups g;
  g.groups = S.size(1);
  const at::Tensor nz = S.detach().t().nonzero();  // (q, p) pairs, sorted by q
  g.qs = nz.select(1, 0).contiguous();
  g.ps = nz.select(1, 1).contiguous();
  g.entries = g.qs.numel();
  const at::Tensor counts = at::bincount(g.qs, {}, g.groups);
  g.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + g.groups);
  g.starts.resize(static_cast<size_t>(g.groups));
  std::exclusive_scan(g.counts.begin(), g.counts.end(), g.starts.begin(), int64_t{0});
  g.most = g.counts.empty() ? 0 : *std::max_element(g.counts.begin(), g.counts.end());
  const at::Tensor vals = pattern ? at::Tensor() : S.index({g.ps, g.qs}).to(dtype);
  g.padded = static_cast<double>(g.groups * g.most) <= kMaxPadding * static_cast<double>(g.entries) +
                                                          static_cast<double>(g.groups);
  if (!g.padded) {
    g.rows = g.ps;
    g.cols = g.qs;
    g.vals = vals;
    return g;
  }
  const auto idx = at::TensorOptions().dtype(at::kLong);
  g.slot = at::arange(g.entries, idx) - at::from_blob(g.starts.data(), {g.groups}, idx).index_select(0, g.qs);
  g.rows = at::zeros({g.groups, g.most}, idx).index_put_({g.qs, g.slot}, g.ps);
  g.cols = at::arange(g.groups, idx).unsqueeze(1).expand({g.groups, g.most});
  g.vals = at::zeros({g.groups, g.most}, S.options().dtype(dtype))
               .index_put({g.qs, g.slot}, pattern ? at::ones({}, S.options().dtype(dtype)) : vals);
  return g;
}

// One step on the layout. Its operands: the chain's (cast, patterns as 0/1) or earlier steps' results (held
// rows). Returns the rows of its result: padded (groups, slots, rest), ragged (entries, rest); or, when its
// output lacks p (the last step only), the result summed over the rows: (groups, rest) or (rest).
struct StepResult {
  at::Tensor rows;    // defined when the output keeps p
  at::Tensor summed;  // otherwise: the output's tensor in letters `summed_letters`
  std::string rest, summed_letters;
};

StepResult run_step(const ChainStep& st, std::vector<Held> held, const Groups& g, bool first_with_vals) {
  const RegionProgram& prog = *st.program;
  const char p = st.p, q = st.q;
  const std::string rest_out = without(prog.out, p, q);
  // S's values scale the smallest operand gathered by rows (a further einsum operand would make einsum build
  // an outer product first).
  if (first_with_vals && g.vals.defined()) {
    int best = -1;
    for (size_t k = 0; k < held.size(); ++k)
      if (held[k].how == Held::How::rows && (best < 0 || held[k].t.numel() < held[static_cast<size_t>(best)].t.numel()))
        best = static_cast<int>(k);
    SCORCH_CHECK(best >= 0, "scorch::chain: the first step reads no rows to gather");
    at::Tensor& t = held[static_cast<size_t>(best)].t;
    std::vector<int64_t> shape = g.vals.sizes().vec();
    shape.resize(static_cast<size_t>(t.dim()), 1);
    t = t.mul(g.vals.view(shape));
  }
  StepResult r;
  r.rest = rest_out;
  const bool keeps_p = has(prog.out, p);
  if (g.padded) {
    std::string eq;
    std::vector<at::Tensor> args;
    for (const Held& h : held) {
      eq += (eq.empty() ? "" : ",") + std::string(h.how == Held::How::rows ? std::string{q, p}
                                                   : h.how == Held::How::groups ? std::string{q}
                                                                                 : std::string{}) + h.letters;
      args.push_back(h.t);
    }
    if (keeps_p) {
      r.rows = at::einsum(eq + "->" + std::string{q, p} + rest_out, args);
    } else {
      r.summed_letters = (has(prog.out, q) ? std::string{q} : std::string{}) + rest_out;
      r.summed = at::einsum(eq + "->" + r.summed_letters, args);
    }
    return r;
  }
  // ragged: one product per group on its slice
  std::string eq;
  for (const Held& h : held) eq += (eq.empty() ? "" : ",") + (h.how == Held::How::rows ? std::string{p} : "") + h.letters;
  eq += "->" + (keeps_p ? std::string{p} : std::string{}) + rest_out;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> present;
  for (int64_t q_ = 0; q_ < g.groups; ++q_) {
    const int64_t n = g.counts[static_cast<size_t>(q_)], lo = g.starts[static_cast<size_t>(q_)];
    if (n == 0) continue;
    std::vector<at::Tensor> args;
    for (const Held& h : held)
      args.push_back(h.how == Held::How::rows ? h.t.narrow(0, lo, n) : h.how == Held::How::groups ? h.t.select(0, q_) : h.t);
    parts.push_back(at::einsum(eq, args));
    present.push_back(q_);
  }
  if (keeps_p) {
    r.rows = parts.size() == 1 ? parts[0] : at::cat(parts);
  } else if (has(prog.out, q)) {
    r.summed_letters = std::string{q} + rest_out;
    std::vector<int64_t> shape{g.groups};
    for (const auto& s : parts[0].sizes()) shape.push_back(s);
    r.summed = at::zeros(shape, parts[0].options())
                   .index_copy(0, at::tensor(present, at::TensorOptions().dtype(at::kLong)), at::stack(parts));
  } else {
    r.summed_letters = rest_out;
    r.summed = at::stack(parts).sum(0);
  }
  return r;
}

}  // namespace

at::Tensor run_grouped_chain(const ChainProgram& c, at::TensorList operands, bool differentiable) {
  const at::ScalarType dtype = chain_dtype(c, operands);
  const ChainStep& first = c.steps[0];
  const RegionOperand& so = first.program->operands[static_cast<size_t>(c.s)];
  const at::Tensor& s_in = operands[static_cast<size_t>(first.inputs[static_cast<size_t>(c.s)])];
  SCORCH_CHECK(s_in.dim() == 2, "scorch::chain {}: the grouping factor has {} dimensions, not 2", c.title, s_in.dim());
  const bool pattern = so.kind == RegionOperand::Kind::pattern;
  at::Tensor S = so.letters[0] == first.p ? s_in : s_in.t();
  if (pattern) S = S.ne(0);
  std::vector<c10::SymInt> shape_sym = chain_output_shape(c, operands);
  std::vector<int64_t> shape;
  for (const auto& s : shape_sym) shape.push_back(s.expect_int());
  const Groups g = group_entries(S, pattern, dtype);
  const at::TensorOptions opts = s_in.options().dtype(dtype);
  if (g.entries == 0) return at::zeros(shape, opts);

  std::vector<StepResult> results;
  for (size_t j = 0; j < c.steps.size(); ++j) {
    const ChainStep& st = c.steps[j];
    const RegionProgram& prog = *st.program;
    std::vector<Held> held;
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      const int i = st.inputs[k];
      const RegionOperand& o = prog.operands[k];
      if (j == 0 && static_cast<int>(k) == c.s) continue;  // S itself: its values scale the first step
      if (i < 0) {  // an earlier step's rows, their rest letters renamed to this step's
        const StepResult& src = results[static_cast<size_t>(-i - 1)];
        const RegionProgram& sp = *c.steps[static_cast<size_t>(-i - 1)].program;
        std::string letters;
        for (char l : src.rest) letters += o.letters[sp.out.find(l)];
        held.push_back({Held::How::rows, src.rows, letters});
        continue;
      }
      const at::Tensor& t0 = operands[static_cast<size_t>(i)];
      const at::Tensor t = o.kind == RegionOperand::Kind::pattern ? t0.ne(0).to(dtype)
                           : t0.scalar_type() == dtype            ? t0
                                                                  : t0.to(dtype);
      const std::string lt = o.tensor_letters();
      SCORCH_CHECK(t.dim() == static_cast<int64_t>(lt.size()), "scorch::chain {}: operand {} has {} dimensions, not {}",
                   c.title, i, t.dim(), lt.size());
      if (has(lt, st.p)) held.push_back({Held::How::rows, gather_rows(t, lt, st.p, st.q, g), without(lt, st.p, st.q)});
      else if (has(lt, st.q)) held.push_back({Held::How::groups, t.movedim(static_cast<int64_t>(lt.find(st.q)), 0),
                                              without(lt, st.p, st.q)});
      else held.push_back({Held::How::whole, t, lt});
    }
    StepResult r = run_step(st, std::move(held), g, j == 0);
    at::Tensor& t = r.rows.defined() ? r.rows : r.summed;
    const bool last = j + 1 == c.steps.size();
    if (last && r.rows.defined() && g.padded) t = t.index({g.qs, g.slot});  // the real slots
    if (prog.coef != 1.0) t = differentiable ? t.mul(prog.coef) : t.mul_(prog.coef);
    for (Elementwise f : st.then) t = apply_elementwise(f, t, !differentiable);
    if (!last) {
      results.push_back(std::move(r));
      continue;
    }
    // The output, in the program's letter order.
    const std::string& out_letters = prog.out;
    at::Tensor out;
    if (r.rows.defined()) {
      const std::string view_letters = (has(out_letters, st.q) ? std::string{st.p, st.q} : std::string{st.p}) + r.rest;
      std::vector<int64_t> perm;
      for (char l : view_letters) perm.push_back(static_cast<int64_t>(out_letters.find(l)));
      out = at::zeros(shape, opts);
      at::Tensor view = out.permute(perm);
      if (has(out_letters, st.q)) view.index_put_({g.ps, g.qs}, r.rows);  // each (p, q) is one entry of S
      else view.index_add_(0, g.ps, r.rows);                            // a row may sit in several groups
      return out;
    }
    std::vector<int64_t> perm;
    for (char l : out_letters) perm.push_back(static_cast<int64_t>(r.summed_letters.find(l)));
    return r.summed.permute(perm).contiguous();
  }
  SCORCH_CHECK(false, "scorch::chain {}: no steps", c.title);
}

}  // namespace scorch::torch_glue
