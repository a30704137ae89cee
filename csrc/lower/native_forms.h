// Statement forms with a lowering of their own, tried before the general Lowerer: each entry recognises
// a statement over particular level kinds (a BSR operand times a dense one, ...) and emits a kernel that
// walks those levels natively. A form that does not match costs one call; the first match wins.
#pragma once

#include <optional>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

namespace scorch {

// The kernel of the first native form that matches the spec, or nothing (the general Lowerer runs).
std::optional<LoweredKernel> lower_native_form(const KernelSpec& spec, const Schedule& schedule,
                                               const VectorShape& machine);

}  // namespace scorch
