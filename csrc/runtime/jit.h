// The JIT: kernel spec -> schedule -> loop IR -> C++ -> shared object, cached on disk and in the process.
// The disk cache (SCORCH_CACHE_DIR, default $XDG_CACHE_HOME/scorch or ~/.cache/scorch) is keyed by a hash of
// the source, the full compiler command and the target's fingerprint (every macro the compiler predefines for
// the target, and its version); files are written under a temporary name
// and renamed into place while a per-key file lock is held, so processes may share it.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "codegen/kernel_abi.h"

namespace scorch {

struct CompiledKernel {
  std::string spec;
  std::string statement;        // readable index notation
  std::string schedule;         // one line
  std::vector<std::string> reasons;
  std::string loop_ir;
  std::string source_path, library_path;
  bool sparse_output = false;
  bool sorted_output = false;   // sparse output arrives sorted in storage order, without repeats
  int sampled_operand = -1;     // >= 0: the sparse output has this operand's pattern; the caller passes a
                                // zeroed values array of its size as out_dense and reuses its index buffers
  int input_pointers = 0;
  double seconds = 0;           // time to get it: codegen + compile, or codegen + load
  bool compiled = false;        // false: loaded from the disk cache
  std::string target;           // the target it was compiled for (runtime/target.h)
  KernelFn fn = nullptr;
  KernelFreeFn free_fn = nullptr;
};

std::string kernel_cache_dir();

// The kernel for a spec (see lower/kernel_spec.h), built at most once per process.
std::shared_ptr<const CompiledKernel> get_kernel(const std::string& spec);

// The C++ source a spec compiles to (no compiling), for tests and debugging.
std::string kernel_source(const std::string& spec);

}  // namespace scorch
