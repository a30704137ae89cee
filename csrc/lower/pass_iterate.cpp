// Pass: iteration. The general Lowerer (lowerer.h, lower.cpp, linear_merge.cpp, register_tile.cpp) makes
// one thread's loop nest: a loop per index variable in schedule order, its form from the merge lattice of
// the expression at that variable (a dense loop locating into dense levels and merging sparse iterators, a
// counted loop over one sparse iterator, co-iterating while loops, or one linear merge of many iterators),
// the value summed where the output mode wants it (the sink), register tiles of dense output columns with
// their prefetches, and the thread's share of the outer loop. Reductions over contiguous operands come out
// as unit-stride loops for the vectorisation pass.
#include "lower/lowerer.h"
#include "lower/passes.h"

namespace scorch::passes {

void iterate(KernelIR& k) {
  if (k.native) return;
  lowering::Lowerer(*k.spec, *k.sched, k.machine).run(k);
}

}  // namespace scorch::passes
