// scorch::kernel: run the compiled kernel of a spec on torch tensors. Inputs are checked against the spec
// (count, dtypes, shapes, buffer lengths) before the kernel runs; a sparse result is packed into the
// spec's output format.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cstring>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <fmt/ranges.h>

#include "convert.h"
#include "kernel_call.h"
#include "format/storage.h"
#include "lower/kernel_spec.h"
#include "runtime/jit.h"
#include "runtime/target.h"
#include "validated_once.h"

namespace scorch::torch_glue {
namespace {

// The team a kernel call starts: the threads asked for (1 when <= 0), at most 4 per core of this machine.
// libgomp cannot refuse a team it fails to create: it exits the process or faults (10^5 threads did), so a
// request of thousands is cut here instead of being passed on.
int32_t kernel_threads(int64_t requested) {
  static const int64_t most = 4 * std::max<int64_t>(1, std::thread::hardware_concurrency());
  return static_cast<int32_t>(std::clamp<int64_t>(requested, 1, most));
}

// The duration of this thread's last kernel call (two clock reads per call, ~40 ns): a benchmark reads it to
// split a whole call's time into the kernel and the cost around it, on the same call.
thread_local double last_kernel_s = 0.0;

struct Entry {
  KernelSpec spec;
  std::shared_ptr<const CompiledKernel> kernel;
  uint64_t epoch = 0;  // kernel_config_epoch() when the kernel was obtained
  std::string profile_name;
  std::vector<const ir::Expr*> accesses;              // of spec.stmt, in order
  std::vector<std::vector<std::string>> buffer_names;  // per operand
};

// Kernels by spec text; entries are never removed (a process uses a bounded set of kernels), so the
// references handed out stay valid.
struct TextHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// An entry made under another target, gather form, sanitizer setting or compiler (kernel_config_epoch moved)
// is made again: its kernel would be the old configuration's. The old entry is kept (a caller on another
// thread may hold it), so the references handed out stay valid.
const Entry& lookup(c10::string_view text_view) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<Entry>, TextHash, std::equal_to<>> entries;
  static std::vector<std::unique_ptr<Entry>> replaced;
  const std::string_view text(text_view.data(), text_view.size());
  const uint64_t epoch = kernel_config_epoch();
  {
    std::lock_guard lock(mu);
    auto it = entries.find(text);
    if (it != entries.end() && it->second->epoch == epoch) return *it->second;
  }
  auto e = std::make_unique<Entry>();
  e->spec = KernelSpec::parse(std::string(text));
  e->kernel = get_kernel(std::string(text));
  e->epoch = epoch;
  e->profile_name = "scorch::kernel " + e->kernel->statement;
  ir::collect_accesses(e->spec.stmt.rhs, e->accesses);
  for (const auto& s : e->spec.operands) e->buffer_names.push_back(s.strided() ? std::vector<std::string>{} : s.format->buffer_names());
  std::lock_guard lock(mu);
  auto it = entries.find(text);
  if (it == entries.end()) return *entries.emplace(std::string(text), std::move(e)).first->second;
  if (it->second->epoch == epoch) return *it->second;  // another thread made it meanwhile
  replaced.push_back(std::move(it->second));
  it->second = std::move(e);
  return *it->second;
}

// Sorted, repeat-free coordinates into a format of dense levels then one compressed level (CSR, batched CSR,
// a compressed vector) in one pass: count per row, prefix-sum, copy the last coordinate. Returns false
// (and the caller packs generally) if the format does not fit or the coordinates turn out unsorted.
template <typename I>
bool pack_sorted_rows(const Format& f, const std::vector<int64_t>& shape, const int64_t* coords, int64_t nnz,
                      at::Tensor& pos_out, at::Tensor& crd_out) {
  const auto& levels = f.levels();
  if (levels.empty() || levels.back().kind->name() != "compressed" || !levels.back().kind->properties().unique)
    return false;
  int64_t rows = 1;
  for (size_t l = 0; l + 1 < levels.size(); ++l) {
    if (levels[l].kind->name() != "dense" || levels[l].expr.part != LevelExpr::Part::whole) return false;
    rows *= shape[levels[l].expr.dim];
  }
  if (levels.back().expr.part != LevelExpr::Part::whole) return false;
  at::Tensor pos = at::zeros({rows + 1}, c10::CppTypeToScalarType<I>::value);
  at::Tensor crd = at::empty({nnz}, c10::CppTypeToScalarType<I>::value);
  I* p = pos.data_ptr<I>();
  I* c = crd.data_ptr<I>();
  const int64_t* last = coords + levels.back().expr.dim * nnz;
  const int64_t cols = shape[levels.back().expr.dim];
  int64_t prev_row = -1, prev_col = -1;
  for (int64_t q = 0; q < nnz; ++q) {
    int64_t row = 0;
    for (size_t l = 0; l + 1 < levels.size(); ++l) {
      const int64_t c = coords[levels[l].expr.dim * nnz + q], n = shape[levels[l].expr.dim];
      if (c < 0 || c >= n) return false;  // the general packing reports it
      row = row * n + c;
    }
    if (last[q] < 0 || last[q] >= cols) return false;
    if (row < prev_row || (row == prev_row && last[q] <= prev_col)) return false;
    prev_row = row;
    prev_col = last[q];
    p[row + 1]++;
    c[q] = static_cast<I>(last[q]);
  }
  for (int64_t r = 0; r < rows; ++r) p[r + 1] += p[r];
  pos_out = pos;
  crd_out = crd;
  return true;
}

// A copy of a contiguous index buffer (prepare made it so) with one allocation and one memcpy: at::clone
// dispatches clone, empty_like and copy_ (about a microsecond each time, four buffers a call for a CSF
// tensor's fibers), and a sampled result's buffers are copied on every call.
at::Tensor copy_buffer(const at::Tensor& b) {
  at::Tensor out = at::empty({b.numel()}, b.options());
  if (b.numel() > 0) std::memcpy(out.data_ptr(), b.data_ptr(), b.numel() * b.element_size());
  return out;
}

// A copy of a contiguous index buffer in slot `slot` of this thread's scratch, valid until the thread's next
// kernel call: the slots keep their memory from call to call. Copies into fresh tensors made SpAdd 1.9x and
// SpGEMM 1.2x slower (kernels.py, native): a large at::empty is a new mapping whose pages fault in at every
// call, which cost more than the copy. A buffer above kScratchKeepBytes gets a fresh tensor instead (freed
// with it), so that one product of a huge matrix does not leave that much memory held by each calling thread
// for the life of the process; there the faults are a small part of a kernel that long.
constexpr size_t kScratchKeepBytes = size_t{32} << 20;

at::Tensor scratch_copy(const at::Tensor& b, size_t slot) {
  thread_local std::vector<std::vector<unsigned char>> slots;
  const size_t bytes = static_cast<size_t>(b.numel()) * b.element_size();
  if (bytes > kScratchKeepBytes) return copy_buffer(b);
  if (slots.size() <= slot) slots.resize(slot + 1);
  auto& mem = slots[slot];
  if (mem.size() < std::max<size_t>(bytes, 1)) mem.resize(std::max<size_t>(bytes, 1));
  if (bytes > 0) std::memcpy(mem.data(), b.data_ptr(), bytes);
  return at::from_blob(mem.data(), {b.numel()}, b.options());
}

// The first index value out of range in an operand's buffers (the kernel found one): a coordinate outside
// its level's extent, or a pos entry outside its crd buffer or decreasing. Falls back to the full validation
// (which also catches unsorted coordinates, which a merge notices too); empty when all is well.
// It reads a copy of the buffers: the levels' checks read a value again after checking it (a position, then
// the coordinates it bounds), and a caller writing a buffer during the call made them read out of bounds.
std::string bad_index_report(const Format& f, const std::vector<int64_t>& shape, const std::vector<at::Tensor>& live,
                             int64_t value_count) {
  std::vector<at::Tensor> bufs;
  bufs.reserve(live.size());
  for (const auto& b : live) bufs.push_back(copy_buffer(b.contiguous()));
  const auto spans = spans_of(bufs);
  const auto sizes = f.level_sizes(shape);
  const auto names = f.buffer_names();
  // Each level reads its own buffers (LevelKind::find_bad_index): no level kind is named here.
  int64_t parents = 1;
  size_t at = 0;
  for (size_t l = 0; l < f.levels().size(); ++l) {
    const LevelKind& kind = *f.levels()[l].kind;
    const size_t n = kind.buffer_names().size();
    if (at + n > spans.size()) break;  // fewer buffers than the format stores: validate below says so
    const auto r = kind.find_bad_index(std::span(spans).subspan(at, n), std::span(names).subspan(at, n), parents,
                                       sizes[l], level_name(f, l));
    if (!r.problem.empty()) return r.problem;
    parents = r.positions;
    at += n;
  }
  try {
    validate(f, shape, spans, value_count);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}


ValidatedOnce validated_buffers;  // sparse operands' buffers, checked in full once per version

// The key of a sparse operand's buffers: its format (by text: one kernel's result and the next kernel's operand
// meet), shape, values and index buffers.
ValidatedOnce::Key buffers_key(const Format& f, const std::vector<int64_t>& shape, const at::Tensor& values,
                               at::TensorList buffers) {
  ValidatedOnce::Key key{{static_cast<int64_t>(std::hash<std::string>{}(f.str()))}};
  key.words.insert(key.words.end(), shape.begin(), shape.end());
  key.add(values);
  for (const auto& b : buffers) key.add(b);
  return key;
}

// A call's inputs checked against its spec (count, dtypes, shapes, buffer lengths) and laid out for the
// kernel ABI.
struct PreparedCall {
  std::vector<std::vector<int64_t>> shapes;  // each operand's shape
  std::vector<void*> ptrs;
  std::vector<int64_t> lengths;  // entries of each pointer's buffer: kernels clamp every index to them
  std::vector<int64_t> strides;
  std::vector<at::Tensor> keep;  // contiguous copies stay alive during the call
  std::vector<std::vector<at::Tensor>> operand_buffers;
  std::vector<int64_t> operand_nnz;
};

PreparedCall prepare(const Entry& e, at::TensorList inputs, c10::IntArrayRef sizes) {
  const KernelSpec& spec = e.spec;
  const auto vt = spec.f64 ? at::kDouble : at::kFloat;
  const auto it = spec.idx64 ? at::kLong : at::kInt;
  SCORCH_CHECK(static_cast<int>(sizes.size()) == spec.stmt.num_vars(), "expected {} index sizes, got {}",
               spec.stmt.num_vars(), sizes.size());
  for (auto s : sizes) SCORCH_CHECK(s >= 0, "index sizes must be non-negative, got {}", s);
  SCORCH_CHECK(static_cast<int>(inputs.size()) == e.kernel->input_pointers,
               "kernel '{}' takes {} input tensors, got {}", spec.stmt.str(), e.kernel->input_pointers, inputs.size());

  const bool order_matters =
      (!spec.output.strided() && !spec.output.format->all_dense()) ||
      std::count_if(spec.operands.begin(), spec.operands.end(),
                    [](const Storage& o) { return !o.strided() && !o.format->all_dense(); }) > 1;
  PreparedCall c;
  size_t scratch_used = 0;  // scratch slots taken by this call's copies (scratch_copy)
  // Map each operand's dimensions to index sizes through its accesses.
  c.shapes.assign(spec.operands.size(), {});
  std::vector<bool> seen(spec.operands.size(), false);
  for (const ir::Expr* a : e.accesses) {
    std::vector<int64_t> shape;
    for (int v : a->vars) shape.push_back(sizes[v]);
    if (seen[a->tensor])
      SCORCH_CHECK(c.shapes[a->tensor] == shape, "operand {} is accessed with different sizes", a->tensor);
    c.shapes[a->tensor] = std::move(shape);
    seen[a->tensor] = true;
  }
  c.operand_buffers.resize(spec.operands.size());
  c.operand_nnz.assign(spec.operands.size(), 0);
  c.ptrs.reserve(inputs.size());
  c.lengths.reserve(inputs.size());
  c.keep.reserve(inputs.size());
  size_t at = 0;
  for (size_t t = 0; t < spec.operands.size(); ++t) {
    const Storage& s = spec.operands[t];
    if (s.strided()) {
      const at::Tensor& x = inputs[at++];
      SCORCH_CHECK_TYPE(x.scalar_type() == vt, "operand {} must be {}, got {}", t, c10::toString(vt),
                        c10::toString(x.scalar_type()));
      SCORCH_CHECK(x.device().is_cpu(), "operand {} must be on the CPU", t);
      SCORCH_CHECK(x.sizes().equals(c.shapes[t]), "operand {} has shape {}, the statement needs {}", t,
                   c10::str(x.sizes()), fmt::join(c.shapes[t], ", "));
      c.keep.push_back(x.contiguous());  // kernels assume row-major strided operands
      c.ptrs.push_back(c.keep.back().data_ptr());
      c.lengths.push_back(c.keep.back().numel());
      for (auto st : c.keep.back().strides()) c.strides.push_back(st);
      continue;
    }
    const auto& names = e.buffer_names[t];
    const size_t first = at;  // the caller's buffers, before any copy
    std::vector<at::Tensor> bufs;
    for (const auto& name : names) {
      const at::Tensor& b = inputs[at++];
      SCORCH_CHECK_TYPE(b.scalar_type() == it, "operand {}: index buffer {} must be {}, got {}", t, name,
                        c10::toString(it), c10::toString(b.scalar_type()));
      SCORCH_CHECK(b.dim() == 1 && b.device().is_cpu(), "operand {}: index buffer {} must be a 1-D CPU tensor", t, name);
      // A kernel that assembles a sparse result (lower/assemble.h) sizes its buffers from one read of the
      // operands' positions and fills them in another: it gets its own copy, which no other thread can write
      // between the two (a caller writing the buffer during the call made it write past its buffers). Other
      // kernels read a checked copy of each chunk of rows, or keep a value read again in range (kept_in).
      bufs.push_back(e.kernel->assembled_output ? scratch_copy(b.contiguous(), scratch_used++) : b.contiguous());
    }
    const at::Tensor& v = inputs[at++];
    SCORCH_CHECK_TYPE(v.scalar_type() == vt, "operand {}: values must be {}, got {}", t, c10::toString(vt),
                      c10::toString(v.scalar_type()));
    SCORCH_CHECK(v.dim() == 1 && v.device().is_cpu(), "operand {}: values must be a 1-D CPU tensor", t);
    const auto spans = spans_of(bufs);
    try {
      check_lengths(*s.format, c.shapes[t], spans, v.size(0));
      // The kernels check coordinates against their ranges as they read them, but not that they are sorted and
      // unique, which a merge of sparse operands and a sorted sparse output rely on (a product of two CSR
      // operands with unsorted rows dropped entries): those kernels get their operands checked in full, once
      // per tensor and version (a kernel reading one sparse operand into a dense result needs no order).
      if (order_matters) {
        ValidatedOnce::Key key = buffers_key(*s.format, c.shapes[t], v, inputs.slice(first, names.size()));
        validated_buffers.check_once(std::move(key), [&] {
          const std::string why = bad_index_report(*s.format, c.shapes[t], bufs, v.size(0));
          SCORCH_CHECK(why.empty(), "{}", why);
        });
      }
    } catch (const Error& err) {
      throw_error(err.kind(), fmt::format("operand {}: {}", t, err.what()));
    }
    for (auto& b : bufs) {
      c.ptrs.push_back(b.data_ptr());
      c.lengths.push_back(b.numel());
      c.keep.push_back(b);
    }
    c.operand_buffers[t] = std::move(bufs);
    c.operand_nnz[t] = v.size(0);
    c.keep.push_back(v.contiguous());
    c.ptrs.push_back(c.keep.back().data_ptr());
    c.lengths.push_back(v.size(0));
  }
  return c;
}

// Returns (values, index buffers): the values of a sparse result (or the dense result, with no buffers) first.
std::tuple<at::Tensor, std::vector<at::Tensor>> kernel_op(c10::string_view spec_text, at::TensorList inputs,
                                                          c10::IntArrayRef sizes, int64_t num_threads) {
  return translate_errors([&] {
    const Entry& e = lookup(spec_text);
    const KernelSpec& spec = e.spec;
    const auto vt = spec.f64 ? at::kDouble : at::kFloat;
    const auto it = spec.idx64 ? at::kLong : at::kInt;
    PreparedCall c = prepare(e, inputs, sizes);
    auto& shapes = c.shapes;
    auto& ptrs = c.ptrs;
    auto& lengths = c.lengths;
    auto& strides = c.strides;
    auto& operand_buffers = c.operand_buffers;
    auto& operand_nnz = c.operand_nnz;

    std::vector<int64_t> out_shape;
    for (int v : spec.stmt.out_vars) out_shape.push_back(sizes[v]);
    const auto opts = at::TensorOptions().dtype(vt);
    at::Tensor dense;
    scorch_kernel_args args{ptrs.data(), sizes.data(), strides.data(), nullptr, 0, nullptr, nullptr,
                            kernel_threads(num_threads), 0, lengths.data()};
    const int sampled = e.kernel->sampled_operand;
    std::vector<at::Tensor> shared;  // the sampling operand's index buffers the output shares
    if (spec.output.strided()) {
      // A kernel that stores every element once gets the output unzeroed (a pass over it saved).
      dense = e.kernel->overwrites_output ? at::empty(out_shape, opts) : at::zeros(out_shape, opts);
      args.out_dense = dense.data_ptr();
    } else if (sampled >= 0) {  // values at the sampling operand's positions (or a dense block under each
                                // position of its leading levels: the output shares only those buffers)
      const auto& all = operand_buffers[sampled];
      shared.assign(all.begin(), all.begin() + e.kernel->sampled_buffers);
      // (In fibers mode the count is the output's: its dense levels below the shared ones may differ in length
      // from the operand's, 8 columns under a compressed row where the operand had 1; sized by the operand's
      // count, the kernel wrote past the end of the values: helper-52.)
      const int64_t n = !e.kernel->sampled_fibers && shared.size() == all.size()
                            ? operand_nnz[sampled]
                            : stored_positions(*spec.output.format, out_shape, spans_of(shared));
      dense = e.kernel->overwrites_output ? at::empty({n}, opts) : at::zeros({n}, opts);
      args.out_dense = dense.data_ptr();
    }
    {
      RECORD_FUNCTION(e.profile_name.c_str(), std::vector<c10::IValue>());
      const auto t0 = std::chrono::steady_clock::now();
      const int rc = e.kernel->fn(&args);
      last_kernel_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rc != SCORCH_STATUS_OK) {
        e.kernel->free_fn(args.out_coords);
        e.kernel->free_fn(args.out_vals);
        if (rc == SCORCH_STATUS_BAD_INDEX) {
          // Index buffers changed since they were validated (or never were): name the first bad value.
          for (size_t t = 0; t < spec.operands.size(); ++t) {
            if (spec.operands[t].strided()) continue;
            const std::string why = bad_index_report(*spec.operands[t].format, shapes[t], operand_buffers[t], operand_nnz[t]);
            SCORCH_CHECK(why.empty(), "operand {}: {}", t, why);
          }
          throw_error(ErrorKind::value, fmt::format("scorch kernel '{}' met an index value out of range in its "
                                                    "operands (were the index buffers written during the call?)",
                                                    spec.stmt.str()));
        }
        SCORCH_ASSERT(rc == SCORCH_STATUS_NO_MEMORY, "scorch kernel '{}' returned the unknown status {}", spec.stmt.str(), rc);
        // A dense workspace over the output's last index is allocated per thread whatever the data: over a
        // huge extent it, not the result, is what does not fit (helper-60: a 3-entry product over 2^31 columns).
        std::string workspace;
        if (e.kernel->workspace_output)
          workspace = fmt::format(", or the dense workspace it keeps per thread over the output's last index ({} "
                                  "entries; {})", out_shape.empty() ? 0 : out_shape.back(), e.kernel->schedule);
        throw_error(ErrorKind::memory, fmt::format("scorch kernel '{}' ran out of memory building its result (a sparse "
                                                   "result holds an entry per nonzero product: this one does not "
                                                   "fit{})",
                                                   spec.stmt.str(), workspace));
      }
    }
    if (spec.output.strided()) return std::make_tuple(dense, std::vector<at::Tensor>{});
    if (sampled >= 0) {
      std::vector<at::Tensor> buffers;
      buffers.reserve(shared.size());
      for (const auto& b : shared) buffers.push_back(copy_buffer(b));  // outputs never alias inputs
      return std::make_tuple(dense, buffers);
    }
    int64_t nnz = args.out_nnz;  // (fewer when an n:m output drops the zeros below)
    if (e.kernel->assembled_output) {
      // The kernel wrote the output format's buffers itself (lower/assemble.h): they become the result's
      // tensors as they are, freed by the kernel library's free function when the last tensor goes.
      SCORCH_CHECK(args.out_coords != nullptr,
                   "the result of '{}' has {} stored entries, more than {} index buffers can address: use int64 "
                   "indices (index_dtype=torch.int64)",
                   spec.stmt.str(), nnz, c10::toString(it));
      const auto free_fn = e.kernel->free_fn;
      auto take = [&](void* p, int64_t n, at::ScalarType type) {
        return at::from_blob(p, {n}, [free_fn](void* q) { free_fn(q); }, at::TensorOptions().dtype(type));
      };
      void** bufs = reinterpret_cast<void**>(args.out_coords);
      // Rows of the output's dense levels (csr_like: one dense level, then the compressed one).
      const auto& lv = spec.output.format->levels();
      const int64_t rows = out_shape[lv.front().expr.dim];
      std::vector<at::Tensor> buffers{take(bufs[0], rows + 1, it), take(bufs[1], nnz, it)};
      at::Tensor values = take(args.out_vals, nnz, vt);
      free_fn(args.out_coords);
      // Sorted and unique by construction: a kernel that reads this result next need not check it again
      // (a chain of sparse products on fresh results checked every one of them: 2.3x slower).
      validated_buffers.check_once(buffers_key(*spec.output.format, out_shape, values, buffers), [] {});
      return std::make_tuple(values, buffers);
    }
    at::Tensor values = at::from_blob(args.out_vals, {nnz}, opts).clone();
    // The kernel writes every entry its operands could make nonzero, zeros among them. An n:m level takes its
    // coordinates for nonzeros and refused a result that fits it ("ij->ij" of a 2:4-sparse x into "nm(2,4)",
    // helper-62): for such a format the zeros are dropped first (it pads its groups with zeros itself). A
    // group with more than n nonzeros still raises.
    const int64_t* coords = args.out_coords;
    std::vector<int64_t> kept;
    const auto& out_levels = spec.output.format->levels();
    if (std::any_of(out_levels.begin(), out_levels.end(), [](const auto& l) { return l.kind->structured_groups().first > 0; })) {
      const int64_t nd = static_cast<int64_t>(out_shape.size());
      const at::Tensor keep = values.ne(0).nonzero().reshape(-1);
      const int64_t* k = keep.data_ptr<int64_t>();
      kept.reserve(static_cast<size_t>(keep.numel() * nd));
      for (int64_t d = 0; d < nd; ++d)  // (by dimension: dimension d's coordinates at d * nnz)
        for (int64_t j = 0; j < keep.numel(); ++j) kept.push_back(coords[d * nnz + k[j]]);
      values = values.index_select(0, keep);
      coords = kept.data();
      nnz = keep.numel();
    }
    at::Tensor pos, crd;
    const bool fast = e.kernel->sorted_output &&
                      (it == at::kInt ? nnz <= std::numeric_limits<int32_t>::max() &&
                                            pack_sorted_rows<int32_t>(*spec.output.format, out_shape, coords, nnz, pos, crd)
                                      : pack_sorted_rows<int64_t>(*spec.output.format, out_shape, coords, nnz, pos, crd));
    auto [buffers, packed] = fast ? std::make_tuple(std::vector<at::Tensor>{pos, crd}, values)
                                  : pack_to_tensors(*spec.output.format, out_shape, coords, nnz, values, it);
    e.kernel->free_fn(args.out_coords);
    e.kernel->free_fn(args.out_vals);
    validated_buffers.check_once(buffers_key(*spec.output.format, out_shape, packed, buffers), [] {});  // (as above)
    return std::make_tuple(packed, buffers);
  });
}

}  // namespace

double last_kernel_seconds() { return last_kernel_s; }

double time_kernel(const std::string& spec_text, at::TensorList inputs, c10::IntArrayRef sizes, int64_t num_threads,
                   int repeats, int warmup, bool mean) {
  return translate_errors([&] {
    const Entry& e = lookup(spec_text);
    SCORCH_CHECK(e.spec.output.strided(), "time_kernel times kernels with a dense output only");
    PreparedCall c = prepare(e, inputs, sizes);
    std::vector<int64_t> out_shape;
    for (int v : e.spec.stmt.out_vars) out_shape.push_back(sizes[v]);
    at::Tensor out = at::zeros(out_shape, e.spec.f64 ? at::kDouble : at::kFloat);
    scorch_kernel_args args{c.ptrs.data(), sizes.data(), c.strides.data(), out.data_ptr(), 0, nullptr, nullptr,
                            kernel_threads(num_threads), 0, c.lengths.data()};
    const size_t bytes = out.numel() * out.element_size();
    std::vector<double> times;
    warmup = std::max(warmup, 0);
    for (int r = 0; r < std::max(repeats, 1) + warmup; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!e.kernel->overwrites_output) std::memset(out.data_ptr(), 0, bytes);  // zeroed, as a call does
      const int rc = e.kernel->fn(&args);
      const auto t1 = std::chrono::steady_clock::now();
      SCORCH_CHECK(rc == SCORCH_STATUS_OK, "kernel '{}' failed with status {}", e.spec.stmt.str(), rc);
      if (r >= warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    if (mean) return std::accumulate(times.begin(), times.end(), 0.0) / static_cast<double>(times.size());
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    return times[times.size() / 2];
  });
}

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  // SymInt sizes: a call traced with dynamic shapes keeps them symbolic (the kernels below take them concrete).
  m.def("kernel(str spec, Tensor[] inputs, SymInt[] sizes, int num_threads) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(scorch, CPU, m) { m.impl("kernel", kernel_op); }

}  // namespace scorch::torch_glue
