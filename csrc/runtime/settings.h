// Settings the run-time path reads from the environment, parsed strictly in one place (the Python package's
// config.py mirrors these messages for the variables only Python reads). Each reader looks at the variable
// on every call, because tests and users change it while a process runs; parsing is cached per distinct
// value, so a call costs one getenv and a string compare.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace scorch {

enum class DispatchMode { automatic, sparse, dense };

// SCORCH_DISPATCH: auto (default) | sparse | dense. Anything else is a ValueError naming the variable.
DispatchMode dispatch_mode();
const char* dispatch_mode_name(DispatchMode m);

// SCORCH_DENSE_CROSSOVER: a density in (0, 1] overriding the calibrated crossover, or none when unset.
std::optional<double> dense_crossover_override();

// SCORCH_DEBUG: 0 (default) quiet, 1 decisions and plans, 2 and up more. Anything but a non-negative
// integer is a ValueError naming the variable.
int debug_level();

// SCORCH_JIT: 1 (default) compiles kernels no loaded bundle holds; 0 forbids it (no compiler, no disk cache:
// kernels come from loaded bundles only). Anything else is a ValueError naming the variable.
bool jit_enabled();

// SCORCH_MEASURE: 1 (default) times a region's sparse and dense paths on its first real call at each size and
// keeps the faster (under SCORCH_DISPATCH=auto), and does the same for an eager einsum whose density is near
// the crossover (executor.cpp); 0 trusts the density rule alone. Anything else is a
// ValueError naming the variable.
bool measure_regions();

// SCORCH_THREAD_GRAIN: elements a call must touch per thread it starts (default 2048; 1 = always every
// thread, which the test suite uses to exercise the parallel code on small inputs). A positive integer, else
// a ValueError naming the variable.
int64_t thread_grain();

// SCORCH_COMPILE_TIMEOUT: seconds a kernel compile may take before it is stopped (default 300; 0 = no limit).
// Anything but a plain non-negative decimal number is a ValueError naming the variable.
double compile_timeout_seconds();
// The limit of a compiler's quick answers (its version, its predefined macros for a target): the compile
// timeout, and at most 60 s.
double compiler_probe_timeout_seconds();

// SCORCH_SANITIZE: 1 compiles kernels with -fsanitize=address,undefined; 0 (default) does not.
bool sanitize_kernels();

// SCORCH_GATHERS: how vector code reads elements through an index (x[crd[p]] in a row's sum): auto (default:
// vectors built from scalar loads where that measured faster than the CPU's gather instruction when the target
// was resolved, runtime/gather_probe.h) | hardware (the compiler's gather instructions) | soft (vectors built
// from scalar loads). Anything else is a ValueError naming the variable.
enum class GatherMode { automatic, hardware, soft };
GatherMode gather_mode();

// SCORCH_TARGET: the kernel target's name as set ("native" when unset); target.cpp checks it.
std::string target_setting();

// A path variable as set (not trimmed: a path may hold blanks), "" when unset or blanks only: SCORCH_CACHE_DIR (the kernel
// cache), SCORCH_DUMP_DIR (where SCORCH_DEBUG=2 writes), SCORCH_KERNEL_BUNDLES (bundles to load, ':'-separated).
std::string path_setting(const char* name);

// Messages for the `scorch` logger: `name` is its child ("kernel", "bundle"), `level` one of Python
// logging's (10 DEBUG, 20 INFO, 30 WARNING). Without a sink, as in a C++ program, they go to stderr prefixed
// "[scorch] ". The Python package installs a sink that queues them for `logging`. A sink must not block
// and must not throw: it is called from compile workers and inside the kernel cache's critical sections.
using LogSink = void (*)(int level, const char* name, const std::string& text);
void set_log_sink(LogSink sink);
void log_message(int level, const char* name, const std::string& text);

}  // namespace scorch
