// The scorch::region operator: its schema and its CPU, Meta and Autograd kernels (the run-time path is
// region.cpp; a region's gradients are region calls too).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/record_function.h>

#include <optional>

#include "convert.h"
#include "forward_ad.h"
#include "region.h"
#include "region_kernels.h"
#include "region_operands.h"

namespace scorch::torch_glue {

// --- the op ------------------------------------------------------------------------------------------------
namespace {

at::Tensor region_cpu(c10::string_view program, at::TensorList operands) {
  return translate_errors([&] {
    const std::string text(program);
    const RegionProgram& p = region_program(text);
    RECORD_FUNCTION(p.profile_name.c_str(), std::vector<c10::IValue>());
    return run_region(text, operands);
  });
}

// Shapes only: the output in its storage order, handed back permuted (as the real kernel does), or contiguous
// in the requested order when the program asks for it.
at::Tensor region_meta(c10::string_view program, at::TensorList all) {
  return translate_errors([&] {
    const RegionProgram& p = region_program(std::string(program));
    SCORCH_CHECK(!p.operands.empty(), "scorch::region {}: a program without operands", p.title);
    const Slots s = split_operands(p, all, /*resolve=*/false);
    const at::TensorList operands = s.slots;
    std::map<char, c10::SymInt> sizes;
    for (size_t k = 0; k < operands.size(); ++k) {
      const std::string letters = p.operands[k].tensor_letters();
      if (!p.operands[k].packed.empty()) {
        for (size_t d = 0; d < letters.size(); ++d)
          if (p.operands[k].packed_size[d] >= 0) sizes.emplace(letters[d], p.operands[k].packed_size[d]);
        continue;
      }
      const auto s = operands[k].sym_sizes();
      SCORCH_CHECK(s.size() == letters.size(), "scorch::region {}: operand {} has {} dimensions, the program gives it {}",
                   p.title, k, s.size(), letters.size());
      for (size_t d = 0; d < letters.size(); ++d) sizes.emplace(letters[d], s[d]);
    }
    // A packed size the call gives (-1) and no other operand has: the row pointers' count less one (see
    // resolve_packed_size).
    for (size_t k = 0; k < operands.size(); ++k) {
      const std::string letters = p.operands[k].tensor_letters();
      for (size_t d = 0; d < letters.size() && !p.operands[k].packed.empty(); ++d)
        if (!sizes.count(letters[d]) && !s.buffers[k].empty() && s.buffers[k][0].dim() == 1)
          sizes.emplace(letters[d], s.buffers[k][0].sym_numel() - 1);
    }
    std::vector<c10::SymInt> shape;
    const auto options = operands[0].options().dtype(region_dtype(p, operands));
    if (p.requested_order) {
      for (char c : p.out) shape.push_back(sizes.at(c));
      return at::empty_symint(shape, options);
    }
    for (char c : p.storage) shape.push_back(sizes.at(c));
    return at::empty_symint(shape, options).permute(p.back);
  });
}

at::Tensor region_below_autograd(const std::string& program, at::TensorList operands) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::region", "").typed<
      at::Tensor(c10::string_view, at::TensorList)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return h.call(program, operands);
}

at::Tensor region_call(const std::string& program, at::TensorList operands) {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::region", "").typed<
      at::Tensor(c10::string_view, at::TensorList)>();
  return h.call(program, operands);
}

class RegionFunction : public torch::autograd::Function<RegionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const std::string& program,
                                                at::TensorList operands) {
    ctx->saved_data["program"] = program;
    const RegionProgram& p = region_program(program);
    if (p.call_sized) {  // the packed sizes this call resolves (GivenPackedSizes: maybe given to it in turn)
      std::vector<int64_t> flat;
      for (const auto& size : split_operands(p, operands).packed_sizes) flat.insert(flat.end(), size.begin(), size.end());
      ctx->saved_data["packed_sizes"] = flat;
    }
    ctx->save_for_backward(operands.vec());
    return {region_below_autograd(program, operands)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::string program = ctx->saved_data["program"].toStringRef();
    const RegionProgram& p = region_program(program);
    const auto all = ctx->get_saved_variables();
    // A gradient program's own backward: the sizes its call was given (it may lack the letters that give them).
    std::optional<GivenPackedSizes> forward_sizes;
    if (p.call_sized) {
      const auto flat = ctx->saved_data["packed_sizes"].toIntVector();
      std::vector<std::vector<int64_t>> sizes(p.operands.size());
      auto at = flat.begin();
      for (size_t k = 0; k < p.operands.size(); ++k) {
        if (p.operands[k].packed.empty()) continue;
        const auto n = static_cast<std::ptrdiff_t>(p.operands[k].packed_size.size());
        sizes[k].assign(at, at + n);
        at += n;
      }
      forward_sizes.emplace(p, std::move(sizes));
    }
    const Slots s = split_operands(p, all);
    const at::TensorList operands = s.slots;
    torch::autograd::variable_list result(1 + all.size());  // index buffers and packed values get none
    at::Tensor grad = grads[0];
    for (size_t k = 0; k < operands.size(); ++k) {
      const auto& o = p.operands[k];
      const at::Tensor& t = operands[k];
      if (!ctx->needs_input_grad(k) || !t.is_floating_point()) continue;
      // an addend's gradient is the output's, summed; the rest run their gradient program (region_kernels.h)
      const bool addend = o.kind == RegionOperand::Kind::add && o.grad;
      if (!addend && !gradient_by_program(o)) continue;
      if (!grad.defined()) {
        result[1 + k] = at::zeros_like(t);
        continue;
      }
      if (o.kind == RegionOperand::Kind::add) {  // the output's gradient, summed along the letters it lacks
        std::vector<int64_t> dims;
        std::string kept;
        for (size_t d = 0; d < p.out.size(); ++d) {
          if (o.letters.find(p.out[d]) == std::string::npos) dims.push_back(static_cast<int64_t>(d));
          else kept += p.out[d];
        }
        at::Tensor g = dims.empty() ? grad : grad.sum(dims);
        std::vector<int64_t> perm;
        for (char c : o.letters) perm.push_back(static_cast<int64_t>(kept.find(c)));
        result[1 + k] = g.permute(perm).to(t.scalar_type());
        continue;
      }
      const RegionGradient& rg = region_gradient(program, static_cast<int>(k));
      // A packed operand whose size the call gives (-1: a rewritten model's sparse input, docs/rewrite.md) gets
      // the size this call resolved: the gradient program may lack the letter that gave it (operand k's own,
      // e.g. j of `adj(i,j) @ h(j,k)` when differentiating h), and resolve_packed_size would refuse it.
      const RegionProgram& gp = region_program(rg.text);
      std::optional<GivenPackedSizes> given;
      if (gp.call_sized) {
        std::vector<std::vector<int64_t>> sizes(rg.operands.size());
        for (size_t i = 0; i < rg.operands.size(); ++i) {
          const int j = rg.operands[i];
          if (j >= 0 && !p.operands[j].packed.empty()) sizes[i] = s.packed_sizes[j];
        }
        given.emplace(gp, std::move(sizes));
      }
      std::vector<at::Tensor> args;
      for (int j : rg.operands) args.push_back(j < 0 ? grad : operands[j]);
      for (int j : rg.operands)  // the packed operands' index buffers follow, in the gradient program's order
        if (j >= 0) args.insert(args.end(), s.buffers[j].begin(), s.buffers[j].end());
      at::Tensor g = region_call(rg.text, args);
      if (rg.produced != o.letters) {  // letters summed only within operand k: constant along them
        for (size_t d = 0; d < o.letters.size(); ++d)
          if (rg.produced.find(o.letters[d]) == std::string::npos) g = g.unsqueeze(static_cast<int64_t>(d));
        g = g.expand(t.sizes());
      }
      result[1 + k] = g.to(t.scalar_type());
    }
    return result;
  }
};

at::Tensor region_autograd(c10::string_view program, at::TensorList operands) {
  refuse_forward_ad("scorch::region", operands);
  bool wants_grad = false;
  if (at::GradMode::is_enabled())
    for (const auto& t : operands) wants_grad = wants_grad || t.requires_grad();
  if (!wants_grad) return region_below_autograd(std::string(program), operands);
  const std::string text(program);
  const RegionProgram& p = region_program(text);
  if (p.has_relu) {  // differentiated as the plain program on the ReLUs' outputs, which autograd records
    std::vector<at::Tensor> applied = operands.vec();
    for (size_t k = 0; k < p.operands.size(); ++k)
      if (p.operands[k].relu) applied[k] = at::relu(applied[k]);
    return RegionFunction::apply(p.plain_text, at::TensorList(applied))[0];  // (a list autograd sees)
  }
  return RegionFunction::apply(text, operands)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) { m.def("region(str program, Tensor[] operands) -> Tensor"); }
TORCH_LIBRARY_IMPL(scorch, CPU, m) { m.impl("region", region_cpu); }
TORCH_LIBRARY_IMPL(scorch, Meta, m) { m.impl("region", region_meta); }
TORCH_LIBRARY_IMPL(scorch, Autograd, m) { m.impl("region", region_autograd); }

}  // namespace scorch::torch_glue
