// The Python extension scorch_backend._C: format metadata for the Python layer. Loading it also loads
// libscorch_ops, which registers the torch.ops.scorch operators.
#include <atomic>
#include <mutex>
#include <thread>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "format/format.h"
#include "ir/parser.h"
#include "ir/split_reductions.h"
#include "lower/differentiate.h"
#include "lower/plan.h"
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

// Parse index notation, check sizes against the operands' shapes, and split it into steps (see
// ir/split_reductions.h): a list of (canonical text over t0, t1, ..., global operand ids).
py::list split_compute(const std::string& text, const std::vector<std::string>& names,
                       const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<int> ndims;
  for (const auto& s : shapes) ndims.push_back(static_cast<int>(s.size()));
  const auto st = scorch::ir::parse_index_notation(text, names, ndims);
  scorch::ir::infer_var_sizes(st, shapes);
  py::list out;
  for (const auto& step : scorch::ir::split_reductions(st)) out.append(py::make_tuple(step.stmt.canonical(), step.operands));
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
  const auto k = scorch::get_kernel(spec);
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
  d["tile_vectors"] = t.tile_vectors();
  d["fingerprint"] = t.fingerprint;
  d["summary"] = t.summary();
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Scorch native module";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const scorch::Error& e) {
      PyObject* type = e.kind() == scorch::ErrorKind::type    ? PyExc_TypeError
                       : e.kind() == scorch::ErrorKind::value ? PyExc_ValueError
                                                              : PyExc_RuntimeError;
      PyErr_SetString(type, e.what());
    }
  });
  m.def("format_info", &format_info, py::arg("spec"), py::arg("ndim"),
        "Parse a format (preset name or canonical text) for an ndim-dimensional tensor and describe it.");
  m.def("plan_einsum", &plan_einsum, py::arg("equation"), py::arg("operands"), py::arg("out_format"), py::arg("f64"),
        py::arg("idx64"), "Plan an einsum call: operands are (format or 'strided', shape, nnz).");
  m.def("plan_compute", &plan_compute, py::arg("text"), py::arg("names"), py::arg("operands"), py::arg("out_format"),
        py::arg("f64"), py::arg("idx64"), "Plan an index-notation statement.");
  m.def("split_compute", &split_compute, py::arg("text"), py::arg("names"), py::arg("shapes"),
        "Split index notation into steps with their own reduction scopes.");
  m.def("statement_info", &statement_info, py::arg("text"), py::arg("num_tensors"));
  m.def("differentiate", &differentiate, py::arg("text"), py::arg("num_tensors"), py::arg("tensor"),
        py::arg("with_pattern"), "The compiler-derived gradient statement of one operand.");
  m.def("compile_kernels", &compile_kernels, py::arg("specs"), py::arg("workers") = 2,
        "Compile (or load) kernels in parallel, ahead of their first use.");
  m.def("kernel_info", &kernel_info, py::arg("spec"), "Compile (or load) a kernel and describe it.");
  m.def("kernel_source", &scorch::kernel_source, py::arg("spec"), "The C++ source a kernel spec compiles to.");
  m.def("kernel_cache_dir", &scorch::kernel_cache_dir);
  m.def("set_target", &scorch::set_target, py::arg("name"),
        "Compile kernels from now on for this target ('' = SCORCH_TARGET or native).");
  m.def("target_name", &scorch::target_name);
  m.def("target_info", [](const std::string& name) {
    return target_dict(name.empty() ? scorch::current_target() : scorch::resolve_target(name));
  }, py::arg("name") = "", "Resolve a target (default: the current one) and describe it.");
}
