#include "region_addends.h"

#include "convert.h"
#include "region_operands.h"

namespace scorch::torch_glue {
namespace {

// An addend viewed in the output's letter order, sizes of 1 where it has no letter (broadcastable to `out`).
at::Tensor addend_view(const RegionProgram& p, size_t k, const at::Tensor& a) {
  const RegionOperand& o = p.operands[k];
  SCORCH_CHECK(a.dim() == static_cast<int64_t>(o.letters.size()),
               "scorch::region {}: addend {} has {} dimensions, the program gives it {} ('{}')", p.title, k, a.dim(),
               o.letters.size(), o.letters);
  std::string ordered;
  for (char c : p.out)
    if (o.letters.find(c) != std::string::npos) ordered += c;
  std::vector<int64_t> perm, shape;
  for (char c : ordered) perm.push_back(static_cast<int64_t>(o.letters.find(c)));
  const at::Tensor v = a.permute(perm);
  for (char c : p.out) {
    const size_t at = ordered.find(c);
    shape.push_back(at == std::string::npos ? 1 : v.size(static_cast<int64_t>(at)));
  }
  return v.reshape(shape);
}

}  // namespace

// The operands of a program's product (a program with addends): the product's slots, then the index buffers.
std::vector<at::Tensor> product_args(const RegionProgram& p, at::TensorList all) {
  SCORCH_CHECK(all.size() == p.operands.size() + static_cast<size_t>(p.packed_buffers),
               "scorch::region {}: {} operands expected ({} index buffers of packed operands included), got {}",
               p.title, p.operands.size() + p.packed_buffers, p.packed_buffers, all.size());
  std::vector<at::Tensor> args;
  for (int k : p.product_operands) args.push_back(all[static_cast<size_t>(k)]);
  for (size_t k = p.operands.size(); k < all.size(); ++k) args.push_back(all[k]);
  return args;
}

// A product of two dense matrices plus addends (a dense forward that a region takes for its gradients: a linear
// whose output's gradient is sparse): one addmm, which starts the product from the first addend (no pass of
// its own over the output). nullopt when the program is not that shape.
std::optional<at::Tensor> dense_matmul_with_addends(const RegionProgram& p, at::TensorList all) {
  if (p.packed_buffers || p.product_operands.size() != 2 || p.out.size() != 2) return std::nullopt;
  const at::ScalarType dtype = region_dtype(p, all.slice(0, p.operands.size()));
  if (dtype != at::kFloat && dtype != at::kDouble) return std::nullopt;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    if (all[k].scalar_type() != dtype || o.expand) return std::nullopt;
    if (o.kind != RegionOperand::Kind::dense && o.kind != RegionOperand::Kind::add) return std::nullopt;
    if (o.kind == RegionOperand::Kind::dense && (o.letters.size() != 2 || all[k].dim() != 2)) return std::nullopt;
  }
  const RegionOperand& a = p.operands[p.product_operands[0]];
  const RegionOperand& b = p.operands[p.product_operands[1]];
  const char r = p.out[0], c = p.out[1];
  const bool a_left = a.letters.find(r) != std::string::npos;
  const RegionOperand& left = a_left ? a : b;
  const RegionOperand& right = a_left ? b : a;
  const at::Tensor& lt = all[p.product_operands[a_left ? 0 : 1]];
  const at::Tensor& rt = all[p.product_operands[a_left ? 1 : 0]];
  if (left.letters.find(r) == std::string::npos) return std::nullopt;
  // left holds r and the contracted letter, right holds that letter and c
  const char kl = left.letters[0] == r ? left.letters[1] : left.letters[0];
  if (right.letters.find(c) == std::string::npos || right.letters.find(kl) == std::string::npos || kl == c ||
      right.letters.find(r) != std::string::npos || left.letters.find(c) != std::string::npos)
    return std::nullopt;
  const at::Tensor L = left.letters[0] == r ? lt : lt.t();   // (r, k)
  const at::Tensor R = right.letters[0] == kl ? rt : rt.t();  // (k, c)
  if (L.size(1) != R.size(0)) return std::nullopt;
  at::Tensor out;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind != RegionOperand::Kind::add) continue;
    const at::Tensor v = addend_view(p, k, all[k]);
    if (!out.defined()) {
      out = at::addmm(v, L, R, 1, p.coef);
    } else {
      out.add_(v);
    }
  }
  return out;
}

// The product's result (requested order, a tensor of its own) plus the addends, each broadcast along the output
// letters it lacks: one pass over the output, in this op call.
at::Tensor add_addends(const RegionProgram& p, at::Tensor out, at::TensorList all) {
  const at::ScalarType dtype = region_dtype(p, all.slice(0, p.operands.size()));
  if (out.scalar_type() != dtype) out = out.to(dtype);
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind != RegionOperand::Kind::add) continue;
    const at::Tensor v = addend_view(p, k, all[k]);
    for (int64_t d = 0; d < v.dim(); ++d)
      SCORCH_CHECK(v.size(d) == 1 || v.size(d) == out.size(d),
                   "scorch::region {}: addend {} has size {} for letter '{}', the output {}", p.title, k, v.size(d),
                   p.out[static_cast<size_t>(d)], out.size(d));
    out.add_(v.to(dtype));
  }
  return out;
}

}  // namespace scorch::torch_glue
