// C++ messages for Python's `logging` (log_queue.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace scorch::torch_glue::log_queue {

// Queues one message of the runtime (scorch::set_log_sink's signature).
void sink(int level, const char* name, const std::string& text);
// The queued messages, oldest first, as (level, name, text) tuples; the queue is emptied.
pybind11::list take();

}  // namespace scorch::torch_glue::log_queue
