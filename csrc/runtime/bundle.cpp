#include "runtime/bundle.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "codegen/kernel_abi.h"
#include "common/error.h"
#include "common/hash.h"
#include "runtime/cpu_features.h"
#include "runtime/fileio.h"
#include "runtime/jit_internal.h"
#include "runtime/process.h"
#include "runtime/settings.h"
#include "runtime/target.h"

namespace scorch {
namespace {

constexpr const char* kMagic = "SCORCH-KERNEL-BUNDLE";
constexpr int kFormatVersion = 1;
constexpr const char* kManifestFormat = "scorch-kernel-bundle-3";  // 3: the gathers line
constexpr size_t kMaxBundleBytes = size_t(1) << 30;
constexpr size_t kMaxHeaderBytes = 160;

// The index table the bundle's library exports; the loader reads it with the same layout.
struct IndexEntry {
  const char* spec;
  const char* source_hash;
  KernelFn fn;
  KernelFreeFn free_fn;
};

[[noreturn]] void refuse(const std::string& path, const std::string& why) {
  throw_error(ErrorKind::value, fmt::format("scorch: kernel bundle {} refused: {}", path, why));
}

std::string render_manifest(const BundleInfo& b) {
  std::string m = fmt::format("format {}\narch {}\ntarget {}\ntarget_flags {}\nvector_bytes {}\ntile_vectors {}\nvector_registers {}\n"
                              "gathers {}\nisa {}\ncompiler {}\ncommand {}\nkernels {}\n",
                              kManifestFormat, b.arch, b.target, b.target_flags, b.vector_bytes, b.tile_vectors, b.vector_registers,
                              b.soft_gathers ? "soft" : "hardware", fmt::join(b.isa, " "), b.compiler, b.command,
                              b.kernels.size());
  for (size_t i = 0; i < b.kernels.size(); ++i)
    m += fmt::format("kernel {} {} {}\n", i, b.kernels[i].source_hash, b.kernels[i].spec);
  return m;
}

bool one_line(const std::string& s) { return s.find_first_of("\n\r") == std::string::npos; }

// Text from a file, for a message: control characters shown as escapes ("format x\r" from a file whose line
// endings were changed to CRLF would otherwise read as the very value expected), at most `max` characters.
std::string shown(const std::string& s, size_t max = 60) {
  std::string out;
  for (char c : s.substr(0, max)) {
    if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else out += c;
  }
  return out;
}

std::vector<std::string> split_words(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// "key value" lines in a fixed order; returns the value of the next line, which must have this key.
struct ManifestReader {
  const std::string& path;
  std::vector<std::string> lines;
  size_t at = 0;
  std::string take(const std::string& key) {
    if (at >= lines.size()) refuse(path, fmt::format("its manifest ends before '{}'", key));
    const std::string& l = lines[at++];
    if (l.compare(0, key.size() + 1, key + " ") != 0 && l != key)
      refuse(path, fmt::format("its manifest has '{}' where '{}' belongs (another Scorch version, or damaged)",
                               shown(l), key));
    return l.size() > key.size() ? l.substr(key.size() + 1) : "";
  }
  int number(const std::string& key, int max) {
    const std::string v = take(key);
    if (!fileio::all_digits(v) || v.size() > 9 || std::stoi(v) > max)
      refuse(path, fmt::format("its manifest's {} is '{}', not a number up to {}", key, v, max));
    return std::stoi(v);
  }
};

}  // namespace

BundleInfo parse_kernel_bundle(const std::string& bytes, const std::string& path, std::string* library) {
  const auto nl = bytes.find('\n');
  if (bytes.compare(0, std::strlen(kMagic), kMagic) != 0 || nl == std::string::npos || nl > kMaxHeaderBytes)
    refuse(path, fmt::format("it is not a Scorch kernel bundle (a bundle starts with '{}')", kMagic));
  const auto head = split_words(bytes.substr(0, nl));
  if (head.size() != 5 || !fileio::all_digits(head[1]) || head[1].size() > 6)
    refuse(path, "its header line is garbled");
  if (std::stoi(head[1]) != kFormatVersion)
    refuse(path, fmt::format("it has bundle format version {}, this Scorch reads version {}; rebuild it with this "
                             "Scorch (scorch_backend.aot.build_bundle)",
                             head[1], kFormatVersion));
  if (!fileio::all_digits(head[2]) || !fileio::all_digits(head[3]) || head[2].size() > 10 || head[3].size() > 10 ||
      head[4].size() != 32)
    refuse(path, "its header line is garbled");
  const size_t manifest_bytes = std::stoull(head[2]), library_bytes = std::stoull(head[3]);
  const size_t expect = nl + 1 + manifest_bytes + library_bytes;
  if (bytes.size() != expect)
    refuse(path, fmt::format("it is {} bytes, its header says {} (truncated, or something appended)", bytes.size(),
                             expect));
  const std::string actual = content_hash(bytes.data() + nl + 1, manifest_bytes + library_bytes);
  if (actual != head[4])
    refuse(path, fmt::format("it is damaged: its content hash is {}, its header records {}", actual, head[4]));

  BundleInfo b;
  b.path = path;
  b.file_bytes = bytes.size();
  b.library_bytes = library_bytes;
  b.content_hash = head[4];
  b.manifest = bytes.substr(nl + 1, manifest_bytes);
  ManifestReader r{path, {}};
  {
    std::istringstream in(b.manifest);
    for (std::string l; std::getline(in, l);) r.lines.push_back(l);
  }
  if (const std::string f = r.take("format"); f != kManifestFormat)
    refuse(path, fmt::format("its manifest has format '{}', this Scorch reads '{}'", shown(f), kManifestFormat));
  b.arch = r.take("arch");
  if (b.arch.empty() || b.arch.find_first_of(" \t") != std::string::npos)
    refuse(path, fmt::format("its manifest's arch '{}' is not one word (damaged?)", shown(b.arch, 20)));
  b.target = r.take("target");
  b.target_flags = r.take("target_flags");
  b.vector_bytes = r.number("vector_bytes", 1 << 12);
  b.tile_vectors = r.number("tile_vectors", 64);
  b.vector_registers = r.number("vector_registers", 256);
  {
    const std::string g = r.take("gathers");
    if (g != "soft" && g != "hardware")
      refuse(path, fmt::format("its manifest has gathers '{}' (soft or hardware)", shown(g, 20)));
    b.soft_gathers = g == "soft";
  }
  b.isa = split_words(r.take("isa"));
  b.compiler = r.take("compiler");
  b.command = r.take("command");
  const int count = r.number("kernels", 1 << 20);
  for (int i = 0; i < count; ++i) {
    const std::string l = r.take("kernel");
    const auto a = l.find(' '), c = a == std::string::npos ? a : l.find(' ', a + 1);
    if (c == std::string::npos || l.substr(0, a) != std::to_string(i))
      refuse(path, fmt::format("its manifest's kernel line {} is garbled", i));
    b.kernels.push_back({l.substr(c + 1), l.substr(a + 1, c - a - 1)});
  }
  if (r.at != r.lines.size()) refuse(path, "its manifest has lines after the last kernel");
  // The manifest must be exactly what this Scorch writes for what was read: one canonical form.
  if (render_manifest(b) != b.manifest) refuse(path, "its manifest is not in canonical form (damaged?)");
  if (library) *library = bytes.substr(nl + 1 + manifest_bytes);
  return b;
}

namespace {

// Everything that needs no loading: the file, the architecture, this CPU's instruction set, and the source
// this Scorch generates for each spec. Returns the library's bytes in `library`.
std::string read_bundle_file(const std::string& path) {
  // (open() would stop at a NUL and read another file than the one named)
  SCORCH_CHECK(path.find('\0') == std::string::npos, "scorch: a kernel bundle path holds a NUL character: '{}'",
               shown(path, 200));
  std::string bytes;
  if (!fileio::read_regular_file(path, kMaxBundleBytes, bytes, -1, /*follow_symlinks=*/true)) {
    struct stat sb;
    if (::stat(path.c_str(), &sb) != 0)
      throw_error(ErrorKind::value, fmt::format("scorch: cannot read kernel bundle {}: {}", path, std::strerror(errno)));
    refuse(path, "it is not a readable regular file of at most 1 GiB");
  }
  return bytes;
}

BundleInfo check_bundle(const std::string& bytes, const std::string& path, std::string& library,
                        std::vector<Lowered>* lowered) {
  SCORCH_CHECK(bytes.size() <= kMaxBundleBytes, "scorch: kernel bundle {} refused: larger than 1 GiB", path);
  BundleInfo b = parse_kernel_bundle(bytes, path, &library);
  if (b.arch != host_arch())
    refuse(path, fmt::format("it holds {} code, this process runs on {}", b.arch, host_arch()));
  if (const std::string damaged = fileio::elf_problem(library); !damaged.empty())
    refuse(path, "its library is damaged: " + damaged);
  const IsaCheck isa = check_cpu_features(b.isa);
  if (!isa.missing.empty())
    refuse(path, fmt::format("it was compiled for target '{}', whose code needs {} which this CPU lacks (its "
                             "kernels would crash here). Build the bundle for a target this CPU runs (e.g. "
                             "SCORCH_TARGET=x86-64-v3, or build_bundle(..., target=...))",
                             b.target, fmt::join(isa.missing, ", ")));
  if (!isa.unknown.empty())
    refuse(path, fmt::format("it needs instruction-set features this Scorch cannot check on {}: {}", host_arch(),
                             fmt::join(isa.unknown, ", ")));
  for (size_t i = 0; i < b.kernels.size(); ++i) {
    const auto& k = b.kernels[i];
    Lowered l;
    try {
      l = lower_spec(k.spec, VectorShape{b.vector_bytes, b.tile_vectors, b.vector_registers, b.soft_gathers});
    } catch (const Error& e) {
      refuse(path, fmt::format("this Scorch does not take the spec of its kernel {} ('{}'): {}", i, k.spec, e.what()));
    }
    const std::string here = content_hash(l.source);
    if (here != k.source_hash)
      refuse(path, fmt::format("it was made by a different Scorch version or lowering: for kernel {} ('{}') this "
                               "Scorch generates other code (source hash {} here, {} in the bundle). Rebuild the "
                               "bundle with this Scorch",
                               i, k.spec, here, k.source_hash));
    if (lowered) lowered->push_back(std::move(l));
  }
  return b;
}

// Maps exactly `library` (bytes already checked). First through a sealed memfd kept open for the life of the
// process (its /proc/self/fd name is then never reused for another library, so glibc cannot mistake one
// bundle for another, and no writable, exec-allowed directory is needed); where memfds cannot be mapped
// executable, through a private copy in the kernel cache directory, as the disk cache does.
void* load_library_bytes(const std::string& library, const std::string& path, std::string& how, bool try_memfd = true) {
  const int fd = try_memfd ? ::memfd_create("scorch-kernel-bundle", MFD_CLOEXEC | MFD_ALLOW_SEALING) : -1;
  std::string memfd_error = !try_memfd ? "not tried" : fd < 0 ? std::string("memfd_create: ") + std::strerror(errno) : "";
  if (fd >= 0) {
    if (fileio::write_all(fd, library) &&
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0) {
      const std::string name = fmt::format("/proc/self/fd/{}", fd);
      if (void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        how = "memfd";
        return h;  // fd stays open: see above
      }
      memfd_error = ::dlerror();
      // The library itself is bad (a forged or damaged one whose hash was made to match): refused here, not
      // loaded a second time from a copy written into the cache directory (which SCORCH_JIT=0 promises not to
      // touch). Only a memfd that may not be mapped executable (a noexec policy) falls back to the copy.
      const bool mapping_refused = memfd_error.find("failed to map segment") != std::string::npos ||
                                   memfd_error.find("Operation not permitted") != std::string::npos ||
                                   memfd_error.find("Permission denied") != std::string::npos;
      if (!mapping_refused) {
        ::close(fd);
        refuse(path, fmt::format("its library does not load: {}", memfd_error));
      }
    } else {
      memfd_error = std::string("writing the memfd: ") + std::strerror(errno);
    }
    ::close(fd);
  }
  // A memfd that cannot be mapped executable (a noexec policy): a private file copy instead. When that fails
  // too, the library itself does not load (both reasons are given): the bundle is refused, as any other.
  try {
    const std::string dir = kernel_cache_dir();
    fileio::make_dirs(dir);
    how = "private copy in " + dir + " (memfd: " + memfd_error + ")";
    return fileio::load_private_copy(dir, "bundle-" + content_hash(library).substr(0, 16), library,
                                     "kernel bundle " + path);
  } catch (const Error& e) {
    refuse(path, fmt::format("its library does not load: {} (from a memfd: {})", e.what(), memfd_error));
  }
}

struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, std::shared_ptr<const CompiledKernel>> by_spec;
  std::vector<std::pair<std::string, std::string>> order;  // spec, bundle path
  std::unordered_map<std::string, int> loaded;              // content hash -> kernels it holds
  int bundles = 0;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: kernels may run during static destruction
  return *r;
}

std::string c_string_literal(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\' || c < 0x20 || c >= 0x7f) o += fmt::format("\\{:03o}", c);
    else o += static_cast<char>(c);
  }
  return o + "\"";
}

// A directory of our own for the build's objects; removed with what it holds.
struct TempDir {
  std::string path;
  std::vector<std::string> files;
  TempDir() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/scorch-bundle-XXXXXX";
    SCORCH_CHECK_KIND(ErrorKind::runtime, ::mkdtemp(tmpl.data()) != nullptr,
                      "scorch: cannot create a temporary directory {}: {}", tmpl, std::strerror(errno));
    path = tmpl;
  }
  std::string file(const std::string& name) {
    files.push_back(path + "/" + name);
    return files.back();
  }
  ~TempDir() {
    for (const auto& f : files) ::unlink(f.c_str());
    ::rmdir(path.c_str());
  }
};

void write_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  SCORCH_CHECK_KIND(ErrorKind::runtime, fd >= 0, "scorch: cannot write {}: {}", path, std::strerror(errno));
  const bool ok = fileio::write_all(fd, text);
  ::close(fd);
  SCORCH_CHECK_KIND(ErrorKind::runtime, ok, "scorch: cannot write {}", path);
}

void run_compiler(const std::vector<std::string>& argv, double timeout, const std::string& what) {
  std::string output;
  const int rc = run_program(argv, output, timeout);
  if (rc == -2)
    throw_error(ErrorKind::runtime, fmt::format("scorch: compiling {} timed out after {} s and the compiler was "
                                                "killed (SCORCH_COMPILE_TIMEOUT)\ncompiler said so far:\n{}",
                                                what, timeout, output));
  if (rc != 0)
    throw_error(ErrorKind::runtime, fmt::format("scorch: compiling {} failed (exit {}): {}\ncompiler said:\n{}", what,
                                                rc, fmt::join(argv, " "), output));
}

}  // namespace

void* load_bundle_library_for_test(const std::string& library, const std::string& name, bool memfd, std::string& how) {
  return load_library_bytes(library, name, how, memfd);
}

BundleInfo build_kernel_bundle(const std::vector<std::string>& specs_in, const std::string& path,
                               const std::string& target_name, int workers) {
  std::vector<std::string> specs;
  {
    std::set<std::string> seen;
    for (const auto& s : specs_in) {
      SCORCH_CHECK(one_line(s) && !s.empty(), "a kernel spec must be one non-empty line, got '{}'", s);
      if (seen.insert(s).second) specs.push_back(s);
    }
  }
  SCORCH_CHECK(!specs.empty(), "build_kernel_bundle: no kernel specs given");
  SCORCH_CHECK(!path.empty(), "build_kernel_bundle: no output path given");
  // An explicit target may be one this CPU cannot run: the bundle is then meant for another machine (loading
  // it here is refused). The current target was checked when it was chosen.
  const Target target = target_name.empty() ? current_target() : resolve_target(target_name);
  const double timeout = compile_timeout_seconds();

  BundleInfo b;
  b.path = path;
  b.arch = target.arch;
  b.target = target.name;
  b.target_flags = fmt::format("{}", fmt::join(target.flags, " "));
  b.vector_bytes = target.vector_bytes;
  b.tile_vectors = target.tile_vectors();
  b.vector_registers = target.vector_registers;
  b.soft_gathers = target.soft_gathers;
  b.isa = target.isa;
  b.compiler = compiler_version();
  std::vector<std::string> flags = kernel_compile_flags(target);
  flags.push_back("-fvisibility=hidden");
  b.command = fmt::format("{} {}", fmt::join(compiler_command(), " "), fmt::join(flags, " "));
  SCORCH_CHECK(one_line(b.compiler) && one_line(b.command) && one_line(b.target_flags),
               "the compiler's version or command spans several lines");

  std::vector<std::string> sources;
  for (const auto& s : specs) {
    Lowered l = lower_spec(s, target.vector_shape());
    b.kernels.push_back({s, content_hash(l.source)});
    sources.push_back(std::move(l.source));
  }

  TempDir tmp;
  std::vector<std::string> objects(specs.size());
  std::vector<std::vector<std::string>> commands(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    // The generated source as it is (its hash is what the manifest records); only its two entry points are
    // renamed, by macros ahead of it, so the kernels can share one library.
    const std::string src = tmp.file(fmt::format("k{}.cpp", i));
    write_file(src, fmt::format("#define scorch_kernel scorch_bundle_kernel_{0}\n"
                                "#define scorch_kernel_free scorch_bundle_free_{0}\n{1}",
                                i, sources[i]));
    objects[i] = tmp.file(fmt::format("k{}.o", i));
    commands[i] = compiler_command();
    commands[i].insert(commands[i].end(), flags.begin(), flags.end());
    for (const auto& a : {std::string("-c"), std::string("-o"), objects[i], src}) commands[i].push_back(a);
  }
  {
    std::atomic<size_t> next{0};
    std::mutex mu;
    std::string first_error;
    std::vector<std::thread> pool;
    for (int w = 0; w < std::max(1, std::min<int>(workers, static_cast<int>(specs.size()))); ++w)
      pool.emplace_back([&] {
        for (size_t i; (i = next++) < specs.size();) {
          try {
            run_compiler(commands[i], timeout, fmt::format("bundle kernel {} ('{}')", i, specs[i]));
          } catch (const std::exception& e) {
            std::lock_guard lock(mu);
            if (first_error.empty()) first_error = e.what();
          }
        }
      });
    for (auto& t : pool) t.join();
    if (!first_error.empty()) throw_error(ErrorKind::runtime, first_error);
  }

  // The index table: spec, source hash and entry points of every kernel, in manifest order.
  std::string index = "#include <cstdint>\n" + std::string(kKernelAbiSource) + "\n";
  for (size_t i = 0; i < specs.size(); ++i)
    index += fmt::format("extern \"C\" int scorch_bundle_kernel_{0}(scorch_kernel_args*);\n"
                         "extern \"C\" void scorch_bundle_free_{0}(void*);\n",
                         i);
  index += "struct scorch_bundle_entry { const char* spec; const char* source_hash; "
           "int (*fn)(scorch_kernel_args*); void (*free_fn)(void*); };\n";
  index += fmt::format("extern \"C\" __attribute__((visibility(\"default\"))) const int scorch_bundle_count = {};\n",
                       specs.size());
  index += "extern \"C\" __attribute__((visibility(\"default\"))) const scorch_bundle_entry scorch_bundle_index[] = {\n";
  for (size_t i = 0; i < specs.size(); ++i)
    index += fmt::format("  {{{}, \"{}\", scorch_bundle_kernel_{}, scorch_bundle_free_{}}},\n",
                         c_string_literal(specs[i]), b.kernels[i].source_hash, i, i);
  index += "};\n";
  const std::string index_src = tmp.file("index.cpp");
  write_file(index_src, index);
  const std::string lib = tmp.file("bundle.so");
  std::vector<std::string> link = compiler_command();
  link.insert(link.end(), flags.begin(), flags.end());
  for (const auto& a : {std::string("-shared"), std::string("-o"), lib, index_src}) link.push_back(a);
  link.insert(link.end(), objects.begin(), objects.end());
  run_compiler(link, timeout, "the bundle's library");

  std::string library;
  SCORCH_CHECK_KIND(ErrorKind::runtime, fileio::read_regular_file(lib, kMaxBundleBytes, library),
                    "scorch: the compiler reported success but {} is unreadable", lib);
  b.manifest = render_manifest(b);
  b.library_bytes = library.size();
  b.content_hash = content_hash(b.manifest + library);
  const std::string file = fmt::format("{} {} {} {} {}\n", kMagic, kFormatVersion, b.manifest.size(), library.size(),
                                       b.content_hash) +
                           b.manifest + library;
  b.file_bytes = file.size();
  fileio::write_atomically(path, file);
  return b;
}

BundleInfo inspect_kernel_bundle(const std::string& path) {
  std::string library;
  return check_bundle(read_bundle_file(path), path, library, nullptr);
}

int load_kernel_bundle(const std::string& path) { return load_kernel_bundle_bytes(read_bundle_file(path), path); }

int load_kernel_bundle_bytes(const std::string& bytes, const std::string& path) {
  static std::mutex load_mu;  // one load at a time: registration order stays that of the calls
  std::lock_guard load_lock(load_mu);
  const auto t0 = std::chrono::steady_clock::now();
  const int debug = debug_level();  // a bad SCORCH_DEBUG fails here, before anything is registered
  Registry& reg = registry();
  {
    // The same content (the hash covers all of it) was checked and loaded before: nothing more to do.
    const BundleInfo seen = parse_kernel_bundle(bytes, path);
    std::lock_guard lock(reg.mu);
    if (auto it = reg.loaded.find(seen.content_hash); it != reg.loaded.end()) return it->second;
  }
  std::string library;
  std::vector<Lowered> lowered;
  const BundleInfo b = check_bundle(bytes, path, library, &lowered);
  std::string how;
  void* handle = load_library_bytes(library, path, how);
  const auto* count = static_cast<const int*>(::dlsym(handle, "scorch_bundle_count"));
  const auto* index = static_cast<const IndexEntry*>(::dlsym(handle, "scorch_bundle_index"));
  // The handle is never closed: a mismatch below leaves an unused mapping, as a failed dlopen would not.
  if (!count || !index || *count != static_cast<int>(b.kernels.size()))
    refuse(path, "its library's index table does not match its manifest");
  std::vector<std::shared_ptr<CompiledKernel>> kernels;
  for (size_t i = 0; i < b.kernels.size(); ++i) {
    const IndexEntry& e = index[i];
    if (!e.spec || !e.source_hash || !e.fn || !e.free_fn || b.kernels[i].spec != e.spec ||
        b.kernels[i].source_hash != e.source_hash)
      refuse(path, fmt::format("its library's index entry {} does not match its manifest", i));
    auto k = std::make_shared<CompiledKernel>();
    describe_kernel(lowered[i], b.kernels[i].spec, *k);
    k->library_path = path;
    k->target = b.target;
    k->fn = e.fn;
    k->free_fn = e.free_fn;
    kernels.push_back(std::move(k));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int added = 0;
  {
    std::lock_guard lock(reg.mu);
    for (auto& k : kernels) {
      k->seconds = seconds / kernels.size();
      if (reg.by_spec.emplace(k->spec, k).second) {
        reg.order.emplace_back(k->spec, path);
        ++added;
      }
    }
    reg.loaded.emplace(b.content_hash, static_cast<int>(b.kernels.size()));
    ++reg.bundles;
  }
  if (debug >= 1)
    log_message(20, "bundle",
                fmt::format("kernel bundle {}: {} kernels ({} new) for target '{}' ({}), loaded through {} in {:.3f} s",
                            path, b.kernels.size(), added, b.target, fmt::join(b.isa, " "), how, seconds));
  return static_cast<int>(b.kernels.size());
}

void load_bundles_from_environment() {
  const std::string list_text = path_setting("SCORCH_KERNEL_BUNDLES");
  if (list_text.empty()) return;
  static std::mutex mu;
  static std::set<std::string> done;
  std::lock_guard lock(mu);
  const std::string& list = list_text;
  for (size_t at = 0; at <= list.size();) {
    size_t end = list.find(':', at);
    if (end == std::string::npos) end = list.size();
    const std::string path = list.substr(at, end - at);
    at = end + 1;
    if (path.empty() || done.count(path)) continue;
    try {
      load_kernel_bundle(path);
    } catch (const Error& e) {
      throw_error(e.kind(), fmt::format("{} (listed in SCORCH_KERNEL_BUNDLES)", e.what()));
    }
    done.insert(path);
  }
}

std::shared_ptr<const CompiledKernel> find_bundled_kernel(const std::string& spec) {
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  if (reg.by_spec.empty()) return nullptr;
  auto it = reg.by_spec.find(spec);
  return it == reg.by_spec.end() ? nullptr : it->second;
}

std::vector<std::pair<std::string, std::string>> bundled_kernels() {
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  return reg.order;
}

std::string bundle_summary() {
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  if (reg.bundles == 0) return "no kernel bundle is loaded";
  return fmt::format("{} bundle{} loaded, {} kernels", reg.bundles, reg.bundles == 1 ? "" : "s", reg.by_spec.size());
}

}  // namespace scorch
