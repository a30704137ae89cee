// Errors of the C++ core. User mistakes (bad shapes, bad buffers, bad format strings) are raised with
// SCORCH_CHECK and carry a kind that the Python binding maps to ValueError or TypeError;
// broken internal invariants use SCORCH_ASSERT and surface as RuntimeError. No torch header here.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace scorch {

enum class ErrorKind { value, type, runtime, memory };  // memory: Python's MemoryError

// `text` with every byte that does not belong to a well-formed UTF-8 sequence replaced by U+FFFD. Messages
// carry bytes from outside (a compiler's output in any locale, cut at a byte count; dlerror() text; file
// names), and Python decodes an exception's message as UTF-8: one stray byte turned the error into a
// UnicodeDecodeError that hid it (helper-55).
std::string valid_utf8(const std::string& text);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(valid_utf8(what)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] void throw_error(ErrorKind kind, const std::string& msg);
[[noreturn]] void throw_assert(const char* cond, const char* file, int line, const std::string& msg);

}  // namespace scorch

// SCORCH_CHECK(cond, "fmt {}", args...) raises a ValueError-kind error. The _KIND form picks the kind.
#define SCORCH_CHECK_KIND(kind, cond, ...)                                  \
  do {                                                                      \
    if (!(cond)) ::scorch::throw_error((kind), ::fmt::format(__VA_ARGS__)); \
  } while (0)
#define SCORCH_CHECK(cond, ...) SCORCH_CHECK_KIND(::scorch::ErrorKind::value, cond, __VA_ARGS__)
#define SCORCH_CHECK_TYPE(cond, ...) SCORCH_CHECK_KIND(::scorch::ErrorKind::type, cond, __VA_ARGS__)
#define SCORCH_ASSERT(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) ::scorch::throw_assert(#cond, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)
