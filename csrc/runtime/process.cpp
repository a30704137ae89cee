#include "runtime/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include <fmt/format.h>

#include "common/error.h"

extern char** environ;

namespace scorch {

namespace {
constexpr size_t kMaxChildOutput = size_t{1} << 20;  // bytes of a child's output kept
}  // namespace

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

int run_program(const std::vector<std::string>& argv, std::string& output, double timeout_seconds) {
  SCORCH_CHECK(!argv.empty(), "run_program: no program given");
  int fds[2];
  SCORCH_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "pipe() failed while starting {}", argv[0]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  // The child gets a process group of its own, so a timeout kills the compiler and everything it started.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    output = fmt::format("cannot start '{}': {}", argv[0], std::strerror(rc));
    return -1;
  }
  const auto start = std::chrono::steady_clock::now();
  bool timed_out = false;
  char buf[4096];
  for (;;) {
    int wait_ms = -1;
    if (timeout_seconds > 0) {
      const double left = timeout_seconds - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (left <= 0) {
        timed_out = true;
        break;
      }
      wait_ms = static_cast<int>(left * 1000) + 1;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = ::poll(&p, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) continue;  // the deadline is checked at the top
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
  if (timed_out) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
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
  const int rc = run_program(argv, out, 60);
  std::string v = rc == 0 ? out.substr(0, out.find('\n')) : "";
  seen[cmd] = v;
  return v;
}

}  // namespace scorch
