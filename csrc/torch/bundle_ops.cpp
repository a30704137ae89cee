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

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  // Returns the number of kernels the bundle holds (all of them are then available).
  m.def("load_kernels(str path) -> int", &load_kernels);
}

}  // namespace scorch::torch_glue
