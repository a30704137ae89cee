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
#include "common/hash.h"
#include "common/error.h"
#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"
#include "runtime/process.h"
#include "runtime/target.h"

namespace scorch {
namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int debug_level() { return std::atoi(env_or("SCORCH_DEBUG", "0").c_str()); }

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

std::vector<std::string> compile_command(const Target& target, const std::string& src, const std::string& lib) {
  std::vector<std::string> cmd = compiler_command();
  cmd.push_back("-O3");
  cmd.insert(cmd.end(), target.flags.begin(), target.flags.end());
  for (const char* a : {"-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w", "-o"}) cmd.push_back(a);
  cmd.push_back(lib);
  cmd.push_back(src);
  return cmd;
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

Lowered lower_spec(const std::string& text, const Target& target) {
  Lowered l{KernelSpec::parse(text), {}, {}, {}};
  l.schedule = make_schedule(l.spec);
  l.kernel = lower(l.spec, l.schedule, VectorShape{target.vector_bytes, target.tile_vectors()});
  l.source = emit_cpp(l.spec, l.kernel, target.vector_bytes);
  return l;
}

std::shared_ptr<CompiledKernel> build(const std::string& text, const Target& target) {
  const auto t0 = std::chrono::steady_clock::now();
  Lowered l = lower_spec(text, target);
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
  // The key names the machine code, not the flag text: the target's fingerprint hashes every macro the
  // compiler predefines for it (so "native" on two CPUs gives two keys) and the compiler's version.
  std::string key_material = l.source + "\n";
  for (const auto& a : compile_command(target, "SRC", probe_lib)) key_material += a + " ";
  key_material += "\n" + target.fingerprint;
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
        const int rc = run_program(compile_command(target, k->source_path, tmp_lib), output);
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
  k->target = target.name;
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
  const Target& target = current_target();
  const std::string key = target.fingerprint + "\n" + spec;  // a new target in this process: new kernels
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto k = build(spec, target);  // outside the lock: compiling takes a while; a duplicate build is harmless
  std::lock_guard lock(mu);
  return cache.emplace(key, std::move(k)).first->second;
}

std::string kernel_source(const std::string& spec) { return lower_spec(spec, current_target()).source; }

}  // namespace scorch
