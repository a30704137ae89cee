#include "lower/native_forms.h"

#include "lower/assemble.h"
#include "lower/blocked.h"
#include "lower/nm.h"
#include "lower/sampled_dot.h"

namespace scorch {

std::optional<LoweredKernel> lower_native_form(const KernelSpec& spec, const Schedule& schedule,
                                               const VectorShape& machine) {
  // A blocked operand in a form the block kernels cover is walked block by block (blocked.h).
  if (auto m = match_blocked(spec.stmt, spec.operands, spec.output)) return lower_blocked(spec, schedule, *m, machine);
  // An n:m operand times a dense one is walked group by group, by its masks (nm.h).
  if (auto m = match_nm(spec.stmt, spec.operands, spec.output)) return lower_nm(spec, schedule, *m, machine);
  // A CSR result of a product or a sum of CSR operands is assembled by the kernel (assemble.h).
  if (auto m = match_assembled(spec)) return lower_assembled(spec, schedule, *m, machine);
  if (auto m = match_sampled_dot(spec, schedule, machine)) return lower_sampled_dot(spec, schedule, *m, machine);
  return std::nullopt;
}

}  // namespace scorch
