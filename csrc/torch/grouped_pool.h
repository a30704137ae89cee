// Warm blocks for the grouped products' large results (a weight gradient of every expert, one per training step).
#pragma once

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// A contiguous tensor, uninitialised, like at::empty. A large one (a few MB and up) takes its memory from a small
// pool of blocks that tensors of this kind gave back when they died, instead of from the system: a block the
// system hands out is new pages, faulted in and zeroed by the kernel on first touch, which for the mixture of
// experts' weight gradient (16 experts x 512 x 1024 floats, 32 MB, past malloc's largest mmap threshold, so
// unmapped when freed) cost more than the products that fill it (16 ms against 5.6 ms, one thread).
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace scorch::torch_glue
