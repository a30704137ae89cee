// The kernel ABI: one struct and the status codes, defined once here and pasted verbatim into every
// generated kernel, so the runtime and the kernels cannot disagree. Kernels export
//   extern "C" int scorch_kernel(scorch_kernel_args*);   // SCORCH_STATUS_OK (0) on success
//   extern "C" void scorch_kernel_free(void*);           // frees out_coords / out_vals
// Inputs are raw pointers in the order lower.h describes; a sparse output comes back as coordinates
// (row-major [ndim][out_nnz]) and values allocated by the kernel, in any order, possibly repeated.
//
// Kernels trust no index value: every coordinate read from a crd buffer is compared with its dimension's
// extent before it is used (at each load, or for a whole segment before the loop that reads it) and every
// pos segment is clamped to the crd buffer it points into (lengths[] gives the buffers'
// lengths; a caller that passes null vouches for them, and the kernel takes them from the pos buffers). A
// coordinate or segment out of range is replaced by a harmless one and the call returns
// SCORCH_STATUS_BAD_INDEX: the caller then finds and reports the offending buffer.
#pragma once

#include <cstdint>

#define SCORCH_KERNEL_ABI                                                                  \
  enum scorch_kernel_status {                                                              \
    SCORCH_STATUS_OK = 0,                                                                  \
    SCORCH_STATUS_NO_MEMORY = 1, /* an allocation inside the kernel failed */              \
    SCORCH_STATUS_BAD_INDEX = 2  /* an index buffer holds a value out of range */          \
  };                                                                                       \
  struct scorch_kernel_args {                                                              \
    void* const* inputs;   /* operand buffers */                                           \
    const int64_t* sizes;  /* extent of each index variable */                             \
    const int64_t* strides; /* strided operands' strides (row-major: kernels derive them) */ \
    void* out_dense;       /* dense output, zero-filled by the caller */                   \
    int64_t out_nnz;       /* sparse output: number of entries */                          \
    int64_t* out_coords;   /* sparse output: coordinates [ndim][out_nnz], kernel-allocated */ \
    void* out_vals;        /* sparse output: values, kernel-allocated */                   \
    int32_t num_threads;                                                                   \
    int32_t status;        /* a scorch_kernel_status; nonzero: the kernel failed */        \
    const int64_t* lengths; /* entries of each input buffer, in input order (or null) */   \
  };

#define SCORCH_STRINGIFY_(...) #__VA_ARGS__
#define SCORCH_STRINGIFY(...) SCORCH_STRINGIFY_(__VA_ARGS__)

namespace scorch {
SCORCH_KERNEL_ABI
inline constexpr const char* kKernelAbiSource = SCORCH_STRINGIFY(SCORCH_KERNEL_ABI);
using KernelFn = int (*)(scorch_kernel_args*);
using KernelFreeFn = void (*)(void*);
}  // namespace scorch
