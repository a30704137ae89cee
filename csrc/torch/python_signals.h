// Python's signal handlers, run from inside a long C++ wait (python_signals.cpp).
#pragma once

namespace scorch::torch_glue::python_signals {

// The runtime's interrupt check (runtime/process.h) for a Python process: runs pending signal handlers and
// throws what they raise (torch's python_error, which torch's bindings and Scorch's give back to Python).
void check();
// Installs check() as the runtime's interrupt check (with the GIL held, at the module's import).
void install();

}  // namespace scorch::torch_glue::python_signals
