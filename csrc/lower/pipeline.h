// The lowering pipeline: a kernel spec and its schedule through the passes of passes.h, in order, to the
// loop IR of the kernel entry. With a dump sink, the IR after each pass is handed to it (SCORCH_DEBUG=2
// writes them to files: runtime/jit.cpp, docs/loop_ir.md).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lower/lower.h"
#include "lower/passes.h"

namespace scorch {

struct PipelinePass {
  const char* name;
  void (*run)(passes::KernelIR&);
};

// The passes in the order they run (native forms first).
const std::vector<PipelinePass>& pipeline_passes();

// Called after each pass with its number (1-based), its name and the IR's text.
using PassDump = std::function<void(int number, const std::string& pass, const std::string& ir)>;

// Runs the passes; `native_forms` false skips the first (the general lowering alone, lower_general).
// `stop_after` > 0 stops after that many passes (tests of one pass), leaving the IR as it then is.
passes::KernelIR run_pipeline(const KernelSpec& spec, const Schedule& schedule, const VectorShape& machine,
                              const PassDump& dump = nullptr, bool native_forms = true, int stop_after = 0);

// Writes each pass's IR to <dir>/<kernel>.<NN>-<pass>.txt (`kernel`: a name for the kernel, e.g. a hash of
// its spec); creates dir. Returns the dump sink for run_pipeline.
PassDump dump_to_folder(const std::string& dir, const std::string& kernel, const std::string& spec_text);

}  // namespace scorch
