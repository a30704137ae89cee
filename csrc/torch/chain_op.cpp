// The scorch::chain operator (chain.h) and its gradient op scorch::chain_backward: schemas, CPU, Meta and
// Autograd kernels.
//
// A grouped chain of plain grouped products (the mixture of experts) gets its gradient directly
// (grouped_backward.cpp), for the operands the caller asks for only. Any other chain:
// the gradient recomputes the chain with ATen's autograd recording it and asks the engine for the operands'
// gradients (torch::autograd::grad), rather than deriving a program per step. Why: the forward is gathers,
// batched products, elementwise ops and scatters on group blocks whose layout is chosen from the data, so a
// derived gradient would be a second grouped runner (every product's operand gradient another grouped product,
// scattered back through the same gathers) with the same cost as autograd's; and the op must stay opaque to
// torch.compile (its group sizes are data), so the forward's intermediates cannot be handed to the backward
// graph: a recomputation is paid either way (one forward of the chain, a third of a training step's work).
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "forward_ad.h"
#include "chain.h"
#include "convert.h"

namespace scorch::torch_glue {
namespace {

bool wants_gradient(const ChainProgram& c, size_t k, const at::Tensor& t) {
  return k < c.differentiable.size() && c.differentiable[k] && t.is_floating_point();
}

// wants_gradient, narrowed by the caller's `wanted` (per operand, 0: its gradient is not needed) when given.
bool asked(const ChainProgram& c, size_t k, const at::Tensor& t, at::OptionalIntArrayRef wanted) {
  if (!wants_gradient(c, k, t)) return false;
  return !wanted.has_value() || (k < wanted->size() && (*wanted)[k] != 0);
}

void check_gradient_shape(const ChainProgram& c, at::TensorList operands, const at::Tensor& grad) {
  const auto out_shape = chain_output_shape(c, operands);
  SCORCH_CHECK(grad.sym_sizes().equals(out_shape), "scorch::chain {}: the gradient has shape {}, the chain's output "
               "has shape {}", c.title, c10::str(grad.sym_sizes()), c10::str(c10::SymIntArrayRef(out_shape)));
}

at::Tensor chain_cpu(c10::string_view program, at::TensorList operands) {
  return translate_errors([&] {
    const std::string text(program);
    const ChainProgram& c = chain_program(text);
    RECORD_FUNCTION(c.profile_name.c_str(), std::vector<c10::IValue>());
    for (size_t k = 0; k < operands.size(); ++k)
      SCORCH_CHECK(operands[k].device().is_cpu(), "scorch::chain {}: operand {} is on {}; Scorch runs on the CPU",
                   c.title, k, operands[k].device().str());
    region_capture(text, operands);
    at::NoGradGuard no_grad;
    return run_chain(c, operands);
  });
}

at::Tensor chain_meta(c10::string_view program, at::TensorList operands) {
  return translate_errors([&] {
    const ChainProgram& c = chain_program(std::string(program));
    SCORCH_CHECK(!operands.empty(), "scorch::chain {}: no operands", c.title);
    return at::empty_symint(chain_output_shape(c, operands), operands[0].options().dtype(chain_dtype(c, operands)));
  });
}

// Every operand's gradient (an empty tensor for those that get none): the chain run again under ATen's autograd.
std::vector<at::Tensor> chain_backward_cpu(c10::string_view program, at::TensorList operands, const at::Tensor& grad,
                                           at::OptionalIntArrayRef wanted) {
  return translate_errors([&] {
    const ChainProgram& c = chain_program(std::string(program));
    SCORCH_CHECK(operands.size() == c.differentiable.size(), "scorch::chain {}: {} operands expected, got {}", c.title,
                 c.differentiable.size(), operands.size());
    check_gradient_shape(c, operands, grad);
    std::vector<bool> ask(operands.size());
    for (size_t k = 0; k < operands.size(); ++k) ask[k] = asked(c, k, operands[k], wanted);
    std::vector<at::Tensor> direct;
    if (grouped_chain_backward(c, operands, grad, ask, direct)) {
      for (size_t k = 0; k < operands.size(); ++k)
        if (!direct[k].defined())
          direct[k] = ask[k] ? at::zeros_like(operands[k]) : at::empty({0}, operands[k].options());
      return direct;
    }
    // The dispatcher excludes the autograd keys below an op's autograd kernel: let them record again here.
    const auto keys = c10::impl::tls_local_dispatch_key_set();
    c10::impl::ForceDispatchKeyGuard record(keys.included_,
                                            keys.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    at::AutoGradMode on(true);
    std::vector<at::Tensor> vars, wanted;
    std::vector<size_t> which;
    for (size_t k = 0; k < operands.size(); ++k) {
      at::Tensor t = operands[k].detach();
      if (ask[k]) {
        t.requires_grad_(true);
        wanted.push_back(t);
        which.push_back(k);
      }
      vars.push_back(t);
    }
    std::vector<at::Tensor> out(operands.size());
    if (!wanted.empty()) {
      const at::Tensor y = run_chain(c, vars, /*differentiable=*/true);
      const auto grads = torch::autograd::grad({y}, wanted, {grad}, /*retain_graph=*/false, /*create_graph=*/false,
                                               /*allow_unused=*/true);
      for (size_t n = 0; n < which.size(); ++n)
        out[which[n]] = grads[n].defined() ? grads[n].detach() : at::zeros_like(operands[which[n]]);
    }
    for (size_t k = 0; k < operands.size(); ++k)
      if (!out[k].defined()) out[k] = at::empty({0}, operands[k].options());
    return out;
  });
}

std::vector<at::Tensor> chain_backward_meta(c10::string_view program, at::TensorList operands, const at::Tensor& grad,
                                            at::OptionalIntArrayRef wanted) {
  return translate_errors([&] {
    const ChainProgram& c = chain_program(std::string(program));
    check_gradient_shape(c, operands, grad);
    std::vector<at::Tensor> out;
    for (size_t k = 0; k < operands.size(); ++k)
      out.push_back(asked(c, k, operands[k], wanted) ? at::empty_like(operands[k])
                                                      : at::empty({0}, operands[k].options()));
    return out;
  });
}

at::Tensor chain_below_autograd(const std::string& program, at::TensorList operands) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::chain", "").typed<
      at::Tensor(c10::string_view, at::TensorList)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(program, operands);
}

class ChainFunction : public torch::autograd::Function<ChainFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const std::string& program,
                                                at::TensorList operands) {
    ctx->saved_data["program"] = program;
    ctx->save_for_backward(operands.vec());
    return {chain_below_autograd(program, operands)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::chain_backward", "").typed<
        std::vector<at::Tensor>(c10::string_view, at::TensorList, const at::Tensor&, at::OptionalIntArrayRef)>();
    const std::string program = ctx->saved_data["program"].toStringRef();
    const ChainProgram& c = chain_program(program);
    const auto operands = ctx->get_saved_variables();
    torch::autograd::variable_list result(1 + operands.size());
    if (!grads[0].defined()) return result;
    std::vector<int64_t> wanted(operands.size());
    for (size_t k = 0; k < operands.size(); ++k) wanted[k] = ctx->needs_input_grad(k) ? 1 : 0;
    const auto g = h.call(program, operands, grads[0], wanted);
    for (size_t k = 0; k < operands.size(); ++k)
      if (ctx->needs_input_grad(k) && wants_gradient(c, k, operands[k])) result[1 + k] = g[k];
    return result;
  }
};

at::Tensor chain_autograd(c10::string_view program, at::TensorList operands) {
  refuse_forward_ad("scorch::chain", operands);
  bool wants_grad = false;
  if (at::GradMode::is_enabled())
    for (const auto& t : operands) wants_grad = wants_grad || t.requires_grad();
  if (!wants_grad) return chain_below_autograd(std::string(program), operands);
  return ChainFunction::apply(std::string(program), operands)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  m.def("chain(str program, Tensor[] operands) -> Tensor");
  m.def("chain_backward(str program, Tensor[] operands, Tensor grad, int[]? wanted=None) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(scorch, CPU, m) {
  m.impl("chain", chain_cpu);
  m.impl("chain_backward", chain_backward_cpu);
}
TORCH_LIBRARY_IMPL(scorch, Meta, m) {
  m.impl("chain", chain_meta);
  m.impl("chain_backward", chain_backward_meta);
}
TORCH_LIBRARY_IMPL(scorch, Autograd, m) { m.impl("chain", chain_autograd); }

}  // namespace scorch::torch_glue
