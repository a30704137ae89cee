#include "region_addends.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "convert.h"
#include "region_operands.h"
#include "runtime/settings.h"

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

// Two 2-D factors whose product is a matrix product giving `out` (two letters): (L, R) with L @ R in that
// letter order, each a view (transposed where its letters run the other way). nullopt for any other shape.
std::optional<std::pair<at::Tensor, at::Tensor>> matmul_factors(const RegionOperand& a, const at::Tensor& at_,
                                                               const RegionOperand& b, const at::Tensor& bt,
                                                               const std::string& out) {
  if (out.size() != 2 || a.letters.size() != 2 || b.letters.size() != 2 || a.expand || b.expand ||
      at_.dim() != 2 || bt.dim() != 2)
    return std::nullopt;
  const char r = out[0], c = out[1];
  const bool a_left = a.letters.find(r) != std::string::npos;
  const RegionOperand& left = a_left ? a : b;
  const RegionOperand& right = a_left ? b : a;
  const at::Tensor& lt = a_left ? at_ : bt;
  const at::Tensor& rt = a_left ? bt : at_;
  if (left.letters.find(r) == std::string::npos) return std::nullopt;
  // left holds r and the contracted letter, right holds that letter and c
  const char kl = left.letters[0] == r ? left.letters[1] : left.letters[0];
  if (right.letters.find(c) == std::string::npos || right.letters.find(kl) == std::string::npos || kl == c ||
      right.letters.find(r) != std::string::npos || left.letters.find(c) != std::string::npos)
    return std::nullopt;
  at::Tensor L = left.letters[0] == r ? lt : lt.t();   // (r, k)
  at::Tensor R = right.letters[0] == kl ? rt : rt.t();  // (k, c)
  if (L.size(1) != R.size(0)) return std::nullopt;
  return std::make_pair(std::move(L), std::move(R));
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
    if (o.relu) return std::nullopt;  // (the product's own run applies it)
  }
  const size_t i = static_cast<size_t>(p.product_operands[0]), j = static_cast<size_t>(p.product_operands[1]);
  const auto lr = matmul_factors(p.operands[i], all[i], p.operands[j], all[j], p.out);
  if (!lr) return std::nullopt;
  at::Tensor out;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind != RegionOperand::Kind::add) continue;
    const at::Tensor v = addend_view(p, k, all[k]);
    if (!out.defined()) {
      out = at::addmm(v, lr->first, lr->second, 1, p.coef);
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
  // (a half-precision product comes in float32: the addends are added there, the sum rounded once)
  const at::ScalarType acc = out.scalar_type() == at::kFloat && (dtype == at::kHalf || dtype == at::kBFloat16)
                                 ? at::kFloat
                                 : dtype;
  if (out.scalar_type() != acc) out = out.to(acc);
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind != RegionOperand::Kind::add) continue;
    const at::Tensor v = addend_view(p, k, all[k]);
    for (int64_t d = 0; d < v.dim(); ++d)
      SCORCH_CHECK(v.size(d) == 1 || v.size(d) == out.size(d),
                   "scorch::region {}: addend {} has size {} for letter '{}', the output {}", p.title, k, v.size(d),
                   p.out[static_cast<size_t>(d)], out.size(d));
    out.add_(v.to(acc));
  }
  return acc == dtype ? out : out.to(dtype);
}

namespace {

// out(i, j) = 0 wherever mask(i, j) is 0, both 2-D, any strides, of one float or double dtype: rows of out's
// memory order shared among the threads. False when the tensors are not such (the caller takes ATen's op).
bool zero_outside_2d(at::Tensor& out, const at::Tensor& mask) {
  if (out.dim() != 2 || mask.dim() != 2 || mask.scalar_type() != out.scalar_type() ||
      (out.scalar_type() != at::kFloat && out.scalar_type() != at::kDouble) || out.sizes() != mask.sizes())
    return false;
  const bool rows = out.stride(1) <= out.stride(0);  // walk out's inner dimension innermost
  const int64_t outer = out.size(rows ? 0 : 1), inner = out.size(rows ? 1 : 0);
  const int64_t os_o = out.stride(rows ? 0 : 1), os_i = out.stride(rows ? 1 : 0);
  const int64_t ms_o = mask.stride(rows ? 0 : 1), ms_i = mask.stride(rows ? 1 : 0);
  if (outer == 0 || inner == 0) return true;
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "region_mask", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* m = mask.const_data_ptr<scalar_t>();
    at::parallel_for(0, outer, std::max<int64_t>(1, thread_grain() / inner), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* orow = o + r * os_o;
        const scalar_t* mrow = m + r * ms_o;
        // A select, not a branch: the mask of a ReLU's pattern is about half zeros in no order, and a branch
        // on it mispredicted every other element (this pass was 4% of a pruned MLP's training step). With
        // unit strides the compiler makes it a vector blend.
        if (os_i == 1 && ms_i == 1) {
          for (int64_t j = 0; j < inner; ++j) orow[j] = mrow[j] == scalar_t(0) ? scalar_t(0) : orow[j];
        } else {
          for (int64_t j = 0; j < inner; ++j)
            orow[j * os_i] = mrow[j * ms_i] == scalar_t(0) ? scalar_t(0) : orow[j * os_i];
        }
      }
    });
  });
  return true;
}

}  // namespace

// Zero the product's result outside each mask operand (a pattern demoted to run after the product): the mask is
// viewed in the output's letter order; a 2-D float or double pair by one pass of our own, anything else by
// masked_fill_ (zero, not a product: an infinite entry outside the mask becomes 0, as the kernel leaves it).
void apply_masks(const RegionProgram& p, at::Tensor& out, at::TensorList all) {
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    if (o.kind != RegionOperand::Kind::mask) continue;
    SCORCH_CHECK(all[k].dim() == static_cast<int64_t>(o.letters.size()),
                 "scorch::region {}: mask {} has {} dimensions, the program gives it {} ('{}')", p.title, k,
                 all[k].dim(), o.letters.size(), o.letters);
    std::vector<int64_t> perm;
    for (char c : p.out) perm.push_back(static_cast<int64_t>(o.letters.find(c)));
    const at::Tensor m = all[k].permute(perm);
    SCORCH_CHECK(m.sizes() == out.sizes(), "scorch::region {}: mask {} does not have the output's sizes", p.title, k);
    if (!zero_outside_2d(out, m)) out.masked_fill_(m.eq(0), 0);
  }
}

}  // namespace scorch::torch_glue
