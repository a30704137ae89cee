#include "runtime/jit.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "codegen/emit_cpp.h"
#include "common/error.h"
#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

extern char** environ;

namespace scorch {
namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int debug_level() { return std::atoi(env_or("SCORCH_DEBUG", "0").c_str()); }

// 128-bit FNV-1a (two 64-bit lanes with different offsets): a stable content hash for cache keys.
std::string content_hash(const std::string& data) {
  uint64_t h1 = 1469598103934665603ULL, h2 = 7809847782465536322ULL;
  for (unsigned char ch : data) {
    h1 = (h1 ^ ch) * 1099511628211ULL;
    h2 = (h2 ^ ch) * 1099511628211ULL + 0x9e3779b97f4a7c15ULL;
  }
  return fmt::format("{:016x}{:016x}", h1, h2);
}

void make_dirs(const std::string& path) {
  std::string at;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!at.empty()) ::mkdir(at.c_str(), 0755);
    }
    if (i < path.size()) at += path[i];
  }
  struct stat sb;
  SCORCH_CHECK(::stat(path.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode), "cannot create the kernel cache directory {}",
               path);
}

// Run argv[0] with the given arguments (no shell); returns the exit status and what it printed.
int run_program(const std::vector<std::string>& argv, std::string& output) {
  int fds[2];
  SCORCH_CHECK(::pipe(fds) == 0, "pipe() failed while starting the compiler");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    output = fmt::format("cannot start '{}': {}", argv[0], std::strerror(rc));
    return -1;
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) output.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string compiler() { return env_or("CXX", "c++"); }

const std::string& compiler_version() {
  static const std::string v = [] {
    std::string out;
    run_program({compiler(), "--version"}, out);
    return out.substr(0, out.find('\n'));
  }();
  return v;
}

std::vector<std::string> compile_command(const std::string& src, const std::string& lib) {
  return {compiler(), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w", "-o", lib, src};
}

void write_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << data;
    SCORCH_CHECK(f.good(), "cannot write {}", tmp);
  }
  SCORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename {} to {}", tmp, path);
}

bool exists(const std::string& path) { return ::access(path.c_str(), R_OK) == 0; }

struct Lowered {
  KernelSpec spec;
  Schedule schedule;
  LoweredKernel kernel;
  std::string source;
};

Lowered lower_spec(const std::string& text) {
  Lowered l{KernelSpec::parse(text), {}, {}, {}};
  l.schedule = make_schedule(l.spec);
  l.kernel = lower(l.spec, l.schedule);
  l.source = emit_cpp(l.spec, l.kernel);
  return l;
}

std::shared_ptr<CompiledKernel> build(const std::string& text) {
  const auto t0 = std::chrono::steady_clock::now();
  Lowered l = lower_spec(text);
  auto k = std::make_shared<CompiledKernel>();
  k->spec = text;
  k->statement = l.spec.stmt.str();
  k->schedule = l.schedule.str(l.spec.stmt);
  k->reasons = l.schedule.reasons;
  k->reasons.insert(k->reasons.end(), l.kernel.reasons.begin(), l.kernel.reasons.end());
  k->loop_ir = loops::print(l.kernel.body);
  k->sparse_output = l.kernel.sparse_output;
  k->sorted_output = l.schedule.output == OutputMode::append || l.schedule.output == OutputMode::workspace;
  k->sampled_operand = l.schedule.output == OutputMode::sampled ? l.schedule.sampled_tensor : -1;
  k->input_pointers = input_pointer_count(l.spec);

  const std::string dir = kernel_cache_dir();
  make_dirs(dir);
  const std::string probe_lib = "LIB";
  std::string key_material = l.source + "\n";
  for (const auto& a : compile_command("SRC", probe_lib)) key_material += a + " ";
  key_material += "\n" + compiler_version();
  const std::string key = content_hash(key_material);
  k->source_path = dir + "/" + key + ".cpp";
  k->library_path = dir + "/" + key + ".so";

  if (!exists(k->library_path)) {
    const std::string lock_path = dir + "/" + key + ".lock";
    const int fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR, 0644);
    SCORCH_CHECK(fd >= 0, "cannot open the kernel cache lock {}", lock_path);
    ::flock(fd, LOCK_EX);
    try {
      if (!exists(k->library_path)) {  // another process may have built it while we waited
        write_atomically(k->source_path, l.source);
        const std::string tmp_lib = fmt::format("{}.tmp.{}.so", k->library_path, ::getpid());
        std::string output;
        const int rc = run_program(compile_command(k->source_path, tmp_lib), output);
        if (rc != 0) {
          ::unlink(tmp_lib.c_str());
          throw_error(ErrorKind::runtime, fmt::format("scorch: compiling a kernel failed (exit {}).\nsource: {}\n"
                                                      "compiler said:\n{}",
                                                      rc, k->source_path, output));
        }
        SCORCH_CHECK(::rename(tmp_lib.c_str(), k->library_path.c_str()) == 0, "cannot move {} into the cache",
                     tmp_lib);
        k->compiled = true;
      }
    } catch (...) {
      ::flock(fd, LOCK_UN);
      ::close(fd);
      throw;
    }
    ::flock(fd, LOCK_UN);
    ::close(fd);
  }
  void* handle = ::dlopen(k->library_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) throw_error(ErrorKind::runtime, fmt::format("scorch: cannot load kernel {}: {}", k->library_path, ::dlerror()));
  k->fn = reinterpret_cast<KernelFn>(::dlsym(handle, "scorch_kernel"));
  k->free_fn = reinterpret_cast<KernelFreeFn>(::dlsym(handle, "scorch_kernel_free"));
  SCORCH_CHECK(k->fn && k->free_fn, "kernel library {} lacks the scorch_kernel entry points", k->library_path);
  k->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  if (debug_level() >= 1) {
    std::string msg = fmt::format("[scorch] kernel {}\n  index notation: {}\n  spec: {}\n  schedule: {}\n", key,
                                  k->statement, k->spec, k->schedule);
    for (const auto& r : k->reasons) msg += "    - " + r + "\n";
    msg += fmt::format("  {} in {:.3f} s; source: {}\n", k->compiled ? "compiled" : "loaded from cache", k->seconds,
                       k->source_path);
    msg += "  loop IR:\n" + loops::print(l.kernel.body, 2);
    std::fputs(msg.c_str(), stderr);
  }
  return k;
}

}  // namespace

std::string kernel_cache_dir() {
  if (const char* d = std::getenv("SCORCH_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/scorch";
  return env_or("HOME", "/tmp") + "/.cache/scorch";
}

std::shared_ptr<const CompiledKernel> get_kernel(const std::string& spec) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const CompiledKernel>> cache;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(spec);
    if (it != cache.end()) return it->second;
  }
  auto k = build(spec);  // outside the lock: compiling takes a while; a duplicate build is harmless
  std::lock_guard lock(mu);
  return cache.emplace(spec, std::move(k)).first->second;
}

std::string kernel_source(const std::string& spec) { return lower_spec(spec).source; }

}  // namespace scorch
