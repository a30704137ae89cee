// A generated kernel outside the loop-IR pipeline: the grouped dense product of the mixture of experts,
// out[rows of group q] = A[rows of group q] @ W[q], for every group q, with the weights streamed from memory
// under the arithmetic (software prefetch of the next block of weights while this one is multiplied).
//
// Spec text: "grouped_product f32" or "grouped_product f64" -- nothing else; the source is built from the
// value type and the target's vector shape only (no user text). The tile (rows x vectors of accumulators) is
// the largest that fits the target's vector registers (grouped_tile); on a target without vectors (scalar)
// a "vector" is one value.
//
// The kernel's arguments (scorch_kernel_args):
//   inputs:  A (entries x K, rows lda apart), W (groups x K x N: group q at q * wq, rows ldw apart, columns
//            contiguous), starts and counts (int64 per group: the rows of group q are starts[q] ..
//            starts[q] + counts[q] of A and of the output), units (int64 triples: group, first column, end
//            column; run in this order, shared among the threads as they come free), bias (groups x N, group q
//            at q * bq, columns contiguous; null: none) added to every row of its group before the ReLU.
//   sizes:   groups, K, N, units, relu (1: max(x, 0) of every result; NaN stays NaN).
//   strides: lda, wq, ldw, ldc, bq.
//   out_dense: (entries x N, rows ldc apart); every element of every unit's rows and columns is written.
#pragma once

#include <string>

#include "lower/vector_shape.h"

namespace scorch {

inline constexpr const char* kGroupedProductSpec = "grouped_product";

struct GroupedTile {
  int rows = 0;     // rows of A per register tile
  int vectors = 0;  // vectors of output columns per register tile
};

// The register tile for vectors of `machine`: the most accumulators (rows x vectors) such that they, one
// vector of weights per column vector and a broadcast value fit the registers; rows <= 8, vectors <= 4; on a
// tie a panel of whole 64-byte lines, then the fewest loads per multiply-add. AVX-512 (32 registers): 6 x 4;
// AVX2 (16): 6 x 2. A scalar target counts 16 registers of one value.
GroupedTile grouped_tile(const VectorShape& machine);

// Whether `spec` names this kernel ("grouped_product f32" / "grouped_product f64").
bool is_grouped_product_spec(const std::string& spec);

// The kernel's C++ source for `spec` on `machine`; throws for a spec that is not one of the two above.
std::string grouped_product_source(const std::string& spec, const VectorShape& machine);

}  // namespace scorch
