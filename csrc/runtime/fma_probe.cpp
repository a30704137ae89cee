#include "runtime/fma_probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace scorch {

#if defined(__x86_64__)
namespace {

// Twelve independent chains: enough to cover a 4-cycle latency on two pipes with room to spare, and with the two
// operands it fits the 16 registers of AVX2.
constexpr int kChains = 12;
constexpr long kSteps = 1L << 19;  // x 12 chains x 2 FLOP x lanes: ~10 ms per run at a few GHz

__attribute__((target("avx2,fma"))) float chains_256(float seed) {
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(seed);
  __m256 c[kChains];
  for (int k = 0; k < kChains; ++k) c[k] = _mm256_set1_ps(static_cast<float>(k));
  for (long s = 0; s < kSteps; ++s)
    for (int k = 0; k < kChains; ++k) c[k] = _mm256_fmadd_ps(c[k], a, b);
  __m256 t = c[0];
  for (int k = 1; k < kChains; ++k) t = _mm256_add_ps(t, c[k]);
  alignas(32) float out[8];
  _mm256_store_ps(out, t);
  return out[0] + out[7];
}

__attribute__((target("avx512f"))) float chains_512(float seed) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(seed);
  __m512 c[kChains];
  for (int k = 0; k < kChains; ++k) c[k] = _mm512_set1_ps(static_cast<float>(k));
  for (long s = 0; s < kSteps; ++s)
    for (int k = 0; k < kChains; ++k) c[k] = _mm512_fmadd_ps(c[k], a, b);
  __m512 t = c[0];
  for (int k = 1; k < kChains; ++k) t = _mm512_add_ps(t, c[k]);
  return _mm512_reduce_add_ps(t);
}

double run(float (*chains)(float), int lanes, int threads) {
  threads = std::max(1, threads);
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<float> sink(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        sink[t] = chains(0.5f + static_cast<float>(t));
      });
    while (ready.load() < threads) std::this_thread::yield();
    const auto t0 = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    for (auto& th : pool) th.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    volatile float keep = sink[0];  // the chains' results are used: the loops stay
    (void)keep;
  }
  const double flop = 2.0 * lanes * kChains * static_cast<double>(kSteps) * threads;
  return flop / best / 1e9;
}

}  // namespace

double fma_peak_gflops(int vector_bytes, int threads) {
  if (vector_bytes == 32 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return run(chains_256, 8, threads);
  if (vector_bytes == 64 && __builtin_cpu_supports("avx512f")) return run(chains_512, 16, threads);
  return 0.0;
}

#else

double fma_peak_gflops(int, int) { return 0.0; }

#endif

}  // namespace scorch
