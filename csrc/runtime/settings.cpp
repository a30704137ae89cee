#include "runtime/settings.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "common/error.h"

namespace scorch {
namespace {

// The variable's value with surrounding blanks removed; empty when unset.
std::string raw(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return "";
  std::string s(v);
  const auto b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\n\r");
  return s.substr(b, e - b + 1);
}

// A parse cached per distinct value of one variable.
template <typename T, typename Parse>
T cached(const char* name, Parse parse) {
  static std::mutex mu;
  static std::string last_text = "\x01unset";
  static T last_value{};
  const std::string text = raw(name);
  std::lock_guard lock(mu);
  if (text != last_text) {
    last_value = parse(text);  // throws for a bad value, leaving the cache as it was
    last_text = text;
  }
  return last_value;
}

}  // namespace

DispatchMode dispatch_mode() {
  return cached<DispatchMode>("SCORCH_DISPATCH", [](const std::string& v) {
    if (v.empty() || v == "auto") return DispatchMode::automatic;
    if (v == "sparse") return DispatchMode::sparse;
    if (v == "dense") return DispatchMode::dense;
    throw_error(ErrorKind::value, fmt::format("SCORCH_DISPATCH='{}': expected one of auto, sparse, dense", v));
  });
}

const char* dispatch_mode_name(DispatchMode m) {
  switch (m) {
    case DispatchMode::sparse: return "sparse";
    case DispatchMode::dense: return "dense";
    default: return "auto";
  }
}

std::optional<double> dense_crossover_override() {
  return cached<std::optional<double>>("SCORCH_DENSE_CROSSOVER", [](const std::string& v) -> std::optional<double> {
    if (v.empty()) return std::nullopt;
    // Plain decimal notation only, the grammar config.py checks too (helper-55: "0x0.8" passed here as hex and
    // failed in Python; "5e-324" the other way): digits, a point, an exponent.
    size_t i = 0, digits = 0;
    auto run = [&] {
      size_t n = 0;
      for (; i < v.size() && v[i] >= '0' && v[i] <= '9'; ++i) ++n;
      return n;
    };
    digits += run();
    if (i < v.size() && v[i] == '.') ++i, digits += run();
    bool plain = digits > 0;
    if (plain && i < v.size() && (v[i] == 'e' || v[i] == 'E')) {
      ++i;
      if (i < v.size() && (v[i] == '+' || v[i] == '-')) ++i;
      plain = run() > 0;
    }
    const double x = plain && i == v.size() ? std::strtod(v.c_str(), nullptr) : NAN;
    if (!(x > 0.0 && x <= 1.0))
      throw_error(ErrorKind::value, fmt::format("SCORCH_DENSE_CROSSOVER='{}': expected a density, a number greater "
                                                "than 0 and at most 1 (e.g. 0.3)", v));
    return x;
  });
}

int debug_level() {
  return cached<int>("SCORCH_DEBUG", [](const std::string& v) {
    if (v.empty()) return 0;
    bool digits = v.size() <= 9;
    for (char c : v) digits = digits && c >= '0' && c <= '9';
    if (!digits)
      throw_error(ErrorKind::value, fmt::format("SCORCH_DEBUG='{}': expected a non-negative integer (0 = quiet, 1 = "
                                                "print decisions and plans, 2 = more)", v));
    return std::stoi(v);
  });
}

// A switch that is on unless set to "0"; `meaning` says what 1 and 0 do, for the error.
static bool parse_switch(const char* name, const std::string& v, const char* meaning) {
  if (v.empty() || v == "1") return true;
  if (v == "0") return false;
  throw_error(ErrorKind::value, fmt::format("{}='{}': expected {}", name, v, meaning));
}

bool jit_enabled() {
  return cached<bool>("SCORCH_JIT", [](const std::string& v) {
    return parse_switch("SCORCH_JIT", v, "1 (compile kernels no loaded bundle holds, the default) or 0 (kernels "
                                         "from loaded bundles only)");
  });
}

bool measure_regions() {
  return cached<bool>("SCORCH_MEASURE", [](const std::string& v) {
    return parse_switch("SCORCH_MEASURE", v, "1 (time a region's sparse and dense paths on its first call and keep "
                                             "the faster, the default) or 0");
  });
}

int64_t thread_grain() {
  return cached<int64_t>("SCORCH_THREAD_GRAIN", [](const std::string& v) -> int64_t {
    if (v.empty()) return int64_t{2048};
    bool digits = v.size() <= 12;
    for (char c : v) digits = digits && c >= '0' && c <= '9';
    if (!digits || std::stoll(v) < 1)
      throw_error(ErrorKind::value, fmt::format("SCORCH_THREAD_GRAIN='{}': expected a positive integer, the elements "
                                                "a call must touch per thread it starts (default 2048)", v));
    return std::stoll(v);
  });
}

double compiler_probe_timeout_seconds() {
  const double t = compile_timeout_seconds();
  return t > 0 ? std::min(t, 60.0) : 60.0;
}

double compile_timeout_seconds() {
  return cached<double>("SCORCH_COMPILE_TIMEOUT", [](const std::string& v) {
    if (v.empty()) return 300.0;
    // strtod also takes "inf", "nan" and hex; only plain decimal numbers are meant here.
    const bool plain = v.find_first_not_of("0123456789.") == std::string::npos;
    char* end = nullptr;
    errno = 0;
    const double t = plain ? std::strtod(v.c_str(), &end) : NAN;
    if (!plain || end != v.c_str() + v.size() || errno != 0 || !std::isfinite(t) || t < 0 || t > 1e6)
      throw_error(ErrorKind::value, fmt::format("SCORCH_COMPILE_TIMEOUT='{}': expected a number of seconds (e.g. 300; "
                                                "0 = no limit)", v));
    return t;
  });
}

bool sanitize_kernels() {
  return cached<bool>("SCORCH_SANITIZE", [](const std::string& v) {
    if (v.empty() || v == "0") return false;
    if (v == "1") return true;
    throw_error(ErrorKind::value, fmt::format("SCORCH_SANITIZE='{}': expected 0 or 1 (1 = compile kernels with "
                                              "-fsanitize=address,undefined)", v));
  });
}

GatherMode gather_mode() {
  return cached<GatherMode>("SCORCH_GATHERS", [](const std::string& v) {
    if (v.empty() || v == "auto") return GatherMode::automatic;
    if (v == "hardware") return GatherMode::hardware;
    if (v == "soft") return GatherMode::soft;
    throw_error(ErrorKind::value, fmt::format("SCORCH_GATHERS='{}': expected one of auto, hardware, soft", v));
  });
}

std::string target_setting() {
  const std::string v = raw("SCORCH_TARGET");
  return v.empty() ? "native" : v;
}

std::string path_setting(const char* name) {
  static constexpr const char* kPaths[] = {"SCORCH_CACHE_DIR", "SCORCH_DUMP_DIR", "SCORCH_KERNEL_BUNDLES"};
  bool known = false;
  for (const char* k : kPaths) known = known || std::string(k) == name;
  SCORCH_ASSERT(known, "path_setting: {} is not one of Scorch's path variables", name);
  const char* v = std::getenv(name);
  if (raw(name).empty()) return "";  // blanks only: unset, as for the other variables (not a folder named " ")
  return v;
}

namespace {
std::atomic<LogSink> g_log_sink{nullptr};
}  // namespace

void set_log_sink(LogSink sink) { g_log_sink.store(sink); }

void log_message(int level, const char* name, const std::string& text) {
  if (LogSink sink = g_log_sink.load()) {
    sink(level, name, text);
    return;
  }
  std::string line = "[scorch] " + text;
  if (line.empty() || line.back() != '\n') line += '\n';
  std::fputs(line.c_str(), stderr);
}

}  // namespace scorch
