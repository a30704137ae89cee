// The passes of the lowering pipeline (pipeline.h runs them in order, docs/loop_ir.md). Each pass is a file
// and takes the kernel's IR as the pass before left it:
//   pass_iterate.cpp   iteration: one loop per index variable from its merge lattice (co-iteration, linear
//                      merges), the values summed into the output's sink, register tiles, the thread's share
//   pass_vectorize.cpp vectorisation: reductions over contiguous operands into vector accumulators
//   pass_output.cpp    output assembly: what each output mode needs around the nest (dense pointer or private
//                      copy, streams, workspace) and after the threads (summing copies, joining streams)
//   pass_parallel.cpp  parallelisation: the thread region, the thread count, the bad-index flag, the status
//   pass_entry.cpp     entry: argument unpacking (named buffers, sizes, strides) before everything
// Kernels of a native form (native_forms.h) come out of the first pass complete; the others leave them be.
#pragma once

#include <string>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/loop_ir.h"
#include "lower/schedule.h"

namespace scorch::passes {

// One kernel on its way through the pipeline: its regions as far as the passes have built them.
struct KernelIR {
  const KernelSpec* spec = nullptr;
  const Schedule* sched = nullptr;
  VectorShape machine;
  loops::Stmts nest;      // iteration: one thread's loop nest (it writes through `o`, `st` or the workspace)
  loops::Stmts setup;     // output assembly: before the thread region
  loops::Stmts thread;    // output assembly: one thread's part, the nest inside
  loops::Stmts teardown;  // output assembly: after the thread region
  loops::Stmts body;      // parallelisation and entry (or a native form): the kernel entry's body
  bool parallel = false;  // iteration: the nest takes its thread's share, so the region runs many threads
  bool native = false;    // a native form made the whole kernel (body); the general passes leave it
  LoweredKernel facts;    // reasons, sparse_output, overwrites_output (its body is filled at the end)

  // The IR as C++ text, region by region (for dumps and golden tests).
  std::string str() const;
};

void native_forms(KernelIR& k);
void iterate(KernelIR& k);
void vectorize(KernelIR& k);
void output_assembly(KernelIR& k);
void parallelize(KernelIR& k);
void entry(KernelIR& k);

}  // namespace scorch::passes
