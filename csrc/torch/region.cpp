#include "region.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <list>
#include <optional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "chain.h"
#include "common/saturating.h"
#include "dense_einsum.h"
#include "convert.h"
#include "region_addends.h"
#include "region_compress.h"
#include "region_entry.h"
#include "region_fingerprint.h"
#include "region_kernels.h"
#include "region_measure.h"
#include "region_operands.h"
#include "region_variants.h"
#include "runtime/settings.h"

namespace scorch::torch_glue {
namespace {

// --- compressed operands, cached by tensor version: the entries (region_entry.h) and the two caches ----------
using namespace region_cache;

// Never destroyed: at exit the caches' tensors may hold memory that Python owns (torch.from_numpy's storage,
// whose deleter takes the GIL), and static destructors run after the interpreter is gone (a SIGSEGV at exit).
std::mutex& cache_mu = *new std::mutex;
Lru& weights = *new Lru{kMaxWeights, {}, {}};
Lru& inputs = *new Lru{kMaxInputs, {}, {}};
std::atomic<int64_t> n_compressions{0}, n_hits{0}, n_sparse{0}, n_dense{0}, n_grouped{0}, n_demoted{0};
std::atomic<int64_t> n_content_hashes{0};

uint64_t counted_hash(const at::Tensor& t) {
  ++n_content_hashes;
  return content_hash(t);
}

RegionHooks hooks;
std::atomic<bool> capturing{false};

std::string tensor_key(const at::Tensor& t) {
  std::string k = fmt::format("{}|{}|", reinterpret_cast<uintptr_t>(t.data_ptr()), c10::toString(t.scalar_type()));
  for (auto s : t.sizes()) k += std::to_string(s) + ",";
  k += '|';
  for (auto s : t.strides()) k += std::to_string(s) + ",";
  return k;
}

// A weight's fingerprint: 32 spread entries and the nonzeros after them (the write it must catch, a fused
// optimizer step, changes stored values). A data input's entry is checked by a hash of all its bytes: a server
// that refills one buffer per request through numpy (no version bump) writes a mostly-zero input whose spread
// entries are zeros before and after, and every request got the first one's result (helper-54). The hash reads
// the input once per call (at the speed the caches deliver it, byte_hash.h), less than compressing it again. It
// is taken when the entry is made too, also for a new batch at every call (inference) that never finds it: a
// training step's backward finds it, and under torch.compile the op cannot tell the two apart (AOTAutograd runs
// the forward graph with grad mode off), while skipping it would have the backward compress the input again.
// The hash a failed lookup just took of the same bytes is reused (`Hashed`): a refilled buffer is read once a
// call, not twice (helper-59). (Taken before the new entry reads the version: a write between the two makes at
// worst a later miss.)
struct Hashed {
  bool taken = false;
  uint64_t content = 0;
};

void take_fingerprint(const at::Tensor& t, Entry& e, bool weight, const Hashed& hashed = {}) {
  if (!weight) {
    e.whole = true;
    e.content = hashed.taken ? hashed.content : counted_hash(t);
    return;
  }
  e.fingerprint_at = fingerprint_offsets(t, true);
  e.fingerprint = read_fingerprint(t, e.fingerprint_at);
}

bool unchanged(const at::Tensor& t, const Entry& e, Hashed* hashed) {
  if (e.whole) {
    const uint64_t h = counted_hash(t);
    if (hashed) *hashed = {true, h};
    return e.content == h;
  }
  return e.fingerprint.empty() || e.fingerprint == read_fingerprint(t, e.fingerprint_at);
}

EntryPtr lookup(const at::Tensor& t, bool frozen, bool weight, Hashed* hashed = nullptr) {
  if (t.is_inference()) return nullptr;  // no version counter (torch.inference_mode): a write could not be seen
  const std::string key = tensor_key(t);
  EntryPtr e;
  {
    std::lock_guard lock(cache_mu);
    e = (weight ? weights : inputs).get(key);
  }
  // A write through torch moves the version; a fused optimizer step does not, and is caught by the fingerprint.
  if (!e || !same_memory(*e, t) || e->version != static_cast<int64_t>(t._version())) return nullptr;
  if (!frozen && !unchanged(t, *e, hashed)) return nullptr;
  return e;
}

void remember(const at::Tensor& t, EntryPtr e, bool weight) {
  std::lock_guard lock(cache_mu);
  Lru& cache = weight ? weights : inputs;
  cache.sweep();  // (a few hundred entries at most, once per new entry)
  cache.put(tensor_key(t), std::move(e));
}

// A matrix laid out by columns: its transpose is contiguous.
bool column_major(const at::Tensor& t) { return t.dim() == 2 && !t.is_contiguous() && t.t().is_contiguous(); }

// `relu`: of relu(t) (RegionOperand::relu; such an operand is never cached, so its entry is its own).
void measure_density(const at::Tensor& t, Entry& e, bool relu = false) {
  if (column_major(t) && single_or_double(t)) {  // the same count on the transpose; the row counts wait for `rows_of`
    e.density = density_of(t.detach().t(), nullptr, relu);
    return;
  }
  if (t.dim() >= 2 && !t.is_contiguous() && single_or_double(t)) e.rows = row_major(t.detach());
  e.density = density_of(e.rows.defined() ? e.rows : t, &e.row_counts, relu);
}

// The tensor to compress by rows: its row-major copy, made here the first time for a column-major matrix.
at::Tensor rows_of(const at::Tensor& t, Entry& e) {
  if (!e.rows.defined() && column_major(t) && single_or_double(t)) e.rows = row_major(t.detach());
  return e.rows.defined() ? e.rows : t.detach();
}

EntryPtr entry_of(const at::Tensor& t, bool cached, bool frozen, bool weight, bool relu = false) {
  cached = cached && !t.is_inference();  // an inference tensor has no version to check a cached entry by
  Hashed hashed;
  if (cached) {
    if (EntryPtr e = lookup(t, frozen, weight, &hashed)) {
      std::lock_guard lock(e->mu);
      if (e->density < 0) measure_density(t, *e);
      ++n_hits;
      return e;
    }
  }
  auto e = std::make_shared<Entry>();
  own(*e, t);
  e->version = cached ? static_cast<int64_t>(t._version()) : -1;
  if (cached) take_fingerprint(t, *e, weight, hashed);
  measure_density(t, *e, relu);
  if (cached) remember(t, e, weight);
  return e;
}

std::vector<EntryPtr> entries_of(const RegionProgram& p, at::TensorList operands) {
  std::vector<EntryPtr> out;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const auto& o = p.operands[k];
    out.push_back(o.kind == RegionOperand::Kind::dense || !o.packed.empty()
                      ? nullptr
                      : entry_of(operands[k], o.cached, p.frozen && o.weight, o.weight, o.relu));
  }
  return out;
}

Operand sparse_of(const at::Tensor& t, Entry& e, const RegionOperand& o, at::ScalarType dtype,
                  const std::map<char, int64_t>& sizes) {
  std::lock_guard lock(e.mu);  // a second thread asking for the same form waits and then finds it made
  std::vector<int64_t> lead;
  for (int i = 0; i < o.expand; ++i) lead.push_back(sizes.at(o.letters[i]));
  const char* order = o.col_major ? "T" : o.relu ? "R" : "";
  std::string key = fmt::format("{}{}|{}|", static_cast<int>(o.kind), order, c10::toString(dtype));
  for (auto s : lead) key += std::to_string(s) + ",";
  if (!lead.empty()) touch_sized(e, key);  // (before the form exists: what it evicts is never this key)
  auto it = e.sparse.find(key);
  if (it != e.sparse.end()) return it->second;
  if (o.kind == RegionOperand::Kind::pattern && lead.empty()) {
    // The same tensor compressed with its values (the forward pass of the region that also samples its
    // gradient): the pattern is those index buffers with ones.
    auto same = e.sparse.find(
        fmt::format("{}{}|{}|", static_cast<int>(RegionOperand::Kind::sparse), order, c10::toString(dtype)));
    if (same != e.sparse.end()) {
      Operand c = same->second.with_values(at::ones_like(same->second.values));
      e.sparse.emplace(key, c);
      return c;
    }
  }
  ++n_compressions;
  at::Tensor src, counts;
  if (o.col_major) {  // the transpose's rows (the counts are the other way's; no copy if t is column-major)
    src = row_major(t.detach().t());
  } else {
    src = rows_of(t, e);
    counts = e.row_counts;  // (undefined when the density was counted on a transpose: compress counts)
  }
  if (o.kind == RegionOperand::Kind::pattern && lead.empty() && src.dim() >= 2 && src.is_contiguous() &&
      single_or_double(src)) {
    // The positions of the nonzeros, read off the tensor itself (no 0/1 copy of it first), with ones as values.
    if (auto fast = compress_rows(src, region_compressed_format(static_cast<int>(src.dim())), counts)) {
      Operand c = fast->with_values(at::ones({fast->values.numel()}, fast->values.options().dtype(dtype)));
      e.sparse.emplace(key, c);
      return c;
    }
  }
  if (o.kind == RegionOperand::Kind::pattern) {
    src = (src != 0).to(dtype);
    if (!lead.empty()) {
      std::vector<int64_t> ones(lead.size(), 1), shape = lead;
      ones.insert(ones.end(), src.sizes().begin(), src.sizes().end());
      shape.insert(shape.end(), src.sizes().begin(), src.sizes().end());
      src = src.reshape(ones).expand(shape);
    }
  } else if (src.scalar_type() != dtype) {
    src = src.to(dtype);  // (a narrower type may round values to zero: the counts are not reused)
  }
  const bool same = o.kind == RegionOperand::Kind::sparse && src.scalar_type() == t.scalar_type();
  Operand c = compress(src, same ? counts : at::Tensor(), o.relu);
  e.sparse.emplace(key, c);
  return c;
}

// A tensor derived from t (a dense layout of it, a packed copy, ...), made by `make` once and kept in t's cache
// entry under `key` while t's version and fingerprint stay; made anew at every call when not `cached` or when t
// has no version counter (made under inference mode).
at::Tensor derived_of(const at::Tensor& t, const std::string& key, const std::function<at::Tensor()>& make,
                      bool cached, bool frozen, bool weight) {
  cached = cached && !t.is_inference();  // as in entry_of
  Hashed hashed;
  EntryPtr e = cached ? lookup(t, frozen, weight, &hashed) : nullptr;
  const bool sized = key.find('#') != std::string::npos;  // a layout sized by the call (Entry::sized)
  if (e) {
    std::lock_guard lock(e->mu);
    if (sized) touch_sized(*e, key);
    auto it = e->layouts.find(key);
    if (it != e->layouts.end()) return it->second;
  }
  // A new entry (a dense operand: no density needed) takes t's version and fingerprint before `make` reads
  // t: read after, a write from another thread during `make` would file the old data under the new version
  // for good (helper-46: a weight halved in place meanwhile kept its old layout at every later call).
  std::shared_ptr<Entry> fresh;
  if (cached && !e) {
    fresh = std::make_shared<Entry>();
    own(*fresh, t);
    fresh->version = static_cast<int64_t>(t._version());
    take_fingerprint(t, *fresh, weight, hashed);
  }
  at::Tensor out = make();
  if (cached) {
    if (fresh) {
      fresh->layouts[key] = out;  // before the entry is shared
      if (sized) touch_sized(*fresh, key);
      remember(t, fresh, weight);
      return out;
    }
    std::lock_guard lock(e->mu);
    if (sized) touch_sized(*e, key);  // (evicted meanwhile by other sizes: kept again, first)
    e->layouts.try_emplace(key, out);  // (another thread may have made the same layout meanwhile)
  }
  return out;
}

at::Tensor laid_out(const at::Tensor& t, const std::vector<int64_t>& perm, at::ScalarType dtype, bool cached,
                    bool frozen, bool weight) {
  if (std::is_sorted(perm.begin(), perm.end()) && t.scalar_type() == dtype && t.is_contiguous()) return t.detach();
  std::string key = fmt::format("{}|", c10::toString(dtype));
  for (auto d : perm) key += std::to_string(d) + ",";
  return derived_of(t, key, [&] { return t.detach().to(dtype).permute(perm).contiguous(); }, cached, frozen, weight);
}

std::map<char, int64_t> letter_sizes(const RegionProgram& p, const Slots& s) {
  const at::TensorList operands = s.slots;
  std::map<char, int64_t> sizes;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const std::string letters = p.operands[k].tensor_letters();
    if (!p.operands[k].packed.empty()) {
      for (size_t d = 0; d < letters.size(); ++d) sizes.emplace(letters[d], s.packed_sizes[k][d]);
      continue;
    }
    SCORCH_CHECK(static_cast<int64_t>(letters.size()) == operands[k].dim(),
                 "scorch::region {}: operand {} has {} dimensions, the program gives it {} ('{}')", p.title, k,
                 operands[k].dim(), letters.size(), letters);
    for (size_t d = 0; d < letters.size(); ++d) sizes.emplace(letters[d], operands[k].size(d));
  }
  return sizes;
}

std::vector<Operand> sparse_args(const RegionProgram& p, const Slots& s, const std::vector<EntryPtr>& entries,
                                 at::ScalarType dtype) {
  const at::TensorList operands = s.slots;
  const auto sizes = letter_sizes(p, s);
  std::vector<Operand> args;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const auto& o = p.operands[k];
    if (!o.packed.empty()) {
      args.push_back(packed_operand(p, k, s, dtype));
      continue;
    }
    if (entries[k]) {
      args.push_back(sparse_of(operands[k], *entries[k], o, dtype, sizes));
      continue;
    }
    std::vector<int64_t> perm;
    for (char c : p.kernel_letters[k]) perm.push_back(static_cast<int64_t>(o.letters.find(c)));
    at::Tensor t = laid_out(o.relu ? at::relu(operands[k]) : operands[k], perm, dtype, o.cached, p.frozen && o.weight,
                            o.weight);
    args.push_back(Operand{nullptr, t.sizes().vec(), {}, t});
  }
  return args;
}

// The compressed operands' densities (cached or packed).
std::vector<double> densities_of(const RegionProgram& p, const Slots& s, const std::vector<EntryPtr>& entries) {
  const at::TensorList slots = s.slots;
  std::vector<double> densities;
  for (size_t k = 0; k < slots.size(); ++k) {
    if (entries[k]) {
      densities.push_back(entries[k]->density);
    } else if (!p.operands[k].packed.empty()) {
      int64_t n = 1;
      for (auto d : s.packed_sizes[k]) n *= d;
      densities.push_back(n ? static_cast<double>(slots[k].numel()) / static_cast<double>(n) : 0.0);
    }
  }
  return densities;
}

std::string choose_path(const RegionProgram& p, const std::string& text, const Slots& s,
                        const std::vector<EntryPtr>& entries) {
  const at::TensorList operands = s.slots;
  const std::vector<double> densities = densities_of(p, s, entries);
  int64_t elements = 0;
  bool empty = false;
  for (size_t k = 0; k < operands.size(); ++k) {
    int64_t n = operands[k].numel();
    if (!p.operands[k].packed.empty()) {
      n = 1;
      for (auto d : s.packed_sizes[k]) n = saturating_mul(n, d);
    }
    elements = saturating_add(elements, n);
    empty = empty || n == 0;
  }
  if (empty || densities.empty()) return "dense";
  if (choose_by_density(densities, elements, at::get_num_threads(), false).dense) return "dense";
  if (p.packed_buffers == 0 && dispatch_mode() != DispatchMode::sparse && grouped_worth(p, operands, densities[0]))
    return "grouped";
  return "sparse";
}

// The same memory and strides as a tensor of its own, not a view: autograd forbids in-place updates of a
// custom op's output that is a view (out += b after a region, under the eager fallback).
at::Tensor owning(const at::Tensor& view) {
  if (!view.is_view()) return view;
  at::Tensor out = at::empty({0}, view.options());
  out.set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
  return out;
}

bool shares_memory(const at::Tensor& a, at::TensorList others) {
  for (const auto& t : others)
    if (t.has_storage() && a.has_storage() && t.storage().data() == a.storage().data() && a.storage().data()) return true;
  return false;
}

// Whether each pattern with a nonempty letter (RegionOperand::nonempty) keeps an entry in every fiber along it:
// one pass over the tensor, once per version of a cached one (a mask buffer).
bool patterns_hold(const RegionProgram& p, const Slots& s) {
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    if (!o.nonempty) continue;
    const at::Tensor& t = s.slots[k];
    const std::string letters = o.tensor_letters();
    SCORCH_CHECK(t.dim() == static_cast<int64_t>(letters.size()),
                 "scorch::region {}: operand {} has {} dimensions, the program gives it {} ('{}')", p.title, k, t.dim(),
                 letters.size(), letters);
    if (t.numel() == 0) continue;  // no fiber at all (or only empty ones, whose softmax is empty too)
    const int64_t d = static_cast<int64_t>(letters.find(o.nonempty));
    const at::Tensor kept = derived_of(t, fmt::format("nonempty|{}", d), [&] { return t.detach().ne(0).any(d).all(); },
                                       o.cached, p.frozen && o.weight, o.weight);
    if (!kept.item<bool>()) return false;
  }
  return true;
}

// Whether every value the product multiplies is finite. The kernels skip a compressed operand's zeros, where
// eager multiplies them: a NaN or inf in another operand (or among its own values, when another compressed
// operand skips its partner) would give NaN there in eager and nothing here (helper-42: one NaN in a pruned
// linear's input made 51 of 1024 outputs NaN, eager all of them). A region stands for dense code, so such a
// call runs densely (run_region). One pass per operand in RegionProgram::finite_checked: once per entry of a
// compressed one (cached per version for a weight), once per version of a dense weight, at every call for a
// dense data input (its cache entry would be checked by a hash of every byte: a pass as long as the scan).
// Set while run_region runs a variant of a program whose values it has just found finite.
thread_local bool variant_of_checked = false;

bool values_finite(const RegionProgram& p, const Slots& s, const std::vector<EntryPtr>& entries) {
  for (int k : p.finite_checked) {
    const at::Tensor& t = s.slots[k];
    if (const EntryPtr& e = entries[k]) {
      std::lock_guard lock(e->mu);
      if (e->finite < 0) e->finite = all_finite(t) ? 1 : 0;
      if (!e->finite) return false;
      continue;
    }
    const RegionOperand& o = p.operands[k];
    if (!o.cached || !o.weight || t.is_inference()) {  // (no cache entry worth keeping the answer in)
      if (!all_finite(t)) return false;
      continue;
    }
    const at::Tensor finite = derived_of(t, "finite", [&] { return at::scalar_tensor(all_finite(t), at::kBool); },
                                         o.cached, p.frozen && o.weight, o.weight);
    if (!finite.item<bool>()) return false;
  }
  return true;
}

}  // namespace

std::pair<std::string, std::vector<Operand>> region_sparse_call(const std::string& text, at::TensorList operands) {
  const RegionProgram& p = region_program(text);
  if (p.has_addends()) return region_sparse_call(p.product_text, product_args(p, operands));
  const Slots s = split_operands(p, operands);
  const auto entries = entries_of(p, s.slots);
  return {p.kernel_equation, sparse_args(p, s, entries, region_dtype(p, s.slots))};
}

std::string region_choose(const std::string& text, at::TensorList operands) {
  const RegionProgram& p = region_program(text);
  if (p.has_addends()) return region_choose(p.product_text, product_args(p, operands));
  const Slots s = split_operands(p, operands);
  if (p.has_nonempty && !patterns_hold(p, s)) return "dense";
  const auto entries = entries_of(p, s.slots);
  if (!values_finite(p, s, entries) && !p.selects_on_output) return "dense";
  return choose_path(p, text, s, entries);
}

namespace {

// One path of a program, its result in storage order (before the coefficient and the permutation back).
// `count`: add the run to the statistics (measurement runs do not).
at::Tensor run_path(const RegionProgram& p, const std::string& text, const Slots& s,
                    const std::vector<EntryPtr>& entries, at::ScalarType dtype, const std::string& path, bool count) {
  const at::TensorList operands = s.slots;
  at::Tensor out;
  if (path == "grouped") {
    SCORCH_CHECK(p.packed_buffers == 0, "scorch::region {}: a program with packed operands cannot run grouped",
                 p.title);
    if (count) ++n_grouped;
    std::vector<at::Tensor> applied = operands.vec();  // (the ReLUs the program applies, on the dense tensors)
    for (size_t k = 0; k < applied.size(); ++k)
      if (p.operands[k].relu) applied[k] = at::relu(applied[k]);
    out = run_grouped_chain(grouped_region_chain(text), applied, false);  // in the requested order
    std::vector<int64_t> to_storage;
    for (char c : p.storage) to_storage.push_back(static_cast<int64_t>(p.out.find(c)));
    return out.permute(to_storage);
  }
  if (path == "dense") {
    if (count) ++n_dense;
    // float16 multiplied in float32, as the executor's dense path (ATen's are scalar loops: 84 ms against 0.8)
    if (dtype == at::kHalf) return run_path(p, text, s, entries, at::kFloat, path, false).to(at::kHalf);
    std::vector<at::Tensor> factors;
    for (size_t k = 0; k < operands.size(); ++k) {
      if (!p.operands[k].packed.empty()) {
        factors.push_back(packed_operand(p, k, s, dtype).to_dense());
        continue;
      }
      const at::Tensor t = p.operands[k].relu ? at::relu(operands[k]) : operands[k];
      factors.push_back(p.operands[k].kind == RegionOperand::Kind::pattern ? (t != 0).to(dtype)
                        : t.scalar_type() == dtype                          ? t
                                                                            : t.to(dtype));
    }
    // A matrix product of two factors: one mm on (transposed) views, no copies. einsum goes through bmm and
    // copies its operands into its own order (a 64x512 by 64x512 weight gradient: 0.28 ms as einsum). A
    // parameter's gradient is computed in the requested order, so run_region need not copy it.
    if (factors.size() == 2) {
      const std::string& letters = p.requested_order ? p.out : p.storage;
      if (auto lr = matmul_factors(p.operands[0], factors[0], p.operands[1], factors[1], letters)) {
        out = at::mm(lr->first, lr->second);
        if (!p.requested_order) return out;
        std::vector<int64_t> to_storage;
        for (char c : p.storage) to_storage.push_back(static_cast<int64_t>(p.out.find(c)));
        return out.permute(to_storage);
      }
    }
    out = dense_einsum(p.dense_equation, factors);  // three or more factors: contracted a pair at a time
    return out;
  }
  SCORCH_CHECK(path == "sparse", "scorch::region: unknown path '{}' (dense, sparse or grouped)", path);
  if (count) ++n_sparse;
  const auto args = sparse_args(p, s, entries, dtype);
  return run_einsum(p.kernel_equation, args, "strided", at::get_num_threads(), false, /*decide=*/false).result.values;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<Operand>>> region_sparse_calls(const std::string& text,
                                                                             at::TensorList operands) {
  const RegionProgram& p = region_program(text);
  if (p.has_addends()) return region_sparse_calls(p.product_text, product_args(p, operands));
  std::vector<std::pair<std::string, std::vector<Operand>>> calls{region_sparse_call(text, operands)};
  for (const std::string* v : all_variants(p)) calls.push_back(region_sparse_call(*v, operands));
  return calls;
}

at::Tensor run_region(const std::string& text, at::TensorList all, const std::string& force) {
  const RegionProgram& p = region_program(text);
  if (p.has_addends()) {
    for (size_t k = 0; k < all.size(); ++k)
      SCORCH_CHECK(all[k].device().is_cpu(), "scorch::region {}: operand {} is on {}; Scorch runs on the CPU",
                   p.title, k, all[k].device().str());
    if (capturing && hooks.capture && p.packed_buffers == 0) hooks.capture(text, all.slice(0, p.operands.size()));
    if (force.empty() || force == "dense") {  // an all-dense product always takes the dense path
      if (auto out = dense_matmul_with_addends(p, all)) {
        ++n_dense;
        return *out;
      }
    }
    const at::ScalarType dtype = region_dtype(p, all.slice(0, p.operands.size()));
    std::optional<HalfAsFloat> wide;  // a half-precision product in float32, its addends added before rounding
    if (dtype == at::kHalf || dtype == at::kBFloat16) wide.emplace();
    at::Tensor out = run_region(p.product_text, product_args(p, all), force);
    wide.reset();
    if (p.has_masks) apply_masks(p, out, all);
    return add_addends(p, std::move(out), all);
  }
  const Slots s = split_operands(p, all);
  const at::TensorList operands = s.slots;
  for (size_t k = 0; k < all.size(); ++k)
    SCORCH_CHECK(all[k].device().is_cpu(), "scorch::region {}: operand {} is on {}; Scorch runs on the CPU",
                 p.title, k, all[k].device().str());
  if (capturing && hooks.capture && p.packed_buffers == 0) hooks.capture(text, operands);
  const at::ScalarType dtype = region_dtype(p, operands);
  // A pattern that leaves a fiber empty where its factor is NaN, not zero (a fully masked softmax row): only
  // the dense product carries the NaN through, whatever path was asked for.
  const bool patterns_ok = !p.has_nonempty || patterns_hold(p, s);
  const auto entries = patterns_ok ? entries_of(p, operands) : std::vector<EntryPtr>(p.operands.size());
  // So does a NaN or inf that eager would multiply by a zero the kernels skip (values_finite). A program that
  // selects on an output pattern (a ReLU's backward) runs its every compressed operand dense then, the pattern
  // as a mask that zeroes outside it, as eager's select does; when it cannot, it keeps its path (zero outside
  // the pattern, as eager; inside, a skipped zero's NaN is lost).
  const bool finite = !patterns_ok || force == "dense" || variant_of_checked || values_finite(p, s, entries);
  const std::string* exact = !finite && p.selects_on_output ? fully_demoted(p) : nullptr;
  const bool holds = patterns_ok && (finite || (p.selects_on_output && !exact));
  if (exact || (holds && (force.empty() || force == "sparse"))) {
    std::vector<double> densities;
    for (const auto& e : entries) densities.push_back(e ? e->density : -1.0);
    if (const std::string* variant = exact ? exact : demoted_variant(p, densities)) {
      // The variant may store its result in another order; hand it back in this program's (its Meta kernel's).
      ++n_demoted;
      // (the variant reads the same tensors, just checked: it need not scan them again)
      variant_of_checked = finite;
      at::Tensor r;
      try {
        r = run_region(*variant, all, exact ? "dense" : force);
      } catch (...) {
        variant_of_checked = false;
        throw;
      }
      variant_of_checked = false;
      if (p.requested_order || region_program(*variant).storage == p.storage) return r;
      std::vector<int64_t> to_storage;
      for (char c : p.storage) to_storage.push_back(static_cast<int64_t>(p.out.find(c)));
      return owning(row_major(r.permute(to_storage)).permute(p.back));
    }
  }
  std::string path = !holds ? "dense" : force.empty() ? choose_path(p, text, s, entries) : force;
  if (force.empty() && path != "dense" && dispatch_mode() == DispatchMode::automatic && measure_regions()) {
    Timing t;
    bool fresh = false;
    const auto sizes = letter_sizes(p, s);
    const auto densities = densities_of(p, s, entries);
    if (path == "grouped") {
      // Grouping pays where each group's product runs at dense speed, which the rule judges from the plan's
      // shape and the rows per group: timed against the sparse kernel first, then the faster against dense
      // (a group that is a matrix-vector product ran 60x slower than the kernel, and only dense was compared).
      const std::string better = measured_region_path(
          p, sizes, densities, "grouped", "sparse",
          [&] { run_path(p, text, s, entries, dtype, "grouped", false); },
          [&] { run_path(p, text, s, entries, dtype, "sparse", false); }, &t, &fresh, dtype);
      if (fresh && hooks.note_measured)
        hooks.note_measured(text, better == "grouped" ? "grouped>sparse" : "sparse>grouped", t.kernel_ms, t.dense_ms);
      path = better;
    }
    const std::string chosen = measured_region_path(
        p, sizes, densities, path, "dense",
        [&] { run_path(p, text, s, entries, dtype, path, false); },
        [&] { run_path(p, text, s, entries, dtype, "dense", false); }, &t, &fresh, dtype);
    if (fresh && hooks.note_measured)
      hooks.note_measured(text, chosen == "dense" ? "dense>" + path : chosen, t.kernel_ms, t.dense_ms);
    path = chosen;
  }
  if (hooks.note_path && debug_level() >= 1) hooks.note_path(text, path, densities_of(p, s, entries), all);
  at::Tensor out = run_path(p, text, s, entries, dtype, path, true);
  if (path == "dense" && shares_memory(out, all)) out = out.clone();  // einsum may hand back an operand ("ij->ij")
  if (!(p.requested_order && out.permute(p.back).is_contiguous())) out = out.contiguous();
  if (p.coef != 1.0) out.mul_(p.coef);
  return owning(p.requested_order ? row_major(out.permute(p.back)) : out.permute(p.back));
}

std::pair<double, Operand> cached_compressed(const at::Tensor& t, const RegionOperand& o, at::ScalarType dtype,
                                             const std::vector<int64_t>& lead, bool frozen) {
  SCORCH_CHECK(static_cast<int>(lead.size()) == o.expand, "expected {} broadcast sizes, got {}", o.expand, lead.size());
  EntryPtr e = entry_of(t, /*cached=*/true, frozen, /*weight=*/false);
  std::map<char, int64_t> sizes;
  for (int i = 0; i < o.expand; ++i) sizes[o.letters[i]] = lead[i];
  return {e->density, sparse_of(t, *e, o, dtype, sizes)};
}

std::vector<uint8_t> region_fingerprint(const at::Tensor& t) { return read_fingerprint(t, fingerprint_offsets(t)); }

at::Tensor cached_derived(const at::Tensor& t, const std::string& key, const std::function<at::Tensor()>& make,
                          bool weight) {
  return derived_of(t, key, make, /*cached=*/true, /*frozen=*/false, weight);
}

double cached_density(const at::Tensor& t, bool frozen) {
  return entry_of(t, /*cached=*/true, frozen, /*weight=*/false)->density;
}

RegionStats region_stats() {
  const MeasureStats m = region_measure_stats();
  return {n_compressions.load(), n_hits.load(), n_sparse.load(), n_dense.load(), n_grouped.load(), m.measured,
          m.kept_dense, m.contended, m.remeasured, n_demoted.load(), n_content_hashes.load()};
}

RegionCacheSizes region_cache_sizes() {
  std::lock_guard lock(cache_mu);
  size_t forms = 0;
  for (const Lru* cache : {&weights, &inputs})
    for (const auto& [key, e] : cache->order) {
      std::lock_guard entry_lock(e->mu);
      forms += e->sparse.size() + e->layouts.size();
    }
  return {weights.order.size(), inputs.order.size(), kMaxWeights, kMaxInputs, forms};
}

void region_clear_cache() {
  std::lock_guard lock(cache_mu);
  weights.clear();
  inputs.clear();
}

void set_region_hooks(RegionHooks h) { hooks = std::move(h); }
void set_region_capture(bool on) { capturing = on; }
void region_capture(const std::string& text, at::TensorList operands) {
  if (capturing && hooks.capture) hooks.capture(text, operands);
}

}  // namespace scorch::torch_glue
