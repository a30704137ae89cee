// The kernel ABI: one struct, defined once here and pasted verbatim into every generated kernel, so the
// runtime and the kernels cannot disagree. Kernels export
//   extern "C" int scorch_kernel(scorch_kernel_args*);   // 0 on success
//   extern "C" void scorch_kernel_free(void*);           // frees out_coords / out_vals
// Inputs are raw pointers in the order lower.h describes; a sparse output comes back as coordinates
// (row-major [ndim][out_nnz]) and values allocated by the kernel, in any order, possibly repeated.
#pragma once

#include <cstdint>

#define SCORCH_KERNEL_ABI                                                                  \
  struct scorch_kernel_args {                                                              \
    void* const* inputs;   /* operand buffers */                                           \
    const int64_t* sizes;  /* extent of each index variable */                             \
    const int64_t* strides; /* strided operands' strides (row-major: kernels derive them) */ \
    void* out_dense;       /* dense output, zero-filled by the caller */                   \
    int64_t out_nnz;       /* sparse output: number of entries */                          \
    int64_t* out_coords;   /* sparse output: coordinates [ndim][out_nnz], kernel-allocated */ \
    void* out_vals;        /* sparse output: values, kernel-allocated */                   \
    int32_t num_threads;                                                                   \
    int32_t status;        /* nonzero: the kernel failed (out of memory) */                \
  };

#define SCORCH_STRINGIFY_(x) #x
#define SCORCH_STRINGIFY(x) SCORCH_STRINGIFY_(x)

namespace scorch {
SCORCH_KERNEL_ABI
inline constexpr const char* kKernelAbiSource = SCORCH_STRINGIFY(SCORCH_KERNEL_ABI);
using KernelFn = int (*)(scorch_kernel_args*);
using KernelFreeFn = void (*)(void*);
}  // namespace scorch
