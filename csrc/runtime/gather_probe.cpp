#include "runtime/gather_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace scorch {

#if defined(__x86_64__)
namespace {

constexpr int kTable = 2048;   // 8 KB of floats: stays in L1
constexpr int kEntries = 4096;  // indices a pass reads
constexpr int kPasses = 8;

// Each kernel sums w[i] * table[idx[i]] over kPasses passes, in two vector accumulators (as the generated
// loops do), with the gather instruction or with scalar loads.
__attribute__((target("avx2,fma"))) float hardware_256(const float* t, const int32_t* idx, const float* w) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int r = 0; r < kPasses; ++r)
    for (int i = 0; i < kEntries; i += 16) {
      const __m256i j0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
      const __m256i j1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i + 8));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_i32gather_ps(t, j0, 4), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_i32gather_ps(t, j1, 4), a1);
    }
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_add_ps(a0, a1));
  return s[0] + s[7];
}

__attribute__((target("avx2,fma"))) float soft_256(const float* t, const int32_t* idx, const float* w) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int r = 0; r < kPasses; ++r)
    for (int i = 0; i < kEntries; i += 16) {
      const int32_t* j = idx + i;
      const __m256 g0 = _mm256_setr_ps(t[j[0]], t[j[1]], t[j[2]], t[j[3]], t[j[4]], t[j[5]], t[j[6]], t[j[7]]);
      const __m256 g1 = _mm256_setr_ps(t[j[8]], t[j[9]], t[j[10]], t[j[11]], t[j[12]], t[j[13]], t[j[14]], t[j[15]]);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), g0, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), g1, a1);
    }
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_add_ps(a0, a1));
  return s[0] + s[7];
}

__attribute__((target("avx512f"))) float hardware_512(const float* t, const int32_t* idx, const float* w) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int r = 0; r < kPasses; ++r)
    for (int i = 0; i < kEntries; i += 32) {
      const __m512i j0 = _mm512_loadu_si512(idx + i);
      const __m512i j1 = _mm512_loadu_si512(idx + i + 16);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_i32gather_ps(j0, t, 4), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_i32gather_ps(j1, t, 4), a1);
    }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

__attribute__((target("avx512f"))) float soft_512(const float* t, const int32_t* idx, const float* w) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int r = 0; r < kPasses; ++r)
    for (int i = 0; i < kEntries; i += 32) {
      const int32_t* j = idx + i;
      const __m512 g0 = _mm512_setr_ps(t[j[0]], t[j[1]], t[j[2]], t[j[3]], t[j[4]], t[j[5]], t[j[6]], t[j[7]],
                                       t[j[8]], t[j[9]], t[j[10]], t[j[11]], t[j[12]], t[j[13]], t[j[14]], t[j[15]]);
      const __m512 g1 = _mm512_setr_ps(t[j[16]], t[j[17]], t[j[18]], t[j[19]], t[j[20]], t[j[21]], t[j[22]],
                                       t[j[23]], t[j[24]], t[j[25]], t[j[26]], t[j[27]], t[j[28]], t[j[29]],
                                       t[j[30]], t[j[31]]);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), g0, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), g1, a1);
    }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

using Kernel = float (*)(const float*, const int32_t*, const float*);

bool measure(Kernel hardware, Kernel soft) {
  std::vector<float> table(kTable), w(kEntries);
  std::vector<int32_t> idx(kEntries);
  uint32_t x = 12345;  // a fixed pseudo-random walk over the table: no two runs of the probe differ
  for (int i = 0; i < kTable; ++i) table[i] = 1.0f + static_cast<float>(i % 7);
  for (int i = 0; i < kEntries; ++i) {
    x = x * 1664525u + 1013904223u;
    idx[i] = static_cast<int32_t>((x >> 8) % kTable);
    w[i] = 0.5f;
  }
  auto time = [&](Kernel k) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = k(table.data(), idx.data(), w.data());
    (void)sink;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double best_hw = 1e30, best_soft = 1e30;
  for (int round = 0; round < 7; ++round) {  // alternating rounds, the best of each: a busy core slows both
    best_hw = std::min(best_hw, time(hardware));
    best_soft = std::min(best_soft, time(soft));
  }
  return best_soft < 0.9 * best_hw;
}

}  // namespace

bool soft_gathers_faster(int vector_bytes) {
  static std::once_flag once256, once512;
  static bool faster256 = false, faster512 = false;
  if (vector_bytes == 32) {
    std::call_once(once256, [] {
      if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) faster256 = measure(hardware_256, soft_256);
    });
    return faster256;
  }
  if (vector_bytes == 64) {
    std::call_once(once512, [] {
      if (__builtin_cpu_supports("avx512f")) faster512 = measure(hardware_512, soft_512);
    });
    return faster512;
  }
  return false;
}

#else

bool soft_gathers_faster(int) { return false; }

#endif

}  // namespace scorch
