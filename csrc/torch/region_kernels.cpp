#include "region_kernels.h"

#include <algorithm>
#include <map>

#include "common/error.h"

namespace scorch::torch_glue {

const FormatRef& region_compressed_format(int rank) {
  return interned_format(rank >= 2 ? "csr" : rank == 1 ? "compressed(0)" : "dense", rank);
}

bool gradient_by_program(const RegionOperand& o) {
  return o.grad && o.packed.empty() && o.kind != RegionOperand::Kind::add;
}

namespace {

std::map<char, int64_t> sizes_of(const RegionProgram& p, const std::vector<std::vector<int64_t>>& shapes) {
  SCORCH_CHECK(shapes.size() == p.operands.size(), "scorch::region {}: {} operand shapes for {} operands", p.title,
               shapes.size(), p.operands.size());
  std::map<char, int64_t> sizes;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    const std::string letters = o.tensor_letters();
    if (!o.packed.empty()) {
      for (size_t d = 0; d < letters.size() && d < o.packed_size.size(); ++d)
        if (o.packed_size[d] >= 0) sizes.emplace(letters[d], o.packed_size[d]);
      continue;
    }
    SCORCH_CHECK(shapes[k].size() == letters.size(),
                 "scorch::region {}: operand {} has {} dimensions, the program gives it {} ('{}')", p.title, k,
                 shapes[k].size(), letters.size(), letters);
    for (size_t d = 0; d < letters.size(); ++d) {
      SCORCH_CHECK(shapes[k][d] >= 0, "scorch::region {}: operand {} has a negative size", p.title, k);
      sizes.emplace(letters[d], shapes[k][d]);
    }
  }
  return sizes;
}

int64_t size_of(const RegionProgram& p, const std::map<char, int64_t>& sizes, char c) {
  auto it = sizes.find(c);
  SCORCH_CHECK(it != sizes.end(), "scorch::region {}: no operand gives the size of letter '{}'", p.title, c);
  return it->second;
}

// The forward kernel of a program without addends: the operands as sparse_args hands them to the executor
// (dense ones laid out in the kernel's letter order, compressed ones in their format), planned as run_einsum
// plans them. Empty when no operand is compressed (the op never runs a kernel then).
std::string forward_spec(const RegionProgram& p, const std::map<char, int64_t>& sizes, at::ScalarType dtype,
                         const std::vector<double>& densities) {
  std::vector<OperandDesc> descs;
  bool compressed = false, idx64 = false;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    std::vector<int64_t> shape;
    int64_t n = 1;
    for (char c : p.kernel_letters[k]) {
      shape.push_back(size_of(p, sizes, c));
      n *= shape.back();
    }
    const int rank = static_cast<int>(shape.size());
    const FormatRef* f = !o.packed.empty()                    ? &interned_format(o.packed, rank)
                         : o.kind == RegionOperand::Kind::dense ? nullptr
                                                                : &region_compressed_format(rank);
    compressed = compressed || f;
    // The stored entries (their estimate) weigh in the planner's choice of conversions and loop order.
    const int64_t nnz = f ? static_cast<int64_t>(static_cast<double>(n) * densities[k] + 0.5) : n;
    idx64 = idx64 || needs_index64(f, f ? nnz : 0, shape);
    descs.push_back({f ? f->text : "strided", shape, nnz});
  }
  if (!compressed) return "";
  return plan_einsum(p.kernel_equation, descs, "strided", compute_dtype(dtype) == at::kDouble, idx64).spec;
}

void collect(const std::string& text, const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dtype,
             const std::vector<bool>& grads, std::vector<double> densities, double grad_density,
             std::vector<std::string>& out) {
  const RegionProgram& p = region_program(text);
  const auto sizes = sizes_of(p, shapes);
  if (densities.empty()) densities.assign(p.operands.size(), 1.0);
  SCORCH_CHECK(densities.size() == p.operands.size(), "scorch::region {}: {} densities for {} operands", p.title,
               densities.size(), p.operands.size());
  for (double d : densities)
    SCORCH_CHECK(d >= 0 && d <= 1, "scorch::region {}: a density must be in [0, 1], got {}", p.title, d);
  auto add = [&](std::string spec) {
    if (!spec.empty() && std::find(out.begin(), out.end(), spec) == out.end()) out.push_back(std::move(spec));
  };
  if (p.has_addends()) {  // run_region runs the product as a program of its own
    const RegionProgram& product = region_program(p.product_text);
    std::vector<std::vector<int64_t>> product_shapes;
    std::vector<double> product_densities;
    for (int k : p.product_operands) {
      product_shapes.push_back(shapes[static_cast<size_t>(k)]);
      product_densities.push_back(densities[static_cast<size_t>(k)]);
    }
    add(forward_spec(product, sizes_of(product, product_shapes), dtype, product_densities));
  } else {
    add(forward_spec(p, sizes, dtype, densities));
  }
  SCORCH_CHECK(grads.empty() || grads.size() == p.operands.size(), "scorch::region {}: {} gradient flags for {} operands",
               p.title, grads.size(), p.operands.size());
  std::vector<int64_t> out_shape;
  for (char c : p.out) out_shape.push_back(size_of(p, sizes, c));
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k] || !gradient_by_program(p.operands[k])) continue;
    const RegionGradient g = region_gradient(text, static_cast<int>(k));
    std::vector<std::vector<int64_t>> g_shapes;
    std::vector<double> g_densities;
    for (int j : g.operands) {
      g_shapes.push_back(j < 0 ? out_shape : shapes[static_cast<size_t>(j)]);
      g_densities.push_back(j < 0 ? grad_density : densities[static_cast<size_t>(j)]);
    }
    collect(g.text, g_shapes, dtype, {}, g_densities, 1.0, out);  // the backward's region call (no second derivative)
  }
}

}  // namespace

std::vector<std::string> region_kernel_specs(const std::string& text, const std::vector<std::vector<int64_t>>& shapes,
                                             at::ScalarType dtype, const std::vector<bool>& grads,
                                             const std::vector<double>& densities, double grad_density) {
  SCORCH_CHECK(grad_density >= 0 && grad_density <= 1, "scorch::region: a density must be in [0, 1], got {}",
               grad_density);
  std::vector<std::string> out;
  collect(text, shapes, dtype, grads, densities, grad_density, out);
  return out;
}

}  // namespace scorch::torch_glue
