// REFERENCE ONLY: a hand-written, register-blocked CSR SpMM (C = A B, A CSR float32/int32, B dense row-major)
// used by benchmarks/spmm_yardstick.py as the yardstick the generated kernels are measured against. The
// library never calls it. It is compiled at benchmark time with the same compiler flags as the kernels of the
// chosen target, and its vector width comes from that target's instruction-set macros.
//
// The timing harness below also loads a generated Scorch kernel (its .so, through the ABI of
// csrc/codegen/kernel_abi.h) and times both the same way: same threads, same operands, warm-ups, median of
// repeats, no Python in the timed loop.
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "codegen/kernel_abi.h"

#if defined(__AVX512F__)
#define REF_VECTOR_BYTES 64
#elif defined(__AVX__)
#define REF_VECTOR_BYTES 32
#elif defined(__SSE2__) || defined(__ARM_NEON)
#define REF_VECTOR_BYTES 16
#else
#define REF_VECTOR_BYTES 0
#endif

namespace {

#if REF_VECTOR_BYTES > 0
typedef float vf __attribute__((vector_size(REF_VECTOR_BYTES)));
constexpr int W = REF_VECTOR_BYTES / 4;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void add_store(float* p, vf v) {
  vf o = load(p);
  o += v;
  std::memcpy(p, &o, sizeof o);
}

// V vectors (V * W columns starting at j0) of one row, accumulated in registers across the row's nonzeros.
template <int V>
inline void row_tile(const int32_t* crd, const float* val, int64_t kb, int64_t ke, const float* B, int64_t n,
                     int64_t j0, float* c) {
  vf acc[V];
  for (int q = 0; q < V; ++q) acc[q] = vf{};
  for (int64_t k = kb; k < ke; ++k) {
    const float a = val[k];
    const float* b = B + static_cast<int64_t>(crd[k]) * n + j0;
    for (int q = 0; q < V; ++q) acc[q] += a * load(b + q * W);
  }
  for (int q = 0; q < V; ++q) add_store(c + j0 + q * W, acc[q]);
}
#endif

// tile_vectors: vectors per full tile (0: scalar loop).
void spmm_rows(int64_t r0, int64_t r1, const int32_t* pos, const int32_t* crd, const float* val, const float* B,
               int64_t n, float* C, int tile_vectors) {
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t kb = pos[i], ke = pos[i + 1];
    float* c = C + i * n;
    int64_t j = 0;
#if REF_VECTOR_BYTES > 0
    if (tile_vectors >= 16) {
      for (; j + 16 * W <= n; j += 16 * W) row_tile<16>(crd, val, kb, ke, B, n, j, c);
    }
    if (tile_vectors >= 8) {
      for (; j + 8 * W <= n; j += 8 * W) row_tile<8>(crd, val, kb, ke, B, n, j, c);
    }
    if (tile_vectors >= 4) {
      for (; j + 4 * W <= n; j += 4 * W) row_tile<4>(crd, val, kb, ke, B, n, j, c);
    }
    for (; j + 2 * W <= n; j += 2 * W) row_tile<2>(crd, val, kb, ke, B, n, j, c);
    for (; j + W <= n; j += W) row_tile<1>(crd, val, kb, ke, B, n, j, c);
#endif
    for (; j < n; ++j) {
      float s = 0;
      for (int64_t k = kb; k < ke; ++k) s += val[k] * B[static_cast<int64_t>(crd[k]) * n + j];
      c[j] += s;
    }
  }
}

// Rows [0, m) split so each thread gets about the same number of nonzeros.
int64_t split(const int32_t* pos, int64_t m, int t, int nt) {
  if (t <= 0) return 0;
  if (t >= nt) return m;
  const int64_t target = static_cast<int64_t>(pos[m]) * t / nt;
  return std::lower_bound(pos, pos + m + 1, static_cast<int32_t>(target)) - pos;
}

void reference(int64_t m, int64_t n, const int32_t* pos, const int32_t* crd, const float* val, const float* B,
               float* C, int threads, int tile_vectors) {
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    spmm_rows(split(pos, m, t, nt), split(pos, m, t + 1, nt), pos, crd, val, B, n, C, tile_vectors);
  }
}

template <typename F>
double median_seconds(F&& f, int warmup, int repeats) {
  for (int r = 0; r < warmup; ++r) f();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

extern "C" int ref_vector_bytes() { return REF_VECTOR_BYTES; }

// Times the generated kernel in `kernel_lib` (spec: out(i0,i1) = t0(i0,i2) * t1(i2,i1), t0 CSR, t1 and out
// strided, f32, i32) and the reference with each tile width in `tiles`, keeping the best reference. Both
// outputs are compared. Returns 0 on success.
extern "C" int compare_spmm(const char* kernel_lib, int64_t m, int64_t k, int64_t n, const int32_t* pos,
                            const int32_t* crd, const float* val, const float* B, int threads, int warmup,
                            int repeats, double* t_generated, double* t_reference, int* best_tile,
                            double* max_abs_diff) {
  void* h = dlopen(kernel_lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) return 1;
  auto fn = reinterpret_cast<scorch::KernelFn>(dlsym(h, "scorch_kernel"));
  if (!fn) return 2;
  std::vector<float> c_gen(m * n), c_ref(m * n);
  const void* inputs[] = {pos, crd, val, B};
  const int64_t sizes[] = {m, n, k};
  const int64_t strides[] = {n, 1};
  // Buffer lengths as scorch::kernel passes them, so the kernel checks its index loads as it does in use.
  const int64_t lengths[] = {m + 1, pos[m], pos[m], k * n};
  auto run_generated = [&] {
    std::fill(c_gen.begin(), c_gen.end(), 0.0f);  // the caller zero-fills, as scorch::kernel does
    scorch::scorch_kernel_args args{const_cast<void* const*>(inputs), sizes, strides, c_gen.data(), 0,
                                    nullptr, nullptr, threads, 0, lengths};
    return fn(&args);
  };
  if (run_generated() != 0) return 3;
  // The reference's best tile width first (a short run each), then the two timed in alternation, call by
  // call, so drift (frequency, caches, the OpenMP pool waking up) hits both alike.
  double best = 1e30;
  *best_tile = 2;
  for (int tile : {16, 8, 4, 2}) {
    if (tile == 16 && REF_VECTOR_BYTES > 0 && REF_VECTOR_BYTES * 16 / 4 > n) continue;
    const double t = median_seconds([&] { reference(m, n, pos, crd, val, B, c_ref.data(), threads, tile); },
                                    warmup, std::max(5, repeats / 3));
    if (t < best) {
      best = t;
      *best_tile = tile;
    }
  }
  auto run_reference = [&] {
    std::fill(c_ref.begin(), c_ref.end(), 0.0f);
    reference(m, n, pos, crd, val, B, c_ref.data(), threads, *best_tile);
  };
  for (int r = 0; r < warmup; ++r) {
    run_generated();
    run_reference();
  }
  std::vector<double> tg, tr;
  for (int r = 0; r < repeats; ++r) {
    tg.push_back(median_seconds(run_generated, 0, 1));
    tr.push_back(median_seconds(run_reference, 0, 1));
  }
  std::sort(tg.begin(), tg.end());
  std::sort(tr.begin(), tr.end());
  *t_generated = tg[tg.size() / 2];
  *t_reference = tr[tr.size() / 2];
  double diff = 0;
  for (int64_t q = 0; q < m * n; ++q) diff = std::max(diff, static_cast<double>(std::fabs(c_gen[q] - c_ref[q])));
  *max_abs_diff = diff;
  dlclose(h);
  return 0;
}
