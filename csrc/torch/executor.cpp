#include "executor.h"
#include "dense_einsum.h"
#include "dense_first.h"
#include "eager_measure.h"
#include "equation_facts.h"
#include "region_compress.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <functional>
#include <map>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "convert.h"
#include "ir/parser.h"
#include "common/saturating.h"
#include "ir/split_reductions.h"
#include "runtime/settings.h"
#include "runtime/target.h"

namespace scorch::torch_glue {
namespace {

constexpr int64_t kTinyDenseElements = 4096;  // below this many dense elements in all operands, dense ATen
                                              // code wins on overhead alone (cost_model.TINY_DENSE_ELEMENTS)
constexpr size_t kMaxCachedPlans = 8192;      // a process planning more distinct calls starts over

using TensorVec = std::vector<at::Tensor>;

// The ops the executor calls go through the dispatcher, so their autograd and profiler rows apply.
// scorch::kernel's sizes are SymInt[] (traced calls keep them symbolic) and its autograd kernel takes them so:
// called with SymInts, the call stays unboxed (with an IntArrayRef it would be boxed and unboxed again).
const auto& kernel_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::kernel", "").typed<
      std::tuple<at::Tensor, TensorVec>(c10::string_view, at::TensorList, c10::SymIntArrayRef, int64_t)>();
  return h;
}
const auto& to_dense_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::to_dense", "").typed<
      at::Tensor(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view)>();
  return h;
}
const auto& unpack_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::unpack", "").typed<
      at::Tensor(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view)>();
  return h;
}

const std::string& text_of(const FormatRef* f) {
  static const std::string strided = "strided";
  return f ? f->text : strided;
}

// A statement split into steps (ir/split_reductions.h).
struct Steps {
  std::vector<std::string> texts;          // canonical text of each step over t0..
  std::vector<std::vector<int>> operands;  // global operand ids of each step
};

// The steps of `st` on operands of these shapes (one step when nothing is worth summing first).
std::shared_ptr<Steps> steps_of(const ir::Statement& st, const std::vector<std::vector<int64_t>>& shapes) {
  auto s = std::make_shared<Steps>();
  for (const auto& step : ir::split_reductions(st, ir::infer_var_sizes(st, shapes))) {
    s->texts.push_back(step.stmt.canonical());
    s->operands.push_back(step.operands);
  }
  return s;
}

// A plan with the formats it names already parsed.
struct PlanEntry {
  Plan plan;
  std::vector<int> convert;              // per operand: 0 keep, 1 densify, 2 convert to convert_to[i]
  std::vector<const FormatRef*> convert_to;
  const FormatRef* out = nullptr;        // null: strided output
  // Not empty: the operands broadcast (torch.einsum's rule) to these shapes, and the call is run again with the
  // dense ones expanded; the entry then holds no plan.
  std::vector<std::vector<int64_t>> broadcast;
  // Set when the kernel's work is better done in steps (an index summed over one factor first): what the
  // sparse route runs instead of `plan`'s one loop nest (which still gives the shape and format).
  std::shared_ptr<const Steps> steps;
};

std::shared_ptr<const PlanEntry> make_entry(Plan plan, const std::vector<Operand>& ops) {
  auto e = std::make_shared<PlanEntry>();
  for (size_t i = 0; i < plan.convert.size(); ++i) {
    const std::string& c = plan.convert[i];
    e->convert.push_back(c.empty() ? 0 : c == "strided" ? 1 : 2);
    e->convert_to.push_back(c.empty() || c == "strided" ? nullptr
                                                        : &interned_format(c, static_cast<int>(ops[i].shape.size())));
  }
  if (plan.out_format != "strided") e->out = &interned_format(plan.out_format, static_cast<int>(plan.out_shape.size()));
  e->plan = std::move(plan);
  return e;
}

// Plans keyed by everything they depend on.
template <typename Build>
std::shared_ptr<const PlanEntry> cached_plan(const std::string& key, Build build) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const PlanEntry>> plans;
  {
    std::lock_guard lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
  }
  auto e = build();  // may throw: nothing is cached then
  std::lock_guard lock(mu);
  if (plans.size() >= kMaxCachedPlans) plans.clear();
  return plans.emplace(key, std::move(e)).first->second;
}

void append_int(std::string& key, int64_t v) {
  char buf[24];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  key.append(buf, r.ptr);
}

// Appends what a plan depends on of each operand (runs on every call: no formatting library).
void append_descs(std::string& key, const std::vector<Operand>& ops) {
  for (const auto& o : ops) {
    key += '|';
    key += text_of(o.format);
    key += ':';
    for (auto s : o.shape) {
      append_int(key, s);
      key += ',';
    }
    key += ':';
    append_int(key, o.sparse() ? o.nnz() : o.numel());
  }
}

std::vector<OperandDesc> descs_of(const std::vector<Operand>& ops) {
  std::vector<OperandDesc> d;
  d.reserve(ops.size());
  for (const auto& o : ops) d.push_back(o.desc());
  return d;
}

std::vector<std::vector<int64_t>> shapes_of(const std::vector<Operand>& ops) {
  std::vector<std::vector<int64_t>> s;
  for (const auto& o : ops) s.push_back(o.shape);
  return s;
}

std::vector<int> ndims_of(const std::vector<Operand>& ops) {
  std::vector<int> n;
  for (const auto& o : ops) n.push_back(static_cast<int>(o.shape.size()));
  return n;
}

// The operands as dense tensors of the result's dtype: what the dense path multiplies.
// The dtype the dense path multiplies in: float16 in float32 (ATen's float16 products on a CPU are scalar
// loops: helper-43 saw 35-65x the kernel's time), cast back after; others as they are.
at::ScalarType dense_dtype(at::ScalarType result) { return result == at::kHalf ? at::kFloat : result; }

TensorVec dense_operands(const std::vector<Operand>& ops, at::ScalarType result) {
  TensorVec t;
  t.reserve(ops.size());
  const at::ScalarType as = dense_dtype(result);
  for (const auto& o : ops) {
    at::Tensor x = o.to_dense();
    t.push_back(x.scalar_type() == as ? x : x.to(as));
  }
  return t;
}

at::Tensor dense_product(const std::string& equation, const std::vector<Operand>& ops, at::ScalarType result) {
  at::Tensor out = dense_einsum(equation, dense_operands(ops, result));
  return out.scalar_type() == result ? out : out.to(result);
}

at::ScalarType index_dtype(const std::vector<Operand>& ops) {
  for (const auto& o : ops) {
    const bool long_buffers = o.sparse() && !o.buffers.empty() && o.buffers[0].scalar_type() == at::kLong;
    if (long_buffers || needs_index64(o.format, o.sparse() ? o.nnz() : 0, o.shape)) return at::kLong;
  }
  return at::kInt;
}

}  // namespace

at::ScalarType compute_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

bool needs_index64(const FormatRef* format, int64_t nnz, const std::vector<int64_t>& shape) {
  constexpr int64_t int32_max = std::numeric_limits<int32_t>::max();
  // an all-dense format has no buffers; int64 is what SparseTensor.index_dtype reports then
  if (format && (nnz > int32_max || format->format.all_dense())) return true;
  for (auto s : shape)
    if (s > int32_max) return true;
  return false;
}

Plan plan_einsum(const std::string& equation, const std::vector<OperandDesc>& descs, const std::string& out_format,
                 bool f64, bool idx64) {
  std::vector<int> ndims;
  for (const auto& d : descs) ndims.push_back(static_cast<int>(d.shape.size()));
  return make_plan(ir::parse_einsum(equation, ndims), descs, out_format, f64, idx64);
}

namespace {

// The threads worth starting for a call. Starting and joining an OpenMP team costs microseconds on an idle
// machine and tens of them on a busy one (a thread that is not running must be woken), so a call touching
// few elements runs on one thread: one more thread for every SCORCH_THREAD_GRAIN elements read or written
// (stored entries, dense operands and the result), up to `threads`. The default grain (2048) keeps every
// call of the kernel benchmark's matrices on all threads (SpMV there: 0.74x torch CSR with a grain of 32768,
// 0.99x with 2048 or 1, Zen 3, 2 threads) and puts a region call on a 2x2 problem on one (85 us -> 15 us on
// a busy machine).

int64_t threads_for(const std::vector<Operand>& ops, const std::vector<int64_t>& out_shape, int64_t threads) {
  const int64_t grain = thread_grain();  // read (and checked) on every call, one thread or many
  if (threads <= 1) return threads;
  int64_t work = 1;
  for (auto s : out_shape) work *= s;
  for (const auto& o : ops) {
    const auto n = o.values.sym_numel().maybe_as_int();
    if (!n) return threads;  // symbolic (tracing): the kernel is not run here
    work += *n;
  }
  return std::clamp<int64_t>(work / grain, 1, threads);
}

Operand run_kernel(const PlanEntry& e, const std::vector<Operand>& ops, int64_t threads, at::ScalarType result) {
  threads = threads_for(ops, e.plan.out_shape, threads);
  const at::ScalarType compute = compute_dtype(result);
  const at::ScalarType idx = e.plan.spec.find("; i64") != std::string::npos ? at::kLong : at::kInt;
  TensorVec inputs;
  inputs.reserve(ops.size() * 3);
  for (size_t i = 0; i < ops.size(); ++i) {
    const Operand* o = &ops[i];
    Operand converted;
    if (e.convert[i] == 1 && o->sparse()) {
      converted = Operand{nullptr, o->shape, {}, o->to_dense()};
      o = &converted;
    } else if (e.convert[i] == 2) {
      converted = to_format(*o, *e.convert_to[i], idx);
      o = &converted;
    }
    for (const auto& b : o->buffers) inputs.push_back(b.scalar_type() == idx ? b : b.to(idx));
    inputs.push_back(o->values.scalar_type() == compute ? o->values : o->values.to(compute));
  }
  auto [values, buffers] = kernel_handle().call(e.plan.spec, inputs, c10::fromIntArrayRefSlow(e.plan.var_sizes), threads);
  if (values.scalar_type() != result) values = values.to(result);
  if (!e.out) return Operand{nullptr, e.plan.out_shape, {}, values};
  return Operand{e.out, e.plan.out_shape, std::move(buffers), values};
}

bool all_finite(const std::vector<Operand>& ops) {
  for (const auto& o : ops) {
    if (o.values.numel() == 0) continue;
    const auto acc = o.values.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    if (!at::isfinite(o.values.detach().sum(acc)).item<bool>()) return false;
  }
  return true;
}

std::atomic<int64_t> routed_kernel{0}, routed_dense{0}, routed_caller{0};

// Calibrated crossover densities by (threads, target name), handed in by the Python cost model.
std::mutex crossover_mu;
std::unordered_map<std::string, double> crossovers;

std::string crossover_key(int64_t threads) {
  std::string k;
  append_int(k, threads);
  k += '|';
  k += target_name();
  return k;
}

}  // namespace

namespace {
std::function<void(int64_t)> calibration_hook;
constexpr double kFallbackCrossover = 0.3;  // a program without the Python package and without SCORCH_DENSE_CROSSOVER

double calibrated_crossover(int64_t threads) {
  const std::string key = crossover_key(threads);
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard lock(crossover_mu);
      auto it = crossovers.find(key);
      if (it != crossovers.end()) return it->second;
    }
    // Measuring compiles kernels; with SCORCH_JIT=0 (a deployment with kernel bundles) the fallback is used.
    if (attempt == 0 && calibration_hook && jit_enabled()) calibration_hook(threads);  // measures once, then stored
  }
  return kFallbackCrossover;
}
}  // namespace

void set_calibration_hook(std::function<void(int64_t)> hook) { calibration_hook = std::move(hook); }

RouteCounts route_counts() { return {routed_kernel.load(), routed_dense.load(), routed_caller.load()}; }

void set_calibrated_crossover(int64_t threads, const std::string& target, double crossover) {
  std::lock_guard lock(crossover_mu);
  crossovers[fmt::format("{}|{}", threads, target)] = crossover;
}

const FormatRef& interned_format(const std::string& text, int ndim) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<FormatRef>> table;
  std::string key = fmt::format("{}#{}", text, ndim);
  std::lock_guard lock(mu);
  auto it = table.find(key);
  if (it != table.end()) return *it->second;
  auto f = std::make_unique<FormatRef>();
  f->format = Format::parse(text, ndim);  // throws for bad text: nothing is cached then
  f->text = f->format.str();
  return *table.emplace(std::move(key), std::move(f)).first->second;
}

int64_t Operand::nnz() const {
  const c10::SymInt n = values.sym_numel();
  const auto known = n.maybe_as_int();
  return known ? *known : 0;
}

int64_t Operand::numel() const {
  int64_t n = 1;
  for (auto s : shape) n = saturating_mul(n, s);
  return n;
}

double Operand::density() const {
  const int64_t n = numel();
  return n ? static_cast<double>(nnz()) / static_cast<double>(n) : 0.0;
}

OperandDesc Operand::desc() const { return {text_of(format), shape, sparse() ? nnz() : numel()}; }

at::Tensor Operand::to_dense() const {
  if (!sparse()) return values;
  return to_dense_handle().call(buffers, values, c10::fromIntArrayRefSlow(shape), text_of(format));
}

at::Tensor Operand::coordinates() const {
  return unpack_handle().call(buffers, values.detach(), c10::fromIntArrayRefSlow(shape), text_of(format));
}

Operand Operand::with_values(at::Tensor v) const { return Operand{format, shape, buffers, std::move(v)}; }

// torch's rule for floating-point operands: those with dimensions decide, 0-d ones only when there are none
// (frontend._result_dtype, which also has Python numbers: they never reach this path).
at::ScalarType result_dtype(const std::vector<Operand>& ops) {
  const bool any_dims = std::any_of(ops.begin(), ops.end(), [](const Operand& o) { return !o.shape.empty(); });
  std::optional<at::ScalarType> t;
  for (const auto& o : ops) {
    if (any_dims && o.shape.empty()) continue;
    t = t ? c10::promoteTypes(*t, o.values.scalar_type()) : o.values.scalar_type();
  }
  return t.value_or(at::kFloat);
}

Decision choose_by_density(const std::vector<double>& densities, int64_t elements, int64_t threads, bool explain) {
  Decision d;
  const DispatchMode mode = dispatch_mode();
  if (mode != DispatchMode::automatic) {
    d.dense = mode == DispatchMode::dense;
    if (explain) d.why = fmt::format("SCORCH_DISPATCH={}", dispatch_mode_name(mode));
    return d;
  }
  const auto override_ = dense_crossover_override();  // read (and checked) whenever the cost model decides
  if (densities.empty()) {
    // Nothing to skip: ATen's dense products (BLAS) are what the kernel would be at best (helper-43: a 1024^3
    // matmul through sb.einsum ran the generated loops 200x slower than torch.einsum).
    d.dense = true;
    if (explain) d.why = "no sparse operand: dense ATen code";
    return d;
  }
  if (elements <= kTinyDenseElements) {
    d.dense = true;
    if (explain) d.why = fmt::format("tiny problem ({} dense elements): dense ATen code has less overhead", elements);
    return d;
  }
  double combined = 1.0;
  for (double x : densities) combined *= x;
  const double threshold = override_ ? *override_ : calibrated_crossover(threads);
  d.dense = combined >= threshold;
  if (explain)
    d.why = d.dense ? fmt::format("sparse operands' combined density {:.3g} >= crossover {:.3g} (measured on this "
                                  "machine): dense is faster", combined, threshold)
                    : fmt::format("combined density {:.3g} < crossover {:.3g}: sparse kernel", combined, threshold);
  return d;
}

Decision choose(const std::vector<Operand>& ops, int64_t threads, bool explain) {
  std::vector<double> densities;
  int64_t elements = 0;
  for (const auto& o : ops) {
    elements = saturating_add(elements, o.numel());
    if (o.sparse()) densities.push_back(o.density());
  }
  if (!densities.empty() && elements <= kTinyDenseElements && dispatch_mode() == DispatchMode::automatic) {
    // The tiny rule is for operands held dense (a region's): a stored sparse one would be densified first,
    // which costs more than the kernel (helper-75: a 32x32 SpMV 36-55 us dense, 5.6-7 us the kernel).
    Decision k;
    if (explain)
      k.why = fmt::format("tiny problem ({} dense elements) with a stored sparse operand: the kernel, without "
                          "densifying it", elements);
    return k;
  }
  return choose_by_density(densities, elements, threads, explain);
}

Decision finite_or_kernel(Decision d, const std::function<bool()>& finite, bool explain) {
  if (d.dense && !finite()) {  // also when forced: the contract does not depend on dispatch
    d.dense = false;
    if (explain)
      d.why = "an operand holds inf or NaN: unstored entries are never multiplied, which only the kernel keeps (a "
              "dense product would make 0 * inf = NaN)";
  }
  return d;
}

namespace {

// The eager measurement (eager_measure.cpp) for calls of at most two operands with a dense result, or a sparse
// one with a summed index (SpGEMM: the rule multiplies densities as for an SpMM, and at 0.5-0.8 the kernel ran
// 2.4-5.5x slower than the dense product and its compression, helper-43 F9). An elementwise product with a
// sparse result always takes the kernel (run_einsum).
Decision measured_choice(const std::string& equation, const PlanEntry& entry, const std::vector<Operand>& ops,
                         int64_t threads, bool explain, Decision d, const std::function<bool()>& finite) {
  if (dispatch_mode() != DispatchMode::automatic || !measure_regions() || ops.size() > 2) return d;
  int64_t elements = 0;
  for (const auto& o : ops) elements = saturating_add(elements, o.numel());
  if (elements <= kTinyDenseElements) return d;
  const auto override_ = dense_crossover_override();
  const at::ScalarType result = result_dtype(ops);
  EagerCall c{equation, ops, entry.plan.out_shape};
  c.sparse_out = entry.out != nullptr;
  c.threads = threads;
  c.explain = explain;
  c.crossover = override_ ? *override_ : calibrated_crossover(threads);
  c.kernel = [&] { run_kernel(entry, ops, threads, result); };
  c.dense = [&] {
    at::Tensor r = dense_product(equation, ops, result);
    if (entry.out) compress(r);  // (the caller compresses a dense run's sparse result the same way)
  };
  c.finite = finite;
  return measured_eager_choice(c, std::move(d));
}

}  // namespace


namespace {
Operand run_steps(const Steps& steps, const std::vector<Operand>& ops, const std::string& out_format, int64_t threads);
}  // namespace

Outcome run_einsum(const std::string& equation, const std::vector<Operand>& ops, const std::string& out_format,
                   int64_t threads, bool explain, bool decide, bool dense_first) {
  const at::ScalarType result = result_dtype(ops);
  const at::ScalarType idx = index_dtype(ops);
  const bool f64 = compute_dtype(result) == at::kDouble;
  std::string key;
  key.reserve(128);
  key += 'E';
  key += equation;
  key += '|';
  key += out_format;
  key += f64 ? "|d" : "|f";
  key += idx == at::kLong ? 'L' : 'I';
  append_descs(key, ops);
  if (dense_first && ops.size() >= 3) {
    if (const auto df = dense_first_for(key, equation, ops); df->has_value()) {
      const DenseFirst& d = **df;
      // The contraction stays in the compute dtype (float32 for half types: an intermediate of a float16
      // product may exceed float16's range where the result does not, as the one loop nest never stores it);
      // the result is given the operands' result dtype again.
      std::vector<at::Tensor> factors;
      for (int t : d.group) factors.push_back(ops[t].values.to(compute_dtype(result)));
      at::Tensor contracted = dense_einsum(d.dense_eq, factors);
      std::vector<Operand> next;
      for (int t : d.rest) next.push_back(ops[t]);
      next.push_back(Operand{nullptr, contracted.sizes().vec(), {}, contracted});
      Outcome o = run_einsum(d.rest_eq, next, out_format, threads, explain, decide);
      if (o.result.values.defined() && o.result.values.scalar_type() != result)
        o.result.values = o.result.values.to(result);
      o.plan = nullptr;  // the rest's plan is over another statement; `why` says what ran
      if (explain) o.why = d.why + "; then " + o.why;
      return o;
    }
  }
  auto entry = cached_plan(key, [&] {
    std::vector<bool> sparse;
    for (const auto& o : ops) sparse.push_back(o.sparse());
    if (auto shapes = ir::broadcast_shapes(equation, shapes_of(ops), sparse); !shapes.empty()) {
      auto e = std::make_shared<PlanEntry>();
      e->broadcast = std::move(shapes);
      return std::shared_ptr<const PlanEntry>(std::move(e));
    }
    auto e = make_entry(plan_einsum(equation, descs_of(ops), out_format, f64, idx == at::kLong), ops);
    if (equation.find('.') == std::string::npos && ops.size() >= 2) {
      auto steps = steps_of(ir::parse_einsum(equation, ndims_of(ops)), shapes_of(ops));
      if (steps->texts.size() > 1) {
        auto with_steps = std::make_shared<PlanEntry>(*e);
        with_steps->steps = std::move(steps);
        return std::shared_ptr<const PlanEntry>(std::move(with_steps));
      }
    }
    return e;
  });
  if (!entry->broadcast.empty()) {
    // Each dense operand viewed with leading dimensions of size 1 where "..." covers fewer dimensions than
    // elsewhere, then expanded (a view: stride 0 along the broadcast dimensions; expand's gradient sums).
    std::vector<Operand> expanded = ops;
    for (size_t t = 0; t < ops.size(); ++t) {
      const auto& to = entry->broadcast[t];
      if (to == ops[t].shape) continue;
      std::vector<int64_t> lead(to.size() - ops[t].shape.size(), 1);
      lead.insert(lead.end(), ops[t].shape.begin(), ops[t].shape.end());
      expanded[t] = Operand{nullptr, to, {}, ops[t].values.reshape(lead).expand(to)};
    }
    return run_einsum(equation, expanded, out_format, threads, explain, decide, dense_first);
  }

  Outcome out;
  out.plan = &entry->plan;
  Decision d;
  const bool elementwise = entry->plan.var_sizes.size() == entry->plan.out_shape.size();
  if (decide && entry->out && (elementwise || sampled_by_a_factor(equation, ops)) &&
      dispatch_mode() == DispatchMode::automatic) {
    // A product with a sparse result and nothing summed visits each stored entry of its sparse factors once;
    // densifying, multiplying and compressing again never pays (helper-43: ij,ij->ij at density 0.75 ran
    // dense 95x slower than the kernel). Nor does it for a sampled product (SDDMM): its result lies within
    // the sparse factor on the output's letters, and the kernel computes only those entries (helper-75: at
    // density 0.9 the dense run of "ij,ik,jk->ij" was 144-177x slower than torch's S * (X @ Y.T)).
    if (explain)
      d.why = elementwise ? "an elementwise product with a sparse result: the kernel visits only stored entries"
                          : "a sampled product (its result within a sparse factor's entries): the kernel computes "
                            "only those";
  } else if (decide) {
    // Unstored entries must never meet inf or NaN, so a dense choice stands only on finite values: checked once,
    // and only where the choice is dense (a sum over every operand, 20-50 us on a small call; it was taken
    // before the measured choice, which then often kept the kernel: helper-75).
    std::optional<bool> finite_known;
    const std::function<bool()> finite = [&] {
      if (!finite_known) finite_known = all_finite(ops);
      return *finite_known;
    };
    d = choose(ops, threads, explain);
    d = measured_choice(equation, *entry, ops, threads, explain, std::move(d), finite);
    d = finite_or_kernel(std::move(d), finite, explain);
  } else if (explain) {
    d.why = "the caller chose the sparse kernel";
  }
  if (!d.dense && at::GradMode::is_enabled() && diagonal_needs_grad(equation, ops)) {
    // The gradient of a diagonal read ("ii->i") is a diagonal write, which the kernels' derivatives do not
    // make: the dense path (torch.einsum, whose autograd has it) runs such a call, in every dispatch mode.
    d.dense = true;
    if (explain) d.why = "an operand read along a diagonal needs its gradient: torch.einsum differentiates it";
  }
  out.why = std::move(d.why);
  if (!d.dense) {
    ++routed_kernel;
    out.route = Route::kernel;
    if (entry->steps) {
      out.result = run_steps(*entry->steps, ops, entry->plan.out_format, threads);  // (the format planned)
      if (explain) out.why += "; in steps, indices used by one factor summed over it first";
    } else {
      out.result = run_kernel(*entry, ops, threads, result);
    }
    return out;
  }
  if (entry->out) {  // a dense run whose result is stored sparse: the caller converts (and keeps gradients)
    ++routed_caller;
    out.route = Route::caller;
    return out;
  }
  ++routed_dense;
  out.route = Route::dense;
  out.result = Operand{nullptr, entry->plan.out_shape, {}, dense_product(equation, ops, result)};
  return out;
}

namespace {

template <typename Parse>
std::shared_ptr<const Steps> split_statement(const std::string& key, Parse parse,
                                             const std::vector<std::vector<int64_t>>& shapes) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const Steps>> cache;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  std::shared_ptr<const Steps> s = steps_of(parse(), shapes);
  std::lock_guard lock(mu);
  if (cache.size() >= kMaxCachedPlans) cache.clear();
  return cache.emplace(key, std::move(s)).first->second;
}

std::vector<std::string> local_names(size_t n) {
  std::vector<std::string> names;
  for (size_t t = 0; t < n; ++t) names.push_back(fmt::format("t{}", t));
  return names;
}

Operand run_steps(const Steps& steps, const std::vector<Operand>& ops, const std::string& out_format, int64_t threads) {
  const at::ScalarType result = result_dtype(ops);
  const bool f64 = compute_dtype(result) == at::kDouble;
  std::vector<Operand> all = ops;
  for (size_t k = 0; k < steps.texts.size(); ++k) {
    std::vector<Operand> step_ops;
    for (int g : steps.operands[k]) step_ops.push_back(all[g]);
    const at::ScalarType idx = index_dtype(step_ops);
    const std::string& out = k + 1 == steps.texts.size() ? out_format : std::string();
    std::string key = fmt::format("S{}|{}|{}{}", steps.texts[k], out, f64 ? 'd' : 'f', idx == at::kLong ? 'L' : 'I');
    append_descs(key, step_ops);
    auto entry = cached_plan(key, [&] {
      const auto st = ir::parse_index_notation(steps.texts[k], local_names(step_ops.size()), ndims_of(step_ops));
      return make_entry(make_plan(st, descs_of(step_ops), out, f64, idx == at::kLong), step_ops);
    });
    all.push_back(run_kernel(*entry, step_ops, threads, result));
  }
  return all.back();
}


}  // namespace

Operand run_statement(const ir::Statement& st, const std::vector<Operand>& ops, const std::string& out_format,
                      int64_t threads) {
  fmt::memory_buffer key;
  fmt::format_to(std::back_inserter(key), "S{}", st.canonical());
  for (const auto& o : ops) fmt::format_to(std::back_inserter(key), "|{}", fmt::join(o.shape, ","));
  // The split works on the statement as its canonical text parses (as every other caller's does).
  const auto steps = split_statement(
      fmt::to_string(key),
      [&] { return ir::parse_index_notation(st.canonical(), local_names(ops.size()), ndims_of(ops)); },
      shapes_of(ops));
  return run_steps(*steps, ops, out_format, threads);
}

Operand run_compute(const std::string& text, const std::vector<std::string>& names, const std::vector<Operand>& ops,
                    const std::string& out_format, int64_t threads) {
  fmt::memory_buffer key;
  fmt::format_to(std::back_inserter(key), "C{}|{}", text, fmt::join(names, ","));
  for (const auto& o : ops) fmt::format_to(std::back_inserter(key), "|{}", fmt::join(o.shape, ","));
  const auto steps = split_statement(
      fmt::to_string(key), [&] { return ir::parse_index_notation(text, names, ndims_of(ops)); }, shapes_of(ops));
  return run_steps(*steps, ops, out_format, threads);
}

}  // namespace scorch::torch_glue
