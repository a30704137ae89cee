// Whether this CPU reads a vector of elements through an index faster with scalar loads than with its gather
// instruction. On the Zen 5 machine Scorch was measured on, an SpMV over rows of ~900 entries ran 2x faster
// with vectors built from scalar loads than with AVX-512 gathers (89 -> 44 us, 2 threads), and a little faster
// under AVX2 (49-63 -> 46 us); gathers are known to be quick on other CPUs. So it is measured, not assumed.
#pragma once

namespace scorch {

// True when building `vector_bytes`-wide float vectors from scalar loads (and multiply-adding them) ran at
// least 10% faster than the gather instruction of that width (32: AVX2, 64: AVX-512) on this CPU. Measured
// once per width per process, in about a millisecond, on a table that stays in L1 (the cost of the
// instruction, not of the memory behind it). False where this CPU or build has no such instruction.
bool soft_gathers_faster(int vector_bytes);

}  // namespace scorch
