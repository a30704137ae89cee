#include "lower/kernel_spec.h"

#include "common/error.h"
#include "ir/parser.h"

namespace scorch {

int KernelSpec::operand_ndim(int t) const {
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(stmt.rhs, acc);
  for (const ir::Expr* a : acc)
    if (a->tensor == t) return static_cast<int>(a->vars.size());
  return 0;
}

std::string KernelSpec::str() const {
  std::string s = stmt.canonical();
  for (size_t t = 0; t < operands.size(); ++t) s += fmt::format("; t{}={}", t, operands[t].str());
  s += "; out=" + output.str();
  s += f64 ? "; f64" : "; f32";
  s += idx64 ? "; i64" : "; i32";
  return s;
}

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  const size_t e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace

KernelSpec KernelSpec::parse(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == ';') {
      parts.push_back(trim(text.substr(start, i - start)));
      start = i + 1;
    }
  }
  SCORCH_CHECK(parts.size() >= 4, "bad kernel spec '{}': expected 'statement; t0=...; out=...; f32; i32'", text);
  KernelSpec k;
  const size_t nt = parts.size() - 4;
  std::vector<std::string> names;
  for (size_t t = 0; t < nt; ++t) names.push_back(fmt::format("t{}", t));
  k.stmt = ir::parse_index_notation(parts[0], names);
  auto storage = [&](const std::string& part, const std::string& name, int ndim) {
    SCORCH_CHECK(part.rfind(name + "=", 0) == 0, "bad kernel spec: expected '{}=' in '{}'", name, part);
    const std::string f = part.substr(name.size() + 1);
    Storage s;
    if (f != "strided") s.format = Format::parse(f, ndim);
    return s;
  };
  for (size_t t = 0; t < nt; ++t)
    k.operands.push_back(storage(parts[1 + t], names[t], k.operand_ndim(static_cast<int>(t))));
  k.output = storage(parts[1 + nt], "out", static_cast<int>(k.stmt.out_vars.size()));
  const std::string& vt = parts[2 + nt];
  const std::string& it = parts[3 + nt];
  SCORCH_CHECK(vt == "f32" || vt == "f64", "bad kernel spec: value type must be f32 or f64, got '{}'", vt);
  SCORCH_CHECK(it == "i32" || it == "i64", "bad kernel spec: index type must be i32 or i64, got '{}'", it);
  k.f64 = vt == "f64";
  k.idx64 = it == "i64";
  return k;
}

}  // namespace scorch
