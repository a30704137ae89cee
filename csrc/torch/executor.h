// The run-time path of a sparse call, owned by C++: given an einsum equation (or a parsed statement) and its
// operands, find the plan (cached per equation, formats, shapes and sizes), make the dense-or-sparse choice,
// convert the operands the plan asks for, and run the kernel through the scorch::kernel op (so autograd, the
// profiler and fake tensors see one op). Eager einsum and compute, and the backward of scorch::kernel, all
// come through here; Python only hands operands in and wraps the result.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "format/format.h"
#include "ir/expr.h"
#include "lower/plan.h"

namespace scorch::torch_glue {

// A format parsed once per process (per text and rank) and never freed, so that operands and plans can
// point at it; `text` is its canonical form.
struct FormatRef {
  Format format;
  std::string text;
};
const FormatRef& interned_format(const std::string& text, int ndim);

// An operand as the executor holds it: an ordinary dense tensor (`format` null, the tensor in `values`), or
// a format's index buffers and stored values.
struct Operand {
  const FormatRef* format = nullptr;
  std::vector<int64_t> shape;
  std::vector<at::Tensor> buffers;
  at::Tensor values;

  bool sparse() const { return format != nullptr; }
  int64_t nnz() const;  // stored values; 0 when symbolic and unknown (under tracing: planning needs no more)
  int64_t numel() const;
  double density() const;
  OperandDesc desc() const;
  at::Tensor to_dense() const;      // differentiable in the values (scorch::to_dense)
  at::Tensor coordinates() const;   // (ndim, nnz) int64, storage order (scorch::unpack)
  Operand with_values(at::Tensor v) const;
};

// Where a call ran, and why.
enum class Route { kernel, dense, caller };  // caller: a dense run whose result must be sparse (Python does it)

struct Decision {
  bool dense = false;
  std::string why;  // filled only when asked for (it formats numbers)
};

// The dense-or-sparse choice from the sparse operands' densities and the dense elements of all operands (no
// check of the values): SCORCH_DISPATCH forces a side; else a tiny problem or sparse operands denser (combined)
// than the crossover go dense.
Decision choose_by_density(const std::vector<double>& densities, int64_t elements, int64_t threads, bool explain);

// Measures (or loads) the crossover for a thread count and the current target and hands it to
// set_calibrated_crossover; the Python package installs it. Without one (a C++ program), the crossover is
// SCORCH_DENSE_CROSSOVER or a fixed fallback.
void set_calibration_hook(std::function<void(int64_t threads)> hook);

// The crossover is the one calibrated for `threads` and the current target (set_calibrated_crossover, measured
// through the calibration hook the first time), unless SCORCH_DENSE_CROSSOVER overrides it. A tiny problem
// with a stored sparse operand takes the kernel (densifying it would cost more). The values are not checked:
// finite_or_kernel, on the final choice.
Decision choose(const std::vector<Operand>& ops, int64_t threads, bool explain);

// A dense choice turned back to the kernel when `finite` says some operand holds inf or NaN.
Decision finite_or_kernel(Decision d, const std::function<bool()>& finite, bool explain);

struct Outcome {
  Route route = Route::kernel;
  Operand result;
  std::string why;
  const Plan* plan = nullptr;  // the kernel plan (also when the dense side ran)
};

// einsum("ij,jk->ik", ...). `out_format`: "" infer, "strided" dense, else a format's text.
// `decide` false skips the cost model: the sparse kernel runs (the caller decided).
// `dense_first`: dense factors holding a summed index no sparse operand holds may be contracted first (ATen),
// the rest then runs as a smaller product (executor.cpp, plan_dense_first). Only for the user's eager calls:
// regions and attention run the kernels they planned (and bundled) ahead.
Outcome run_einsum(const std::string& equation, const std::vector<Operand>& ops, const std::string& out_format,
                   int64_t threads, bool explain, bool decide = true, bool dense_first = false);

// How many einsum calls went each way since the process started (for tests and tools).
struct RouteCounts {
  int64_t kernel = 0, dense = 0, caller = 0;
};
RouteCounts route_counts();

// Eager calls whose dense/sparse choice was settled by timing both paths (the density was near the crossover),
// and how many of those kept the dense path.
struct EagerMeasureStats {
  int64_t measured = 0, kept_dense = 0;
  int64_t contended = 0, remeasured = 0;  // timed on a busy machine; taken again for that (measured_choice.h)
};
EagerMeasureStats eager_measure_stats();

// The crossover density measured for a thread count and target (the Python cost model measures it).
void set_calibrated_crossover(int64_t threads, const std::string& target, double crossover);

// A parsed statement over ops (t0..t{n-1}): split into steps by reduction scope, each run as one kernel.
// `out_format` applies to the last step.
Operand run_statement(const ir::Statement& st, const std::vector<Operand>& ops, const std::string& out_format,
                      int64_t threads);

// Index notation text with operand names, as sb.compute takes it.
Operand run_compute(const std::string& text, const std::vector<std::string>& names, const std::vector<Operand>& ops,
                    const std::string& out_format, int64_t threads);

// The operand in another format (coordinates re-packed; zeros a dense last level pads are dropped unless a
// gradient is wanted). With a gradient wanted its values are read again from x's through autograd (values_at).
Operand to_format(const Operand& x, const FormatRef& target, at::ScalarType index_dtype);
// src's values at the coordinates `coords` ((ndim, n) int64, within src.shape): the sum of src's entries at each
// (zero where it stores none), differentiable in src.values. What a conversion or a gradient needs to keep
// autograd's graph: the packing ops work on detached tensors.
at::Tensor values_at(const Operand& src, const at::Tensor& coords);

// The result dtype of a call (type promotion over the operands' values) and the dtype kernels compute in.
at::ScalarType result_dtype(const std::vector<Operand>& ops);
// The dtype kernels compute in for a result dtype (float or double).
at::ScalarType compute_dtype(at::ScalarType result);

// The kernel plan for an einsum over operands so described: run_einsum plans through it (once per equation,
// formats, shapes and sizes), and so does a prediction of the kernels a call will run (region_kernel_specs).
Plan plan_einsum(const std::string& equation, const std::vector<OperandDesc>& descs, const std::string& out_format,
                 bool f64, bool idx64);

// Whether an operand (format null: dense) makes a call index in int64: more stored entries or a larger
// dimension than int32 holds, or an all-dense format (no buffers). Int64 index buffers do too.
bool needs_index64(const FormatRef* format, int64_t nnz, const std::vector<int64_t>& shape);

}  // namespace scorch::torch_glue
