// Kernel bundles: kernels compiled ahead of time into one file, loaded with no compiler (docs/deploy.md).
//
// A bundle is one file: a header line, a text manifest and a shared library.
//   SCORCH-KERNEL-BUNDLE 1 <manifest bytes> <library bytes> <content hash of manifest + library>\n
//   <manifest><library>
// The manifest records the target (architecture, name, vector shape, the instruction-set features its code
// needs), the compiler, and per kernel its spec and the hash of the C++ source Scorch generated for it. The
// library holds every kernel under a name of its own and an index table (scorch_bundle_index) tying each
// entry point to its spec.
//
// Loading reads the file once, checks the header's sizes and hash, the manifest's form, the architecture,
// the CPU's instruction-set features (before any of the library's code is mapped), and that this Scorch
// generates the same source for every spec (so a bundle from another version or lowering is refused, not
// run); then it loads those same bytes (through a sealed memfd, or a private copy in the kernel cache
// directory), checks the index table against the manifest and registers the kernels, which get_kernel()
// then returns before any JIT is tried. Every refusal is a ValueError saying why.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/jit.h"

namespace scorch {

struct BundleKernel {
  std::string spec;
  std::string source_hash;  // content_hash of the generated C++ source
};

struct BundleInfo {
  std::string path;
  std::string arch, target, target_flags, compiler, command;
  int vector_bytes = 0, tile_vectors = 0, vector_registers = 0;
  bool soft_gathers = false;     // its kernels build indexed vectors from scalar loads (Target::soft_gathers)
  std::vector<std::string> isa;  // instruction-set features the code needs (runtime/cpu_features.h)
  std::vector<BundleKernel> kernels;
  size_t file_bytes = 0, library_bytes = 0;
  std::string content_hash;  // of manifest + library, as the header records it
  std::string manifest;      // the manifest's text
};

// Compiles the kernels of `specs` (repeats dropped, order kept) for a target ("" = the current one, else
// a target name; it need not run on this CPU, the bundle is for another machine then) and writes the bundle
// to `path` atomically. `workers` compiles run at once. Needs the compiler; ignores SCORCH_JIT.
BundleInfo build_kernel_bundle(const std::vector<std::string>& specs, const std::string& path,
                               const std::string& target_name = "", int workers = 2);

// Reads and checks a bundle as loading does, without loading it: throws a ValueError saying why it is
// refused (damaged, another format version, another architecture, an instruction set this CPU lacks, kernels
// this Scorch generates differently).
BundleInfo inspect_kernel_bundle(const std::string& path);

// Checks and loads a bundle and registers its kernels. Returns the number of kernels it holds. Loading the
// same bytes again does nothing more; a spec already registered by an earlier bundle keeps that kernel.
int load_kernel_bundle(const std::string& path);

// The same for a bundle already in memory (e.g. an extra file of a TorchScript archive); `name` stands for
// its path in messages and in bundled_kernels().
int load_kernel_bundle_bytes(const std::string& bytes, const std::string& name);

// SCORCH_KERNEL_BUNDLES: bundle files separated by ':', loaded (each path once per process, in order) the first
// time get_kernel misses the registry; so a program that never calls load_kernels (a generic TorchScript
// server with libscorch_ops loaded) gets them too. Throws the load's error, naming the variable.
void load_bundles_from_environment();

// The kernel a loaded bundle registered for this spec, or null.
std::shared_ptr<const CompiledKernel> find_bundled_kernel(const std::string& spec);

// (spec, bundle path) of every registered kernel, in registration order.
std::vector<std::pair<std::string, std::string>> bundled_kernels();

// "no kernel bundle is loaded" or "2 bundles loaded, 14 kernels", for messages.
std::string bundle_summary();

// The bundle's header and manifest checks on bytes in memory (for tests): returns the parsed manifest or
// throws the error loading would raise. No instruction-set or source-hash check.
BundleInfo parse_kernel_bundle(const std::string& bytes, const std::string& path, std::string* library = nullptr);

// dlopen()s library bytes as loading does: through a sealed memfd, or (memfd = false, or when that fails) a
// private copy in the kernel cache directory. `how` says which. For tests of both routes.
void* load_bundle_library_for_test(const std::string& library, const std::string& name, bool memfd, std::string& how);

}  // namespace scorch
