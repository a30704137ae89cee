// Index buffers validated once per identity and version. Checking a sparse operand's buffers in full
// (coordinates in range, sorted and unique where the format says) reads every one of them, as much as the kernel
// does; a deployed model's buffers are data read from a file, and an operand passed call after call is the same
// tensors. So the check runs once per tensor and version: a write through torch bumps the version and the next
// call checks again.
//
// A tensor is named by its storage (the StorageImpl, held by a weak reference: while the entry lives no other
// storage can take that address, so a buffer freed and another allocated in its place is not taken for it, as
// an address and a version of 0 were), its offset, sizes and strides.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include "tensor_version.h"

namespace scorch::torch_glue {

class ValidatedOnce {
 public:
  // The key of a set of tensors (plus any extra numbers: a format's address, sizes); `versioned` false when one
  // of them has no version counter (an inference tensor), whose writes cannot be seen: never remembered.
  struct Key {
    std::vector<int64_t> words;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
    bool versioned = true;
    void add(const at::Tensor& t) {
      const int64_t version = version_of(t);
      if (version < 0 || !t.has_storage()) {
        versioned = false;
        return;
      }
      storages.push_back(t.storage().getWeakStorageImpl());
      words.insert(words.end(), {reinterpret_cast<int64_t>(t.storage().unsafeGetStorageImpl()), t.storage_offset(),
                                 version, t.dim()});
      words.insert(words.end(), t.sizes().begin(), t.sizes().end());
      words.insert(words.end(), t.strides().begin(), t.strides().end());
    }
  };

  // Runs check() unless `key` was checked before and its tensors' storages are alive; remembers it when check()
  // returns.
  template <class Check>
  void check_once(Key key, Check&& check) {
    if (key.versioned) {
      std::lock_guard lock(mu_);
      auto it = seen_.find(key.words);
      if (it != seen_.end()) {
        bool alive = true;
        for (const auto& s : it->second) alive = alive && !s.expired();
        if (alive) return;
        seen_.erase(it);
      }
    }
    check();
    if (!key.versioned) return;
    std::lock_guard lock(mu_);
    if (seen_.size() > 4096) seen_.clear();
    seen_[std::move(key.words)] = std::move(key.storages);
  }

 private:
  std::mutex mu_;
  std::map<std::vector<int64_t>, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>> seen_;
};

}  // namespace scorch::torch_glue
