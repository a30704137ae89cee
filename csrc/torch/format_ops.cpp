// Torch operators of the format layer: pack coordinates into level buffers, validate buffers, unpack them to
// coordinates and densify. Registered in TORCH_LIBRARY(scorch) so Python, TorchScript and C++ share them.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include "forward_ad.h"
#include "format/format.h"
#include "format/storage.h"
#include "convert.h"

namespace scorch::torch_glue {

// The index buffers checked for dtype, rank and device, each as a private copy: the op validates the copy and
// reads it, so a buffer another thread writes meanwhile (a user's in-place edit racing the op) cannot change a
// value between its check and its use. Reading the caller's buffers, validate() re-read pos and crd after
// checking them and to_dense scattered at offsets computed from values written since: a segfault (helper-61).
std::vector<at::Tensor> checked_index_buffers(at::TensorList buffers,
                                              const std::vector<std::string>& names) {
  SCORCH_CHECK(buffers.size() == names.size(), "expected {} index buffers, got {}", names.size(), buffers.size());
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    SCORCH_CHECK_TYPE(b.scalar_type() == at::kInt || b.scalar_type() == at::kLong,
                      "index buffer '{}' must be int32 or int64, got {}", names[i], c10::toString(b.scalar_type()));
    SCORCH_CHECK(b.dim() == 1, "index buffer '{}' must be 1-D, got {} dimensions", names[i], b.dim());
    SCORCH_CHECK(b.device().is_cpu(), "index buffer '{}' must be on the CPU", names[i]);
    out.push_back(b.clone(at::MemoryFormat::Contiguous));
  }
  return out;
}

std::vector<IndexSpan> spans_of(const std::vector<at::Tensor>& buffers) {
  std::vector<IndexSpan> spans;
  for (const auto& b : buffers) {
    if (b.scalar_type() == at::kLong) spans.emplace_back(b.data_ptr<int64_t>(), b.numel());
    else spans.emplace_back(b.data_ptr<int32_t>(), b.numel());
  }
  return spans;
}

void check_values(const at::Tensor& v, const char* what) {
  const auto t = v.scalar_type();
  SCORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
                    "{} must be float32, float64, bfloat16 or float16, got {}", what, c10::toString(t));
  SCORCH_CHECK(v.dim() == 1, "{} must be 1-D, got {} dimensions", what, v.dim());
  SCORCH_CHECK(v.device().is_cpu(), "{} must be on the CPU", what);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> pack_to_tensors(const Format& f, const std::vector<int64_t>& shape,
                                                                 const int64_t* coords, int64_t nnz,
                                                                 const at::Tensor& values, at::ScalarType index_dtype) {
  Packed p = pack(f, shape, {coords, static_cast<size_t>(nnz * f.ndim())}, nnz);
  const int64_t limit = index_dtype == at::kInt ? std::numeric_limits<int32_t>::max() : INT64_MAX;
  std::vector<at::Tensor> buffers;
  for (auto& b : p.buffers) {
    for (auto x : b) SCORCH_CHECK(x <= limit, "index value {} does not fit in int32; use index_dtype=torch.int64", x);
    buffers.push_back(at::tensor(b, at::kLong).to(index_dtype));
  }
  SCORCH_CHECK(p.value_count <= limit, "{} stored values do not fit int32 positions; use index_dtype=torch.int64",
               p.value_count);
  at::Tensor out = at::zeros({p.value_count}, values.options());
  if (nnz > 0) out.index_add_(0, at::tensor(p.value_pos, at::kLong), values);
  return std::make_tuple(std::move(buffers), out);
}

namespace {

std::vector<int64_t> to_vec(c10::IntArrayRef a) { return {a.begin(), a.end()}; }

std::tuple<std::vector<at::Tensor>, at::Tensor> pack_op(const at::Tensor& indices, const at::Tensor& values,
                                                        c10::IntArrayRef size, c10::string_view format,
                                                        at::ScalarType index_dtype) {
  return translate_errors([&] {
    const auto shape = to_vec(size);
    const Format f = Format::parse(std::string(format), static_cast<int>(shape.size()));
    SCORCH_CHECK_TYPE(index_dtype == at::kInt || index_dtype == at::kLong, "index_dtype must be int32 or int64, got {}",
                      c10::toString(index_dtype));
    SCORCH_CHECK_TYPE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
                      "indices must be int32 or int64, got {}", c10::toString(indices.scalar_type()));
    SCORCH_CHECK(indices.dim() == 2 && indices.size(0) == static_cast<int64_t>(shape.size()),
                 "indices must have shape (ndim={}, nnz), got {}", shape.size(), c10::str(indices.sizes()));
    check_values(values, "values");
    SCORCH_CHECK(values.size(0) == indices.size(1), "indices describe {} nonzeros but values has {}", indices.size(1),
                 values.size(0));
    const at::Tensor idx = indices.to(at::kLong).contiguous();
    return pack_to_tensors(f, shape, idx.data_ptr<int64_t>(), idx.size(1), values, index_dtype);
  });
}

void validate_op(at::TensorList buffers, const at::Tensor& values, c10::IntArrayRef size,
                 c10::string_view format) {
  translate_errors([&] {
    const auto shape = to_vec(size);
    const Format f = Format::parse(std::string(format), static_cast<int>(shape.size()));
    const auto bufs = checked_index_buffers(buffers, f.buffer_names());
    check_values(values, "values");
    const auto spans = spans_of(bufs);
    validate(f, shape, spans, values.size(0));
    return 0;
  });
}

at::Tensor unpack_op(at::TensorList buffers, const at::Tensor& values, c10::IntArrayRef size,
                     c10::string_view format) {
  return translate_errors([&] {
    check_values(values, "values");  // only its length is read, but a 0-D or 2-D tensor is a caller's mistake
    const int64_t value_count = values.size(0);
    const auto shape = to_vec(size);
    const Format f = Format::parse(std::string(format), static_cast<int>(shape.size()));
    const auto bufs = checked_index_buffers(buffers, f.buffer_names());
    const auto spans = spans_of(bufs);
    at::Tensor coords = at::empty({static_cast<int64_t>(shape.size()), value_count}, at::kLong);
    unpack_into(f, shape, spans, value_count, {coords.data_ptr<int64_t>(), static_cast<size_t>(coords.numel())});
    return coords;
  });
}

at::Tensor to_dense_op(at::TensorList buffers, const at::Tensor& values, c10::IntArrayRef size,
                       c10::string_view format) {
  const std::vector<int64_t> offsets = translate_errors([&] {
    check_values(values, "values");  // (a raw scatter follows: a 2-D values tensor must not pass)
    const auto shape = to_vec(size);
    const Format f = Format::parse(std::string(format), static_cast<int>(shape.size()));
    const auto bufs = checked_index_buffers(buffers, f.buffer_names());
    return dense_offsets(f, shape, spans_of(bufs), values.size(0));
  });
  const int64_t value_count = values.size(0);
  if (size.empty()) return values.reshape({}).clone();
  at::Tensor dense = at::zeros(size, values.options());
  if (value_count == 0) return dense;
  // Each stored value added at its offset (a non-unique format's duplicates sum, as index_put_ with
  // accumulate summed them), in storage order: one pass, no coordinate tensors.
  const at::Tensor v = values.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "scorch::to_dense", [&] {
    scalar_t* out = dense.data_ptr<scalar_t>();
    const scalar_t* in = v.const_data_ptr<scalar_t>();
    for (int64_t q = 0; q < value_count; ++q) out[offsets[static_cast<size_t>(q)]] += in[q];
  });
  return dense;
}

// --- to_dense below and above autograd ----------------------------------------------------------------------
// Densifying is differentiable in the values: the gradient of each stored value is the dense gradient at its
// coordinates (a zero a dense level pads is a value too, and gets its gradient the same way). Registered
// here, in C++, so TorchScript and C++ programs differentiate it as Python does.

at::Tensor to_dense_below_autograd(at::TensorList buffers, const at::Tensor& values, c10::SymIntArrayRef size,
                                   c10::string_view format) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::to_dense", "").typed<
      at::Tensor(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(buffers, values, size, format);
}

at::Tensor unpack_below_autograd(at::TensorList buffers, const at::Tensor& values, c10::SymIntArrayRef size,
                                 c10::string_view format) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::unpack", "").typed<
      at::Tensor(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(buffers, values, size, format);
}

class ToDenseFunction : public torch::autograd::Function<ToDenseFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList buffers, const at::Tensor& values,
                            c10::SymIntArrayRef size, const std::string& format) {
    ctx->saved_data["size"] = size;  // (symbolic under torch.compile's tracing: kept as SymInts)
    ctx->saved_data["format"] = format;
    std::vector<at::Tensor> saved(buffers.begin(), buffers.end());
    saved.push_back(values);
    ctx->save_for_backward(saved);
    return to_dense_below_autograd(buffers, values, size, format);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor values = saved.back();
    saved.pop_back();
    const std::vector<c10::SymInt> size = ctx->saved_data["size"].toSymIntVector();
    const std::string format = ctx->saved_data["format"].toStringRef();
    torch::autograd::variable_list out(saved.size());  // no gradient for the index buffers
    const at::Tensor& g = grads[0];
    at::Tensor gv;
    if (g.defined()) {
      if (size.empty()) {
        gv = g.reshape({1});
      } else {
        const at::Tensor coords = unpack_below_autograd(saved, values, size, format);
        c10::List<std::optional<at::Tensor>> index;
        // (the rank from `size`, not coords.size(0): sizes() on a traced tensor turns every symbolic size into a
        // constant, the stored-entry count among them, and the compiled graph then assumed that count)
        for (int64_t d = 0; d < static_cast<int64_t>(size.size()); ++d) index.push_back(coords.select(0, d));
        gv = g.index(index);
      }
      gv = gv.to(values.scalar_type());
    }
    out.push_back(gv);
    out.push_back(at::Tensor());  // size
    out.push_back(at::Tensor());  // format
    return out;
  }
};

at::Tensor to_dense_autograd(at::TensorList buffers, const at::Tensor& values, c10::SymIntArrayRef size,
                             c10::string_view format) {
  // (A size below -2^62 is held as a heap SymInt, which the dispatcher refuses to pass to the CPU kernel with a
  // message about SymInts; the CPU kernel's own check names it.)
  translate_errors([&] {
    for (const auto& s : size)
      if (const auto v = s.maybe_as_int()) SCORCH_CHECK(*v >= 0, "sizes must be non-negative, got {}", *v);
    return 0;
  });
  refuse_forward_ad("scorch::to_dense", {values});
  if (!(at::GradMode::is_enabled() && values.requires_grad())) return to_dense_below_autograd(buffers, values, size, format);
  return ToDenseFunction::apply(buffers, values, size, std::string(format));
}

// --- shapes for fake tensors (torch.compile, export) ------------------------------------------------------------
// The sizes are SymInt[] in the schemas, so a traced call keeps a SparseTensor's symbolic sizes: with int[] every
// call specialized them (one recompile per new shape under dynamic=True), and a traced graph whose sparse output
// had specialized sizes returned None for them (its outer sizes were symbolic), so the call failed.
at::Tensor to_dense_meta(at::TensorList, const at::Tensor& values, c10::SymIntArrayRef size, c10::string_view) {
  return at::empty_symint(size, values.options());
}

void validate_meta(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view) {}

at::Tensor unpack_meta(at::TensorList, const at::Tensor& values, c10::SymIntArrayRef size, c10::string_view) {
  return at::empty_symint({c10::SymInt(static_cast<int64_t>(size.size())), values.sym_size(0)},
                         values.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY(scorch, m) {
  m.def("pack(Tensor indices, Tensor values, int[] size, str format, ScalarType index_dtype) -> (Tensor[], Tensor)");
  m.def("validate(Tensor[] buffers, Tensor values, SymInt[] size, str format) -> ()");
  m.def("unpack(Tensor[] buffers, Tensor values, SymInt[] size, str format) -> Tensor");
  m.def("to_dense(Tensor[] buffers, Tensor values, SymInt[] size, str format) -> Tensor");
}

TORCH_LIBRARY_IMPL(scorch, CPU, m) {
  m.impl("pack", pack_op);
  m.impl("validate", validate_op);
  m.impl("unpack", unpack_op);
  m.impl("to_dense", to_dense_op);
}

TORCH_LIBRARY_IMPL(scorch, Meta, m) {
  m.impl("to_dense", to_dense_meta);
  m.impl("validate", validate_meta);
  m.impl("unpack", unpack_meta);
}

TORCH_LIBRARY_IMPL(scorch, Autograd, m) { m.impl("to_dense", to_dense_autograd); }

}  // namespace scorch::torch_glue
