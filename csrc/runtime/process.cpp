#include "runtime/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/error.h"
#include "runtime/settings.h"

namespace scorch {

namespace {
constexpr size_t kMaxChildOutput = size_t{1} << 20;  // bytes of a child's output kept
}  // namespace

namespace {
std::atomic<InterruptCheck> g_interrupt_check{nullptr};
}  // namespace

void set_interrupt_check(InterruptCheck check) { g_interrupt_check.store(check); }

void check_interrupt() {
  if (InterruptCheck check = g_interrupt_check.load()) check();
}

std::vector<std::string> compiler_command() {
  const char* cxx = std::getenv("CXX");
  std::vector<std::string> words;
  if (cxx) {
    std::istringstream in(cxx);
    for (std::string w; in >> w;) words.push_back(w);
  }
  if (words.empty()) words.push_back("c++");
  return words;
}

namespace {

// `name` as execv takes it: a path as given, a bare name searched on PATH (here, not in the child, which shares
// this thread's memory until it execs and must not allocate). Empty when none is found.
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path && *path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string full = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (::access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

}  // namespace

int run_program(const std::vector<std::string>& argv, std::string& output, double timeout_seconds) {
  SCORCH_CHECK(!argv.empty(), "run_program: no program given");
  const std::string program = resolve_program(argv[0]);
  if (program.empty()) {
    output = fmt::format("cannot start '{}': {}", argv[0], std::strerror(ENOENT));
    return -1;
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int fds[2], exec_fds[2];  // the child's output; the errno of a failed exec (closed by a successful one)
  SCORCH_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "pipe() failed while starting {}", argv[0]);
  if (::pipe2(exec_fds, O_CLOEXEC) != 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    SCORCH_CHECK(false, "pipe() failed while starting {}", argv[0]);
  }
  const pid_t parent = ::getpid();
  // vfork (as posix_spawn does inside, and CPython's subprocess), not posix_spawn: the child must die with this
  // process (PR_SET_PDEATHSIG), which posix_spawn cannot ask for. A compiler whose process was killed ran on
  // unbounded (SCORCH_COMPILE_TIMEOUT is enforced by the loop below) and left its library's temporary in the
  // cache, which nothing removed once the entry was built (helper-51). The signal comes when the thread that
  // started the child ends; that thread waits for the child below. (Not fork: copying a large process's page
  // tables costs milliseconds, and under strict overcommit it fails.)
  // Signals are blocked around the vfork (as posix_spawn does), so no handler of this process runs in the
  // child while it shares this thread's memory; the child puts caught signals back to their defaults first.
  sigset_t all_signals, old_mask;
  ::sigfillset(&all_signals);
  ::pthread_sigmask(SIG_SETMASK, &all_signals, &old_mask);
  const pid_t pid = ::vfork();
  if (pid == 0) {  // this thread's memory, shared: only system calls from here to execv
    for (int sig = 1; sig < NSIG; ++sig) {
      struct sigaction sa {};
      if (::sigaction(sig, nullptr, &sa) != 0 || sa.sa_handler == SIG_IGN || sa.sa_handler == SIG_DFL) continue;
      sa = {};
      sa.sa_handler = SIG_DFL;
      ::sigaction(sig, &sa, nullptr);
    }
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    ::setpgid(0, 0);  // a group of its own, so a timeout kills the compiler and everything it started
#ifdef __linux__
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before the request took effect
#endif
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execv(program.c_str(), args.data());
    [[maybe_unused]] const ssize_t w = ::write(exec_fds[1], &errno, sizeof(int));
    ::_exit(127);
  }
  const int fork_errno = errno;  // (of vfork, when it failed)
  ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  ::close(fds[1]);
  ::close(exec_fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    ::close(exec_fds[0]);
    output = fmt::format("cannot start '{}': {}", argv[0], std::strerror(fork_errno));
    return -1;
  }
  int exec_errno = 0;
  ssize_t got;
  while ((got = ::read(exec_fds[0], &exec_errno, sizeof exec_errno)) < 0 && errno == EINTR) {
  }
  ::close(exec_fds[0]);
  if (got == static_cast<ssize_t>(sizeof exec_errno)) {
    ::close(fds[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    output = fmt::format("cannot start '{}': {}", argv[0], std::strerror(exec_errno));
    return -1;
  }
  const auto start = std::chrono::steady_clock::now();
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  bool timed_out = false, exited = false;
  int status = 0;
  std::chrono::steady_clock::time_point exited_at;
  char buf[4096];
  // Output is read until the pipe closes or, once the child has exited, until nothing more is waiting: a
  // compiler that leaves a process behind holding the pipe (a compiler cache's server, `(sleep 30 &)` in a
  // wrapper) made the compile last as long as that process, or fail as timed out after it had succeeded
  // (helper-55). The child's exit is checked every 50 ms.
  // Stops the child's group: SIGTERM first, so a compiler driver removes its temporary files (a SIGKILLed one
  // left its .s and .o files in TMPDIR, helper-61), then SIGKILL to whatever is left after a second.
  auto stop = [&] {
    ::kill(-pid, SIGTERM);
    ::kill(pid, SIGTERM);
    for (int k = 0; k < 100 && !exited; ++k) {
      if (::waitpid(pid, &status, WNOHANG) == pid) exited = true;
      else std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(-pid, SIGKILL);
    if (!exited) ::kill(pid, SIGKILL);
  };
  for (;;) {
    try {
      check_interrupt();
    } catch (...) {  // the caller is told after the compiler is stopped and reaped
      ::close(fds[0]);
      stop();
      while (!exited && ::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      throw;
    }
    if (!exited) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        exited = true;
        exited_at = std::chrono::steady_clock::now();
      }
    }
    int wait_ms = exited ? 0 : 50;
    if (timeout_seconds > 0 && !exited) {
      const double left = timeout_seconds - seconds_since(start);
      if (left <= 0) {
        timed_out = true;
        break;
      }
      wait_ms = std::min(wait_ms, static_cast<int>(left * 1000) + 1);
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      if (exited) break;  // what the child wrote has been read; whatever holds the pipe now is not the child
      continue;         // the deadline and the child's exit are checked at the top
    }
    if (exited && seconds_since(exited_at) > 1) break;  // a process it left behind writing without end
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    // Keep the start of what the child says (a compiler's first errors are the useful ones) and drain the
    // rest unread: a child that writes without end must not fill this process's memory.
    if (output.size() < kMaxChildOutput) {
      output.append(buf, std::min(static_cast<size_t>(n), kMaxChildOutput - output.size()));
      if (output.size() == kMaxChildOutput) output += "\n... (output cut at 1 MiB)";
    }
  }
  ::close(fds[0]);
  if (timed_out) stop();
  while (!exited && ::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return -2;
  if (WIFSIGNALED(status)) output += fmt::format("\n(killed by signal {})", WTERMSIG(status));
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string compiler_version() {
  static std::mutex mu;
  static std::map<std::vector<std::string>, std::string> seen;
  const auto cmd = compiler_command();
  std::lock_guard lock(mu);
  auto it = seen.find(cmd);
  if (it != seen.end()) return it->second;
  std::string out;
  auto argv = cmd;
  argv.push_back("--version");
  const int rc = run_program(argv, out, compiler_probe_timeout_seconds());
  std::string v = rc == 0 ? out.substr(0, out.find('\n')) : "";
  seen[cmd] = v;
  return v;
}

}  // namespace scorch
