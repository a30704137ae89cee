// Instruction-set features of compiled code, named from the macros the compiler predefines for a target
// (when kernels are built) and checked on the CPU that runs this process (when a kernel bundle is loaded,
// with no compiler at hand). A bundle whose code needs a feature this CPU lacks is refused by name instead of
// dying of SIGILL at its first such instruction.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace scorch {

// The architecture this library was built for: "x86_64", "aarch64", ... (the names Target::arch uses).
const char* host_arch();

// The features the table knows among the predefined macros `defined` (names such as "avx2", "bmi2",
// "avx512f", "neon", "sve"), in table order. These are the features code generation can make use of.
std::vector<std::string> isa_features_from_macros(const std::set<std::string>& defined);

struct IsaCheck {
  std::vector<std::string> missing;  // features this CPU lacks
  std::vector<std::string> unknown;  // names this build cannot check on this architecture
};

// Checks each feature on the running CPU (cpuid with the OS's register-state support on x86-64, the
// kernel's hwcaps on aarch64). Needs no compiler.
IsaCheck check_cpu_features(const std::vector<std::string>& features);

}  // namespace scorch
