// The program texts of regions and chains (JSON the backend writes): a small reader and a string writer. Errors
// name the op whose program is malformed (ValueError in Python).
#pragma once

#include <map>
#include <string>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"

namespace scorch::torch_glue::json {

struct Json;
using JsonArray = std::vector<Json>;
using JsonObject = std::map<std::string, Json>;
struct Json {
  std::variant<std::nullptr_t, bool, double, std::string, JsonArray, JsonObject> v;
};

class JsonReader {
 public:
  explicit JsonReader(const std::string& s, const char* op = "scorch::region") : s_(s), op_(op) {}
  Json document() {
    Json j = value(0);
    skip();
    check(p_ == s_.size(), "trailing text");
    return j;
  }

 private:
  void check(bool ok, const char* what) const {
    SCORCH_CHECK(ok, "{}: malformed program text ({} at character {})", op_, what, p_);
  }
  void skip() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\t' || s_[p_] == '\r')) ++p_;
  }
  bool eat(char c) {
    skip();
    if (p_ < s_.size() && s_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  Json value(int depth) {
    check(depth < 32, "nesting too deep");
    skip();
    check(p_ < s_.size(), "unexpected end");
    const char c = s_[p_];
    if (c == '{') {
      ++p_;
      JsonObject o;
      if (eat('}')) return Json{o};
      do {
        skip();
        std::string k = string();
        check(eat(':'), "':' expected");
        o[k] = value(depth + 1);
      } while (eat(','));
      check(eat('}'), "'}' expected");
      return Json{o};
    }
    if (c == '[') {
      ++p_;
      JsonArray a;
      if (eat(']')) return Json{a};
      do a.push_back(value(depth + 1));
      while (eat(','));
      check(eat(']'), "']' expected");
      return Json{a};
    }
    if (c == '"') return Json{string()};
    if (s_.compare(p_, 4, "true") == 0) return p_ += 4, Json{true};
    if (s_.compare(p_, 5, "false") == 0) return p_ += 5, Json{false};
    if (s_.compare(p_, 4, "null") == 0) return p_ += 4, Json{nullptr};
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(s_.substr(p_, 32), &used);
    } catch (const std::exception&) {
      check(false, "value expected");
    }
    p_ += used;
    return Json{d};
  }
  std::string string() {
    check(p_ < s_.size() && s_[p_] == '"', "string expected");
    ++p_;
    std::string out;
    while (true) {
      check(p_ < s_.size(), "unterminated string");
      const char c = s_[p_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      check(p_ < s_.size(), "unterminated escape");
      const char e = s_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          check(p_ + 4 <= s_.size(), "short \\u escape");
          unsigned cp = std::stoul(s_.substr(p_, 4), nullptr, 16);
          p_ += 4;
          if (cp >= 0xD800 && cp < 0xDC00 && p_ + 6 <= s_.size() && s_[p_] == '\\' && s_[p_ + 1] == 'u') {
            const unsigned lo = std::stoul(s_.substr(p_ + 2, 4), nullptr, 16);
            p_ += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          // UTF-8
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default: check(false, "bad escape");
      }
    }
  }
  const std::string& s_;
  const char* op_;
  size_t p_ = 0;
};

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20) out += fmt::format("\\u{:04x}", c);
    else out += static_cast<char>(c);
  }
  return out + "\"";
}

template <typename T>
const T& as(const Json& j, const char* what, const char* op = "scorch::region") {
  const T* p = std::get_if<T>(&j.v);
  SCORCH_CHECK(p != nullptr, "{}: malformed program text ({})", op, what);
  return *p;
}

inline const Json* field(const JsonObject& o, const char* name) {
  auto it = o.find(name);
  return it == o.end() ? nullptr : &it->second;
}

}  // namespace scorch::torch_glue::json
