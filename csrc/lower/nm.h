// Native kernels over n:m levels (structured sparsity, format/nm_level.cpp): a 2-D operand whose rows are a
// located level and whose columns an n:m level (LevelKind::structured_groups), times a dense operand, run
// over the groups' masks with register tiles of the dense operand: no conversion to CSR. See docs/levels.md.
//
// Two statement forms (A the n:m operand, D strided, the output strided):
//   spmm:    out(p, k) = A(p, q) * D(q, k)    (einsum "ij,jk->ik", A @ B)
//   linear:  out(k, p) = D(k, q) * A(p, q)    (einsum "bk,nk->bn", F.linear with an n:m weight)
// Any other statement with an n:m operand is planned as before: the operand converted to CSR.
#pragma once

#include <optional>

#include "lower/kernel_spec.h"
#include "lower/lower.h"
#include "lower/schedule.h"

namespace scorch {

struct NmMatch {
  enum class Form { spmm, linear };
  Form form = Form::spmm;
  int sparse = -1, dense = -1;  // operand numbers of A and D
  int p = -1, q = -1, k = -1;   // index variables: p A's rows (the located level), q its n:m columns
  int n = 0, m = 0;
};

// n and m when `f` stores a 2-D tensor as a located level over one dimension then an n:m level over the
// other (the preset nm(n,m), or its transpose).
bool nm_levels(const Format& f, int& n, int& m, int& row_dim);

// Whether the statement is one of the native n:m forms with these operands and output storage.
std::optional<NmMatch> match_nm(const ir::Statement& st, const std::vector<Storage>& operands, const Storage& output);

// The kernel of a matched spec (the caller checked match_nm).
LoweredKernel lower_nm(const KernelSpec& spec, const Schedule& sched, const NmMatch& m, const VectorShape& machine);

}  // namespace scorch
