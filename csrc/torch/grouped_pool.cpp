// The pool behind pooled_empty (grouped_pool.h). Blocks are kept by exact size; a block given back when the pool
// already holds kMaxCachedBytes is freed instead, so the pool never holds more than that. The pool is never
// destroyed: a tensor may die after static destructors have run.
#include "grouped_pool.h"

#include <sys/mman.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "common/error.h"

namespace scorch::torch_glue {
namespace {

constexpr size_t kMinBytes = size_t{4} << 20;         // smaller: the ordinary allocator
constexpr size_t kMaxCachedBytes = size_t{256} << 20;  // the most the pool holds at rest
constexpr size_t kAlign = size_t{2} << 20;            // huge-page aligned, so the kernel may back it by huge pages

struct Pool {
  std::mutex m;
  std::multimap<size_t, void*> free_blocks;
  size_t cached = 0;
};

Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

void give_back(void* ptr, size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.m);
    if (p.cached + bytes <= kMaxCachedBytes) {
      p.free_blocks.emplace(bytes, ptr);
      p.cached += bytes;
      return;
    }
  }
  std::free(ptr);
}

void* take(size_t bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.m);
    auto it = p.free_blocks.find(bytes);
    if (it != p.free_blocks.end()) {
      void* ptr = it->second;
      p.free_blocks.erase(it);
      p.cached -= bytes;
      return ptr;
    }
  }
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kAlign, bytes) != 0) return nullptr;
#ifdef MADV_HUGEPAGE
  madvise(ptr, bytes, MADV_HUGEPAGE);  // advice only: a failure changes nothing
#endif
  return ptr;
}

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const at::TensorOptions opts = options.memory_format(std::nullopt);
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(c10::typeMetaToScalarType(opts.dtype()));
  if (!opts.device().is_cpu() || bytes < kMinBytes) return at::empty(sizes, opts);
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* ptr = take(rounded);
  SCORCH_CHECK(ptr != nullptr, "scorch::chain: out of memory for a {}-byte result", bytes);
  return at::from_blob(ptr, sizes, [rounded](void* p) { give_back(p, rounded); }, opts);
}

}  // namespace scorch::torch_glue
