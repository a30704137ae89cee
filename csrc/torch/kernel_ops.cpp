// scorch::kernel: run the compiled kernel of a spec on torch tensors. Inputs are checked against the spec
// (count, dtypes, shapes, buffer lengths) before the kernel runs; a sparse result is packed into the
// spec's output format.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <mutex>
#include <unordered_map>

#include <fmt/ranges.h>

#include "convert.h"
#include "format/storage.h"
#include "lower/kernel_spec.h"
#include "runtime/jit.h"

namespace scorch::torch_glue {
namespace {

struct Entry {
  KernelSpec spec;
  std::shared_ptr<const CompiledKernel> kernel;
  std::string profile_name;
};

const Entry& lookup(const std::string& text) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<Entry>> entries;
  {
    std::lock_guard lock(mu);
    auto it = entries.find(text);
    if (it != entries.end()) return *it->second;
  }
  auto e = std::make_unique<Entry>();
  e->spec = KernelSpec::parse(text);
  e->kernel = get_kernel(text);
  e->profile_name = "scorch::kernel " + e->kernel->statement;
  std::lock_guard lock(mu);
  return *entries.emplace(text, std::move(e)).first->second;
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
  int64_t prev_row = -1, prev_col = -1;
  for (int64_t q = 0; q < nnz; ++q) {
    int64_t row = 0;
    for (size_t l = 0; l + 1 < levels.size(); ++l)
      row = row * shape[levels[l].expr.dim] + coords[levels[l].expr.dim * nnz + q];
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

// Returns (values, index buffers): the values of a sparse result (or the dense result, with no buffers) first.
std::tuple<at::Tensor, std::vector<at::Tensor>> kernel_op(c10::string_view spec_text,
                                                          const std::vector<at::Tensor>& inputs,
                                                          c10::IntArrayRef sizes, int64_t num_threads) {
  return translate_errors([&] {
    const Entry& e = lookup(std::string(spec_text));
    const KernelSpec& spec = e.spec;
    const auto vt = spec.f64 ? at::kDouble : at::kFloat;
    const auto it = spec.idx64 ? at::kLong : at::kInt;
    SCORCH_CHECK(static_cast<int>(sizes.size()) == spec.stmt.num_vars(), "expected {} index sizes, got {}",
                 spec.stmt.num_vars(), sizes.size());
    for (auto s : sizes) SCORCH_CHECK(s >= 0, "index sizes must be non-negative, got {}", s);
    SCORCH_CHECK(static_cast<int>(inputs.size()) == e.kernel->input_pointers,
                 "kernel '{}' takes {} input tensors, got {}", spec.stmt.str(), e.kernel->input_pointers, inputs.size());

    // Map each operand's dimensions to index sizes through its first access.
    std::vector<std::vector<int64_t>> shapes(spec.operands.size());
    std::vector<bool> seen(spec.operands.size(), false);
    std::vector<const ir::Expr*> acc;
    ir::collect_accesses(spec.stmt.rhs, acc);
    for (const ir::Expr* a : acc) {
      std::vector<int64_t> shape;
      for (int v : a->vars) shape.push_back(sizes[v]);
      if (seen[a->tensor])
        SCORCH_CHECK(shapes[a->tensor] == shape, "operand {} is accessed with different sizes", a->tensor);
      shapes[a->tensor] = shape;
      seen[a->tensor] = true;
    }

    std::vector<void*> ptrs;
    std::vector<int64_t> strides;
    std::vector<at::Tensor> keep;  // contiguous copies stay alive during the call
    std::vector<std::vector<at::Tensor>> operand_buffers(spec.operands.size());
    std::vector<int64_t> operand_nnz(spec.operands.size(), 0);
    size_t at = 0;
    for (size_t t = 0; t < spec.operands.size(); ++t) {
      const Storage& s = spec.operands[t];
      if (s.strided()) {
        const at::Tensor& x = inputs[at++];
        SCORCH_CHECK_TYPE(x.scalar_type() == vt, "operand {} must be {}, got {}", t, c10::toString(vt),
                          c10::toString(x.scalar_type()));
        SCORCH_CHECK(x.device().is_cpu(), "operand {} must be on the CPU", t);
        SCORCH_CHECK(std::vector<int64_t>(x.sizes().begin(), x.sizes().end()) == shapes[t],
                     "operand {} has shape {}, the statement needs {}", t, c10::str(x.sizes()), fmt::join(shapes[t], ", "));
        keep.push_back(x.contiguous());  // kernels assume row-major strided operands
        ptrs.push_back(keep.back().data_ptr());
        for (auto st : keep.back().strides()) strides.push_back(st);
        continue;
      }
      const auto names = s.format->buffer_names();
      std::vector<at::Tensor> bufs;
      for (const auto& name : names) {
        const at::Tensor& b = inputs[at++];
        SCORCH_CHECK_TYPE(b.scalar_type() == it, "operand {}: index buffer {} must be {}, got {}", t, name,
                          c10::toString(it), c10::toString(b.scalar_type()));
        SCORCH_CHECK(b.dim() == 1 && b.device().is_cpu(), "operand {}: index buffer {} must be a 1-D CPU tensor", t, name);
        bufs.push_back(b.contiguous());
      }
      const at::Tensor& v = inputs[at++];
      SCORCH_CHECK_TYPE(v.scalar_type() == vt, "operand {}: values must be {}, got {}", t, c10::toString(vt),
                        c10::toString(v.scalar_type()));
      SCORCH_CHECK(v.dim() == 1 && v.device().is_cpu(), "operand {}: values must be a 1-D CPU tensor", t);
      const auto spans = spans_of(bufs);
      check_lengths(*s.format, shapes[t], spans, v.size(0));
      for (auto& b : bufs) {
        ptrs.push_back(b.data_ptr());
        keep.push_back(b);
      }
      operand_buffers[t] = bufs;
      operand_nnz[t] = v.size(0);
      keep.push_back(v.contiguous());
      ptrs.push_back(keep.back().data_ptr());
    }

    std::vector<int64_t> out_shape;
    for (int v : spec.stmt.out_vars) out_shape.push_back(sizes[v]);
    const auto opts = at::TensorOptions().dtype(vt);
    at::Tensor dense;
    scorch_kernel_args args{ptrs.data(), sizes.data(), strides.data(), nullptr, 0, nullptr, nullptr,
                            static_cast<int32_t>(num_threads > 0 ? num_threads : 1), 0};
    const int sampled = e.kernel->sampled_operand;
    if (spec.output.strided()) {
      dense = at::zeros(out_shape, opts);
      args.out_dense = dense.data_ptr();
    } else if (sampled >= 0) {  // values at the sampling operand's positions
      dense = at::zeros({operand_nnz[sampled]}, opts);
      args.out_dense = dense.data_ptr();
    }
    {
      RECORD_FUNCTION(e.profile_name.c_str(), std::vector<c10::IValue>());
      const int rc = e.kernel->fn(&args);
      if (rc != 0) {
        e.kernel->free_fn(args.out_coords);
        e.kernel->free_fn(args.out_vals);
        throw_error(ErrorKind::runtime, fmt::format("scorch kernel '{}' failed (out of memory?)", spec.stmt.str()));
      }
    }
    if (spec.output.strided()) return std::make_tuple(dense, std::vector<at::Tensor>{});
    if (sampled >= 0) {
      std::vector<at::Tensor> buffers;
      for (const auto& b : operand_buffers[sampled]) buffers.push_back(b.clone());  // outputs never alias inputs
      return std::make_tuple(dense, buffers);
    }
    const int64_t nnz = args.out_nnz;
    at::Tensor values = at::from_blob(args.out_vals, {nnz}, opts).clone();
    at::Tensor pos, crd;
    const bool fast = e.kernel->sorted_output &&
                      (it == at::kInt ? nnz <= std::numeric_limits<int32_t>::max() &&
                                            pack_sorted_rows<int32_t>(*spec.output.format, out_shape, args.out_coords, nnz, pos, crd)
                                      : pack_sorted_rows<int64_t>(*spec.output.format, out_shape, args.out_coords, nnz, pos, crd));
    auto [buffers, packed] = fast ? std::make_tuple(std::vector<at::Tensor>{pos, crd}, values)
                                  : pack_to_tensors(*spec.output.format, out_shape, args.out_coords, nnz, values, it);
    e.kernel->free_fn(args.out_coords);
    e.kernel->free_fn(args.out_vals);
    return std::make_tuple(packed, buffers);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  m.def("kernel(str spec, Tensor[] inputs, int[] sizes, int num_threads) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(scorch, CPU, m) { m.impl("kernel", kernel_op); }

}  // namespace scorch::torch_glue
