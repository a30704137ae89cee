#include "runtime/target.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "common/hash.h"
#include "runtime/cpu_features.h"
#include "runtime/gather_probe.h"
#include "runtime/process.h"
#include "runtime/settings.h"

namespace scorch {
namespace {

std::mutex g_mu;
std::string g_chosen;  // set_target(); empty: the environment decides
std::atomic<uint64_t> g_epoch{1};  // kernel_config_epoch()

bool valid_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '+' || c == '-')) return false;
  return name[0] != '-';
}

std::string env_target() { return target_setting(); }

// Flags for a name, before knowing the machine: the compiler tells the architecture afterwards.
std::vector<std::string> flags_for(const std::string& name, bool aarch64_host) {
  if (name == "generic" || name == "scalar") return {};
  if (name == "native") return {aarch64_host ? "-mcpu=native" : "-march=native"};
  return {"-march=" + name};
}

// Instruction-set macros worth naming, and the feature they stand for.
const std::vector<std::pair<std::string, std::string>>& feature_macros() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"__SSE2__", "sse2"},         {"__SSE4_2__", "sse4.2"},       {"__AVX__", "avx"},
      {"__AVX2__", "avx2"},         {"__FMA__", "fma"},             {"__F16C__", "f16c"},
      {"__AVX512F__", "avx512f"},   {"__AVX512BW__", "avx512bw"},   {"__AVX512VL__", "avx512vl"},
      {"__AVX512DQ__", "avx512dq"}, {"__AVX512BF16__", "avx512bf16"}, {"__AVX512FP16__", "avx512fp16"},
      {"__ARM_NEON", "neon"},       {"__ARM_FEATURE_FMA", "fma"},   {"__ARM_FEATURE_SVE", "sve"},
      {"__ARM_FEATURE_SVE2", "sve2"}, {"__riscv_vector", "rvv"},
  };
  return m;
}

Target resolve_uncached(const std::string& name) {
  SCORCH_CHECK(valid_name(name),
               "bad Scorch target '{}' (SCORCH_TARGET, or a target given to the call): use native, generic, "
               "scalar or a compiler architecture name such as x86-64-v3 (letters, digits, '.', '_', '+', '-')",
               name);
#if defined(__aarch64__)
  const bool aarch64_host = true;
#else
  const bool aarch64_host = false;
#endif
  Target t;
  t.name = name;
  t.flags = flags_for(name, aarch64_host);
  auto argv = compiler_command();
  argv.insert(argv.end(), t.flags.begin(), t.flags.end());
  for (const char* a : {"-dM", "-E", "-x", "c++", "/dev/null"}) argv.push_back(a);
  std::string out;
  // The compile timeout bounds this probe too (helper-55: a hung compiler cost a fixed minute whatever a
  // smaller SCORCH_COMPILE_TIMEOUT said, then an error reading "exit -2").
  const double timeout = compiler_probe_timeout_seconds();
  const int rc = run_program(argv, out, timeout);
  SCORCH_CHECK_KIND(ErrorKind::runtime, rc != -2,
                    "scorch: the compiler ({}) timed out after {} s (SCORCH_COMPILE_TIMEOUT) working out target '{}'",
                    fmt::join(argv, " "), timeout, name);
  if (rc != 0 && t.flags.size() <= 1 && (name == "native" || name == "generic" || name == "scalar")) {
    // Not a bad name: the compiler itself does not work (CXX points nowhere, is not a C++ compiler, ...).
    throw_error(ErrorKind::runtime,
                fmt::format("scorch: compiling a kernel failed: the compiler ({}) does not run for target '{}' "
                            "(exit {}): {}", fmt::join(argv, " "), name, rc, out.substr(0, 400)));
  }
  SCORCH_CHECK(rc == 0, "the compiler does not accept Scorch target '{}' (SCORCH_TARGET, or a target given to the "
               "call; the compiler is CXX's) ({}): {}", name, fmt::join(argv, " "),
               out.substr(0, 400));
  // Every predefined macro, sorted: the fingerprint covers anything that can change the generated code.
  std::set<std::string> lines;
  std::set<std::string> defined;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("#define ", 0) != 0) continue;
    lines.insert(l);
    const auto end = l.find(' ', 8);
    defined.insert(l.substr(8, end == std::string::npos ? std::string::npos : end - 8));
  }
  auto has = [&](const char* m) { return defined.count(m) > 0; };
  if (has("__x86_64__")) t.arch = "x86_64";
  else if (has("__aarch64__")) t.arch = "aarch64";
  else if (has("__arm__")) t.arch = "arm";
  else if (has("__riscv")) t.arch = "riscv";
  else if (has("__powerpc64__")) t.arch = "ppc64";
  else t.arch = "unknown";
  for (const auto& [macro, feature] : feature_macros())
    if (has(macro.c_str()) && std::find(t.features.begin(), t.features.end(), feature) == t.features.end())
      t.features.push_back(feature);
  t.isa = isa_features_from_macros(defined);

  if (name == "scalar") {
    t.vector_bytes = 0;
  } else if (has("__AVX512F__")) {
    t.vector_bytes = 64;
  } else if (has("__AVX__")) {
    t.vector_bytes = 32;
  } else if (has("__SSE2__") || has("__ARM_NEON") || has("__ALTIVEC__")) {
    t.vector_bytes = 16;  // SVE code goes through NEON-width generic vectors
  } else {
    t.vector_bytes = 0;
  }
  // Gathers from scalar loads: where forced, or where the target's gather instruction (AVX2, AVX-512) runs on
  // this CPU and measured slower.
  const GatherMode gathers = gather_mode();
  const bool has_gather = t.arch == "x86_64" && std::string(host_arch()) == "x86_64" &&
                          (t.vector_bytes == 64 ? has("__AVX512F__") : t.vector_bytes == 32 && has("__AVX2__"));
  t.soft_gathers = t.vector_bytes > 0 && (gathers == GatherMode::soft ||
                                          (gathers == GatherMode::automatic && has_gather &&
                                           soft_gathers_faster(t.vector_bytes)));
  if (t.arch == "x86_64") t.vector_registers = has("__AVX512F__") ? 32 : 16;
  else if (t.arch == "aarch64" || t.arch == "ppc64") t.vector_registers = 32;
  else t.vector_registers = t.vector_bytes ? 16 : 0;

  std::string material = compiler_version() + "\n" + fmt::format("{}", fmt::join(t.flags, " ")) + "\n" +
                         (name == "scalar" ? "scalar\n" : "");
  for (const auto& l : lines) material += l + "\n";
  t.fingerprint = content_hash(material);
  return t;
}

// A target whose instruction-set features the CPU running this process lacks would compile kernels that die
// with SIGILL at their first vector instruction: refuse it by name instead. "native" is the reference.
// Both lists are compared: the vector features against what the compiler enables for native, and every
// feature the target's code may use (runtime/cpu_features.h: fma4, xop, sse4a, bmi2, ...) against the CPU
// itself, as a kernel bundle is checked; the short list alone let bdver1-4 (FMA4, XOP) through on a CPU
// without them.
void check_runnable(const Target& t, const Target& native) {
  std::vector<std::string> missing;
  for (const auto& f : t.features)
    if (std::find(native.features.begin(), native.features.end(), f) == native.features.end()) missing.push_back(f);
  for (const auto& f : check_cpu_features(t.isa).missing)
    if (std::find(missing.begin(), missing.end(), f) == missing.end()) missing.push_back(f);
  SCORCH_CHECK(missing.empty(),
               "Scorch target '{}' needs {} which this CPU does not have (it has: {}); kernels compiled for it "
               "would crash here. Pick a target this CPU runs, e.g. native",
               t.name, fmt::join(missing, ", "), fmt::join(native.features, " "));
}

}  // namespace

int Target::tile_vectors() const {
  if (vector_bytes == 0) return 0;
  // Half the registers hold accumulators, the rest the broadcast value, loads and addresses; more than 8
  // live accumulators buys nothing measurable on any CPU tried and makes the tile wider than common N.
  return std::clamp(vector_registers / 2, 2, 8);
}

std::string Target::summary() const {
  return fmt::format("{}: {} {}; {}", name, arch, fmt::join(features, " "),
                     vector_bytes ? fmt::format("{}-byte vectors x {} registers{}", vector_bytes, vector_registers,
                                                soft_gathers ? ", gathers from scalar loads" : "")
                                  : std::string("scalar code"));
}

Target resolve_target(const std::string& name) { return resolve_uncached(name); }

std::string target_name() {
  std::lock_guard lock(g_mu);
  return g_chosen.empty() ? env_target() : g_chosen;
}

const Target& current_target() {
  static std::mutex cache_mu;
  static std::map<std::tuple<std::string, std::vector<std::string>, GatherMode>, std::unique_ptr<Target>> cache;
  const std::string name = target_name();
  const auto key = std::make_tuple(name, compiler_command(), gather_mode());
  std::lock_guard lock(cache_mu);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto t = std::make_unique<Target>(resolve_uncached(name));
  if (name != "native") check_runnable(*t, resolve_uncached("native"));
  return *cache.emplace(key, std::move(t)).first->second;
}

uint64_t kernel_config_epoch() {
  static constexpr const char* kVars[] = {"SCORCH_TARGET", "SCORCH_GATHERS", "SCORCH_SANITIZE", "CXX"};
  static std::mutex mu;
  static std::string seen[4];
  static bool set[4] = {};
  const char* now[4];
  for (int i = 0; i < 4; ++i) now[i] = std::getenv(kVars[i]);
  std::lock_guard lock(mu);
  bool changed = false;
  for (int i = 0; i < 4; ++i) {
    if ((now[i] != nullptr) == set[i] && (!set[i] || seen[i] == now[i])) continue;
    changed = true;
    set[i] = now[i] != nullptr;
    seen[i] = set[i] ? now[i] : "";
  }
  if (changed) g_epoch.fetch_add(1);
  return g_epoch.load();
}

void set_target(const std::string& name) {
  if (!name.empty() && name != "native") check_runnable(resolve_uncached(name), resolve_uncached("native"));
  {
    std::lock_guard lock(g_mu);
    g_chosen = name;
    g_epoch.fetch_add(1);
  }
  if (!name.empty()) (void)current_target();
}

}  // namespace scorch
