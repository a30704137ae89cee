// A tensor's version counter as the operand checks and caches read it.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace scorch::torch_glue {

// t's version counter, or -1 when it has none (an inference tensor, made under torch.inference_mode). A write to
// such a tensor cannot be seen, so a caller treats -1 as "changed": it validates again and caches nothing.
inline int64_t version_of(const at::Tensor& t) { return t.is_inference() ? -1 : static_cast<int64_t>(t._version()); }

}  // namespace scorch::torch_glue
