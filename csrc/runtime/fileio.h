// File helpers shared by the kernel cache (jit.cpp) and kernel bundles (bundle.cpp): whole-file reads that
// never map the file, atomic writes, and loading library bytes that were just checked. See docs/cache.md.
#pragma once

#include <sys/types.h>

#include <string>

namespace scorch::fileio {

bool all_digits(const std::string& s);

// write() all of `data` to fd (retrying on EINTR); false on any error.
bool write_all(int fd, const std::string& data);

// Writes under a name of this process and renames into place, so readers see the old file or the new one.
void write_atomically(const std::string& path, const std::string& data);

// Moves `tmp` over `path` (rename); on failure removes `tmp` and throws, naming the reason and, when `path` is
// in the way (a directory where a file belongs), what to remove.
void move_into_place(const std::string& tmp, const std::string& path);

// The whole of a regular file (never a FIFO or a device; never a symlink unless follow_symlinks), at most
// `limit` bytes, and exactly `expect_size` bytes when that is >= 0. False (and `out` empty) otherwise. Read
// with read(), never mapped: a file truncated under us gives a short read, not a SIGBUS.
bool read_regular_file(const std::string& path, size_t limit, std::string& out, off_t expect_size = -1,
                       bool follow_symlinks = false);

// mkdir -p; throws when the directory does not exist afterwards.
void make_dirs(const std::string& path);

// A JSON string literal of s.
std::string json_string(const std::string& s);

// Why `library` is not a whole shared library of this machine ("" when it is): the ELF header (64-bit, this
// byte order and machine, a shared object) and every program and section header, with every segment's bytes,
// inside it. dlopen maps a truncated library and faults (SIGBUS) on the first page past its end; a hash made to
// match damaged bytes (a careless repack, a hand-edited manifest) must not get that far. Not a defence against a
// forged library, which is code and runs whatever it holds.
std::string elf_problem(const std::string& library);

// dlopen()s exactly these bytes (refused with elf_problem's reason first): they are written to a new file private to this process in `dir`
// ("<stem>.load.PID.N.so", O_EXCL, mode 0700), loaded, and unlinked. `what` names the library in errors.
void* load_private_copy(const std::string& dir, const std::string& stem, const std::string& library,
                        const std::string& what);

}  // namespace scorch::fileio
