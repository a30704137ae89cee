// Conversions of an operand between formats that keep autograd's graph (the packing op works on detached
// tensors), and the lookup they and a sparse operand's gradient share: an operand's values at given coordinates.
#include <algorithm>
#include <limits>
#include <map>

#include <ATen/core/dispatch/Dispatcher.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "convert.h"
#include "executor.h"

namespace scorch::torch_glue {

namespace {

const auto& pack_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::pack", "").typed<
      std::tuple<std::vector<at::Tensor>, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::IntArrayRef,
                                                      c10::string_view, at::ScalarType)>();
  return h;
}

// Row-major offsets of coordinates (ndim, n) in `shape`.
at::Tensor linear_index(const at::Tensor& coords, const std::vector<int64_t>& shape) {
  at::Tensor lin = at::zeros_symint({coords.sym_size(1)}, at::kLong);
  int64_t stride = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    lin.add_(coords[d], stride);
    SCORCH_CHECK(d == 0 || !__builtin_mul_overflow(stride, std::max<int64_t>(shape[static_cast<size_t>(d)], 1), &stride),
                 "a sparse tensor of shape [{}] has more positions than 64-bit offsets address", fmt::join(shape, ", "));
  }
  return lin;
}

// The elements of dense d in the order an all-dense format stores them, flat: its levels' dimensions in their
// order, a blocked dimension split into (outer, inner) (scorch_backend/tensors/sparse_tensor.py: in_level_order).
at::Tensor in_level_order(const at::Tensor& d, const Format& f) {
  std::vector<int64_t> sizes;
  std::map<std::pair<int, LevelExpr::Part>, int64_t> axis;
  for (int64_t dim = 0; dim < d.dim(); ++dim) {
    int64_t block = 0;
    for (const auto& l : f.levels())
      if (l.expr.dim == dim && l.expr.part != LevelExpr::Part::whole) block = l.expr.block;
    if (block > 0) {
      SCORCH_CHECK(d.size(dim) % block == 0, "dimension {} of size {} is not divisible by its block size {}", dim,
                   d.size(dim), block);
      sizes.push_back(d.size(dim) / block);
      axis[{static_cast<int>(dim), LevelExpr::Part::outer}] = static_cast<int64_t>(sizes.size()) - 1;
      sizes.push_back(block);
      axis[{static_cast<int>(dim), LevelExpr::Part::inner}] = static_cast<int64_t>(sizes.size()) - 1;
    } else {
      sizes.push_back(d.size(dim));
      axis[{static_cast<int>(dim), LevelExpr::Part::whole}] = static_cast<int64_t>(sizes.size()) - 1;
    }
  }
  std::vector<int64_t> order;
  for (const auto& l : f.levels()) order.push_back(axis.at({l.expr.dim, l.expr.part}));
  return d.reshape(sizes).permute(order).reshape({-1});
}

}  // namespace

// Every step keeps a shape known from its inputs' (no unique, no mask select), so fake tensors trace it: src's
// offsets sorted, each run of equal offsets a group (the running count of run starts), its values summed by
// group and its offset stored at the group's slot, then each wanted offset found among the groups. One slot
// more than entries holds the largest offset as a sentinel, so an empty src or a miss past the end needs no
// branch.
at::Tensor values_at(const Operand& src, const at::Tensor& coords) {
  const at::Tensor v = src.values.reshape({-1});
  if (src.shape.empty()) return v.sum().reshape({1}).expand_symint({coords.sym_size(1)});
  const at::Tensor want = linear_index(coords, src.shape);
  const at::Tensor offsets = linear_index(src.coordinates(), src.shape);
  // Real data whose offsets already rise strictly (an ordered, unique format in row-major level order: CSR,
  // COO, CSF) needs no sort and no grouping: one search per wanted offset (a 419k-entry CSR's gradient: 30 ms
  // with the sort, most of a training step). Fake tensors take the general path, whose shapes are static.
  const auto dispatch = v.key_set();
  const bool real = !dispatch.has(c10::DispatchKey::Python) && !dispatch.has(c10::DispatchKey::Functionalize) &&
                    !v.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
  if (real && (offsets.numel() < 2 || offsets.slice(0, 1).gt(offsets.slice(0, 0, -1)).all().item<bool>())) {
    if (offsets.numel() == 0) return at::zeros({coords.size(1)}, v.options()) + v.sum();
    const at::Tensor at_ = at::searchsorted(offsets, want).clamp_max(offsets.numel() - 1);
    return at::where(offsets.index_select(0, at_).eq(want), v.index_select(0, at_), at::zeros({}, v.options()));
  }
  const auto [sorted, order] = offsets.sort();
  at::Tensor first = at::ones_like(sorted, at::kBool);
  first.slice(0, 1).copy_(sorted.slice(0, 1).ne(sorted.slice(0, 0, -1)));
  const at::Tensor group = first.cumsum(0).sub_(1);
  const c10::SymInt slots = v.sym_size(0) + 1;
  const at::Tensor keys = at::full_symint({slots}, std::numeric_limits<int64_t>::max(), at::kLong).scatter(0, group, sorted);
  const at::Tensor summed = at::zeros_symint({slots}, v.options()).index_add(0, group, v.index_select(0, order));
  const at::Tensor at_ = at::searchsorted(keys, want);
  return at::where(keys.index_select(0, at_).eq(want), summed.index_select(0, at_), at::zeros({}, v.options()));
}

Operand to_format(const Operand& x, const FormatRef& target, at::ScalarType idx) {
  SCORCH_ASSERT(x.sparse(), "the plan converts only sparse operands");
  const Format& to = target.format;
  const bool grad = at::GradMode::is_enabled() && x.values.requires_grad();
  if (to.all_dense()) {
    at::Tensor d = grad ? x.to_dense() : x.to_dense().detach();  // (to_dense is differentiable in the values)
    return Operand{&target, x.shape, {}, in_level_order(d, to).clone()};
  }
  // Every stored value moves, zeros a format pads its blocks or groups with included: they are stored, as
  // the native BSR and n:m kernels and torch's BSR treat them (0 * inf is NaN there). Dropping them only when
  // no gradient was recorded made a forward value depend on requires_grad, and a BSR SpMV disagree with a BSR
  // SpMM on a non-finite dense operand (helper-68).
  const at::Tensor coords = x.coordinates();
  const at::Tensor values = x.values.detach();
  // Through the op, so that fake tensors (a backward traced by torch.compile) get its fake kernel.
  auto [buffers, packed] = pack_handle().call(coords, values, x.shape, target.text, idx);
  Operand out{&target, x.shape, std::move(buffers), packed};
  // The packed values are detached: read them again from x's, through autograd, at the new positions.
  if (grad) out.values = values_at(x, out.coordinates()).to(packed.scalar_type()).reshape(packed.sizes());
  return out;
}

}  // namespace scorch::torch_glue
