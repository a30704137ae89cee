#include "common/error.h"

namespace scorch {

std::string valid_utf8(const std::string& text) {
  // The length of the well-formed sequence at i (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF),
  // or 0.
  auto sequence = [&](size_t i) -> size_t {
    const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
    const unsigned char c = b(i);
    if (c < 0x80) return 1;
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    if (i + n > text.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
    for (size_t k = 2; k < n; ++k)
      if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
    return n;
  };
  size_t i = 0;
  while (i < text.size() && sequence(i) > 0) i += sequence(i);
  if (i == text.size()) return text;  // the common case: no copy beyond the caller's
  std::string out = text.substr(0, i);
  while (i < text.size()) {
    const size_t n = sequence(i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    } else {
      out.append(text, i, n);
      i += n;
    }
  }
  return out;
}

void throw_error(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

void throw_assert(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(ErrorKind::runtime,
              fmt::format("scorch internal error: {} ({}:{}, failed: {}). Please report it.", msg, file, line, cond));
}

}  // namespace scorch
