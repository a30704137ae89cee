// The multiply-add throughput this CPU reaches at a vector width: the ceiling of a compute-bound kernel (a
// block-sparse or dense-enough SpMM), as the STREAM triad is the ceiling of a memory-bound one. The kernel
// benchmark reports kernels as a fraction of it, so that a target beyond what the hardware can do shows as such
// (2 threads, Zen 5: a BSR SpMM under x86-64-v3 ran at 80% of the 32-byte peak, where 2x over the CSR kernel
// would have needed 130% of it).
#pragma once

namespace scorch {

// Float32 GFLOP/s (a multiply-add counts 2) of `threads` threads each running independent chains of
// `vector_bytes`-wide fused multiply-adds (32: AVX2 + FMA, 64: AVX-512) with no memory traffic: the best of 5
// runs of about 10 ms. 0 when this CPU or build has no such instruction.
double fma_peak_gflops(int vector_bytes, int threads);

}  // namespace scorch
