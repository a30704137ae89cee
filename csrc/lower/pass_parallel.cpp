// Pass: parallelisation. The thread region around each thread's part (output assembly made it): the thread
// count (the caller's when the iteration pass split the outer loop, else one), each thread's id and count,
// its flag for index values out of range (kernel_abi.h) gathered after the region, and the status returned.
// Which loop is split, and how (balanced by nonzeros, positions of a sparse outer level), is decided by the
// iteration pass, where the loop's bounds are made.
#include "lower/passes.h"

namespace scorch::passes {

using loops::line;
using loops::Stmts;

void parallelize(KernelIR& k) {
  if (k.native) return;
  Stmts region{line("const int tid = omp_get_thread_num();"), line("const int nt = omp_get_num_threads();"),
               line("(void)tid; (void)nt;"), line("int bad = 0;")};
  region.insert(region.end(), k.thread.begin(), k.thread.end());
  region.push_back(line("if (bad) __atomic_store_n(&bad_index, 1, __ATOMIC_RELAXED);"));

  Stmts b{loops::decl("int", "nthreads", loops::text(k.parallel ? "args->num_threads > 0 ? args->num_threads : 1" : "1"))};
  b.insert(b.end(), k.setup.begin(), k.setup.end());
  b.push_back(loops::decl("int", "bad_index", loops::integer(0)));
  b.push_back(loops::parallel(loops::var("nthreads"), region));
  b.insert(b.end(), k.teardown.begin(), k.teardown.end());
  // A bad index outranks a failed allocation: it is the caller's to report, with the buffer at fault.
  b.push_back(line("if (bad_index) args->status = SCORCH_STATUS_BAD_INDEX;"));
  b.push_back(line("return args->status;"));
  k.body.insert(k.body.end(), b.begin(), b.end());
  k.thread.clear();
  k.setup.clear();
  k.teardown.clear();
}

}  // namespace scorch::passes
