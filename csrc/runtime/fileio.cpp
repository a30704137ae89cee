#include "runtime/fileio.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.h"

namespace scorch::fileio {

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

bool write_all(int fd, const std::string& data) {
  for (size_t done = 0; done < data.size();) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void write_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  SCORCH_CHECK(fd >= 0, "cannot write {}: {}", tmp, std::strerror(errno));
  const bool ok = write_all(fd, data);
  const bool closed = ::close(fd) == 0;
  if (!ok || !closed) {
    ::unlink(tmp.c_str());
    throw_error(ErrorKind::runtime, fmt::format("cannot write {}", tmp));
  }
  move_into_place(tmp, path);
}

void move_into_place(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) == 0) return;
  const int err = errno;
  ::unlink(tmp.c_str());
  struct stat sb;
  const bool dir = ::lstat(path.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode);
  throw_error(ErrorKind::runtime, fmt::format("cannot move {} to {}: {}{}", tmp, path, std::strerror(err),
                                              dir ? " (a directory is in the way: remove it)" : ""));
}

bool read_regular_file(const std::string& path, size_t limit, std::string& out, off_t expect_size,
                       bool follow_symlinks) {
  out.clear();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow_symlinks ? 0 : O_NOFOLLOW));
  if (fd < 0) return false;
  struct stat sb;
  bool ok = ::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && static_cast<size_t>(sb.st_size) <= limit &&
            (expect_size < 0 || sb.st_size == expect_size);
  if (ok) {
    out.resize(static_cast<size_t>(sb.st_size));
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ok = done == out.size();
    char extra;
    if (ok && ::read(fd, &extra, 1) > 0) ok = false;  // grew while we read it
  }
  ::close(fd);
  if (!ok) out.clear();
  return ok;
}

void make_dirs(const std::string& path) {
  std::string at, why;  // why: the first part that could not be made, and the reason
  for (size_t i = 0; i <= path.size(); ++i) {
    if ((i == path.size() || path[i] == '/') && !at.empty() && ::mkdir(at.c_str(), 0755) != 0 && errno != EEXIST &&
        why.empty())
      why = fmt::format("{}: {}", at, std::strerror(errno));
    if (i < path.size()) at += path[i];
  }
  struct stat sb;
  if (::stat(path.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode)) return;
  if (::stat(path.c_str(), &sb) == 0) why = "it exists and is not a directory";
  else if (::lstat(path.c_str(), &sb) == 0 && S_ISLNK(sb.st_mode)) {
    char to[4096];
    const ssize_t n = ::readlink(path.c_str(), to, sizeof to - 1);
    why = fmt::format("it is a symbolic link to {}, which does not exist", n > 0 ? std::string(to, n) : "?");
  }
  SCORCH_CHECK(false, "cannot create the kernel cache directory {} ({})", path, why.empty() ? "reason unknown" : why);
}

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      o += fmt::format("\\u{:04x}", c);
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

std::string elf_problem(const std::string& library) {
#if defined(__x86_64__)
  constexpr int kMachine = EM_X86_64;
#elif defined(__aarch64__)
  constexpr int kMachine = EM_AARCH64;
#else
  constexpr int kMachine = -1;  // not checked
#endif
  const uint64_t size = library.size();
  Elf64_Ehdr h;
  if (size < sizeof h) return fmt::format("it is {} bytes, shorter than an ELF header", size);
  std::memcpy(&h, library.data(), sizeof h);
  if (std::memcmp(h.e_ident, ELFMAG, SELFMAG) != 0) return "it is not an ELF file";
  if (h.e_ident[EI_CLASS] != ELFCLASS64) return "it is not a 64-bit ELF file";
  const bool little = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
  if (h.e_ident[EI_DATA] != (little ? ELFDATA2LSB : ELFDATA2MSB)) return "its byte order is not this machine's";
  if (h.e_type != ET_DYN) return fmt::format("it is not a shared library (ELF type {})", h.e_type);
  if (kMachine >= 0 && h.e_machine != kMachine)
    return fmt::format("it holds code for ELF machine {}, not this one's ({})", h.e_machine, kMachine);
  // [offset, offset + count * each) inside the file, without overflow
  auto inside = [size](uint64_t offset, uint64_t count, uint64_t each) {
    return offset <= size && (each == 0 || count <= (size - offset) / each);
  };
  if (h.e_phnum == 0 || h.e_phentsize != sizeof(Elf64_Phdr) || !inside(h.e_phoff, h.e_phnum, sizeof(Elf64_Phdr)))
    return fmt::format("its program headers ({} of {} bytes at {}) do not fit in its {} bytes", h.e_phnum,
                       h.e_phentsize, h.e_phoff, size);
  if (h.e_shnum != 0 && (h.e_shentsize != sizeof(Elf64_Shdr) || !inside(h.e_shoff, h.e_shnum, sizeof(Elf64_Shdr))))
    return fmt::format("its section headers ({} at {}) do not fit in its {} bytes: it is truncated", h.e_shnum,
                       h.e_shoff, size);
  for (uint16_t i = 0; i < h.e_phnum; ++i) {
    Elf64_Phdr ph;
    std::memcpy(&ph, library.data() + h.e_phoff + uint64_t(i) * sizeof ph, sizeof ph);
    if (ph.p_filesz > ph.p_memsz && ph.p_type == PT_LOAD)
      return fmt::format("its segment {} holds more bytes in the file than in memory", i);
    if (ph.p_filesz != 0 && !inside(ph.p_offset, 1, ph.p_filesz))
      return fmt::format("its segment {} (bytes {} to {}) ends past its {} bytes: it is truncated", i, ph.p_offset,
                         ph.p_offset + ph.p_filesz, size);
  }
  return "";
}

// The copy is created here (O_EXCL, a name never used twice in the process), loaded, then unlinked: what
// dlopen maps is exactly what was hashed, whatever happens to the original file meanwhile (replaced,
// truncated in place). It goes next to the cache entry; when the cache cannot be written (a prebuilt cache on
// a read-only file system, a full disk, a file size limit), into TMPDIR (or /tmp) instead, so verified entries
// still load (helper-55: a full cache disk failed every kernel with "cannot write the private copy").
void* load_private_copy(const std::string& dir, const std::string& stem, const std::string& library,
                        const std::string& what) {
  const std::string damaged = elf_problem(library);
  SCORCH_CHECK_KIND(ErrorKind::runtime, damaged.empty(), "scorch: cannot load {}: {}", what, damaged);
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = counter++;
  auto create = [&](const std::string& path) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0700);
    if (fd < 0 && errno == EEXIST) {
      // This process never used the name, so the file is a leftover of an earlier process with the same PID
      // (killed between creating and unlinking its copy; containers reuse PIDs). Remove it and create afresh.
      ::unlink(path.c_str());
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0700);
    }
    return fd;
  };
  // The copy written at `path`: 0, or the errno of what failed (creating, writing or closing it; a partial
  // file is removed).
  auto write_copy = [&](const std::string& path) {
    const int fd = create(path);
    if (fd < 0) return errno;
    errno = 0;
    int err = write_all(fd, library) ? 0 : errno != 0 ? errno : EIO;
    if (::close(fd) != 0 && err == 0) err = errno;
    if (err != 0) ::unlink(path.c_str());
    return err;
  };
  std::string path = fmt::format("{}/{}.load.{}.{}.so", dir, stem, ::getpid(), n);
  const int cache_err = write_copy(path);
  if (cache_err != 0) {
    const char* tmp = std::getenv("TMPDIR");
    const std::string fallback = fmt::format("{}/scorch-{}.load.{}.{}.so", tmp && *tmp ? tmp : "/tmp", stem,
                                             ::getpid(), n);
    // (the cache's problem is named when both fail: the one the user can act on)
    SCORCH_CHECK_KIND(ErrorKind::runtime, write_copy(fallback) == 0, "scorch: cannot write {} to load {}: {}",
                      path, what, std::strerror(cache_err));
    path = fallback;
  }
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  const std::string err = handle ? "" : ::dlerror();
  ::unlink(path.c_str());
  if (!handle) throw_error(ErrorKind::runtime, fmt::format("scorch: cannot load {}: {}", what, err));
  return handle;
}

}  // namespace scorch::fileio
