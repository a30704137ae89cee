// The JIT: kernel spec -> schedule -> loop IR -> C++ -> shared object, cached on disk and in the process.
// The disk cache (SCORCH_CACHE_DIR, default $XDG_CACHE_HOME/scorch or ~/.cache/scorch) is keyed by a hash of
// the source, the full compiler command (with the sanitizer flags when SCORCH_SANITIZE=1) and the target's
// fingerprint (every macro the compiler predefines for the target, and its version). An entry is KEY.so and
// its manifest KEY.json (key, spec, target, command, the library's size and content hash). Nothing on disk
// is trusted: before an entry is loaded its bytes are read, hashed and checked against the manifest, and the
// checked bytes are what gets loaded (through a private copy); an entry that does not match is rebuilt.
// Building happens under a per-key file lock (close-on-exec), compiles are bounded by SCORCH_COMPILE_TIMEOUT,
// files are written under temporary names and renamed into place, and temporaries of dead processes are
// removed when the lock is taken. See docs/cache.md.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "codegen/kernel_abi.h"
#include "lower/vector_shape.h"

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
  bool overwrites_output = false;  // dense output: every element stored once, never read (need not be zeroed)
  bool assembled_output = false;   // sparse output returned as the format's own buffers (lower/assemble.h)
  bool workspace_output = false;   // sparse output collected per thread in a dense workspace over its last index
                                   // (OutputMode::workspace), allocated whatever the data
  int sampled_operand = -1;     // >= 0: the sparse output has this operand's pattern; the caller passes a
                                // zeroed values array of its size as out_dense and reuses its index buffers
  int sampled_buffers = 0;      // how many of them: all, or those of the leading levels the output shares
                                // (OutputMode::fibers: the values are a dense block under each of their positions)
  bool sampled_fibers = false;  // OutputMode::fibers: the values count follows the output's own dense levels,
                                // not the operand's (their buffer counts agree when the levels below have none)
  int input_pointers = 0;
  double seconds = 0;           // time to get it: codegen + compile, or codegen + load
  bool compiled = false;        // false: loaded from the disk cache
  std::string target;           // the target it was compiled for (runtime/target.h)
  VectorShape vector_shape;     // the vector width, tile and registers its code was lowered for
  KernelFn fn = nullptr;
  KernelFreeFn free_fn = nullptr;
};

std::string kernel_cache_dir();

// The kernel for a spec (see lower/kernel_spec.h), built at most once per process. Kernels registered by a
// loaded bundle (runtime/bundle.h; those SCORCH_KERNEL_BUNDLES lists are loaded at the first miss) are
// returned first, without resolving the target or touching the disk
// cache; with SCORCH_JIT=0 nothing else is tried, and a spec no bundle holds is a RuntimeError naming it.
std::shared_ptr<const CompiledKernel> get_kernel(const std::string& spec);

// Whether get_kernel(spec) can give a kernel without failing for want of a compiler: a loaded bundle holds it,
// or the JIT may compile (SCORCH_JIT is not 0). Callers with a fallback (a dense path) use it to avoid a
// kernel that a deployment without the JIT does not have.
bool kernel_available(const std::string& spec);

// Every spec get_kernel has returned a kernel for in this process (JIT or bundle), in first-use order: what a
// bundle for this workload must hold.
std::vector<std::string> used_kernel_specs();

// The same, bypassing the in-process cache: the disk cache is consulted (and verified) on every call, and each
// call loads a library of its own. For tests and tools.
std::shared_ptr<const CompiledKernel> get_kernel_uncached(const std::string& spec);

// The C++ source a spec compiles to (no compiling), for tests and debugging.
std::string kernel_source(const std::string& spec);

}  // namespace scorch
