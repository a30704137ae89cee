#include "runtime/jit.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "codegen/emit_cpp.h"
#include "codegen/emit_grouped.h"
#include "common/hash.h"
#include "common/error.h"
#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/pipeline.h"
#include "lower/schedule.h"
#include "runtime/bundle.h"
#include "runtime/fileio.h"
#include "runtime/jit_internal.h"
#include "runtime/process.h"
#include "runtime/settings.h"
#include "runtime/target.h"

namespace scorch {
namespace {

using fileio::all_digits;
using fileio::json_string;
using fileio::make_dirs;
using fileio::move_into_place;
using fileio::read_regular_file;
using fileio::write_atomically;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// What the environment asks of the JIT, read on every get_kernel (tests and users change it at run time):
// settings.cpp parses each variable strictly, so a typo is an error that names it.
struct Settings {
  int debug = 0;           // SCORCH_DEBUG
  double timeout = 300;    // SCORCH_COMPILE_TIMEOUT, seconds; 0: no limit
  bool sanitize = false;   // SCORCH_SANITIZE
};

Settings read_settings() { return {debug_level(), compile_timeout_seconds(), sanitize_kernels()}; }

// A kernel built with -fsanitize=address can only be loaded into a process that runs the ASan runtime (an
// ASan build, or LD_PRELOAD of libasan); elsewhere the runtime aborts the process inside dlopen.
bool asan_runtime_present() { return ::dlsym(RTLD_DEFAULT, "__asan_init") != nullptr; }

const std::vector<std::string>& sanitize_flags() {
  static const std::vector<std::string> f = {"-fsanitize=address,undefined", "-fno-omit-frame-pointer"};
  return f;
}

std::vector<std::string> compile_command(const Target& target, bool sanitize, const std::string& src,
                                         const std::string& lib) {
  std::vector<std::string> cmd = compiler_command();
  cmd.push_back("-O3");
  cmd.insert(cmd.end(), target.flags.begin(), target.flags.end());
  if (sanitize) cmd.insert(cmd.end(), sanitize_flags().begin(), sanitize_flags().end());
  for (const char* a : {"-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w", "-o"}) cmd.push_back(a);
  cmd.push_back(lib);
  cmd.push_back(src);
  return cmd;
}

// What a cache entry must be: written when the kernel is built, and checked (text for text) before an entry
// is loaded. The library's size and content hash tie the manifest to the bytes; the key, spec and target tie
// it to the kernel asked for.
struct Manifest {
  std::string key, spec, target_fingerprint, target_name, command;
  std::string text(const std::string& library) const {
    return fmt::format(
        "{{\n  \"format\": \"scorch-kernel-1\",\n  \"key\": {},\n  \"library_bytes\": {},\n  \"library_hash\": {},\n"
        "  \"spec\": {},\n  \"target\": {},\n  \"target_fingerprint\": {},\n  \"command\": {}\n}}\n",
        json_string(key), library.size(), json_string(content_hash(library)), json_string(spec),
        json_string(target_name), json_string(target_fingerprint), json_string(command));
  }
};

// The raw value after "name": in a manifest (a number, or a string with its quotes), for messages and for
// the recorded size; "" when absent.
std::string manifest_field(const std::string& text, const std::string& name) {
  const std::string tag = "\"" + name + "\": ";
  const auto at = text.find(tag);
  if (at == std::string::npos) return "";
  const auto b = at + tag.size();
  auto e = text.find_first_of(",\n", b);
  return text.substr(b, e == std::string::npos ? std::string::npos : e - b);
}

constexpr size_t kMaxLibraryBytes = size_t(1) << 30;
constexpr size_t kMaxManifestBytes = size_t(1) << 20;

// Checks the entry against its manifest. Returns "" and the library's bytes when it is exactly what was
// built for this key; otherwise why it is not to be trusted ("absent" when there is no entry at all).
std::string verify_entry(const std::string& lib_path, const std::string& manifest_path, const Manifest& m,
                         std::string& library) {
  library.clear();
  std::string manifest;
  if (!read_regular_file(manifest_path, kMaxManifestBytes, manifest)) {
    struct stat sb;
    const bool lib_there = ::lstat(lib_path.c_str(), &sb) == 0, manifest_there = ::lstat(manifest_path.c_str(), &sb) == 0;
    if (!lib_there && !manifest_there) return "absent";
    return manifest_there ? "its manifest is not a readable file" : "it has no manifest";
  }
  const std::string size_text = manifest_field(manifest, "library_bytes");
  if (!all_digits(size_text) || size_text.size() > 12) return "its manifest is garbled (no library_bytes)";
  const off_t recorded = static_cast<off_t>(std::stoll(size_text));
  errno = 0;
  if (!read_regular_file(lib_path, kMaxLibraryBytes, library, recorded)) {
    const int read_errno = errno;
    struct stat sb;
    if (::lstat(lib_path.c_str(), &sb) != 0) return "its library is missing";
    if (!S_ISREG(sb.st_mode)) return "its library is not a regular file";
    if (sb.st_size == recorded && static_cast<size_t>(recorded) > kMaxLibraryBytes)
      return fmt::format("its library is {} bytes, over the {}-byte limit of a kernel library", recorded,
                         kMaxLibraryBytes);
    if (sb.st_size == recorded)
      return fmt::format("its library cannot be read ({})", read_errno ? std::strerror(read_errno) : "unknown reason");
    return fmt::format("its library is {} bytes, the manifest records {}", sb.st_size, recorded);
  }
  if (manifest == m.text(library)) {
    const std::string damaged = fileio::elf_problem(library);  // bytes that match a manifest made to match them
    if (damaged.empty()) return "";
    library.clear();
    return "its library is damaged: " + damaged;
  }
  const std::string reason =
      manifest_field(manifest, "key") != json_string(m.key) ? "its manifest is for another kernel (key differs)"
      : manifest_field(manifest, "library_hash") != json_string(content_hash(library))
          ? "its library's content hash differs from the manifest's"
          : "its manifest does not match this kernel (spec, target or command differ, or it is garbled)";
  library.clear();
  return reason;
}

bool process_gone(long pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

// Removes this key's temporaries left by processes that died mid-build or mid-load: KEY.so.tmp.PID.so,
// KEY.cpp.tmp.PID, KEY.json.tmp.PID (written only under the key's lock, which the caller holds) and
// KEY.load.PID.N.so. A temporary goes when its process is gone, or, for the ones written under the lock, when
// it is older than the compile timeout (its PID may have been reused, or belong to another machine or
// container sharing the cache). Returns what was removed.
std::vector<std::string> remove_orphans(const std::string& dir, const std::string& key, double timeout) {
  std::vector<std::string> removed;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return removed;
  const auto now = std::chrono::system_clock::now();
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, key.size() + 1, key + ".") != 0) continue;
    const std::string rest = name.substr(key.size() + 1);
    bool locked_kind = true;
    std::string pid_text;
    for (const char* prefix : {"so.tmp.", "cpp.tmp.", "json.tmp.", "load."}) {
      if (rest.rfind(prefix, 0) != 0) continue;
      locked_kind = std::strcmp(prefix, "load.") != 0;
      pid_text = rest.substr(std::strlen(prefix));
      pid_text = pid_text.substr(0, pid_text.find('.'));
      break;
    }
    if (!all_digits(pid_text) || pid_text.size() > 9) continue;
    const std::string path = dir + "/" + name;
    bool orphan = process_gone(std::stol(pid_text));
    struct stat sb;
    if (!orphan && locked_kind && timeout > 0 && ::lstat(path.c_str(), &sb) == 0) {
      const auto mtime = std::chrono::system_clock::from_time_t(sb.st_mtime);
      orphan = std::chrono::duration<double>(now - mtime).count() > timeout;
    }
    if (orphan && ::unlink(path.c_str()) == 0) removed.push_back(name);
  }
  ::closedir(d);
  return removed;
}

// The per-key lock: an exclusive flock on KEY.lock, held while an entry is checked, built and published.
// The descriptor is close-on-exec, so the compiler (and anything it leaves running) never holds it. A holder
// compiles for at most the compile timeout; one that holds the lock much longer is stopped (Ctrl-Z) or hung,
// so waiting ends after twice the timeout plus 10 s with an error naming the lock (no limit when the timeout
// is 0, as compiles then have none either).
// The descriptors of the key locks this process holds, for a child forked meanwhile: it inherits them
// (O_CLOEXEC closes them on exec only), and the lock stays held as long as any holder's descriptor is open,
// so a child that outlived its killed parent kept the key locked and every later process waited 610 s
// (helper-46). The child closes them first thing (pthread_atfork). Slots, not a locked set: at a fork another
// thread may hold any mutex for good in the child.
constexpr int kLockSlots = 64;
std::atomic<int> held_lock_fds[kLockSlots];

void close_held_locks_in_child() {
  for (auto& slot : held_lock_fds) {
    const int fd = slot.exchange(-1);
    if (fd >= 0) ::close(fd);
  }
}

void note_held_lock(int fd) {
  static const bool registered = [] {
    for (auto& slot : held_lock_fds) slot.store(-1);
    return pthread_atfork(nullptr, nullptr, close_held_locks_in_child) == 0;
  }();
  (void)registered;
  for (auto& slot : held_lock_fds) {
    int empty = -1;
    if (slot.compare_exchange_strong(empty, fd)) return;
  }  // (more than 64 at once: that one is not closed in a child)
}

void forget_held_lock(int fd) {
  for (auto& slot : held_lock_fds) {
    int mine = fd;
    if (slot.compare_exchange_strong(mine, -1)) return;
  }
}

class KeyLock {
 public:
  KeyLock(const std::string& path, double compile_timeout) {
    // Not through a symbolic link, as the entries' files are not (a link to /dev/null was taken as the lock).
    fd_ = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0644);
    const int open_err = errno;
    SCORCH_CHECK_KIND(ErrorKind::runtime, fd_ >= 0, "cannot open the kernel cache lock {}: {}{}", path,
                      std::strerror(open_err),
                      open_err == EISDIR  ? " (a directory is in the way: remove it)"
                      : open_err == ELOOP ? " (a symbolic link is in the way: remove it)"
                                          : "");
    // Noted from the open on: a child forked while this waits for the lock would share it once taken
    // (helper-47: the same hang as a child forked during the compile).
    note_held_lock(fd_);
    const double limit = compile_timeout > 0 ? 2 * compile_timeout + 10 : 0;
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::milliseconds(5);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK) {
        forget_held_lock(fd_);
        ::close(fd_);
        throw_error(ErrorKind::runtime, fmt::format("cannot lock {}: {}", path, std::strerror(err)));
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (limit > 0 && waited > limit) {
        forget_held_lock(fd_);
        ::close(fd_);
        throw_error(ErrorKind::runtime,
                    fmt::format("another process has held the kernel cache lock {} for {:.0f} s, longer than a "
                                "compile may take (twice SCORCH_COMPILE_TIMEOUT + 10 s): it is stopped or hung. End "
                                "it, or use another cache (SCORCH_CACHE_DIR)",
                                path, waited));
      }
      try {
        check_interrupt();  // (Ctrl-C while another process compiles, or is stopped holding the lock)
      } catch (...) {
        forget_held_lock(fd_);
        ::close(fd_);
        throw;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
    }
  }
  ~KeyLock() {
    forget_held_lock(fd_);
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  KeyLock(const KeyLock&) = delete;
  KeyLock& operator=(const KeyLock&) = delete;

 private:
  int fd_ = -1;
};

Lowered lower_spec(const std::string& text, const Target& target) {
  return scorch::lower_spec(text, target.vector_shape());
}

// Compiles the source into the cache under the held lock; returns the library's bytes. The library is
// published before its manifest: a reader between the two renames sees a mismatch and waits for the lock.
std::string compile_into_cache(const std::string& source, const std::vector<std::string>& cmd_for_tmp,
                               const std::string& tmp_lib, const std::string& source_path,
                               const std::string& lib_path, const std::string& manifest_path, const Manifest& m,
                               double timeout) {
  write_atomically(source_path, source);
  std::string output;
  int rc = 0;
  try {
    rc = run_program(cmd_for_tmp, output, timeout);
  } catch (...) {  // interrupted: the compiler was stopped; what it wrote goes
    ::unlink(tmp_lib.c_str());
    throw;
  }
  if (rc != 0) {
    ::unlink(tmp_lib.c_str());
    if (rc == -2)
      throw_error(ErrorKind::runtime,
                  fmt::format("scorch: compiling a kernel timed out after {} s and the compiler was killed "
                              "(SCORCH_COMPILE_TIMEOUT sets the limit in seconds, 300 by default; 0 = none).\n"
                              "source: {}\ncompiler said so far:\n{}",
                              timeout, source_path, output));
    throw_error(ErrorKind::runtime, fmt::format("scorch: compiling a kernel failed (exit {}).\nsource: {}\n"
                                                "compiler said:\n{}",
                                                rc, source_path, output));
  }
  std::string library;
  if (!read_regular_file(tmp_lib, kMaxLibraryBytes, library)) {
    ::unlink(tmp_lib.c_str());
    throw_error(ErrorKind::runtime, fmt::format("scorch: the compiler reported success but {} is unreadable", tmp_lib));
  }
  move_into_place(tmp_lib, lib_path);
  write_atomically(manifest_path, m.text(library));
  return library;
}

std::shared_ptr<CompiledKernel> build(const std::string& text, const Target& target, const Settings& settings) {
  const auto t0 = std::chrono::steady_clock::now();
  Lowered l = lower_spec(text, target);
  auto k = std::make_shared<CompiledKernel>();
  describe_kernel(l, text, *k);

  const std::string dir = kernel_cache_dir();
  make_dirs(dir);
  // The key names the machine code, not the flag text: the target's fingerprint hashes every macro the
  // compiler predefines for it (so "native" on two CPUs gives two keys) and the compiler's version. The
  // command includes the sanitizer flags, so sanitized and plain kernels never share an entry.
  std::string command;
  for (const auto& a : compile_command(target, settings.sanitize, "SRC", "LIB")) command += a + " ";
  const std::string key = content_hash(l.source + "\n" + command + "\n" + target.fingerprint);
  k->source_path = dir + "/" + key + ".cpp";
  k->library_path = dir + "/" + key + ".so";
  const std::string manifest_path = dir + "/" + key + ".json";
  const Manifest m{key, text, target.fingerprint, target.name, command};

  std::vector<std::string> log;
  std::string library;
  std::string why = verify_entry(k->library_path, manifest_path, m, library);
  if (!why.empty()) {
    KeyLock lock(dir + "/" + key + ".lock", settings.timeout);
    for (const auto& name : remove_orphans(dir, key, settings.timeout)) log.push_back("removed orphan " + name);
    why = verify_entry(k->library_path, manifest_path, m, library);  // another process may have built it
    if (!why.empty()) {
      if (why != "absent") log.push_back("cache entry not trusted, rebuilt: " + why);
      const std::string tmp_lib = fmt::format("{}.tmp.{}.so", k->library_path, ::getpid());
      library = compile_into_cache(l.source, compile_command(target, settings.sanitize, k->source_path, tmp_lib),
                                   tmp_lib, k->source_path, k->library_path, manifest_path, m, settings.timeout);
      k->compiled = true;
    }
  }
  // A verified entry proves only that its files agree with each other: a library the compiler made without
  // the entry points (a CXX wrapper that built something else), or one that does not load, is rebuilt once
  // under the key's lock instead of failing at every later load (helper-55). A library just compiled that
  // fails the same way is the compiler's problem, and the error says so.
  auto load = [&]() -> std::string {
    void* handle = nullptr;
    try {
      handle = fileio::load_private_copy(dir, key, library, "kernel " + k->library_path);
    } catch (const Error& e) {
      if (k->compiled) throw;
      return e.what();
    }
    k->fn = reinterpret_cast<KernelFn>(::dlsym(handle, "scorch_kernel"));
    k->free_fn = reinterpret_cast<KernelFreeFn>(::dlsym(handle, "scorch_kernel_free"));
    if (k->fn && k->free_fn) return "";
    SCORCH_CHECK(!k->compiled, "kernel library {} lacks the scorch_kernel entry points (compiled with: {})",
                 k->library_path, command);
    ::dlclose(handle);
    return "its library lacks the scorch_kernel entry points";
  };
  if (const std::string failed = load(); !failed.empty()) {
    KeyLock lock(dir + "/" + key + ".lock", settings.timeout);
    log.push_back("cache entry did not load, rebuilt: " + failed);
    const std::string tmp_lib = fmt::format("{}.tmp.{}.so", k->library_path, ::getpid());
    library = compile_into_cache(l.source, compile_command(target, settings.sanitize, k->source_path, tmp_lib),
                                 tmp_lib, k->source_path, k->library_path, manifest_path, m, settings.timeout);
    k->compiled = true;
    load();
  }
  k->target = target.name;
  k->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  if (settings.debug >= 1) {
    std::string msg = fmt::format("kernel {}\n  index notation: {}\n  spec: {}\n  schedule: {}\n", key,
                                  k->statement, k->spec, k->schedule);
    for (const auto& r : k->reasons) msg += "    - " + r + "\n";
    for (const auto& c : log) msg += "  cache: " + c + "\n";
    msg += fmt::format("  {} in {:.3f} s; source: {}\n", k->compiled ? "compiled" : "loaded from cache", k->seconds,
                       k->source_path);
    msg += "  loop IR:\n" + loops::print(l.kernel.body, 2);
    log_message(20, "kernel", msg);
  }
  return k;
}

}  // namespace

static std::string loop_ir_dump_dir() {  // SCORCH_DUMP_DIR, else dumps/ in the kernel cache
  if (const std::string d = path_setting("SCORCH_DUMP_DIR"); !d.empty()) return d + "/loop_ir";
  return kernel_cache_dir() + "/dumps/loop_ir";
}

// Under SCORCH_DEBUG=2, where the IR after each pass goes. A folder that cannot be made or a file that cannot
// be written is a warning (once a process), never an error: debugging output must not stop a working run.
static PassDump loop_ir_dump(const std::string& text, const VectorShape& machine) {
  static std::atomic<bool> warned{false};
  auto warn = [](const std::string& why) {
    if (!warned.exchange(true)) log_message(30, "kernel", fmt::format("loop IR dumps are not written: {}", why));
  };
  PassDump dump;
  try {
    dump = dump_to_folder(loop_ir_dump_dir(),
                          content_hash(fmt::format("{}\n{} {} {} {}", text, machine.vector_bytes, machine.tile_vectors,
                                                   machine.vector_registers, machine.soft_gathers)).substr(0, 16), text);
  } catch (const Error& e) {
    warn(e.what());
    return nullptr;
  }
  return [dump, warn](int number, const std::string& pass, const std::string& ir) {
    try {
      dump(number, pass, ir);
    } catch (const Error& e) {
      warn(e.what());
    }
  };
}

Lowered lower_spec(const std::string& text, const VectorShape& machine) {
  if (is_grouped_product_spec(text)) {  // a fixed kernel outside the pipeline (codegen/emit_grouped.h)
    Lowered l;
    l.source = grouped_product_source(text, machine);
    l.machine = machine;
    return l;
  }
  Lowered l{KernelSpec::parse(text), {}, {}, {}, machine};
  // The pipeline: the schedule, the lowering passes (lower/pipeline.h), the C++ source. Under
  // SCORCH_DEBUG=2 the IR after each pass goes to <dump dir>/<hash of spec and vector shape>.<NN>-<pass>.txt.
  l.schedule = make_schedule(l.spec);
  PassDump dump;
  if (debug_level() >= 2) dump = loop_ir_dump(text, machine);
  l.kernel = run_pipeline(l.spec, l.schedule, machine, dump).facts;
  l.source = emit_cpp(l.spec, l.kernel, machine.vector_bytes);
  return l;
}

void describe_kernel(const Lowered& l, const std::string& text, CompiledKernel& k) {
  k.spec = text;
  k.vector_shape = l.machine;
  if (is_grouped_product_spec(text)) {
    k.statement = text;
    k.overwrites_output = true;
    k.input_pointers = 6;  // A, W, starts, counts, units, bias (grouped_kernel.cpp: call_kernel)
    return;
  }
  k.statement = l.spec.stmt.str();
  k.schedule = l.schedule.str(l.spec.stmt);
  k.reasons = l.schedule.reasons;
  k.reasons.insert(k.reasons.end(), l.kernel.reasons.begin(), l.kernel.reasons.end());
  k.loop_ir = loops::print(l.kernel.body);
  k.sparse_output = l.kernel.sparse_output;
  k.overwrites_output = l.kernel.overwrites_output;
  k.assembled_output = l.kernel.assembled_output;
  k.sorted_output = l.schedule.output == OutputMode::append || l.schedule.output == OutputMode::workspace;
  k.workspace_output = l.schedule.output == OutputMode::workspace;
  const bool sampled = l.schedule.output == OutputMode::sampled || l.schedule.output == OutputMode::fibers;
  k.sampled_operand = sampled ? l.schedule.sampled_tensor : -1;
  if (sampled) {
    const auto& levels = l.spec.operands[l.schedule.sampled_tensor].format->levels();
    k.sampled_fibers = l.schedule.output == OutputMode::fibers;
    const size_t shared = k.sampled_fibers ? l.schedule.shared_levels : levels.size();
    for (size_t q = 0; q < shared; ++q) k.sampled_buffers += static_cast<int>(levels[q].kind->buffer_names().size());
  }
  k.input_pointers = input_pointer_count(l.spec);
}

std::vector<std::string> kernel_compile_flags(const Target& target) {
  std::vector<std::string> cmd = {"-O3"};
  cmd.insert(cmd.end(), target.flags.begin(), target.flags.end());
  for (const char* a : {"-fopenmp", "-fPIC", "-std=c++17", "-w"}) cmd.push_back(a);
  return cmd;
}


// Always an absolute path: the kernel's source file, named under it, is the compiler's last argument, and a
// relative SCORCH_CACHE_DIR such as "-x" made it an option (helper-55).
std::string kernel_cache_dir() {
  std::string d = path_setting("SCORCH_CACHE_DIR");
  if (d.empty()) {
    const char* x = std::getenv("XDG_CACHE_HOME");
    d = x && *x ? std::string(x) + "/scorch" : env_or("HOME", "/tmp") + "/.cache/scorch";
  }
  if (d.front() == '/') return d;
  std::string here(4096, '\0');
  SCORCH_CHECK(::getcwd(here.data(), here.size()) != nullptr,
               "the kernel cache directory '{}' is relative and the current directory cannot be read: {}", d,
               std::strerror(errno));
  here.resize(std::strlen(here.c_str()));
  return here + (here.back() == '/' ? "" : "/") + d;
}

namespace {

// The environment checked, and the target, for one request.
const Target& prepare(const Settings& settings) {
  SCORCH_CHECK(!settings.sanitize || asan_runtime_present(),
               "SCORCH_SANITIZE=1 compiles kernels with AddressSanitizer, which can only be loaded into a process "
               "running its runtime: use a SCORCH_SANITIZE=ON build, or start the process with "
               "LD_PRELOAD=$(c++ -print-file-name=libasan.so) (see docs/cache.md)");
  return current_target();
}

}  // namespace

namespace {

std::mutex g_used_mu;
std::vector<std::string> g_used;             // specs get_kernel returned a kernel for, in first-use order
std::unordered_map<std::string, bool> g_used_set;

void note_used(const std::string& spec) {
  std::lock_guard lock(g_used_mu);
  if (g_used_set.emplace(spec, true).second) g_used.push_back(spec);
}

}  // namespace

bool kernel_available(const std::string& spec) {
  if (jit_enabled() || find_bundled_kernel(spec)) return true;
  load_bundles_from_environment();
  return find_bundled_kernel(spec) != nullptr;
}

std::vector<std::string> used_kernel_specs() {
  std::lock_guard lock(g_used_mu);
  return g_used;
}

std::shared_ptr<const CompiledKernel> get_kernel(const std::string& spec) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const CompiledKernel>> cache;
  // Kernels from loaded bundles come first, before anything that needs a compiler (resolving the target).
  Settings settings = read_settings();
  auto bundled = find_bundled_kernel(spec);
  if (!bundled) {
    load_bundles_from_environment();
    bundled = find_bundled_kernel(spec);
  }
  if (bundled) {
    note_used(spec);
    return bundled;
  }
  SCORCH_CHECK_KIND(ErrorKind::runtime, jit_enabled(),
                    "scorch: no kernel for spec '{}': it is not in any loaded kernel bundle ({}), and JIT "
                    "compilation is disabled (SCORCH_JIT=0). Build a bundle that holds it "
                    "(scorch_backend.aot.build_bundle) and load it first",
                    spec, bundle_summary());
  const Target* target = nullptr;
  try {
    target = &prepare(settings);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::runtime) throw;
    // The compiler does not run: say which kernel was needed (the message keeps its beginning).
    throw_error(e.kind(), fmt::format("{}\n(needed for kernel spec '{}', which is not in any loaded kernel bundle: "
                                      "{})", e.what(), spec, bundle_summary()));
  }
  // A new target, gather form or sanitizer setting in this process: new kernels. The disk entry is verified once per
  // process and key; later calls are answered from here.
  const std::string key = target->fingerprint + (settings.sanitize ? "\nsanitize" : "") +
                          (target->soft_gathers ? "\nsoft gathers\n" : "\n") + spec;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto k = build(spec, *target, settings);  // outside the lock: compiling takes a while; a duplicate is harmless
  note_used(spec);
  std::lock_guard lock(mu);
  return cache.emplace(key, std::move(k)).first->second;
}

std::shared_ptr<const CompiledKernel> get_kernel_uncached(const std::string& spec) {
  const Settings settings = read_settings();
  const Target& target = prepare(settings);
  return build(spec, target, settings);
}

std::string kernel_source(const std::string& spec) { return lower_spec(spec, current_target()).source; }

}  // namespace scorch
