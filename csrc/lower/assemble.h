// Sparse outputs assembled inside the kernel: statements whose result is a CSR-like matrix (a dense level, then
// a compressed level with pos/crd buffers) and whose operands are CSR-like too are lowered to kernels that
// write the result's pos, crd and values directly, instead of pushing every entry through a per-thread stream
// of int64 coordinates that the runtime then joins, checks and packs.
//
// Two statement forms (level variables, i.e. the index variable of each storage level, in storage order):
//   gustavson:  out[p, r] = A[p, q] * B[q, r]    (A·B with both operands stored row by row: SpGEMM)
//               each output row is the sum of B's rows q scaled by A's entries (p, q), collected in a
//               workspace chosen per row (see below) and written sorted.
//   merge:      out[p, q] = a*A[p, q] (+|-) b*B[p, q]   (a linear combination of two operands: SpAdd, SpSub)
//               each output row is the merge of the two operands' rows.
// `A`, `B` and the output are matched by what their levels can do (walk, positions read from a "pos" buffer,
// ordered, unique), not by their names. Other statements go to the general Lowerer.
//
// Output protocol (LoweredKernel::assembled_output): the kernel returns in args->out_coords the address of an
// array of the output's index buffers in Format::buffer_names() order (here: pos, crd), each allocated by the
// kernel (pos: rows + 1 entries, crd: out_nnz entries, both idx_t), and in out_vals the out_nnz values; the
// caller takes them as they are and frees every one of them, and the array, with scorch_kernel_free. The
// entries are sorted within each row and unique. A result with more entries than idx_t can count (int32
// indices) comes back with status OK, out_nnz set and out_coords null: the caller reports it. On any other
// failure nothing is returned (out_coords and out_vals stay null).
//
// The kernel runs in one thread region:
//   1. the operands' rows are checked once (rows_in_range: monotone positions inside the crd buffer,
//      coordinates inside their extents), each thread a share; every later read is unchecked;
//   2. gustavson: each row's upper bound of entries (the lengths of the B rows its entries select) and their
//      prefix sum; threads then split the rows so that each gets about the same number of multiply-adds.
//      merge: threads split the rows by the stored entries of both operands;
//   3. each thread computes its rows into its own crd/value buffers and writes each row's count into pos;
//   4. one thread sums the threads' counts and allocates the result; every thread copies its entries in (the
//      result's pages first touched by all threads at once) and turns its rows' counts into positions. When
//      thread 0's buffers are too large to keep (below), they grow into the result instead (realloc of a large
//      block remaps its pages) and only the other threads copy theirs.
// So the entries are written twice: once into the thread's buffers, once into the result. A thread's buffers
// (up to 2^23 entries) and its dense workspace are kept from one call to the next in a slot per thread number,
// taken and put back atomically (calls running at once never share one), so that their pages are not faulted in
// and cleared again at every call: that, not the copy, was what the result's assembly cost.
//
// The workspace of a gustavson row, chosen per row from its upper bound u (entries it may produce) and the
// dense workspace's size: a row of one entry is B's row scaled (already sorted: no workspace); otherwise, if a
// dense workspace over the output's columns (a value, a bit and a byte per column) fits this CPU's L2 cache, it
// is used for every row; if not, rows whose hash table (a power of two >= 2u slots) fits half of L2 use the hash
// table and the rest the dense workspace. The dense workspace's values stay zero where no product landed, so
// products are added without a branch on whether the column is new. A row whose bound is at least an eighth of
// its span (first to last column of the B rows it selects) sets a byte per column and reads the span's bytes
// back 8 at a time, in column order; other rows list each column, count it when its bit was clear (branch-free),
// and come out sorted by reading the span's words of bits, or, when those outnumber a few times what sorting the
// list takes (m log2 m for m columns), by sorting the list; a hashed row's are sorted.
#pragma once

#include <optional>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

namespace scorch {

struct AssembleMatch {
  enum class Form { gustavson, merge };
  Form form = Form::gustavson;
  int a = -1, b = -1;        // operand numbers
  int p = -1, q = -1, r = -1;  // level variables (see above); merge uses p and q only
};

// Whether `f` stores a matrix row by row as this lowering needs: two levels, the first located (dense) and the
// second iterated through pos/crd buffers (prefix positions), ordered and unique, neither blocked.
bool csr_like(const Format& f);

// The form the spec has, if any.
std::optional<AssembleMatch> match_assembled(const KernelSpec& spec);

// The kernel of a matched spec (the caller checked match_assembled).
LoweredKernel lower_assembled(const KernelSpec& spec, const Schedule& sched, const AssembleMatch& m,
                              const VectorShape& machine);

}  // namespace scorch
