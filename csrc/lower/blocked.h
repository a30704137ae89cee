// Native kernels over blocked levels: a BSR operand (a dense level of block rows, a compressed level of
// block columns, and the r x c block as two dense inner levels) times a dense operand, run over the block
// structure with the inner block as dense register blocks: no conversion to CSR. See docs/levels.md.
//
// Two statement forms are recognised (A the blocked operand, D strided, the output strided):
//   spmm:    out(p, k) = A(p, q) * D(q, k)    (einsum "ij,jk->ik")
//   linear:  out(k, p) = D(k, q) * A(p, q)    (einsum "bk,nk->bn", F.linear with a BSR weight)
// Other statements with a blocked operand are planned as before (the operand converted to CSR).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

namespace scorch {

struct BlockedMatch {
  enum class Form { spmm, linear };
  Form form = Form::spmm;
  int sparse = -1, dense = -1;  // operand numbers of A and D
  int p = -1, q = -1, k = -1;   // index variables: A(p, q); k the dense operand's free variable
  int64_t bh = 1, bw = 1;       // block shape
};

// The block shape when `f` stores a 2-D tensor as BSR: block rows dense, block columns compressed (ordered,
// unique), then the block's rows and columns dense.
bool bsr_blocks(const Format& f, int64_t& bh, int64_t& bw);

// Whether the statement is one of the native blocked forms with these operands and output storage.
std::optional<BlockedMatch> match_blocked(const ir::Statement& st, const std::vector<Storage>& operands,
                                          const Storage& output);

// The kernel of a matched spec (the caller checked match_blocked).
LoweredKernel lower_blocked(const KernelSpec& spec, const Schedule& sched, const BlockedMatch& m,
                            const VectorShape& machine);

}  // namespace scorch
