// Pass: output assembly. Around one thread's nest, what its output mode needs: the dense output pointer
// (`o`: the output itself, or a private copy when the outer loop is a reduction), the thread's output
// stream (`st`), the row workspace (ws_val, ws_flag, ws_list); before the thread region, the buffers
// shared by the threads (streams, private copies, the sampled output); after it, the private copies summed
// into the output and the streams joined. The sinks inside the nest (where each value goes) are chosen by
// the iteration pass, which knows the loop each value is computed in.
#include <fmt/format.h>

#include "lower/passes.h"

namespace scorch::passes {

using loops::line;
using loops::Stmts;

void output_assembly(KernelIR& k) {
  if (k.native) return;
  const KernelSpec& spec = *k.spec;
  const Schedule& sched = *k.sched;
  // Sparse outputs come back through per-thread streams, except a sampled one, written in place.
  const bool sparse_output = !spec.output.strided() && sched.output != OutputMode::sampled &&
                             sched.output != OutputMode::fibers;

  // One thread's part.
  Stmts thread;
  if (sparse_output) thread.push_back(line("Stream& st = streams[tid];"));
  Stmts inner;  // inside the scope where the thread's output is ready
  if (sched.output == OutputMode::workspace) {
    const std::string n = fmt::format("N{}", sched.workspace_var);
    inner.push_back(line(fmt::format("val_t* ws_val = (val_t*)calloc({0} ? {0} : 1, sizeof(val_t));", n)));
    inner.push_back(line(fmt::format("unsigned char* ws_flag = (unsigned char*)calloc({0} ? {0} : 1, 1);", n)));
    inner.push_back(line(fmt::format("int64_t* ws_list = (int64_t*)malloc(({0} ? {0} : 1) * sizeof(int64_t));", n)));
    inner.push_back(line("int64_t ws_n = 0;"));
    inner.push_back(loops::if_chain({loops::text("!ws_val || !ws_flag || !ws_list"), nullptr},
                                    {{line("args->status = SCORCH_STATUS_NO_MEMORY;")}, k.nest}));
    inner.push_back(line("free(ws_val); free(ws_flag); free(ws_list);"));
  } else {
    inner = k.nest;
  }
  // A scalar result is summed in double, each thread's part in a local, the parts added in thread order: summed
  // in float into the output, a thread's sum of ones stopped growing at 2^24 (helper-53: 33554432 for the sum of
  // 41943040 ones on two threads; torch.sum gives the count).
  const bool scalar_out = spec.output.strided() && spec.stmt.out_vars.empty();
  if (scalar_out) {
    thread.push_back(line("double oacc = 0;"));
    thread.push_back(line("double* __restrict o = &oacc;"));
    thread.push_back(loops::block(inner));
    thread.push_back(line(sched.private_output ? "dacc[tid] = oacc;" : "out[0] = (val_t)oacc;"));
  } else if (spec.output.strided() && sched.private_output) {
    thread.push_back(line("val_t* __restrict o = tid == 0 ? out : (val_t*)calloc(out_numel ? out_numel : 1, sizeof(val_t));"));
    thread.push_back(line("priv[tid] = o;"));
    // A thread without its copy does nothing (out itself is null when the output is empty).
    thread.push_back(loops::if_chain({loops::text("tid != 0 && !o"), nullptr},
                                     {{line("args->status = SCORCH_STATUS_NO_MEMORY;")}, inner}));
  } else {
    if (spec.output.strided() || sched.output == OutputMode::fibers) thread.push_back(line("val_t* __restrict o = out;"));
    thread.push_back(loops::block(inner));
  }
  k.thread = thread;
  k.nest.clear();

  // Before the threads: buffers they share.
  if (sched.output == OutputMode::fibers)
    k.setup.push_back(line("val_t* __restrict out = (val_t*)args->out_dense;  // a dense block under each shared position"));
  if (sched.output == OutputMode::sampled)
    k.setup.push_back(line("val_t* __restrict sampled_out = (val_t*)args->out_dense;  // the sampling operand's size"));
  if (sched.private_output && k.parallel)
    k.setup.push_back(line("if (out_numel > (int64_t{1} << 24)) nthreads = 1;  // private copies would be too big"));
  if (sparse_output) {
    k.setup.push_back(line("Stream* streams = (Stream*)calloc(nthreads, sizeof(Stream));"));
    k.setup.push_back(line("if (!streams) return SCORCH_STATUS_NO_MEMORY;"));
  }
  if (sched.private_output && scalar_out) {
    k.setup.push_back(line("double* dacc = (double*)calloc(nthreads, sizeof(double));  // each thread's part"));
    k.setup.push_back(line("if (!dacc) return SCORCH_STATUS_NO_MEMORY;"));
  } else if (sched.private_output) {
    k.setup.push_back(line("val_t** priv = (val_t**)calloc(nthreads, sizeof(val_t*));"));
    k.setup.push_back(line("if (!priv) return SCORCH_STATUS_NO_MEMORY;"));
  }

  // After the threads: their results combined.
  if (sched.private_output && scalar_out) {
    k.teardown.push_back(loops::block({line("double total = 0;"),
                                       loops::for_range("t", "0", "nthreads", {line("total += dacc[t];")}),
                                       line("out[0] = (val_t)total;"), line("free(dacc);")}));
  } else if (sched.private_output) {
    k.teardown.push_back(loops::for_range("t", "1", "nthreads",
                                          {line("if (!priv[t]) continue;"),
                                           loops::for_range("q", "0", "out_numel", {line("out[q] += priv[t][q];")}),
                                           line("free(priv[t]);")}));
    k.teardown.push_back(line("free(priv);"));
  }
  if (sparse_output) {
    k.teardown.push_back(line(fmt::format("if (!join_streams(streams, nthreads, {}, args)) args->status = SCORCH_STATUS_NO_MEMORY;",
                                          spec.stmt.out_vars.size())));
    k.teardown.push_back(line("free(streams);"));
  }
}

}  // namespace scorch::passes
