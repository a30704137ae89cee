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

#include <atomic>

#include "runtime/process.h"

namespace scorch::torch_glue::python_signals {
namespace {
std::atomic<unsigned long> main_thread{0};  // Python's main thread (PyThread_get_thread_ident)
}  // namespace

// Only Python's main thread runs signal handlers, and only it takes the GIL here: a compile worker (precompile,
// an autograd thread) never does. The GIL is taken while this thread holds the key's lock of the kernel it
// compiles; every Scorch entry point that may compile releases the GIL first (python_module.cpp), so no
// thread waits for that lock while holding the GIL.
void check() {
  if (!Py_IsInitialized() || PyThread_get_thread_ident() != main_thread.load()) return;
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return;
  python_error err;
  err.persist();
  throw std::move(err);
}

void install() {
  main_thread.store(pybind11::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  scorch::set_interrupt_check(&check);
}

}  // namespace scorch::torch_glue::python_signals
