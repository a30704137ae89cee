// --- Ctrl-C during a compile -------------------------------------------------------------------------------
// A kernel's compile (up to SCORCH_COMPILE_TIMEOUT, 300 s) and the wait for another process's compile of it
// run without the GIL, so Python's handlers for SIGINT and SIGTERM ran only when they ended (helper-61). The
// runtime calls this check every 50-100 ms while it waits. Python runs handlers in the main thread only, so
// the check does nothing elsewhere; a handler that raises (KeyboardInterrupt) ends the compile: the compiler
// is stopped, its output removed and the lock released before the exception reaches Python.
#include "python_signals.h"

#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>

namespace scorch::torch_glue::python_signals {

void check() {
  if (!Py_IsInitialized()) return;
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return;
  python_error err;
  err.persist();
  throw std::move(err);
}

}  // namespace scorch::torch_glue::python_signals
