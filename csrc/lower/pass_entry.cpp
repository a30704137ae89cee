// Pass: entry. The argument unpacking (kernel_frame.h: named buffers, sizes, strides, the dense output)
// before the kernel's body.
#include "lower/kernel_frame.h"
#include "lower/passes.h"

namespace scorch::passes {

void entry(KernelIR& k) {
  if (k.native) return;
  loops::Stmts b = unpack_arguments(*k.spec);
  b.insert(b.end(), k.body.begin(), k.body.end());
  k.body = std::move(b);
}

}  // namespace scorch::passes
