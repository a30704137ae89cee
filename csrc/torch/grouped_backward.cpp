// The direct gradient of a grouped chain (chain.h: grouped_chain_backward), for chains whose every step is a
// grouped product of plain form: one operand of rows with one letter of its own (step 0: a chain operand, gathered
// by S's rows; later steps: the step before's result), scaled by per-entry vectors (S's values, gates: operands of
// the letters p and q only), times one matrix per group; the last step may instead be the rows alone (the
// combine: the rows scaled by the gates, scattered back). Between steps a scale and at most one ReLU or negation.
//
// The gradient then needs no autograd and no dense intermediate: the forward is run again up to the last step's
// input (the last product itself only when a ReLU follows it), and each step's gradients are grouped products
// (grouped_matmul_grads: dA for the step before, dW for the matrix), each per-entry vector's gradient the row sums
// of dA' * A, and step 0's rows are summed back into their operand's rows. Only the operands asked for get a
// gradient: a dA that nobody needs (the input of a model whose input needs no gradient) is not computed.
// Other chains take the autograd route (chain_op.cpp).
#include <algorithm>
#include <map>
#include <mutex>
#include <optional>

#include <torch/csrc/autograd/grad_mode.h>

#include "chain.h"
#include "common/error.h"
#include "grouped_layout.h"
#include "grouped_matmul.h"

namespace scorch::torch_glue {
namespace {

using grouped::gather_rows;
using grouped::Groups;
using grouped::has;
using grouped::without;

struct Ref {
  int input = -1;     // the chain operand
  std::string lt;     // its tensor letters
};

// One step in the plain form.
struct PlainStep {
  Ref rows;                  // step 0: the chain operand gathered by rows; later steps: input -1 (the step before)
  std::optional<Ref> w;      // the matrix per group (none: the rows-only last step)
  std::vector<Ref> vectors;  // per-entry vectors (letters p and q, or p only)
  bool relu = false, neg = false;
};

// The chain's steps in plain form, or nullopt.
std::optional<std::vector<PlainStep>> plain_steps(const ChainProgram& c) {
  std::vector<PlainStep> out;
  const int s_input = c.steps[0].inputs[static_cast<size_t>(c.s)];
  for (size_t j = 0; j < c.steps.size(); ++j) {
    const ChainStep& st = c.steps[j];
    const RegionProgram& prog = *st.program;
    const bool last = j + 1 == c.steps.size();
    if (st.then.size() > 1 || !has(prog.out, st.p) || (!last && !has(prog.out, st.q))) return std::nullopt;
    PlainStep ps;
    if (!st.then.empty()) {
      ps.relu = st.then[0] == Elementwise::relu;
      ps.neg = st.then[0] == Elementwise::neg;
      if (!ps.relu && !ps.neg) return std::nullopt;
    }
    int rows = 0;
    std::string rows_rest;
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      const int i = st.inputs[k];
      const RegionOperand& o = prog.operands[k];
      if (j == 0 && static_cast<int>(k) == c.s) continue;
      if (j > 0 && i == s_input && o.kind == RegionOperand::Kind::pattern && o.expand == 0 &&
          o.letters.size() == 2 && has(o.letters, st.p) && has(o.letters, st.q))
        continue;  // S's pattern read again: 1 on every entry
      if (o.expand != 0 || o.kind == RegionOperand::Kind::add) return std::nullopt;
      if (i < 0) {  // the step before's result (check_grouped: read whole, once)
        if (i != -static_cast<int>(j)) return std::nullopt;
        const RegionProgram& sp = *c.steps[j - 1].program;
        const std::string rest = without(sp.out, c.steps[j - 1].p, c.steps[j - 1].q);
        if (rest.size() != 1) return std::nullopt;
        ++rows;
        rows_rest = std::string{o.letters[sp.out.find(rest[0])]};
        ps.rows = Ref{-1, ""};
        continue;
      }
      const std::string lt = o.tensor_letters();
      const std::string rest = without(lt, st.p, st.q);
      if (has(lt, st.p)) {
        if (rest.empty()) {
          ps.vectors.push_back(Ref{i, lt});
        } else if (rest.size() == 1 && !has(lt, st.q) && o.kind != RegionOperand::Kind::pattern) {
          ++rows;
          rows_rest = rest;
          ps.rows = Ref{i, lt};
        } else {
          return std::nullopt;
        }
      } else if (has(lt, st.q) && rest.size() == 2 && !ps.w && o.kind != RegionOperand::Kind::pattern) {
        ps.w = Ref{i, lt};
      } else {
        return std::nullopt;
      }
    }
    const std::string out_rest = without(prog.out, st.p, st.q);
    if (rows != 1 || out_rest.size() != 1 || (j == 0) != (ps.rows.input >= 0)) return std::nullopt;
    if (ps.w) {
      const std::string wl = without(ps.w->lt, st.p, st.q);
      if (rows_rest[0] == out_rest[0] || !has(wl, rows_rest[0]) || !has(wl, out_rest[0])) return std::nullopt;
    } else if (!last || rows_rest != out_rest) {
      return std::nullopt;
    }
    out.push_back(std::move(ps));
  }
  return out;
}

// An operand as the forward computes with it: cast to the chain's dtype, a pattern as 0/1.
at::Tensor as_factor(const at::Tensor& t, const RegionOperand& o, at::ScalarType dtype) {
  if (o.kind == RegionOperand::Kind::pattern) return t.ne(0).to(dtype);
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

void accumulate(at::Tensor& slot, const at::Tensor& g) {
  slot = slot.defined() ? slot.add(g) : g;
}

// Kept intermediates (keep_intermediates): per chain, the latest forward's step results with the operands it ran
// on, matched by storage, offset, shape, strides, dtype and version: a gradient whose operands differ (another
// call's, or changed in place) computes the results again. An entry is taken by the gradient that matches it or
// replaced by the chain's next forward, so each chain holds at most one. The operands' storages are held weakly:
// an entry must not keep a deleted model's weights alive. A weak reference keeps the storage object itself (not
// its memory) allocated, so no other storage can take its address while the entry exists; a freed one matches
// nothing.
struct KeptOperand {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t version;
};

struct Kept {
  std::vector<KeptOperand> operands;
  std::vector<at::Tensor> results;
};

std::mutex kept_mu;
std::map<const ChainProgram*, Kept>& kept_by_chain() {
  static auto* m = new std::map<const ChainProgram*, Kept>;  // never destroyed: freed tensors may outlive statics
  return *m;
}

bool matches(const KeptOperand& k, const at::Tensor& t) {
  if (!t.has_storage()) return false;
  const auto alive = k.storage.lock();
  return alive && alive.get() == t.storage().unsafeGetStorageImpl() && t.storage_offset() == k.offset &&
         t.sizes() == at::IntArrayRef(k.sizes) && t.strides() == at::IntArrayRef(k.strides) &&
         t.scalar_type() == k.dtype && t._version() == k.version;
}

// The kept results of the forward that ran on exactly these operands (empty: none).
std::vector<at::Tensor> take_kept(const ChainProgram& c, at::TensorList operands) {
  std::lock_guard<std::mutex> lock(kept_mu);
  auto& m = kept_by_chain();
  auto it = m.find(&c);
  if (it == m.end() || it->second.operands.size() != operands.size()) return {};
  for (size_t k = 0; k < operands.size(); ++k)
    if (!matches(it->second.operands[k], operands[k])) return {};
  std::vector<at::Tensor> results = std::move(it->second.results);
  m.erase(it);
  return results;
}

}  // namespace

void keep_intermediates(const ChainProgram& c, at::TensorList operands, std::vector<at::Tensor> results) {
  Kept k;
  for (const at::Tensor& t : operands) {
    if (!t.has_storage()) return;  // nothing to match a sparse or meta operand by
    k.operands.push_back(KeptOperand{t.storage().getWeakStorageImpl(), t.storage_offset(), t.sizes().vec(),
                                     t.strides().vec(), t.scalar_type(), t._version()});
  }
  k.results = std::move(results);
  std::lock_guard<std::mutex> lock(kept_mu);
  kept_by_chain()[&c] = std::move(k);
}

bool chain_has_direct_gradient(const ChainProgram& c) {
  return c.kind == ChainProgram::Kind::grouped && plain_steps(c).has_value();
}

bool grouped_chain_backward(const ChainProgram& c, at::TensorList operands_in, const at::Tensor& grad_in,
                            const std::vector<bool>& wanted, std::vector<at::Tensor>& out) {
  if (c.kind != ChainProgram::Kind::grouped) return false;
  const auto plain = plain_steps(c);
  if (!plain) return false;
  // Plain tensors: the products run on other threads too, where this thread's grad mode does not hold.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> operands;
  for (const at::Tensor& t : operands_in) operands.push_back(t.detach());
  const at::Tensor grad = grad_in.detach();
  const at::ScalarType dtype = chain_dtype(c, operands);
  const ChainStep& first = c.steps[0];
  const RegionOperand& so = first.program->operands[static_cast<size_t>(c.s)];
  const auto [S, pattern, s_input] = grouped::grouping_factor(c, operands);
  const Groups g = grouped::group_entries(S, pattern, dtype, /*padded_allowed=*/false);
  // the forward's results, when it kept them for these operands (the same entries in the same order: ragged)
  std::vector<at::Tensor> kept = c.keep ? take_kept(c, operands_in) : std::vector<at::Tensor>{};
  const bool fits = kept.size() + 1 == c.steps.size() &&
                    std::all_of(kept.begin(), kept.end(), [&](const at::Tensor& t) {
                      return t.defined() && t.dim() == 2 && t.size(0) == g.entries;
                    });
  if (!fits) kept.clear();
  out.assign(operands.size(), at::Tensor());
  auto want = [&](int i) { return i >= 0 && static_cast<size_t>(i) < wanted.size() && wanted[static_cast<size_t>(i)]; };
  auto operand_of = [&](size_t j, int input) -> const RegionOperand& {
    const ChainStep& st = c.steps[j];
    for (size_t k = 0; k < st.inputs.size(); ++k)
      if (st.inputs[k] == input && !(j == 0 && static_cast<int>(k) == c.s)) return st.program->operands[k];
    SCORCH_CHECK(false, "scorch::chain {}: step {} does not read operand {}", c.title, j, input);
    return st.program->operands[0];
  };
  if (g.entries == 0) return true;  // the output was zero whatever the operands: no gradient (zeros)

  // S's values scale step 0's rows; they need keeping when they are not all 1 or S wants a gradient.
  const bool s_wanted = !pattern && want(s_input);
  at::Tensor s_vals = g.vals;
  if (s_wanted && !s_vals.defined()) s_vals = S.index({g.ps, g.qs}).to(dtype);

  // The forward again, keeping each step's rows (A), its per-entry scale (V), the matrix per group and the result
  // where the gradient needs it (a ReLU's output). `defer`: the last step is the rows alone (the combine: the
  // step before's result scaled by the gates) and the step before is a product with no elementwise op after it;
  // that product (the experts' outputs) is then not run again: the gates' gradient, the row sums of the output
  // gradient times it, equals the row sums of (output gradient times the matrix transposed, which the gradient
  // computes anyway) times the product's rows.
  const size_t L = plain->size();
  const bool defer = L >= 2 && !(*plain)[L - 1].w && !(*plain)[L - 1].relu && (*plain)[L - 2].w &&
                     !(*plain)[L - 2].relu && !(*plain)[L - 2].neg;
  std::vector<at::Tensor> A(L), V(L), W(L), O(L);
  std::vector<std::vector<at::Tensor>> vecs(L);
  std::vector<bool> w_t(L, false);
  auto scaled_rows = [&](size_t j) { return V[j].defined() ? A[j].mul(V[j].unsqueeze(1)) : A[j]; };
  for (size_t j = 0; j < L; ++j) {
    const PlainStep& ps = (*plain)[j];
    const ChainStep& st = c.steps[j];
    if (j == 0) {
      const at::Tensor& t = operands[static_cast<size_t>(ps.rows.input)];
      A[j] = gather_rows(as_factor(t, operand_of(j, ps.rows.input), dtype), ps.rows.lt, st.p, st.q, g);
    } else {
      A[j] = O[j - 1];
    }
    for (const Ref& r : ps.vectors) {
      const at::Tensor& t = operands[static_cast<size_t>(r.input)];
      vecs[j].push_back(gather_rows(as_factor(t, operand_of(j, r.input), dtype), r.lt, st.p, st.q, g));
    }
    if (j == 0 && s_vals.defined()) vecs[j].push_back(s_vals);
    for (const at::Tensor& v : vecs[j]) V[j] = V[j].defined() ? V[j].mul(v) : v;
    const RegionProgram& prog = *st.program;
    const char n = without(prog.out, st.p, st.q)[0];
    if (ps.w) {
      const at::Tensor& t = operands[static_cast<size_t>(ps.w->input)];
      W[j] = as_factor(t, operand_of(j, ps.w->input), dtype).movedim(static_cast<int64_t>(ps.w->lt.find(st.q)), 0);
      w_t[j] = without(ps.w->lt, st.p, st.q)[0] == n;
    }
    if ((j + 1 == L && !ps.relu) || (defer && j + 2 >= L)) continue;  // results the gradient does not read
    if (j < kept.size()) {  // (the forward keeps every step's result but the last: a last step's ReLU output,
      O[j] = kept[j];       // which the gradient reads, is computed here)
      continue;
    }
    const at::Tensor scaled = scaled_rows(j);
    at::Tensor r = ps.w ? grouped_matmul(scaled.contiguous(), W[j], w_t[j], g.counts, false) : scaled.clone();
    if (prog.coef != 1.0) r.mul_(prog.coef);
    if (ps.relu) r.relu_();
    if (ps.neg) r.neg_();
    O[j] = r;
  }

  // The output's gradient as rows: (p[, q], rest) gathered at the entries.
  const ChainStep& lst = c.steps.back();
  const std::string& out_letters = lst.program->out;
  const std::string view_letters = (has(out_letters, lst.q) ? std::string{lst.p, lst.q} : std::string{lst.p}) +
                                   without(out_letters, lst.p, lst.q);
  std::vector<int64_t> perm;
  for (char l : view_letters) perm.push_back(static_cast<int64_t>(out_letters.find(l)));
  const at::Tensor gv = grad.to(dtype).permute(perm);
  at::Tensor G = (has(out_letters, lst.q) ? gv.index({g.ps, g.qs}) : gv.index_select(0, g.ps)).contiguous();

  // Step j's per-entry vectors: which want a gradient, and those gradients from rowdot = rowsum(dA' * A) (dA' the
  // gradient of the scaled rows): d v_m = rowdot times the other vectors, put at S's entries of its operand.
  auto vector_wanted = [&](size_t j, size_t m) {
    if (j == 0 && m + 1 == vecs[j].size() && s_vals.defined()) return s_wanted;
    const int input = (*plain)[j].vectors[m].input;
    return want(input) && operand_of(j, input).kind != RegionOperand::Kind::pattern;
  };
  auto any_vector_wanted = [&](size_t j) {
    for (size_t m = 0; m < vecs[j].size(); ++m)
      if (vector_wanted(j, m)) return true;
    return false;
  };
  auto vector_grads = [&](size_t j, const at::Tensor& rowdot) {
    const ChainStep& st = c.steps[j];
    const size_t nv = vecs[j].size();
    for (size_t m = 0; m < nv; ++m) {
      if (!vector_wanted(j, m)) continue;
      const bool is_s = j == 0 && m + 1 == nv && s_vals.defined();
      const int input = is_s ? s_input : (*plain)[j].vectors[m].input;
      at::Tensor dv = rowdot;
      for (size_t o = 0; o < nv; ++o)
        if (o != m) dv = dv.mul(vecs[j][o]);
      const at::Tensor& t = operands[static_cast<size_t>(input)];
      const std::string lt = is_s ? std::string{first.p, first.q} : (*plain)[j].vectors[m].lt;
      at::Tensor full = at::zeros(t.sizes(), t.options().dtype(dtype));
      at::Tensor view = is_s && so.letters[0] != first.p ? full.t() : full;
      if (has(lt, st.q)) {
        view = view.movedim({static_cast<int64_t>(lt.find(st.p)), static_cast<int64_t>(lt.find(st.q))}, {0, 1});
        view.index_put_({g.ps, g.qs}, dv, /*accumulate=*/true);
      } else {
        view.movedim(static_cast<int64_t>(lt.find(st.p)), 0).index_add_(0, g.ps, dv);
      }
      accumulate(out[static_cast<size_t>(input)], full.to(t.scalar_type()));
    }
  };

  for (size_t j = L; j-- > 0;) {
    const PlainStep& ps = (*plain)[j];
    const ChainStep& st = c.steps[j];
    if (ps.relu) G = G.mul(O[j].gt(0));
    if (ps.neg) G = G.neg();
    if (st.program->coef != 1.0) G = G.mul(st.program->coef);
    if (defer && j + 1 == L) continue;  // G stays the gradient of the last step's scaled rows, unscaled by V
    const bool deferred_here = defer && j + 2 == L;  // the last step's vectors V[L - 1] are applied here
    const bool want_rows = j > 0 || want(ps.rows.input) || any_vector_wanted(j) ||
                           (deferred_here && any_vector_wanted(L - 1));
    at::Tensor dA;  // the gradient of the scaled rows
    if (ps.w && (want_rows || want(ps.w->input))) {
      at::Tensor scaled = scaled_rows(j);
      const bool want_w = want(ps.w->input);
      // deferred: dW reads the rows scaled by the last step's vectors too; dA is computed unscaled by them
      const at::Tensor for_w = deferred_here && V[L - 1].defined() ? scaled.mul(V[L - 1].unsqueeze(1)) : scaled;
      auto [da, dw] = grouped_matmul_grads(for_w.contiguous(), W[j], w_t[j], g.counts, G, want_rows, want_w);
      if (want_w) {
        const int64_t iq = static_cast<int64_t>(ps.w->lt.find(st.q));
        const at::Tensor& t = operands[static_cast<size_t>(ps.w->input)];
        accumulate(out[static_cast<size_t>(ps.w->input)], dw.movedim(0, iq).to(t.scalar_type()));
      }
      dA = da;
      if (deferred_here && want_rows) {
        if (any_vector_wanted(L - 1)) vector_grads(L - 1, dA.mul(scaled).sum(1));
        if (V[L - 1].defined()) dA = dA.mul(V[L - 1].unsqueeze(1));
      }
    } else {
      dA = G;
    }
    if (!want_rows) break;
    if (any_vector_wanted(j)) vector_grads(j, dA.mul(A[j]).sum(1));
    if (V[j].defined()) dA = dA.mul(V[j].unsqueeze(1));
    if (j > 0) {
      G = dA.contiguous();
      continue;
    }
    if (want(ps.rows.input)) {  // step 0's rows summed back into their operand's rows
      const at::Tensor& t = operands[static_cast<size_t>(ps.rows.input)];
      at::Tensor full = at::zeros(t.sizes(), t.options().dtype(dtype));
      full.movedim(static_cast<int64_t>(ps.rows.lt.find(st.p)), 0).index_add_(0, g.ps, dA);
      accumulate(out[static_cast<size_t>(ps.rows.input)], full.to(t.scalar_type()));
    }
  }
  return true;
}

}  // namespace scorch::torch_glue
