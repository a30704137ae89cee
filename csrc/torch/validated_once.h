// Index buffers validated once per identity and version. Checking a sparse operand's buffers in full
// (coordinates in range, sorted and unique where the format says) reads every one of them, as much as the kernel
// does; a deployed model's buffers are data read from a file, and an operand passed call after call is the same
// tensors. So the check runs once per (address, elements, version) of the values and every buffer; a write
// through torch bumps the version and the next call checks again.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>
#include <vector>

#include <ATen/ATen.h>

#include "tensor_version.h"

namespace scorch::torch_glue {

class ValidatedOnce {
 public:
  // The key of a set of tensors (plus any extra numbers: a format's address, sizes); `versioned` false when one
  // of them has no version counter (an inference tensor), whose writes cannot be seen: never remembered.
  struct Key {
    std::vector<int64_t> words;
    bool versioned = true;
    void add(const at::Tensor& t) {
      const int64_t version = version_of(t);
      if (version < 0) versioned = false;
      words.insert(words.end(), {reinterpret_cast<int64_t>(t.data_ptr()), t.numel(), version});
    }
  };

  // Runs check() unless `key` was checked before; remembers it when check() returns.
  template <class Check>
  void check_once(Key key, Check&& check) {
    if (key.versioned) {
      std::lock_guard lock(mu_);
      if (seen_.count(key.words)) return;
    }
    check();
    if (!key.versioned) return;
    std::lock_guard lock(mu_);
    if (seen_.size() > 4096) seen_.clear();
    seen_.insert(std::move(key.words));
  }

 private:
  std::mutex mu_;
  std::set<std::vector<int64_t>> seen_;
};

}  // namespace scorch::torch_glue
