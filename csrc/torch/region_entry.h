// The region op's operand cache entries (csrc/torch/region.cpp, its only includer): what one tensor's entry
// keeps (density, compressed forms, dense layouts), the bound on its call-sized forms, whose entry it is (the
// tensor's storage, held weakly), and the LRU of entries.
#pragma once

#include <ATen/ATen.h>

#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "executor.h"

namespace scorch::torch_glue::region_cache {

// --- compressed operands, cached by tensor version (see scorch_backend/custom_ops/region.py for the contract) ---------
constexpr size_t kMaxWeights = 512;  // most recently used parameters and buffers
constexpr size_t kMaxInputs = 8;     // data inputs: a new batch is a new tensor

struct Entry {
  // Whose entry it is: the tensor's storage, held weakly. A StorageImpl is not freed while a weak reference to
  // it lives, so a later tensor given the same memory has another one and is not taken for this tensor
  // (lookup: same_memory). Held strongly (an alias, as before 2026-11-29), a dropped model's weights stayed in
  // memory until 512 newer ones pushed them out (helper-73). Entries whose storage is gone are swept when a new
  // entry is made (remember). `alias` only for a tensor without storage.
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  at::Tensor alias;
  int64_t version = 0;
  std::vector<uint8_t> fingerprint;
  std::vector<int64_t> fingerprint_at;  // the element offsets it was read at (fingerprint_offsets)
  bool whole = false;    // a data input's: checked by `content`, a hash of every byte, in place of the fingerprint
  uint64_t content = 0;
  double density = -1;  // < 0: not measured (known so far only as a dense operand)
  int finite = -1;       // < 0: not checked; else whether every value is finite (values_finite)
  std::map<std::string, Operand> sparse;   // (kind, dtype, broadcast sizes) -> compressed
  std::map<std::string, at::Tensor> layouts;  // (permutation, dtype) -> dense copy in that order
  // Nonzeros per row (int32, the last dimension a row), counted with the density when the tensor is a
  // contiguous float or double one of rank >= 2: the compressor's first pass, already done.
  at::Tensor row_counts;
  // A row-major copy of a float or double tensor of rank >= 2 that is not contiguous (a region's output comes
  // in its storage order, often transposed): the density and the compression read it in one pass each
  // instead of taking the generic paths (count_nonzero; nonzero, index and pack). A column-major matrix gets
  // it only when a kernel compresses it by rows (`rows_of`): its density is counted on its transpose, and a
  // consumer that reads it dense, demoted or by columns (a transposed activation in a training step) needs
  // no copy.
  at::Tensor rows;
  // The keys of forms sized by the call, in `sparse` or `layouts`, most recently used first: a pattern broadcast
  // over a batch, attention's transposed pattern per batch x heads (a layout key with '#'). Each holds batch x
  // nnz entries; one per batch size met, a server seeing many sizes kept them all for good (helper-73: +133 MB
  // over 46 sizes of one 512x512 mask). At most kSizedForms are kept; see touch_sized.
  std::list<std::string> sized;
  // Guards the lazily filled parts above (density, row_counts, rows, sparse, layouts, sized) once the entry is
  // in the cache: callers on several threads (a model served from a thread pool; the op releases the GIL) share it.
  std::mutex mu;
};

// Sized forms kept per cache entry: a few, so that a loader's last short batch, or alternating train and
// evaluation batch sizes, do not compress again at every switch.
constexpr size_t kSizedForms = 4;

// Key `key` of a sized form of e was just used (or made): first in e.sized, and the least recently used one
// beyond kSizedForms dropped from e.sparse or e.layouts. Called with e.mu held.
inline void touch_sized(Entry& e, const std::string& key) {
  for (auto it = e.sized.begin(); it != e.sized.end(); ++it)
    if (*it == key) {
      e.sized.splice(e.sized.begin(), e.sized, it);
      return;
    }
  e.sized.push_front(key);
  while (e.sized.size() > kSizedForms) {
    e.sparse.erase(e.sized.back());
    e.layouts.erase(e.sized.back());
    e.sized.pop_back();
  }
}
using EntryPtr = std::shared_ptr<Entry>;

struct Lru {
  size_t limit;
  std::list<std::pair<std::string, EntryPtr>> order;  // most recent first
  std::unordered_map<std::string, std::list<std::pair<std::string, EntryPtr>>::iterator> index;

  EntryPtr get(const std::string& k) {
    auto it = index.find(k);
    if (it == index.end()) return nullptr;
    order.splice(order.begin(), order, it->second);
    return it->second->second;
  }
  void put(const std::string& k, EntryPtr e) {
    auto it = index.find(k);
    if (it != index.end()) order.erase(it->second);
    order.emplace_front(k, std::move(e));
    index[k] = order.begin();
    while (order.size() > limit) {
      index.erase(order.back().first);
      order.pop_back();
    }
  }
  void clear() {
    order.clear();
    index.clear();
  }
  // Drops the entries whose tensor's storage has been freed (Entry::storage).
  void sweep() {
    for (auto it = order.begin(); it != order.end();) {
      if (it->second->storage && it->second->storage->expired()) {
        index.erase(it->first);
        it = order.erase(it);
      } else {
        ++it;
      }
    }
  }
};

inline void own(Entry& e, const at::Tensor& t) {
  if (t.has_storage()) e.storage.emplace(t.storage().getWeakStorageImpl());
  else e.alias = t.detach();
}

inline bool same_memory(const Entry& e, const at::Tensor& t) {
  if (!e.storage) return true;  // (the alias keeps the memory: the key's data pointer is this tensor's)
  return t.has_storage() && !e.storage->expired() && e.storage->_unsafe_get_target() == t.storage().unsafeGetStorageImpl();
}

}  // namespace scorch::torch_glue::region_cache
