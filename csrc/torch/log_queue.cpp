// --- C++ messages for Python's `logging` -----------------------------------------------------------------
// The runtime's messages (a kernel compiled or loaded, a bundle loaded) are queued here and handed to the
// `scorch` logger by log.py (`_C.take_log_messages`), which drains the queue where Python logs anyway: when
// a compile starts, after an eager call that explains itself, at exit. A queue rather than a call into
// Python: messages come from compile workers and from inside the kernel cache's locks, where taking the GIL
// could wait on a thread that waits on that lock. Bounded: past the limit the oldest are dropped and
// counted.
#include "log_queue.h"

#include <fmt/format.h>

#include <deque>
#include <mutex>
#include <tuple>

namespace py = pybind11;

namespace scorch::torch_glue::log_queue {
namespace {
constexpr size_t kLimit = 1000;
std::mutex mu;
std::deque<std::tuple<int, std::string, std::string>> queue;
size_t dropped = 0;
}  // namespace

void sink(int level, const char* name, const std::string& text) {
  std::lock_guard lock(mu);
  if (queue.size() >= kLimit) {
    queue.pop_front();
    ++dropped;
  }
  queue.emplace_back(level, name, text);
}

py::list take() {
  std::deque<std::tuple<int, std::string, std::string>> out;
  size_t lost = 0;
  {
    std::lock_guard lock(mu);
    out.swap(queue);
    std::swap(lost, dropped);
  }
  py::list l;
  if (lost) l.append(py::make_tuple(30, "log", fmt::format("{} earlier messages were dropped (queue full)", lost)));
  for (auto& [level, name, text] : out) l.append(py::make_tuple(level, name, text));
  return l;
}
}  // namespace scorch::torch_glue::log_queue
