// Chain programs (chain.h): the JSON text read and checked once per text, the grouping plan of a region program,
// the chain's dtype and output shape, and the sequence kind's run (each step a region call; a dense linear step
// through the grouped product kernel, its bias and ReLU in the kernel's last pass).
#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <ATen/core/dispatch/Dispatcher.h>

#include "chain.h"
#include "common/error.h"
#include "grouped_kernel.h"
#include "json.h"

namespace scorch::torch_glue {
namespace {

constexpr const char* kOp = "scorch::chain";

bool has(const std::string& s, char c) { return c != 0 && s.find(c) != std::string::npos; }

Elementwise elementwise_named(const std::string& name, bool sequence) {
  // A sequence differentiates its ops from their outputs (relu, tanh, neg); the grouped kind records them.
  static const std::map<std::string, Elementwise> grouped{{"aten.relu", Elementwise::relu},
                                                          {"aten.gelu", Elementwise::gelu},
                                                          {"aten.tanh", Elementwise::tanh},
                                                          {"aten.abs", Elementwise::abs},
                                                          {"aten.neg", Elementwise::neg}};
  auto it = grouped.find(name);
  const bool ok = it != grouped.end() && (!sequence || name == "aten.relu" || name == "aten.tanh" || name == "aten.neg");
  SCORCH_CHECK(ok, "scorch::chain: elementwise op '{}' not supported{}", name, sequence ? " in a sequence" : "");
  return it->second;
}

// A grouped chain's steps: step 0 groups by its factor S; a later step finds the group letters where it reads
// an earlier step's result (read whole: the same letters, none broadcast); every intermediate keeps both group
// letters and is read exactly once (it lives only per group). `relus_applied`: the caller applies the
// programs' ReLUs to the operands before the grouped runner reads them (a region's grouped path).
void check_grouped(ChainProgram& c, bool relus_applied = false) {
  const auto plan = grouped_plan(*c.steps[0].program);
  SCORCH_CHECK(plan.has_value(), "scorch::chain: the first step has no sparse 2-D factor to group by");
  c.s = plan->s;
  std::vector<int> reads;
  for (size_t j = 0; j < c.steps.size(); ++j) {
    ChainStep& st = c.steps[j];
    const RegionProgram& prog = *st.program;
    SCORCH_CHECK(!prog.has_addends() && prog.packed_buffers == 0,
                 "scorch::chain: step {} of a grouped chain has addends or packed operands", j);
    // (the grouped runner reads the operands as they are: a ReLU flag would be ignored, not applied)
    SCORCH_CHECK(relus_applied || !prog.has_relu, "scorch::chain: step {} of a grouped chain applies a ReLU to an operand",
                 j);
    if (j == 0) {
      st.p = plan->p;
      st.q = plan->q;
      for (int i : st.inputs) SCORCH_CHECK(i >= 0, "scorch::chain: the first step reads no earlier step");
    } else {
      for (size_t k = 0; k < st.inputs.size(); ++k) {
        const int i = st.inputs[k];
        if (i >= 0) continue;
        const size_t from = static_cast<size_t>(-i - 1);
        reads.push_back(i);
        SCORCH_CHECK(from < j, "scorch::chain: step {} reads step {}, not before it", j, from);
        const ChainStep& src = c.steps[from];
        const RegionOperand& o = prog.operands[k];
        SCORCH_CHECK(o.expand == 0 && o.kind != RegionOperand::Kind::add && o.letters.size() == src.program->out.size(),
                     "scorch::chain: an intermediate must be read whole");
        const char pk = o.letters[src.program->out.find(src.p)], qk = o.letters[src.program->out.find(src.q)];
        SCORCH_CHECK(!st.p || (st.p == pk && st.q == qk), "scorch::chain: intermediates disagree on the group letters");
        st.p = pk;
        st.q = qk;
      }
      SCORCH_CHECK(st.p != 0, "scorch::chain: step {} reads no earlier step", j);
    }
    SCORCH_CHECK(j + 1 == c.steps.size() || (has(prog.out, st.p) && has(prog.out, st.q)),
                 "scorch::chain: step {}'s result must keep the group letters", j);
  }
  std::sort(reads.begin(), reads.end());
  std::vector<int> want;
  for (int k = static_cast<int>(c.steps.size()) - 2; k >= 0; --k) want.push_back(-(k + 1));
  std::sort(want.begin(), want.end());
  SCORCH_CHECK(reads == want, "scorch::chain: each step but the last must be read once by a later one");
}

// A sequence: step k + 1 reads step k's result, whole, once, as a factor; no other reads.
void check_sequence(const ChainProgram& c) {
  for (size_t j = 0; j < c.steps.size(); ++j) {
    const ChainStep& st = c.steps[j];
    std::vector<size_t> reads;
    for (size_t k = 0; k < st.inputs.size(); ++k)
      if (st.inputs[k] < 0) reads.push_back(k);
    const bool ok = j == 0 ? reads.empty() : reads.size() == 1 && st.inputs[reads[0]] == -static_cast<int>(j);
    SCORCH_CHECK(ok, "scorch::chain: step {} of a sequence must read the step before it, once", j);
    for (size_t k : reads) {
      const RegionOperand& o = st.program->operands[k];
      SCORCH_CHECK(o.kind != RegionOperand::Kind::add && o.expand == 0 &&
                       o.letters.size() == c.steps[j - 1].program->out.size(),
                   "scorch::chain: an intermediate must be read whole, as a factor");
    }
  }
}

ChainProgram parse_chain(const std::string& text) {
  using json::as;
  const json::Json doc = json::JsonReader(text, kOp).document();
  const auto& o = as<json::JsonObject>(doc, "an object expected", kOp);
  ChainProgram c;
  const json::Json* steps = json::field(o, "steps");
  SCORCH_CHECK(steps != nullptr, "scorch::chain: malformed program text (steps are required)");
  if (const json::Json* n = json::field(o, "name")) c.name = as<std::string>(*n, "name", kOp);
  if (const json::Json* l = json::field(o, "label")) c.label = as<std::string>(*l, "label", kOp);
  if (const json::Json* k = json::field(o, "keep")) c.keep = as<bool>(*k, "keep", kOp);
  std::string kind = "grouped";
  if (const json::Json* k = json::field(o, "kind")) kind = as<std::string>(*k, "kind", kOp);
  SCORCH_CHECK(kind == "grouped" || kind == "sequence", "scorch::chain: unknown chain kind '{}'", kind);
  c.kind = kind == "sequence" ? ChainProgram::Kind::sequence : ChainProgram::Kind::grouped;
  const bool sequence = c.kind == ChainProgram::Kind::sequence;
  int n_operands = 0;
  for (const json::Json& e : as<json::JsonArray>(*steps, "steps must be a list", kOp)) {
    const auto& so = as<json::JsonObject>(e, "a step must be an object", kOp);
    const json::Json* prog = json::field(so, "program");
    const json::Json* inputs = json::field(so, "inputs");
    SCORCH_CHECK(prog && inputs, "scorch::chain: malformed program text (a step needs program and inputs)");
    ChainStep st;
    st.text = as<std::string>(*prog, "a step's program", kOp);
    st.program = &region_program(st.text);  // ValueError for a malformed region program
    for (const json::Json& i : as<json::JsonArray>(*inputs, "inputs must be a list", kOp)) {
      const double v = as<double>(i, "an input", kOp);
      SCORCH_CHECK(v == static_cast<double>(static_cast<int>(v)) && v > -1e6 && v < 1e6,
                   "scorch::chain: bad input {}", v);
      st.inputs.push_back(static_cast<int>(v));
      n_operands = std::max(n_operands, static_cast<int>(v) + 1);
    }
    if (const json::Json* then = json::field(so, "then"))
      for (const json::Json& f : as<json::JsonArray>(*then, "then must be a list", kOp))
        st.then.push_back(elementwise_named(as<std::string>(f, "an elementwise op", kOp), sequence));
    SCORCH_CHECK(st.inputs.size() == st.program->operands.size(), "scorch::chain: step {} has {} operands, {} inputs",
                 c.steps.size(), st.program->operands.size(), st.inputs.size());
    c.steps.push_back(std::move(st));
  }
  SCORCH_CHECK(!c.steps.empty(), "scorch::chain: no steps");
  if (sequence) check_sequence(c);
  else check_grouped(c);
  c.differentiable.assign(static_cast<size_t>(n_operands), false);
  for (const ChainStep& st : c.steps)
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      const RegionOperand& o = st.program->operands[k];
      if (st.inputs[k] >= 0 && o.kind != RegionOperand::Kind::pattern && o.grad)
        c.differentiable[static_cast<size_t>(st.inputs[k])] = true;
    }
  c.title = c.name.empty() && c.label.empty() ? "chain" : c.label.empty() ? c.name
                                                        : c.name.empty() ? c.label : c.name + " " + c.label;
  c.profile_name = "scorch::chain " + c.title;
  return c;
}

template <typename Make>
const ChainProgram& interned(const std::string& key, Make make) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<ChainProgram>> chains;
  {
    std::lock_guard lock(mu);
    auto it = chains.find(key);
    if (it != chains.end()) return *it->second;
  }
  auto c = std::make_unique<ChainProgram>(make());
  std::lock_guard lock(mu);  // never shrinks: callers hold references (a process has a bounded set of chains)
  return *chains.emplace(key, std::move(c)).first->second;
}

// Per step, the size of each of its letters (symbolic under the Meta kernel).
std::vector<std::map<char, c10::SymInt>> chain_sizes(const ChainProgram& c, at::TensorList operands) {
  std::vector<std::map<char, c10::SymInt>> out;
  for (size_t j = 0; j < c.steps.size(); ++j) {
    const ChainStep& st = c.steps[j];
    std::map<char, c10::SymInt> sizes;
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      const RegionOperand& o = st.program->operands[k];
      const int i = st.inputs[k];
      if (i >= 0) {
        const std::string letters = o.tensor_letters();
        const auto shape = operands[static_cast<size_t>(i)].sym_sizes();
        SCORCH_CHECK(shape.size() == letters.size(), "scorch::chain {}: operand {} has {} dimensions, step {} gives it {}",
                     c.title, i, shape.size(), j, letters.size());
        for (size_t d = 0; d < letters.size(); ++d) sizes.emplace(letters[d], shape[d]);
      } else {
        const ChainStep& src = c.steps[static_cast<size_t>(-i - 1)];
        const auto& from = out[static_cast<size_t>(-i - 1)];
        for (size_t d = 0; d < o.letters.size(); ++d) sizes.emplace(o.letters[d], from.at(src.program->out[d]));
      }
    }
    out.push_back(std::move(sizes));
  }
  return out;
}

}  // namespace

const ChainProgram& chain_program(const std::string& text) {
  return interned(text, [&] { return parse_chain(text); });
}

const ChainProgram& grouped_region_chain(const std::string& region_text) {
  return interned("region:" + region_text, [&] {
    ChainProgram c;
    ChainStep st;
    st.text = region_text;
    st.program = &region_program(region_text);
    for (size_t k = 0; k < st.program->operands.size(); ++k) st.inputs.push_back(static_cast<int>(k));
    c.steps.push_back(std::move(st));
    c.title = c.steps[0].program->title;
    check_grouped(c, /*relus_applied=*/true);  // run_path applies them (a ReLU output demoted to dense)
    return c;
  });
}

std::optional<GroupPlan> grouped_plan(const RegionProgram& p) {
  if (p.has_addends() || p.packed_buffers) return std::nullopt;
  int s = -1;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind == RegionOperand::Kind::dense) continue;
    if (s >= 0) return std::nullopt;
    s = static_cast<int>(k);
  }
  if (s < 0 || p.operands[static_cast<size_t>(s)].letters.size() != 2) return std::nullopt;
  const std::string& sl = p.operands[static_cast<size_t>(s)].letters;
  for (int flip = 0; flip < 2; ++flip) {
    const char pl = sl[flip], ql = sl[1 - flip];
    // a matrix per q that does not depend on p (each group is a real matrix product), and p read by some other
    // operand (the rows to gather). The matrix is a dense operand's (an expert's weights W(e,d,h)) or the
    // output's (a weight gradient dW(e,d,h) = sum_t G(t,e) x(t,d) dy(t,h)); the output's only when its other
    // letters come from two operands: a linear on 3-D input, y(a,b,c) = x(a,b,d) W(c,d) with W sparse, has an
    // (a,b) matrix per c, but each group is x's gathered columns times one row of W, a matrix-vector product
    // (measured 9.9 ms per call against 0.16 ms for the sparse kernel, (2,32,512) x 1024x512 at 10%).
    bool out_matrix = p.out.size() >= 3 && has(p.out, ql) && !has(p.out, pl), matrix = false, rows = false;
    for (size_t k = 0; k < p.operands.size(); ++k) {
      if (static_cast<int>(k) == s) continue;
      const std::string t = p.operands[k].tensor_letters();
      matrix = matrix || (t.size() >= 3 && has(t, ql) && !has(t, pl));
      rows = rows || has(t, pl);
      bool holds_rest = true;  // this operand holds every output letter but q
      for (char c : p.out) holds_rest = holds_rest && (c == ql || has(t, c));
      out_matrix = out_matrix && !holds_rest;
    }
    matrix = matrix || out_matrix;
    if (matrix && rows) return GroupPlan{s, pl, ql};
  }
  return std::nullopt;
}

bool grouped_worth(const RegionProgram& p, at::TensorList operands, double density) {
  // Each group's product must have enough rows to run at dense speed (a few rows per group: the sparse kernel).
  constexpr double kMinRowsPerGroup = 8;
  const auto plan = grouped_plan(p);
  if (!plan || density <= 0) return false;
  const at::Tensor& S = operands[static_cast<size_t>(plan->s)];
  const int64_t groups = S.size(static_cast<int64_t>(p.operands[static_cast<size_t>(plan->s)].letters.find(plan->q)));
  return density * static_cast<double>(S.numel()) / static_cast<double>(std::max<int64_t>(groups, 1)) >=
         kMinRowsPerGroup;
}

at::ScalarType chain_dtype(const ChainProgram& c, at::TensorList operands) {
  std::optional<at::ScalarType> dtype;
  for (const ChainStep& st : c.steps)
    for (size_t k = 0; k < st.inputs.size(); ++k) {
      const int i = st.inputs[k];
      if (i < 0 || st.program->operands[k].kind == RegionOperand::Kind::pattern) continue;
      const at::Tensor& t = operands[static_cast<size_t>(i)];
      if (!t.is_floating_point()) continue;
      dtype = dtype ? at::promote_types(*dtype, t.scalar_type()) : t.scalar_type();
    }
  return dtype.value_or(at::kFloat);
}

std::vector<c10::SymInt> chain_output_shape(const ChainProgram& c, at::TensorList operands) {
  SCORCH_CHECK(operands.size() >= c.differentiable.size(), "scorch::chain {}: {} operands expected, got {}", c.title,
               c.differentiable.size(), operands.size());
  const auto sizes = chain_sizes(c, operands);
  std::vector<c10::SymInt> shape;
  for (char l : c.steps.back().program->out) shape.push_back(sizes.back().at(l));
  return shape;
}

at::Tensor apply_elementwise(Elementwise f, at::Tensor t, bool in_place) {
  switch (f) {
    case Elementwise::relu: return in_place ? t.relu_() : t.relu();
    case Elementwise::gelu: return in_place ? at::gelu_(t) : at::gelu(t);
    case Elementwise::tanh: return in_place ? t.tanh_() : t.tanh();
    case Elementwise::abs: return in_place ? t.abs_() : t.abs();
    case Elementwise::neg: return in_place ? t.neg_() : t.neg();
  }
  return t;
}

namespace {

// A step that is a dense linear product -- two dense matrices (out = x W^T or x W), at most a bias along the
// output's columns, coefficient 1, nothing compressed, masked, packed or ReLU'd -- through the grouped product
// kernel as one group, the bias and (`relu`) a ReLU in its last pass: an MLP's fc1 in inference, whose output
// the next step reads compressed. The weight is copied once into the kernel's panels and kept (grouped_kernel.h),
// so only a cached operand (a parameter or buffer) is taken. Undefined when it does not take the step
// (then the region op runs it: ATen's addmm); the kernel's own fallback (no compiler, no bundle, a target whose
// tile is too small) is grouped_product_kernel's.
at::Tensor linear_step(const ChainStep& st, const std::vector<at::Tensor>& args, bool relu) {
  const RegionProgram& p = *st.program;
  if (p.out.size() != 2 || p.coef != 1.0 || p.has_masks || p.has_relu || p.packed_buffers != 0) return at::Tensor();
  int x = -1, w = -1, b = -1;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    if (o.expand != 0 || !o.packed.empty()) return at::Tensor();
    if (o.kind == RegionOperand::Kind::add && b < 0 && o.letters == p.out.substr(1)) {
      b = static_cast<int>(k);
    } else if (o.kind == RegionOperand::Kind::dense && o.letters.size() == 2 && has(o.letters, p.out[0]) && x < 0 &&
               !has(o.letters, p.out[1])) {
      x = static_cast<int>(k);
    } else if (o.kind == RegionOperand::Kind::dense && o.letters.size() == 2 && has(o.letters, p.out[1]) && w < 0 &&
               !has(o.letters, p.out[0])) {
      w = static_cast<int>(k);
    } else {
      return at::Tensor();
    }
  }
  if (x < 0 || w < 0) return at::Tensor();
  const std::string& xl = p.operands[static_cast<size_t>(x)].letters;
  const std::string& wl = p.operands[static_cast<size_t>(w)].letters;
  const char kx = xl[0] == p.out[0] ? xl[1] : xl[0], kw = wl[0] == p.out[1] ? wl[1] : wl[0];
  if (kx != kw) return at::Tensor();
  const at::Tensor& X = args[static_cast<size_t>(x)];
  const at::Tensor& W = args[static_cast<size_t>(w)];
  const at::Tensor bias = b >= 0 ? args[static_cast<size_t>(b)] : at::Tensor();
  const bool w_t = wl[0] == p.out[1];  // stored (n, k): a Linear's weight
  // Anything but the plain shapes (a 2-D input and weight, a 1-D bias) is left to the region op, whose checks
  // name what is wrong. So is a weight that is a data input (a forward argument): the panels kept of it would be
  // checked as a parameter's, by the fingerprint, and a numpy write into it went unseen (helper-59); the region
  // op checks a data input by a hash of every byte.
  const RegionOperand& wo = p.operands[static_cast<size_t>(w)];
  if (X.dim() != 2 || W.dim() != 2 || (bias.defined() && bias.dim() != 1) || X.scalar_type() != W.scalar_type() ||
      (bias.defined() && bias.scalar_type() != X.scalar_type()) || !wo.cached || !wo.weight)
    return at::Tensor();
  at::Tensor A = xl[0] == p.out[0] ? X : X.t();
  if (A.size(1) > 1 && A.stride(1) != 1) A = A.contiguous();
  at::Tensor r = linear_product_kernel(A, W, w_t, bias.defined() && bias.size(0) > 1 ? bias.contiguous() : bias, relu);
  if (r.defined()) region_capture(st.text, args);  // what `explain` records of a region call
  return r;
}

}  // namespace

// A sequence: each step a region call (below autograd, or through the region op's autograd when the gradient is
// recorded), its elementwise ops in place on the step's fresh result; without autograd, a dense linear step runs
// through the grouped product kernel (linear_step) with a ReLU that follows it.
at::Tensor run_chain(const ChainProgram& c, at::TensorList operands, bool differentiable) {
  SCORCH_CHECK(operands.size() == c.differentiable.size(), "scorch::chain {}: {} operands expected, got {}", c.title,
               c.differentiable.size(), operands.size());
  if (c.kind == ChainProgram::Kind::grouped) return run_grouped_chain(c, operands, differentiable);
  static const auto region_op = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::region", "").typed<
      at::Tensor(c10::string_view, at::TensorList)>();
  at::Tensor r;
  for (const ChainStep& st : c.steps) {
    std::vector<at::Tensor> args;
    for (int i : st.inputs) args.push_back(i >= 0 ? operands[static_cast<size_t>(i)] : r);
    const bool first_relu = !st.then.empty() && st.then[0] == Elementwise::relu;
    r = differentiable ? at::Tensor() : linear_step(st, args, first_relu);
    const bool fused = r.defined();
    if (!fused) r = differentiable ? region_op.call(st.text, args) : run_region(st.text, args);
    for (size_t e = fused && first_relu ? 1 : 0; e < st.then.size(); ++e)
      r = apply_elementwise(st.then[e], r, !differentiable);
  }
  return r;
}

}  // namespace scorch::torch_glue
