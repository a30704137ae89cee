// The frame of a kernel around its loop nest: unpacking the ABI arguments into named pointers and sizes,
// and the thread region with what each output mode needs per thread (output streams, private dense copies,
// row workspaces) and after it (summing private copies, joining streams).
#pragma once

#include "lower/kernel_spec.h"
#include "lower/loop_ir.h"
#include "lower/schedule.h"

namespace scorch {

// Named views of the arguments: t<T>_pos<l>, t<T>_crd<l>, t<T>_vals, t<T>_data with strides t<T>_st<d>,
// index sizes N<v>, and the dense output `out` with strides os<d> and out_numel.
loops::Stmts unpack_arguments(const KernelSpec& spec);

// The thread region around `nest` (which writes through `o`, `st` or the workspace), and the code after it.
loops::Stmts thread_frame(const KernelSpec& spec, const Schedule& sched, const loops::Stmts& nest, bool parallel);

}  // namespace scorch
