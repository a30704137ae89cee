// A cursor over text for the hand-written parsers (format strings, index notation): skips blanks, matches
// characters and scans names. Parsers derive from it and add their own grammar and error reporting.
#pragma once

#include <cctype>
#include <string>

namespace scorch {

class TextCursor {
 public:
  explicit TextCursor(const std::string& s) : s_(s) {}

  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  // Skips blanks, then consumes `c` if it comes next.
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool done() {
    skip();
    return i_ == s_.size();
  }
  // Skips blanks, then scans [A-Za-z_][A-Za-z0-9_]*; returns "" and stays put when no name starts here.
  std::string name() {
    skip();
    if (i_ >= s_.size() || !(std::isalpha(static_cast<unsigned char>(s_[i_])) || s_[i_] == '_')) return "";
    const size_t b = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '_')) ++i_;
    return s_.substr(b, i_ - b);
  }
  size_t at() const { return i_; }
  void rewind(size_t i) { i_ = i; }

 protected:
  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace scorch
