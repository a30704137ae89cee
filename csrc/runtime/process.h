// Running the C++ compiler: the command it is (CXX, split into words like a shell would, without a shell),
// and running a program with arguments, no shell, capturing what it prints.
#pragma once

#include <string>
#include <vector>

namespace scorch {

// The compiler command: $CXX split on whitespace (quotes are not interpreted), or "c++".
std::vector<std::string> compiler_command();

// Run argv (argv[0] looked up on PATH), stdout and stderr captured into `output`. Returns the exit status,
// or -1 when the program could not be started or did not exit normally (then `output` says why).
// timeout_seconds > 0: the program is killed after that long and -2 is returned.
int run_program(const std::vector<std::string>& argv, std::string& output, double timeout_seconds = 0);

// A check for a request to stop (Ctrl-C, SIGTERM) while a compile, or a wait for another process's compile,
// goes on: the Python module installs one that runs Python's signal handlers and throws what they raise (the
// loops run without the GIL, so a KeyboardInterrupt waited for the end of a compile of up to 300 s, or 610 s
// of waiting for a stopped process's lock; helper-61). None by default (a C++ program without Python).
using InterruptCheck = void (*)();
void set_interrupt_check(InterruptCheck check);
void check_interrupt();  // calls the installed check, if any (it may throw)

// The first line the compiler prints for --version (cached per compiler command).
std::string compiler_version();

}  // namespace scorch
