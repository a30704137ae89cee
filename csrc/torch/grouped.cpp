// The grouped runner (chain.h): a chain of region programs run grouped by one sparse 2-D factor S(p, q) of its
// first step, in ATen ops. The nonzeros of S are sorted by group q; the rows p of each group are gathered and
// every step runs on them; an intermediate is kept as the rows of its groups only, never as the dense
// (p, q, rest) tensor that is zero outside S; the last step's rows are scattered back (or summed over groups).
//
// Two layouts:
// - ragged: the entries of S sorted by group, (entries, rest): each group's rows are a slice, and each step is
//   one product per group on its slice, no padding work. Below autograd (the op's forward) the groups are
//   shared among the threads, largest first, each product single-threaded (a matrix multiply straight into
//   its slice of the result): the groups' products of 16-45 rows run side by side instead of each split
//   across threads. Measured on the zoo's MoE (bench sizes, 2 threads, whole compiled forward): 4.4x dense
//   Inductor with 8 experts and 7.2x with 16, where padded blocks through one bmm per step ran 2.5x and 0.7-5x.
// - padded: the groups padded to the largest, (groups, slots, rest): each step is one batched product, which
//   autograd records as one op (its gradient one more bmm): taken when the gradient is recorded and padding
//   wastes little. A padding slot reads row 0, but the first step multiplies by S's value there (0), every
//   later step multiplies by an intermediate, and the elementwise ops keep 0 (f(0) = 0): padding slots stay
//   zero.
#include <algorithm>
#include <atomic>
#include <map>
#include <numeric>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include "chain.h"
#include "common/error.h"
#include "grouped_layout.h"
#include "grouped_matmul.h"

namespace scorch::torch_glue {
namespace grouped {

// Padded while the padded slots are at most this many times the entries (plus one per group).
constexpr double kMaxPadding = 1.5;

bool has(const std::string& s, char c) { return c != 0 && s.find(c) != std::string::npos; }

std::string without(const std::string& s, char a, char b) {
  std::string out;
  for (char c : s)
    if (c != a && c != b) out += c;
  return out;
}

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

Groups group_entries(const at::Tensor& S, bool pattern, at::ScalarType dtype, bool padded_allowed) {
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
  g.unique_rows = g.entries == 0 || at::bincount(g.ps, {}, S.size(0)).max().item<int64_t>() <= 1;
  at::Tensor vals = pattern ? at::Tensor() : S.index({g.ps, g.qs}).to(dtype);
  if (vals.defined() && !vals.requires_grad() && vals.eq(1).all().item<bool>()) {  // a 0/1 mask: no scaling
    vals = at::Tensor();
    pattern = true;
  }
  g.padded = padded_allowed && static_cast<double>(g.groups * g.most) <=
                                   kMaxPadding * static_cast<double>(g.entries) + static_cast<double>(g.groups);
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

Factor grouping_factor(const ChainProgram& c, at::TensorList operands) {
  const ChainStep& first = c.steps[0];
  const RegionOperand& so = first.program->operands[static_cast<size_t>(c.s)];
  Factor f;
  f.input = first.inputs[static_cast<size_t>(c.s)];
  const at::Tensor& s_in = operands[static_cast<size_t>(f.input)];
  SCORCH_CHECK(s_in.dim() == 2, "scorch::chain {}: the grouping factor has {} dimensions, not 2", c.title, s_in.dim());
  f.pattern = so.kind == RegionOperand::Kind::pattern;
  f.S = so.letters[0] == first.p ? s_in : s_in.t();
  if (f.pattern) f.S = f.S.ne(0);
  return f;
}

}  // namespace grouped

namespace {

using grouped::Groups;
using grouped::has;
using grouped::without;
using grouped::gather_rows;
using grouped::group_entries;


// One operand of a step as the runner holds it: gathered by rows (p, and q when it has both), the groups along
// its first dimension (q only), or whole.
struct Held {
  enum class How { rows, groups, whole } how;
  at::Tensor t;
  std::string letters;  // of `t` without the layout's leading group/row letters
};

// One group's product written into `dst`: a plain matrix product (two operands, one letter contracted) as one
// matrix multiply into it, anything else through einsum.
void product_into(const std::string& eq, const std::vector<std::string>& letters, const std::string& out,
                  const std::vector<at::Tensor>& args, at::Tensor& dst) {
  if (args.size() == 2 && out.size() == 2 && letters[0].size() == 2 && letters[1].size() == 2) {
    const bool swap = !has(letters[0], out[0]);
    const std::string& a = letters[swap ? 1 : 0];
    const std::string& b = letters[swap ? 0 : 1];
    const char k = a[0] == out[0] ? a[1] : a[0];
    if (has(a, out[0]) && has(b, out[1]) && has(b, k) && !has(out, k) && !has(b, out[0])) {
      const at::Tensor& A = args[swap ? 1 : 0];
      const at::Tensor& B = args[swap ? 0 : 1];
      at::mm_out(dst, a[0] == out[0] ? A : A.t(), b[0] == k ? B : B.t());
      return;
    }
  }
  dst.copy_(at::einsum(eq, args));
}

// One step on the layout. Its operands: the chain's (cast, patterns as 0/1) or earlier steps' results (held
// rows). Returns the rows of its result: padded (groups, slots, rest), ragged (entries, rest); or, when its
// output lacks p (the last step only), the result summed over the rows: (groups, rest) or (rest).
// The operand held by rows, with letters besides the layout's, that has the fewest values (-1: none).
int smallest_rows(const std::vector<Held>& held) {
  int best = -1;
  for (size_t k = 0; k < held.size(); ++k)
    if (held[k].how == Held::How::rows && !held[k].letters.empty() &&
        (best < 0 || held[k].t.numel() < held[static_cast<size_t>(best)].t.numel()))
      best = static_cast<int>(k);
  return best;
}

// Ragged layout: every operand held by rows with no other letter (one value per entry) multiplied into the
// smallest operand held by rows that has other letters, and dropped; one that is 1 on every entry (S's pattern
// read again) is just dropped.
void fold_entry_vectors(std::vector<Held>& held) {
  if (smallest_rows(held) < 0) return;
  std::vector<Held> kept;
  at::Tensor scale;
  for (Held& h : held) {
    if (h.how != Held::How::rows || !h.letters.empty()) kept.push_back(std::move(h));
    else if (h.t.requires_grad() || !h.t.eq(1).all().item<bool>()) scale = scale.defined() ? scale.mul(h.t) : h.t;
  }
  held = std::move(kept);
  if (!scale.defined()) return;
  at::Tensor& t = held[static_cast<size_t>(smallest_rows(held))].t;
  std::vector<int64_t> shape(static_cast<size_t>(t.dim()), 1);
  shape[0] = scale.size(0);
  t = t.mul(scale.view(shape));
}

struct StepResult {
  at::Tensor rows;    // defined when the output keeps p
  at::Tensor summed;  // otherwise: the output's tensor in letters `summed_letters`
  std::string rest, summed_letters;
};

StepResult run_step(const ChainStep& st, std::vector<Held> held, const Groups& g, bool first_with_vals,
                    bool differentiable) {
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
  // ragged. A per-entry vector (an operand of letters p and q only: gates, S's pattern read again) scales the
  // largest other operand held by rows, so that what is left is a plain product where it can be.
  fold_entry_vectors(held);
  if (keeps_p && rest_out.size() == 1) {  // rows (entries, k) times a matrix per group: one grouped product
    const Held* a = nullptr;
    const Held* w = nullptr;
    for (const Held& h : held) {
      if (h.how == Held::How::rows && h.letters.size() == 1) a = a ? nullptr : &h;
      else if (h.how == Held::How::groups && h.letters.size() == 2) w = w ? nullptr : &h;
    }
    const char n = rest_out[0];
    if (held.size() == 2 && a && w && a->letters[0] != n && has(w->letters, a->letters[0]) && has(w->letters, n)) {
      r.rows = grouped_matmul(a->t, w->t, /*w_t=*/w->letters[0] == n, g.counts, differentiable);
      return r;
    }
  }
  // otherwise one product per group on its slice
  std::string eq;
  std::vector<std::string> letters;
  for (const Held& h : held) {
    letters.push_back((h.how == Held::How::rows ? std::string{p} : "") + h.letters);
    eq += (eq.empty() ? "" : ",") + letters.back();
  }
  const std::string out_letters = (keeps_p ? std::string{p} : std::string{}) + rest_out;
  eq += "->" + out_letters;
  auto args_of = [&](int64_t q_) {
    const int64_t n = g.counts[static_cast<size_t>(q_)], lo = g.starts[static_cast<size_t>(q_)];
    std::vector<at::Tensor> args;
    for (const Held& h : held)
      args.push_back(h.how == Held::How::rows ? h.t.narrow(0, lo, n) : h.how == Held::How::groups ? h.t.select(0, q_) : h.t);
    return args;
  };
  // No matrix per group (the combine: rows times rows): one product over every group's rows at once.
  const bool per_group_operand =
      std::any_of(held.begin(), held.end(), [](const Held& h) { return h.how == Held::How::groups; });
  if (!per_group_operand && (keeps_p || !has(prog.out, q))) {
    std::vector<at::Tensor> args;
    for (const Held& h : held) args.push_back(h.t);
    // A step that only passes its rows on ("ph->ph") gets a view of them from einsum; the caller scales and
    // applies elementwise ops in place, which would then change the step before's result (kept for the
    // gradient) or an operand: such a result is copied.
    at::Tensor res = at::einsum(eq, args);
    if (std::any_of(args.begin(), args.end(), [&](const at::Tensor& a) { return res.is_alias_of(a); }))
      res = res.clone();
    if (keeps_p) {
      r.rows = std::move(res);
    } else {
      r.summed = std::move(res);
      r.summed_letters = rest_out;
    }
    return r;
  }
  std::vector<int64_t> present;  // the groups with rows
  for (int64_t q_ = 0; q_ < g.groups; ++q_)
    if (g.counts[static_cast<size_t>(q_)] > 0) present.push_back(q_);
  at::Tensor parts;  // keeps_p: (entries, rest); else per present group (present, rest)
  if (differentiable) {  // one einsum per group, joined (autograd records them)
    // Each operand cut into its groups' pieces by one split (rows) or unbind (groups): their gradients are
    // joined by one op, where a slice or select per group would each make a gradient of the whole operand.
    std::vector<std::vector<at::Tensor>> pieces;
    for (const Held& h : held)
      pieces.push_back(h.how == Held::How::rows     ? h.t.split_with_sizes(g.counts)
                       : h.how == Held::How::groups ? h.t.unbind(0)
                                                    : std::vector<at::Tensor>{});
    std::vector<at::Tensor> each;
    for (int64_t q_ : present) {
      std::vector<at::Tensor> args;
      for (size_t k = 0; k < held.size(); ++k)
        args.push_back(held[k].how == Held::How::whole ? held[k].t : pieces[k][static_cast<size_t>(q_)]);
      each.push_back(at::einsum(eq, args));
    }
    parts = keeps_p ? (each.size() == 1 ? each[0] : at::cat(each)) : at::stack(each);
  } else {  // the groups shared among the threads, each product single-threaded into its slice
    std::map<char, int64_t> sizes;
    for (size_t k = 0; k < held.size(); ++k) {
      const at::Tensor& t = held[k].t;
      const int64_t lead = held[k].how == Held::How::whole ? 0 : 1;
      for (size_t d = 0; d < held[k].letters.size(); ++d)
        sizes[held[k].letters[d]] = t.size(static_cast<int64_t>(d) + lead);
    }
    // keeps_p: the rows of every group; else one result per group (the output keeps q) or per present group
    const bool per_group = !keeps_p && has(prog.out, q);
    std::vector<int64_t> shape{keeps_p ? g.entries : per_group ? g.groups : static_cast<int64_t>(present.size())};
    for (char l : rest_out) shape.push_back(sizes.at(l));
    parts = at::empty(shape, held[0].t.options());
    std::vector<size_t> order(present.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {  // largest first: balanced threads
      return g.counts[static_cast<size_t>(present[a])] > g.counts[static_cast<size_t>(present[b])];
    });
    std::atomic<size_t> next{0};
    const at::ThreadLocalState caller;  // InferenceMode and the dispatch keys: OpenMP workers do not inherit them
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      at::ThreadLocalStateGuard tls(caller);
      for (size_t k = next++; k < order.size(); k = next++) {
        const int64_t q_ = present[order[k]];
        at::Tensor dst = keeps_p    ? parts.narrow(0, g.starts[static_cast<size_t>(q_)], g.counts[static_cast<size_t>(q_)])
                         : per_group ? parts.select(0, q_)
                                     : parts.select(0, static_cast<int64_t>(order[k]));
        product_into(eq, letters, out_letters, args_of(q_), dst);
      }
    });
    if (per_group) {  // groups without rows are zero
      for (int64_t q_ = 0; q_ < g.groups; ++q_)
        if (g.counts[static_cast<size_t>(q_)] == 0) parts.select(0, q_).zero_();
      r.summed_letters = std::string{q} + rest_out;
      r.summed = parts;
      return r;
    }
  }
  if (keeps_p) {
    r.rows = parts;
  } else if (has(prog.out, q)) {
    r.summed_letters = std::string{q} + rest_out;
    std::vector<int64_t> shape = parts.sizes().vec();
    shape[0] = g.groups;
    r.summed = at::zeros(shape, parts.options())
                   .index_copy(0, at::tensor(present, at::TensorOptions().dtype(at::kLong)), parts);
  } else {
    r.summed_letters = rest_out;
    r.summed = parts.sum(0);
  }
  return r;
}

// Does every step run as grouped products in the ragged layout (see run_step): a step with a matrix per group
// takes one operand of rows with one letter of its own (after the per-entry vectors are folded into it) and one
// matrix per group, into rows of one letter; a step without one is a single product over all rows. Then the
// ragged layout is taken with the gradient recorded too (grouped_matmul's gradient); otherwise autograd would
// record one product per group there, and the padded layout's batched products are cheaper.
bool ragged_products(const ChainProgram& c) {
  for (size_t j = 0; j < c.steps.size(); ++j) {
    const ChainStep& st = c.steps[j];
    const RegionProgram& prog = *st.program;
    int rows = 0, groups = 0, whole = 0, rows_one_letter = 0, groups_two_letters = 0;
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      if (j == 0 && static_cast<int>(k) == c.s) continue;
      const RegionOperand& o = prog.operands[k];
      const std::string lt = st.inputs[k] < 0 ? o.letters : o.tensor_letters();
      const size_t rest = without(lt, st.p, st.q).size();
      if (has(lt, st.p)) {
        if (rest == 0) continue;  // a per-entry vector, folded
        ++rows;
        rows_one_letter += rest == 1;
      } else if (has(lt, st.q)) {
        ++groups;
        groups_two_letters += rest == 2;
      } else {
        ++whole;
      }
    }
    if (groups == 0) continue;
    const bool plain = rows == 1 && rows_one_letter == 1 && groups == 1 && groups_two_letters == 1 && whole == 0 &&
                       has(prog.out, st.p) && without(prog.out, st.p, st.q).size() == 1;
    if (!plain) return false;
  }
  return true;
}

}  // namespace

at::Tensor run_grouped_chain(const ChainProgram& c, at::TensorList operands, bool differentiable) {
  const at::ScalarType dtype = chain_dtype(c, operands);
  const auto [S, pattern, s_input] = grouped::grouping_factor(c, operands);
  const at::Tensor& s_in = operands[static_cast<size_t>(s_input)];
  std::vector<c10::SymInt> shape_sym = chain_output_shape(c, operands);
  std::vector<int64_t> shape;
  for (const auto& s : shape_sym) shape.push_back(s.expect_int());
  const Groups g = group_entries(S, pattern, dtype, differentiable && !ragged_products(c));
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
      // S's pattern read again by a later step is 1 on every entry (and padding rows are zero already)
      if (j > 0 && i == s_input && o.kind == RegionOperand::Kind::pattern && o.expand == 0 && o.letters.size() == 2 &&
          has(o.letters, st.p) && has(o.letters, st.q))
        continue;
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
    StepResult r = run_step(st, std::move(held), g, j == 0, differentiable);
    at::Tensor& t = r.rows.defined() ? r.rows : r.summed;
    const bool last = j + 1 == c.steps.size();
    if (last && r.rows.defined() && g.padded) t = t.index({g.qs, g.slot});  // the real slots
    if (prog.coef != 1.0) t = differentiable ? t.mul(prog.coef) : t.mul_(prog.coef);
    for (Elementwise f : st.then) t = apply_elementwise(f, t, !differentiable);
    if (!last) {
      results.push_back(std::move(r));
      continue;
    }
    if (c.keep && !differentiable && chain_has_direct_gradient(c)) {  // for the direct gradient
      std::vector<at::Tensor> kept;
      for (const StepResult& k : results) kept.push_back(k.rows);
      keep_intermediates(c, operands, std::move(kept));
    }
    // The output, in the program's letter order.
    const std::string& out_letters = prog.out;
    at::Tensor out;
    if (r.rows.defined()) {
      const std::string view_letters = (has(out_letters, st.q) ? std::string{st.p, st.q} : std::string{st.p}) + r.rest;
      std::vector<int64_t> perm;
      for (char l : view_letters) perm.push_back(static_cast<int64_t>(out_letters.find(l)));
      // one-hot dispatch (each row in exactly one group) writes every row: no zero-fill
      const bool every_row = !has(out_letters, st.q) && g.unique_rows && g.entries == S.size(0);
      out = every_row ? at::empty(shape, opts) : at::zeros(shape, opts);
      at::Tensor view = out.permute(perm);
      if (has(out_letters, st.q)) view.index_put_({g.ps, g.qs}, r.rows);  // each (p, q) is one entry of S
      else if (g.unique_rows) view.index_copy_(0, g.ps, r.rows);
      else view.index_put_({g.ps}, r.rows, /*accumulate=*/true);  // a row in several groups: summed
      return out;
    }
    std::vector<int64_t> perm;
    for (char l : out_letters) perm.push_back(static_cast<int64_t>(r.summed_letters.find(l)));
    return r.summed.permute(perm).contiguous();
  }
  SCORCH_CHECK(false, "scorch::chain {}: no steps", c.title);
}

}  // namespace scorch::torch_glue
