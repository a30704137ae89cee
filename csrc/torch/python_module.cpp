// The Python extension scorch_backend._C: format metadata for the Python layer. Loading it also loads
// libscorch_ops, which registers the torch.ops.scorch operators.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/error.h"
#include "format/format.h"

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
}
