// scorch::load_kernels: load a kernel bundle (runtime/bundle.h, docs/deploy.md) and register its kernels, so
// scorch::kernel and scorch::region find them before any JIT is tried. Usable from Python
// (torch.ops.scorch.load_kernels), TorchScript and C++ (through the dispatcher) with no Python in the process.
#include <torch/library.h>

#include "convert.h"
#include "runtime/bundle.h"

namespace scorch::torch_glue {
namespace {

int64_t load_kernels(c10::string_view path) {
  return translate_errors([&] { return static_cast<int64_t>(load_kernel_bundle(std::string(path))); });
}

// The bundle's bytes as a 1-D uint8 tensor: a bundle kept inside a model (an extra file of its TorchScript
// archive, or a buffer).
int64_t load_kernel_bytes(const at::Tensor& data, c10::string_view name) {
  return translate_errors([&] {
    SCORCH_CHECK_TYPE(data.scalar_type() == at::kByte, "load_kernel_bytes: data must be uint8, got {}",
                      c10::toString(data.scalar_type()));
    SCORCH_CHECK(data.dim() == 1 && data.device().is_cpu(), "load_kernel_bytes: data must be a 1-D CPU tensor");
    const at::Tensor c = data.contiguous();
    const std::string bytes(static_cast<const char*>(c.const_data_ptr()), static_cast<size_t>(c.numel()));
    return static_cast<int64_t>(load_kernel_bundle_bytes(bytes, std::string(name)));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  // Both return the number of kernels the bundle holds (all of them are then available).
  m.def("load_kernels(str path) -> int", &load_kernels);
  m.def("load_kernel_bytes(Tensor data, str name) -> int", &load_kernel_bytes);
}

}  // namespace scorch::torch_glue
