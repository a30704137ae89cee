// Forward-mode AD (torch.func.jvp / jacfwd, torch.autograd.forward_ad dual tensors) is not derived for
// Scorch's ops. A dual input sets no requires_grad, so the Autograd kernels would run the op below autograd
// and the tangent would be dropped without a word (a zero Jacobian); each Autograd kernel refuses instead.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace scorch::torch_glue {

inline void refuse_forward_ad(const char* op, at::TensorList inputs) {
  for (const auto& t : inputs)
    TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || !t._fw_grad(/*level=*/0).defined(), op,
                                ": forward-mode AD (torch.func.jvp, jacfwd, forward_ad dual tensors) is not "
                                "supported; use reverse mode (backward() or torch.autograd.grad)");
}

}  // namespace scorch::torch_glue
