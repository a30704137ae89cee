// The Python extension scorch_backend._C: format metadata for the Python layer, planning and kernel tools,
// and the eager entry points `einsum` and `compute`, which hand operands straight to the C++ executor
// (csrc/torch/executor.h). Loading it also loads libscorch_ops, which registers the torch.ops.scorch operators.
#include <atomic>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "chain.h"
#include "executor.h"
#include "kernel_call.h"
#include "region.h"
#include "region_kernels.h"
#include "region_compress.h"
#include "log_queue.h"
#include "python_signals.h"
#include "tensor_version.h"
#include "lower/kernel_spec.h"
#include "runtime/settings.h"

#include "common/error.h"
#include "format/format.h"
#include "ir/parser.h"
#include "ir/split_reductions.h"
#include "lower/differentiate.h"
#include "lower/plan.h"
#include "region_fingerprint.h"
#include "runtime/bundle.h"
#include "runtime/byte_hash.h"
#include "runtime/fma_probe.h"
#include "runtime/jit.h"
#include "runtime/target.h"

namespace py = pybind11;

namespace {

py::dict format_info(const std::string& spec, int ndim) {
  const scorch::Format f = scorch::Format::parse(spec, ndim);
  py::list levels;
  for (const auto& l : f.levels()) {
    const char* part = l.expr.part == scorch::LevelExpr::Part::whole   ? "whole"
                       : l.expr.part == scorch::LevelExpr::Part::outer ? "outer"
                                                                        : "inner";
    py::dict d;
    d["kind"] = l.kind->name();
    d["dim"] = l.expr.dim;
    d["part"] = part;
    d["block"] = l.expr.block;
    d["ordered"] = l.kind->properties().ordered;
    d["unique"] = l.kind->properties().unique;
    d["buffers"] = l.kind->buffer_names();
    levels.append(d);
  }
  py::dict out;
  out["canonical"] = f.str();
  out["name"] = f.short_name();
  out["buffer_names"] = f.buffer_names();
  out["levels"] = levels;
  out["all_dense"] = f.all_dense();
  return out;
}

std::vector<scorch::OperandDesc> descs(const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t>>& ops) {
  std::vector<scorch::OperandDesc> out;
  for (const auto& [f, shape, nnz] : ops) out.push_back({f, shape, nnz});
  return out;
}

py::dict plan_dict(const scorch::ir::Statement& st, const scorch::Plan& p) {
  py::dict d;
  d["spec"] = p.spec;
  d["convert"] = p.convert;
  d["out_format"] = p.out_format;
  d["var_sizes"] = p.var_sizes;
  d["out_shape"] = p.out_shape;
  d["reasons"] = p.reasons;
  d["statement"] = st.str();
  return d;
}

using OperandList = std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t>>;

py::dict plan_einsum(const std::string& equation, const OperandList& ops, const std::string& out_format, bool f64,
                     bool idx64) {
  std::vector<int> ndims;
  for (const auto& o : ops) ndims.push_back(static_cast<int>(std::get<1>(o).size()));
  const auto st = scorch::ir::parse_einsum(equation, ndims);
  return plan_dict(st, scorch::make_plan(st, descs(ops), out_format, f64, idx64));
}

py::dict plan_compute(const std::string& text, const std::vector<std::string>& names, const OperandList& ops,
                      const std::string& out_format, bool f64, bool idx64) {
  std::vector<int> ndims;
  for (const auto& o : ops) ndims.push_back(static_cast<int>(std::get<1>(o).size()));
  const auto st = scorch::ir::parse_index_notation(text, names, ndims);
  return plan_dict(st, scorch::make_plan(st, descs(ops), out_format, f64, idx64));
}

// Parse index notation (an einsum equation when `einsum`), check sizes against the operands' shapes, and split it
// into steps (see ir/split_reductions.h): a list of (canonical text over t0, t1, ..., global operand ids).
py::list split_compute(const std::string& text, const std::vector<std::string>& names,
                       const std::vector<std::vector<int64_t>>& shapes, bool einsum) {
  std::vector<int> ndims;
  for (const auto& s : shapes) ndims.push_back(static_cast<int>(s.size()));
  const auto st = einsum ? scorch::ir::parse_einsum(text, ndims) : scorch::ir::parse_index_notation(text, names, ndims);
  py::list out;
  for (const auto& step : scorch::ir::split_reductions(st, scorch::ir::infer_var_sizes(st, shapes)))
    out.append(py::make_tuple(step.stmt.canonical(), step.operands));
  return out;
}

std::vector<std::string> local_names(int n) {
  std::vector<std::string> names;
  for (int t = 0; t < n; ++t) names.push_back(fmt::format("t{}", t));
  return names;
}

// Index variables of each tensor (first access) and of the output of a canonical statement over t0..t{n-1}.
py::dict statement_info(const std::string& text, int num_tensors) {
  const auto st = scorch::ir::parse_index_notation(text, local_names(num_tensors));
  std::vector<std::vector<int>> vars(num_tensors);
  std::vector<bool> seen(num_tensors, false);
  std::vector<const scorch::ir::Expr*> acc;
  scorch::ir::collect_accesses(st.rhs, acc);
  for (const auto* a : acc)
    if (!seen[a->tensor]) {
      vars[a->tensor] = a->vars;
      seen[a->tensor] = true;
    }
  py::dict d;
  d["tensor_vars"] = vars;
  d["out_vars"] = st.out_vars;
  return d;
}

// The gradient statement of `tensor` (canonical, over t0..t{n-1}, t{n} = grad output, t{n+1} = pattern), or
// None when the statement does not depend on it.
py::object differentiate(const std::string& text, int num_tensors, int tensor, bool with_pattern) {
  const auto st = scorch::ir::parse_index_notation(text, local_names(num_tensors));
  const auto g = scorch::differentiate(st, tensor, with_pattern);
  if (!g) return py::none();
  return py::str(g->canonical());
}

// Build many kernels at once, `workers` compiler processes at a time, without holding the GIL.

void compile_kernels(const std::vector<std::string>& specs, int workers) {
  py::gil_scoped_release release;
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  std::mutex mu;
  std::string first_error;
  for (int w = 0; w < std::max(workers, 1); ++w) {
    pool.emplace_back([&] {
      for (size_t i; (i = next++) < specs.size();) {
        try {
          scorch::get_kernel(specs[i]);
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          if (first_error.empty()) first_error = e.what();
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  if (!first_error.empty()) throw scorch::Error(scorch::ErrorKind::runtime, first_error);
}

py::dict kernel_info(const std::string& spec) {
  const auto k = [&] { py::gil_scoped_release release; return scorch::get_kernel(spec); }();  // (may compile)
  py::dict d;
  d["spec"] = k->spec;
  d["statement"] = k->statement;
  d["schedule"] = k->schedule;
  d["reasons"] = k->reasons;
  d["loop_ir"] = k->loop_ir;
  d["source_path"] = k->source_path;
  d["library_path"] = k->library_path;
  d["seconds"] = k->seconds;
  d["compiled"] = k->compiled;
  d["target"] = k->target;
  d["overwrites_output"] = k->overwrites_output;
  d["assembled_output"] = k->assembled_output;
  return d;
}

py::dict target_dict(const scorch::Target& t) {
  py::dict d;
  d["name"] = t.name;
  d["flags"] = t.flags;
  d["arch"] = t.arch;
  d["features"] = t.features;
  d["vector_bytes"] = t.vector_bytes;
  d["vector_registers"] = t.vector_registers;
  d["soft_gathers"] = t.soft_gathers;
  d["tile_vectors"] = t.tile_vectors();
  d["fingerprint"] = t.fingerprint;
  d["summary"] = t.summary();
  return d;
}

// --- the eager entry points ------------------------------------------------------------------------------
namespace glue = scorch::torch_glue;

// The Python side's SparseTensor class and the function that wraps a sparse result into one, handed over
// once by the package (never freed: they live as long as the interpreter).
py::object* sparse_class = nullptr;
py::object* wrap_sparse = nullptr;

void register_python_types(py::object cls, py::object wrap) {
  sparse_class = new py::object(std::move(cls));
  wrap_sparse = new py::object(std::move(wrap));
}

// Tensors the executor may not touch directly: fake or functional tensors, functorch wrappers, symbolic
// sizes, other devices. Python handles those calls (and their errors).
bool plain(const at::Tensor& t) {
  const auto ks = t.key_set();
  if (ks.has(c10::DispatchKey::Python) || ks.has(c10::DispatchKey::Functionalize) ||
      ks.has(c10::DispatchKey::FuncTorchBatched) || ks.has(c10::DispatchKey::FuncTorchGradWrapper))
    return false;
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  return t.device().is_cpu();
}

// One operand from Python, or false when the call is not for the fast path.
bool operand_from_py(py::handle h, glue::Operand& out) {
  static const py::str s_format("_format"), s_canonical("canonical"), s_names("_buffer_names"),
      s_versions("_checked_versions"), s_check("check_unchanged"), s_values("_values"),
      s_diff_values("differentiable_values");
  if (!THPVariable_Check(h.ptr())) return false;
  const at::Tensor& t = THPVariable_Unpack(h.ptr());
  if (sparse_class && py::isinstance(h, *sparse_class)) {
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
    const std::string text = py::cast<std::string>(h.attr(s_format).attr(s_canonical));
    out.shape = t.sizes().vec();
    out.format = &glue::interned_format(text, static_cast<int>(out.shape.size()));
    const py::tuple names = h.attr(s_names);
    const py::tuple checked = h.attr(s_versions);
    bool changed = checked.size() != names.size();
    out.buffers.clear();
    for (size_t k = 0; k < names.size(); ++k) {
      py::object b = h.attr(names[k]);
      if (!THPVariable_Check(b.ptr())) return false;
      out.buffers.push_back(THPVariable_Unpack(b.ptr()));
      if (!plain(out.buffers.back())) return false;
      const int64_t version = glue::version_of(out.buffers.back());
      if (!changed && (version < 0 || py::cast<int64_t>(checked[k]) != version)) changed = true;
    }
    if (changed) h.attr(s_check)();  // re-validates buffers written in place since they were checked
    py::object v = t.requires_grad() ? h.attr(s_diff_values)() : h.attr(s_values);
    if (!THPVariable_Check(v.ptr())) return false;
    out.values = THPVariable_Unpack(v.ptr());
    return plain(out.values);
  }
  if (t.layout() != c10::kStrided || !t.is_floating_point() || !plain(t)) return false;
  out.format = nullptr;
  out.shape = t.sizes().vec();
  out.buffers.clear();
  out.values = t;
  return true;
}

bool operands_from_py(const py::sequence& seq, std::vector<glue::Operand>& ops) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;  // a mode (fake tensors, tracing) is active
  ops.resize(seq.size());
  for (size_t k = 0; k < ops.size(); ++k)
    if (!operand_from_py(seq[k], ops[k])) return false;
  return true;
}

py::object result_to_py(glue::Operand&& r) {
  if (!r.sparse()) return py::cast(std::move(r.values));
  py::tuple versions(r.buffers.size());
  for (size_t k = 0; k < r.buffers.size(); ++k) versions[k] = py::int_(glue::version_of(r.buffers[k]));
  return (*wrap_sparse)(r.format->text, r.shape, r.buffers, r.values, versions);
}

py::dict plan_summary(const scorch::Plan& p, const std::string& statement) {
  py::dict d;
  d["spec"] = p.spec;
  d["reasons"] = p.reasons;
  d["out_format"] = p.out_format;
  d["statement"] = statement;
  return d;
}

// einsum on the executor. Returns (result, why, plan): result None means Python runs the call itself, with
// why "python" (an operand the fast path does not take) or the reason a dense run was chosen whose result is
// stored sparse. `plan` is given when `explain`.
// `decide` false runs the sparse kernel without asking the cost model (the caller decided). SCORCH_DEBUG >= 1
// turns `explain` on: why is then non-empty for every call that ran.
py::tuple einsum_call(const std::string& equation, const py::sequence& operands, const std::string& out_format,
                      int64_t threads, bool explain, bool decide) {
  std::vector<glue::Operand> ops;
  if (!operands_from_py(operands, ops)) return py::make_tuple(py::none(), "python", py::none());
  explain = explain || scorch::debug_level() >= 1;
  glue::Outcome o;
  {
    // Without the GIL: a first call compiles a kernel (a quarter of a second or more), or waits for another
    // process's compile of it, and every other Python thread stopped meanwhile (helper-46). The C++ side holds
    // no Python object; its hooks into Python take the GIL themselves.
    py::gil_scoped_release release;
    o = glue::run_einsum(equation, ops, out_format, threads, explain, decide, /*dense_first=*/true);
  }
  py::object plan = py::none();
  if (explain && o.plan) {  // the statement as the user's equation reads, operands named by position
    std::vector<int> ndims;
    for (const auto& op : ops) ndims.push_back(static_cast<int>(op.shape.size()));
    plan = plan_summary(*o.plan, scorch::ir::parse_einsum(equation, ndims).str());
  }
  const char* route = o.route == glue::Route::dense ? "dense ATen" : "sparse kernel";
  if (o.route == glue::Route::caller) return py::make_tuple(py::none(), o.why, plan);
  return py::make_tuple(result_to_py(std::move(o.result)), explain ? fmt::format("{} ({})", route, o.why) : "", plan);
}

// compute on the executor; None when Python must run it.
py::object compute_call(const std::string& text, const std::vector<std::string>& names, const py::sequence& operands,
                        const std::string& out_format, int64_t threads) {
  std::vector<glue::Operand> ops;
  if (!operands_from_py(operands, ops)) return py::none();
  glue::Operand r;
  {
    py::gil_scoped_release release;  // (as einsum_call)
    r = glue::run_compute(text, names, ops, out_format, threads);
  }
  return result_to_py(std::move(r));
}

// --- regions -----------------------------------------------------------------------------------------------
py::object operand_to_py(glue::Operand&& o) { return result_to_py(std::move(o)); }

// Python's side of regions: explain's recording and the run-time path's log lines.
// Every hook takes the GIL (the op may be called from C++ code holding none).
// Python objects kept by C++ hooks: released with the GIL held, and never after the interpreter is gone.
std::shared_ptr<py::object> keep_py(py::object f) {
  return std::shared_ptr<py::object>(new py::object(std::move(f)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire g;
      delete p;
    }
  });
}

void set_calibration_hook(py::object calibrate) {
  auto cal = keep_py(std::move(calibrate));
  glue::set_calibration_hook([cal](int64_t threads) {
    py::gil_scoped_acquire gil;
    (*cal)(threads);
  });
}

void install_region_hooks(py::object capture, py::object note_path, py::object note_measured) {
  auto c = keep_py(std::move(capture)), n = keep_py(std::move(note_path)), m = keep_py(std::move(note_measured));
  glue::RegionHooks h;
  h.capture = [c](const std::string& text, at::TensorList ops) {
    py::gil_scoped_acquire gil;
    (*c)(text, ops.vec());
  };
  h.note_path = [n](const std::string& text, const std::string& path, const std::vector<double>& densities,
                     at::TensorList ops) {
    py::gil_scoped_acquire gil;
    (*n)(text, path, densities, ops.vec());
  };
  h.note_measured = [m](const std::string& text, const std::string& path, double kernel_ms, double dense_ms) {
    py::gil_scoped_acquire gil;
    (*m)(text, path, kernel_ms, dense_ms);
  };
  glue::set_region_hooks(std::move(h));
}

// Python's side of masked attention: explain's recording and the log line of the path taken.
void install_attention_hooks(py::object capture, py::object note_path) {
  auto c = keep_py(std::move(capture)), n = keep_py(std::move(note_path));
  glue::AttentionHooks h;
  h.capture = [c](double scale, at::TensorList ops) {
    py::gil_scoped_acquire gil;
    (*c)(scale, ops.vec());
  };
  h.note_path = [n](const std::string& path, double density, at::TensorList ops) {
    py::gil_scoped_acquire gil;
    (*n)(path, density, ops.vec());
  };
  glue::set_attention_hooks(std::move(h));
}

py::tuple region_sparse_call(const std::string& text, const std::vector<at::Tensor>& operands) {
  auto [eq, args] = glue::region_sparse_call(text, operands);
  py::list out;
  for (auto& a : args) out.append(operand_to_py(std::move(a)));
  return py::make_tuple(eq, out);
}

py::list region_sparse_calls(const std::string& text, const std::vector<at::Tensor>& operands) {
  py::list calls;
  for (auto& [eq, args] : glue::region_sparse_calls(text, operands)) {
    py::list out;
    for (auto& a : args) out.append(operand_to_py(std::move(a)));
    calls.append(py::make_tuple(eq, out));
  }
  return calls;
}

py::dict region_layout(const std::string& text) {
  const auto& p = glue::region_program(text);
  py::dict d;
  d["loop_letters"] = p.loop_letters;
  d["storage"] = p.storage;
  d["back"] = p.back;
  d["kernel_equation"] = p.kernel_equation;
  d["kernel_letters"] = p.kernel_letters;
  d["title"] = p.title;
  return d;
}

// What the fake kernel of scorch::kernel needs from a spec.
py::dict spec_info(const std::string& spec_text) {
  const auto spec = scorch::KernelSpec::parse(spec_text);
  py::dict d;
  d["out_vars"] = spec.stmt.out_vars;
  d["out_format"] = spec.output.str();
  d["f64"] = spec.f64;
  d["idx64"] = spec.idx64;
  return d;
}

py::dict bundle_dict(const scorch::BundleInfo& b) {
  py::dict d;
  d["path"] = b.path;
  d["arch"] = b.arch;
  d["target"] = b.target;
  d["target_flags"] = b.target_flags;
  d["vector_bytes"] = b.vector_bytes;
  d["tile_vectors"] = b.tile_vectors;
  d["vector_registers"] = b.vector_registers;
  d["soft_gathers"] = b.soft_gathers;
  d["isa"] = b.isa;
  d["compiler"] = b.compiler;
  d["command"] = b.command;
  py::list kernels;
  for (const auto& k : b.kernels) kernels.append(py::make_tuple(k.spec, k.source_hash));
  d["kernels"] = kernels;
  d["file_bytes"] = b.file_bytes;
  d["library_bytes"] = b.library_bytes;
  d["content_hash"] = b.content_hash;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Scorch native module";
  glue::python_signals::install();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const scorch::Error& e) {
      PyObject* type = e.kind() == scorch::ErrorKind::type    ? PyExc_TypeError
                       : e.kind() == scorch::ErrorKind::value ? PyExc_ValueError
                       : e.kind() == scorch::ErrorKind::memory ? PyExc_MemoryError
                                                              : PyExc_RuntimeError;
      PyErr_SetString(type, e.what());
    } catch (python_error& e) {  // a Python kernel or callback raised inside an op: its own exception
      e.restore();
    } catch (const c10::TypeError& e) {  // ops raise c10 errors; Python sees what torch's bindings would show
      PyErr_SetString(PyExc_TypeError, e.msg().c_str());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.msg().c_str());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.msg().c_str());
    } catch (const c10::OutOfMemoryError& e) {  // (a kernel's result that did not fit, through the op)
      PyErr_SetString(PyExc_MemoryError, e.msg().c_str());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.msg().c_str());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.msg().c_str());
    }
  });
  m.def("register_python_types", &register_python_types, py::arg("sparse_class"), py::arg("wrap"));
  m.def("einsum", &einsum_call, py::arg("equation"), py::arg("operands"), py::arg("out_format"), py::arg("threads"),
        py::arg("explain"), py::arg("decide") = true, "Run an einsum on the C++ executor: (result or None, why, plan or None).");
  m.def("compute", &compute_call, py::arg("text"), py::arg("names"), py::arg("operands"), py::arg("out_format"),
        py::arg("threads"), "Run index notation on the C++ executor; None when Python must run it.");
  m.def("set_calibrated_crossover", &glue::set_calibrated_crossover, py::arg("threads"), py::arg("target"),
        py::arg("crossover"), "The measured dense/sparse crossover density for a thread count and target.");
  m.def("dispatch_mode", [] { return std::string(scorch::dispatch_mode_name(scorch::dispatch_mode())); },
        "SCORCH_DISPATCH, parsed strictly (ValueError naming it when malformed).");
  m.def("time_kernel", [](const std::string& spec, const std::vector<at::Tensor>& inputs,
                          const std::vector<int64_t>& sizes, int64_t threads, int repeats, int warmup, bool mean) {
          return glue::time_kernel(spec, inputs, sizes, threads, repeats, warmup, mean);
        }, py::arg("spec"), py::arg("inputs"), py::arg("sizes"), py::arg("threads"), py::arg("repeats") = 200,
        py::arg("warmup") = 3, py::arg("mean") = false, py::call_guard<py::gil_scoped_release>(),
        "Seconds per call of a kernel alone, median (or with mean=True mean) over `repeats` calls after `warmup` "
        "(a benchmark tool; dense outputs only).");
  m.def("values_at", [](py::object sparse, const at::Tensor& coords) -> py::object {
    glue::Operand src;
    if (!operand_from_py(sparse, src) || !src.sparse()) return py::none();
    return py::cast(glue::values_at(src, coords));
  }, py::arg("sparse"), py::arg("coords"),
     "A SparseTensor's values at coordinates (ndim, n) int64, duplicates summed, zero where none is stored: "
     "differentiable in its values (None when the fast path cannot read it: traced or symbolic).");
  m.def("last_kernel_seconds", &glue::last_kernel_seconds,
        "Seconds this thread's last kernel call spent in the kernel itself (a benchmark tool).");
  m.def("executor_stats", [] {
    const auto c = glue::route_counts();
    py::dict d;
    d["kernel"] = c.kernel;
    d["dense"] = c.dense;
    d["caller"] = c.caller;
    const auto e = glue::eager_measure_stats();
    d["measured"] = e.measured;
    d["measured_dense"] = e.kept_dense;
    d["measured_contended"] = e.contended;
    d["remeasured"] = e.remeasured;
    return d;
  }, "How many einsum calls the executor ran as a kernel, as dense ATen code, or handed back to Python.");
  m.def("install_region_hooks", &install_region_hooks, py::arg("capture"), py::arg("note_path"),
        py::arg("note_measured"));
  m.def("set_calibration_hook", &set_calibration_hook, py::arg("calibrate"),
        "The function the executor calls (with a thread count) the first time it needs the crossover density.");
  m.def("region_run", [](const std::string& text, const std::vector<at::Tensor>& operands, const std::string& force) {
    return glue::run_region(text, operands, force);
  }, py::arg("text"), py::arg("operands"), py::arg("force") = "",
        "Run a region program below autograd; force: '' (choose), dense, sparse or grouped.");
  m.def("region_choose", [](const std::string& text, const std::vector<at::Tensor>& operands) {
    return glue::region_choose(text, operands);
  }, py::arg("text"), py::arg("operands"));
  m.def("region_sparse_call", &region_sparse_call, py::arg("text"), py::arg("operands"),
        "The kernel equation and operands (compressed from the cache) of a region's sparse path.");
  m.def("region_sparse_calls", &region_sparse_calls, py::arg("text"), py::arg("operands"),
        "Every (equation, operands) a region's sparse path may run: its own, then its variants that read "
        "compressed operands dense.");
  m.def("region_layout", &region_layout, py::arg("text"));
  m.def("region_grouped_plan", [](const std::string& text) -> py::object {
    const auto g = glue::grouped_plan(glue::region_program(text));
    if (!g) return py::none();
    return py::make_tuple(g->s, std::string(1, g->p), std::string(1, g->q));
  }, py::arg("text"), "(index of the grouping factor S, p, q) when the program can run grouped, else None.");
  m.def("chain_check", [](const std::string& text) { glue::chain_program(text); }, py::arg("text"),
        "Check a chain program (ValueError naming the problem); parsed once per text.");
  m.def("chain_direct_gradient", [](const std::string& text) {
    return glue::chain_has_direct_gradient(glue::chain_program(text));
  }, py::arg("text"), "Whether the chain's gradient runs directly as grouped products (no autograd recomputation).");
  m.def("region_kernel_specs", &glue::region_kernel_specs, py::arg("text"), py::arg("shapes"), py::arg("dtype"),
        py::arg("grads") = std::vector<bool>{}, py::arg("densities") = std::vector<double>{},
        py::arg("grad_density") = 1.0,
        "Every kernel spec a region call runs on its sparse path (forward, and the gradient programs of the "
        "operands flagged in grads), from shapes and estimated densities: the run path's own planning.");
  m.def("region_gradient", [](const std::string& text, int k) {
    const auto g = glue::region_gradient(text, k);
    return py::make_tuple(g.text, g.operands, g.produced);
  }, py::arg("text"), py::arg("k"));
  m.def("region_compressed", [](const at::Tensor& t, const std::string& letters, const std::string& kind, int expand,
                                 const std::vector<int64_t>& lead, at::ScalarType dtype, bool frozen) {
    glue::RegionOperand o;
    o.letters = letters;
    SCORCH_CHECK(kind == "sparse" || kind == "pattern", "kind must be sparse or pattern, got '{}'", kind);
    o.kind = kind == "pattern" ? glue::RegionOperand::Kind::pattern : glue::RegionOperand::Kind::sparse;
    o.expand = expand;
    auto [density, op] = glue::cached_compressed(t, o, dtype, lead, frozen);
    return py::make_tuple(density, operand_to_py(std::move(op)));
  }, py::arg("tensor"), py::arg("letters"), py::arg("kind"), py::arg("expand"), py::arg("lead"), py::arg("dtype"),
        py::arg("frozen"), "A tensor compressed through the region cache (as a data input), and its density.");
  m.def("region_density", &glue::cached_density, py::arg("tensor"), py::arg("frozen") = false);
  m.def("region_stats", [] {
    const auto s = glue::region_stats();
    py::dict d;
    d["compressions"] = s.compressions;
    d["cache_hits"] = s.cache_hits;
    d["sparse_runs"] = s.sparse_runs;
    d["dense_runs"] = s.dense_runs;
    d["grouped_runs"] = s.grouped_runs;
    d["demoted"] = s.demoted;
    d["content_hashes"] = s.content_hashes;
    d["measured"] = s.measured;
    d["measured_dense"] = s.measured_dense;
    d["measured_contended"] = s.measured_contended;
    d["remeasured"] = s.remeasured;
    return d;
  });
  m.def("region_clear_cache", [] {  // every cache of operands derived from tensors (and references to them)
    glue::region_clear_cache();        // (with the linear kernel's weight panels, kept in the same entries)
  });
  m.def("region_fingerprint", [](const at::Tensor& t) {
    const auto f = glue::region_fingerprint(t);
    return py::bytes(reinterpret_cast<const char*>(f.data()), f.size());
  }, py::arg("tensor"));
  m.def("region_cache_sizes", [] {
    const auto c = glue::region_cache_sizes();
    py::dict d;
    d["weights"] = c.weights;
    d["inputs"] = c.inputs;
    d["max_weights"] = c.max_weights;
    d["max_inputs"] = c.max_inputs;
    d["forms"] = c.forms;
    d["programs"] = glue::region_program_count();  // parsed region programs (never freed)
    return d;
  });
  m.def("region_capture", [](bool on) {
    glue::set_region_capture(on);
    glue::set_attention_capture(on);  // explain records masked attention's operands with the regions'
  }, py::arg("on"));
  m.def("attention_kernel_specs", &glue::attention_kernel_specs, py::arg("q_shape"), py::arg("k_shape"),
        py::arg("v_shape"), py::arg("dtype"), py::arg("training"),
        "The kernel specs masked attention's sparse path runs for these shapes (backward too when training).");
  m.def("install_attention_hooks", &install_attention_hooks, py::arg("capture"), py::arg("note_path"));
  m.def("attention_run", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale, const std::string& force) {
    return glue::run_attention(q, k, v, mask, scale, force);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("force") = "",
        "Masked attention's forward pass below autograd; force: '' (choose), dense or sparse.");
  m.def("attention_choose", &glue::attention_choose, py::arg("q"), py::arg("k"), py::arg("mask"),
        "The path masked attention takes for these operands: dense or sparse.");
  m.def("attention_stats", [] {
    const auto s = glue::attention_stats();
    py::dict d;
    d["sparse_runs"] = s.sparse_runs;
    d["dense_runs"] = s.dense_runs;
    d["sparse_backward"] = s.sparse_backward;
    d["dense_backward"] = s.dense_backward;
    return d;
  });
  m.def("spec_info", &spec_info, py::arg("spec"), "Output variables, format and dtypes of a kernel spec.");
  m.def("compress_rows", [](const at::Tensor& x) -> py::object {
    // (the region op's compression: counted rows, then filled by words of kept-bits, in parallel)
    std::optional<glue::Operand> r;
    {
      py::gil_scoped_release release;
      r = glue::compress_rows(x, glue::region_compressed_format(static_cast<int>(x.dim())));
    }
    if (!r) return py::none();
    return py::make_tuple(r->buffers, r->values, r->format->text);
  }, py::arg("x"),
        "A contiguous float32/float64 tensor of rank >= 2 stored with dense outer levels and its last dimension "
        "compressed (CSR for a matrix), int32 indices: (buffers, values, format text); None for other tensors.");
  m.def("format_info", &format_info, py::arg("spec"), py::arg("ndim"),
        "Parse a format (preset name or canonical text) for an ndim-dimensional tensor and describe it.");
  m.def("broadcast_shapes", &scorch::ir::broadcast_shapes, py::arg("equation"), py::arg("shapes"), py::arg("sparse"),
        "The operands' shapes under torch.einsum's broadcasting; empty when none changes (ir/parser.h).");
  m.def("plan_einsum", &plan_einsum, py::arg("equation"), py::arg("operands"), py::arg("out_format"), py::arg("f64"),
        py::arg("idx64"), "Plan an einsum call: operands are (format or 'strided', shape, nnz).");
  m.def("plan_compute", &plan_compute, py::arg("text"), py::arg("names"), py::arg("operands"), py::arg("out_format"),
        py::arg("f64"), py::arg("idx64"), "Plan an index-notation statement.");
  m.def("split_compute", &split_compute, py::arg("text"), py::arg("names"), py::arg("shapes"), py::arg("einsum") = false,
        "Split index notation (or an einsum equation) into steps with their own reduction scopes.");
  m.def("statement_info", &statement_info, py::arg("text"), py::arg("num_tensors"));
  m.def("differentiate", &differentiate, py::arg("text"), py::arg("num_tensors"), py::arg("tensor"),
        py::arg("with_pattern"), "The compiler-derived gradient statement of one operand.");
  m.def("queue_log_messages", [](bool on) { scorch::set_log_sink(on ? &scorch::torch_glue::log_queue::sink : nullptr); }, py::arg("on"),
        "Queue the runtime's messages for take_log_messages (on) or print them to stderr (off, the default).");
  m.def("take_log_messages", &scorch::torch_glue::log_queue::take, "The queued runtime messages, oldest first: (level, name, text).");
  m.def("compile_kernels", &compile_kernels, py::arg("specs"), py::arg("workers") = 2,
        "Compile (or load) kernels in parallel, ahead of their first use.");
  m.def("kernel_info", &kernel_info, py::arg("spec"), "Compile (or load) a kernel and describe it.");
  m.def("kernel_source", &scorch::kernel_source, py::arg("spec"), "The C++ source a kernel spec compiles to.");
  m.def("kernel_cache_dir", &scorch::kernel_cache_dir);
  m.def("build_kernel_bundle", [](const std::vector<std::string>& specs, const std::string& path,
                                  const std::string& target, int workers) {
    scorch::BundleInfo b;
    {
      py::gil_scoped_release release;
      b = scorch::build_kernel_bundle(specs, path, target, workers);
    }
    return bundle_dict(b);
  }, py::arg("specs"), py::arg("path"), py::arg("target") = "", py::arg("workers") = 2,
        "Compile kernels ahead of time into one bundle file (docs/deploy.md).");
  m.def("inspect_kernel_bundle", [](const std::string& path) { return bundle_dict(scorch::inspect_kernel_bundle(path)); },
        py::arg("path"), "Check a kernel bundle as loading would, without loading it, and describe it.");
  m.def("used_kernel_specs", &scorch::used_kernel_specs,
        "Specs of every kernel this process has obtained (JIT-compiled, from the disk cache or from a bundle), in "
        "first-use order.");
  m.def("bundled_kernels", &scorch::bundled_kernels,
        "(spec, bundle path) of every kernel registered by loaded bundles, in registration order.");
  m.def("set_target", &scorch::set_target, py::arg("name"),
        "Compile kernels from now on for this target ('' = SCORCH_TARGET or native).");
  m.def("target_name", &scorch::target_name);
  m.def("target_info", [](const std::string& name) {
    return target_dict(name.empty() ? scorch::current_target() : scorch::resolve_target(name));
  }, py::arg("name") = "", "Resolve a target (default: the current one) and describe it.");
  m.def("content_hash", [](const at::Tensor& t, const std::string& isa) {
    return glue::content_hash(t, scorch::byte_hash_isa_named(isa));
  }, py::arg("tensor"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>(),
        "A hash of every byte of a tensor's elements (region_fingerprint.h); isa: '' (best), or one of byte_hash_isas().");
  m.def("byte_hash_isas", &scorch::byte_hash_isas, "The byte hash's implementations this CPU runs (byte_hash.h).");
  m.def("fma_peak_gflops", &scorch::fma_peak_gflops, py::arg("vector_bytes"), py::arg("threads"),
        py::call_guard<py::gil_scoped_release>(), "Float32 multiply-add GFLOP/s of this CPU at a vector width "
        "(runtime/fma_probe.h; 0 without the instructions).");
}
