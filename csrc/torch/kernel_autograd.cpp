// Autograd of scorch::kernel, registered in C++ so that Python, TorchScript and C++ programs get the same
// gradients and an eager call pays no Python wrapper.
//
// For out(O) = e and an operand T, lower/differentiate.cpp derives the gradient statement; it runs through
// the executor like any other statement (planned, converted, compiled once). For a sparse operand the
// statement is multiplied by T's pattern, so only its stored positions are computed, and the result is
// read at T's stored positions (sparse_gradient); for a dense operand it is a dense tensor of T's shape.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/ATen.h>

#include <mutex>
#include <unordered_map>

#include "forward_ad.h"
#include "convert.h"
#include "executor.h"
#include "lower/differentiate.h"
#include "lower/kernel_spec.h"

namespace scorch::torch_glue {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using TensorVec = std::vector<at::Tensor>;

const KernelSpec& spec_of(const std::string& text) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::unique_ptr<KernelSpec>> specs;
  std::lock_guard lock(mu);
  auto it = specs.find(text);
  if (it != specs.end()) return *it->second;
  auto s = std::make_unique<KernelSpec>(KernelSpec::parse(text));
  return *specs.emplace(text, std::move(s)).first->second;
}

std::tuple<at::Tensor, TensorVec> kernel_below_autograd(c10::string_view spec, at::TensorList inputs,
                                                        c10::IntArrayRef sizes, int64_t threads) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::kernel", "").typed<
      std::tuple<at::Tensor, TensorVec>(c10::string_view, at::TensorList, c10::IntArrayRef, int64_t)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(spec, inputs, sizes, threads);
}

// Each operand's shape, from the index sizes through its first access.
std::vector<std::vector<int64_t>> operand_shapes(const KernelSpec& spec, c10::IntArrayRef sizes) {
  std::vector<std::vector<int64_t>> shapes(spec.operands.size());
  std::vector<bool> seen(spec.operands.size(), false);
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(spec.stmt.rhs, acc);
  for (const ir::Expr* a : acc) {
    if (seen[a->tensor]) continue;
    for (int v : a->vars) shapes[a->tensor].push_back(sizes[v]);
    seen[a->tensor] = true;
  }
  return shapes;
}

// The gradient of a sparse operand's stored values: the pattern-sampled gradient statement, read at each of
// the operand's stored positions (zero where the gradient stores nothing: executor.h, values_at). A union with
// the operand's explicit zeros, stored in the operand's format, would drop a blocked format's all-zero blocks
// and come back shorter than the values.
at::Tensor sparse_gradient(const ir::Statement& g_stmt, std::vector<Operand> ops, const Operand& op, int64_t threads) {
  ops.push_back(op.with_values(at::ones_like(op.values)));
  const Operand g = run_statement(g_stmt, ops, "", threads);
  const auto vt = op.values.scalar_type();
  if (op.shape.empty()) return g.values.reshape({1}).to(vt);
  const at::Tensor coords = op.coordinates();  // (ndim, nnz), in the order of the stored values
  if (g.sparse()) {
    // The sampled gradient usually comes in the operand's own format and pattern: its values are the answer.
    // (compared by value only on real data: fake tensors, under tracing, have none)
    const bool real = !op.values.key_set().has(c10::DispatchKey::Python) &&
                      !op.values.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
    bool same = g.format == op.format && g.buffers.size() == op.buffers.size();
    for (size_t b = 0; same && b < g.buffers.size(); ++b)
      same = g.buffers[b].is_same(op.buffers[b]) ||
             (real && g.buffers[b].sizes() == op.buffers[b].sizes() && at::equal(g.buffers[b], op.buffers[b]));
    if (same) return g.values.to(vt).reshape(op.values.sizes());
    return values_at(g, coords).to(vt).reshape(op.values.sizes());
  }
  c10::List<std::optional<at::Tensor>> index;
  for (int64_t d = 0; d < coords.size(0); ++d) index.push_back(coords[d]);
  return at::index(g.values, index).to(vt).reshape(op.values.sizes());
}

class KernelFunction : public torch::autograd::Function<KernelFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const std::string& spec, at::TensorList inputs,
                               const std::vector<int64_t>& sizes, int64_t threads) {
    TensorVec in(inputs.begin(), inputs.end());
    auto [values, buffers] = kernel_below_autograd(spec, in, sizes, threads);
    ctx->saved_data["spec"] = spec;
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["threads"] = threads;
    ctx->saved_data["n_in"] = static_cast<int64_t>(in.size());
    ctx->saved_data["out_nnz"] = values.sym_numel();  // symbolic under tracing
    TensorVec saved = in;
    saved.insert(saved.end(), buffers.begin(), buffers.end());
    ctx->save_for_backward(saved);
    ctx->mark_non_differentiable(buffers);
    variable_list out{values};
    out.insert(out.end(), buffers.begin(), buffers.end());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::string spec_text = ctx->saved_data["spec"].toStringRef();
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t threads = ctx->saved_data["threads"].toInt();
    const size_t n_in = static_cast<size_t>(ctx->saved_data["n_in"].toInt());
    const KernelSpec& spec = spec_of(spec_text);
    const auto shapes = operand_shapes(spec, sizes);

    std::vector<Operand> ops;
    std::vector<size_t> value_slot;
    size_t at = 0;
    for (size_t t = 0; t < spec.operands.size(); ++t) {
      const Storage& s = spec.operands[t];
      if (s.strided()) {
        ops.push_back(Operand{nullptr, shapes[t], {}, saved[at]});
        value_slot.push_back(at++);
        continue;
      }
      const FormatRef& f = interned_format(s.str(), static_cast<int>(shapes[t].size()));
      const size_t nb = f.format.buffer_names().size();
      ops.push_back(Operand{&f, shapes[t], TensorVec(saved.begin() + at, saved.begin() + at + nb), saved[at + nb]});
      value_slot.push_back(at + nb);
      at += nb + 1;
    }
    std::vector<int64_t> out_shape;
    for (int v : spec.stmt.out_vars) out_shape.push_back(sizes[v]);
    const auto vt = spec.f64 ? at::kDouble : at::kFloat;
    Operand grad_out;
    if (spec.output.strided()) {
      grad_out = Operand{nullptr, out_shape, {}, grads[0].defined() ? grads[0] : at::zeros(out_shape, vt)};
    } else {
      const FormatRef& f = interned_format(spec.output.str(), static_cast<int>(out_shape.size()));
      TensorVec out_buffers(saved.begin() + n_in, saved.end());
      at::Tensor g = grads[0].defined() ? grads[0]
                                        : at::zeros_symint({ctx->saved_data["out_nnz"].toSymInt()}, at::TensorOptions(vt));
      grad_out = Operand{&f, out_shape, out_buffers, g};
    }

    variable_list result(1 + n_in + 2);  // spec, the inputs, sizes, threads
    for (size_t t = 0; t < ops.size(); ++t) {
      const size_t slot = value_slot[t];
      if (!ctx->needs_input_grad(slot)) continue;
      const Operand& op = ops[t];
      const auto g_stmt = differentiate(spec.stmt, static_cast<int>(t), op.sparse());
      if (!g_stmt) {
        result[1 + slot] = at::zeros_like(op.values);
        continue;
      }
      std::vector<Operand> g_ops = ops;
      g_ops.push_back(grad_out);
      if (op.sparse()) {
        result[1 + slot] = sparse_gradient(*g_stmt, std::move(g_ops), op, threads);
      } else {
        Operand g = run_statement(*g_stmt, g_ops, "strided", threads);
        result[1 + slot] = g.values.to(op.values.scalar_type()).reshape(op.values.sizes());
      }
    }
    return result;
  }
};

// The sizes are symbolic when torch.compile traces with dynamic shapes; they pass through untouched.
std::tuple<at::Tensor, TensorVec> kernel_below_autograd_symint(c10::string_view spec, at::TensorList inputs,
                                                               c10::SymIntArrayRef sizes, int64_t threads) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::kernel", "").typed<
      std::tuple<at::Tensor, TensorVec>(c10::string_view, at::TensorList, c10::SymIntArrayRef, int64_t)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(spec, inputs, sizes, threads);
}

std::tuple<at::Tensor, TensorVec> kernel_autograd(c10::string_view spec, at::TensorList inputs,
                                                  c10::SymIntArrayRef sizes, int64_t threads) {
  refuse_forward_ad("scorch::kernel", inputs);
  bool wants_grad = false;
  if (at::GradMode::is_enabled())
    for (const auto& t : inputs) wants_grad = wants_grad || t.requires_grad();
  if (!wants_grad) return kernel_below_autograd_symint(spec, inputs, sizes, threads);
  // The backward plans its gradient statements with concrete sizes. A traced call with symbolic sizes
  // differentiates in Python instead (scorch_backend/tensors/frontend.py, _TracedKernel), calling this op below
  // autograd.
  const auto concrete = c10::asIntArrayRefSlowOpt(sizes);
  TORCH_CHECK(concrete.has_value(), "scorch::kernel: gradients of a call with symbolic sizes are not derived "
              "here; call the op below autograd and differentiate it in the tracer (scorch_backend.frontend)");
  variable_list out = KernelFunction::apply(std::string(spec), inputs, concrete->vec(), threads);
  return std::make_tuple(out[0], TensorVec(out.begin() + 1, out.end()));
}

}  // namespace

TORCH_LIBRARY_IMPL(scorch, Autograd, m) { m.impl("kernel", kernel_autograd); }

}  // namespace scorch::torch_glue
