// Differentiation of statements. For out(O) = e and an operand T, the gradient of a loss L with respect to
// T is the statement
//   dT(I) = sum over the accesses a of T in e:  G(O) * de/da   (a's indices renamed to I)
// where G = dL/dout and de/da is the symbolic partial derivative (products by the product rule, sums term by
// term). Indices outside I are summed with the usual scoping. For a sparse T the caller multiplies by T's
// pattern so that only T's stored positions are computed (SDDMM-style; no dense gradient is formed).
#pragma once

#include <optional>

#include "ir/expr.h"

namespace scorch {

// The gradient statement over the original tensors plus G (tensor number st.num_tensors()) and, when
// `with_pattern`, a pattern tensor P(I) (number st.num_tensors() + 1) multiplied into every contribution. Empty when the
// statement does not depend on `tensor`. Raises ValueError for an access with a repeated index.
std::optional<ir::Statement> differentiate(const ir::Statement& st, int tensor, bool with_pattern);

}  // namespace scorch
