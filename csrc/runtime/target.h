// The target the generated kernels are compiled for: the instruction set and what follows from it.
//
// A target is named (SCORCH_TARGET, or set_target() from Python): "native" (default: the CPU this process
// runs on), a compiler architecture name ("x86-64-v2", "x86-64-v3", "x86-64-v4", "znver3", "armv8.2-a", ...),
// "generic" (the compiler's baseline for the machine: SSE2 on x86-64, NEON on aarch64) or "scalar" (no
// vector code from Scorch; the compiler may still vectorize loops itself). The name is resolved by asking the
// compiler which macros it predefines under the target's flags; everything width-dependent in code
// generation (vector width, register tiles) is read from the result, and the kernel cache key includes a hash
// of those macros, so two CPUs sharing one cache each get their own kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lower/vector_shape.h"

namespace scorch {

struct Target {
  std::string name;                   // as chosen
  std::vector<std::string> flags;     // compiler flags that select it
  std::string arch;                   // "x86_64", "aarch64", ... (from the compiler's macros)
  std::vector<std::string> features;  // instruction-set features the compiler enables, e.g. "avx2", "fma"
  std::vector<std::string> isa;       // every feature of runtime/cpu_features.h it enables (bmi2, lzcnt, ...):
                                      // what a CPU must have to run its code; recorded in kernel bundles
  int vector_bytes = 0;               // width of the vectors generated code uses; 0: scalar code only
  int vector_registers = 0;           // architectural vector registers of that width
  // Indexed reads in vector loops build their vectors from scalar loads instead of the gather instruction
  // (SCORCH_GATHERS; by default where that measured faster on this CPU, runtime/gather_probe.h). It changes
  // the generated source, so the kernel cache key (a hash of the source) tells the two apart.
  bool soft_gathers = false;
  std::string fingerprint;            // hash of every macro the compiler predefines + its version

  // Lanes of a vector of elements of `elem_bytes` bytes (1 for scalar targets).
  int lanes(int elem_bytes) const { return vector_bytes > 0 ? vector_bytes / elem_bytes : 1; }
  // Vector accumulators a register tile keeps live (leaves room for operands and addresses).
  int tile_vectors() const;
  // The shape lowering sizes vectors and register tiles by (width, tile accumulators, registers).
  VectorShape vector_shape() const { return VectorShape{vector_bytes, tile_vectors(), vector_registers, soft_gathers}; }
  // "x86-64-v3: x86_64 avx avx2 fma ...; 32-byte vectors x 16 registers"
  std::string summary() const;
};

// The target in effect: the one set_target() chose, else SCORCH_TARGET, else "native". Resolved once per
// name and compiler (running the compiler once, ~20 ms). Throws a clear error for an unknown name.
const Target& current_target();

// The name in effect, without resolving it.
std::string target_name();

// Choose the target for kernels compiled from now on in this process ("" goes back to SCORCH_TARGET or
// "native"). The name is checked (letters, digits, '.', '_', '+', '-'; at most 64) and resolved here, so a
// name the compiler does not know fails now, not at the next kernel; so does a target whose instruction-set
// features this CPU lacks (its kernels would die of SIGILL): targets can go down from native, not up.
void set_target(const std::string& name);

// A number that changes whenever the kernel get_kernel() would give for a spec may change: a set_target()
// call, or a new value of SCORCH_TARGET, SCORCH_GATHERS, SCORCH_SANITIZE or CXX. A table that keeps kernels by
// spec (the kernel op's) compares it on each call and asks get_kernel() again when it moved: four getenv()
// and string compares, about 50 ns.
uint64_t kernel_config_epoch();

// Resolve a target by name without making it current (for tests and tools).
Target resolve_target(const std::string& name);

}  // namespace scorch
