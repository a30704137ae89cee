// The sampled dot products of SDDMM as a native form (lower/native_forms.h).
#pragma once

#include <optional>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

namespace scorch {

// SDDMM, the sampled output written at the sampling operand's positions (OutputMode::sampled):
//   out[p, q] = S[p, q] * P[p, k] * Q[q, k]   (S row-stored as above, P and Q strided with k last)
// Each output value is S's value times the dot product of P's row p and Q's row q. The general lowering
// computes each dot product alone, multiplying by S's value inside the loop, and reduces it across the vector
// lanes before the next; here the entries of a row go G at a time: P's row is loaded once for G of Q's rows,
// each entry sums into two vector accumulators (2G independent chains for the multiply-adds' latency), the G
// sums are reduced across lanes together (pairs of vectors folded by shuffles into one vector holding G
// segments, then each segment onto its first lane: G - 1 + log2(W / G) shuffle-adds per group instead of W - 1
// adds per entry, when G and the lane count W are powers of two with G <= W), S's value is applied once to each
// sum, and the Q rows of the next G entries are prefetched when Q outgrows half of L2 (they are gathered in an
// order no hardware prefetcher follows). Long rows against a Q larger than half of L2 go in 2-D tiles (a
// block of rows, a quarter of L2 of P, visits Q one column range of half of L2 at a time, each row's entries in
// the range found by binary search), so a Q row is fetched from beyond L2 once per block, not once per entry;
// only when the rows hold a group of entries per column range on average and their columns are sorted (both
// checked where the kernel runs, from its L2 size). G comes from the target's register
// tile (tile_vectors / 2 entries), the vector width from its registers; targets without vectors keep the
// general lowering.
struct SampledDotMatch {
  int s = -1, p_op = -1, q_op = -1;  // operands S, P, Q
  int p = -1, q = -1, k = -1;        // S's level variables and the summed variable
};
std::optional<SampledDotMatch> match_sampled_dot(const KernelSpec& spec, const Schedule& sched,
                                                 const VectorShape& machine);
LoweredKernel lower_sampled_dot(const KernelSpec& spec, const Schedule& sched, const SampledDotMatch& m,
                                const VectorShape& machine);

}  // namespace scorch
