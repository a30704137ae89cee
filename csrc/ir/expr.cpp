#include "ir/expr.h"

#include <algorithm>
#include <cstdio>

#include "common/error.h"

namespace scorch::ir {

ExprPtr Expr::access(int tensor, int access_id, std::vector<int> vars, std::vector<size_t> var_pos, size_t pos) {
  auto e = std::make_shared<Expr>();
  e->kind = ExprKind::access;
  e->tensor = tensor;
  e->access_id = access_id;
  e->vars = std::move(vars);
  e->var_pos = std::move(var_pos);
  e->pos = pos;
  return e;
}

ExprPtr Expr::literal(double v, size_t pos) {
  auto e = std::make_shared<Expr>();
  e->kind = ExprKind::literal;
  e->value = v;
  e->pos = pos;
  return e;
}

ExprPtr Expr::binary(ExprKind k, ExprPtr a, ExprPtr b, size_t pos) {
  auto e = std::make_shared<Expr>();
  e->kind = k;
  e->a = std::move(a);
  e->b = std::move(b);
  e->pos = pos;
  return e;
}

ExprPtr Expr::neg(ExprPtr a, size_t pos) {
  auto e = std::make_shared<Expr>();
  e->kind = ExprKind::neg;
  e->a = std::move(a);
  e->pos = pos;
  return e;
}

std::vector<int> Statement::reduction_vars() const {
  std::vector<const Expr*> acc;
  collect_accesses(rhs, acc);
  std::vector<int> red;
  for (const Expr* a : acc)
    for (int v : a->vars)
      if (std::find(out_vars.begin(), out_vars.end(), v) == out_vars.end() &&
          std::find(red.begin(), red.end(), v) == red.end())
        red.push_back(v);
  return red;
}

int expr_height(const ExprPtr& e) {
  if (!e) return 0;
  return 1 + std::max(expr_height(e->a), expr_height(e->b));
}

namespace {
void count_nodes(const ExprPtr& e, size_t stop, size_t& n) {
  if (!e || n >= stop) return;
  ++n;
  count_nodes(e->a, stop, n);
  count_nodes(e->b, stop, n);
}
}  // namespace

size_t expr_size(const ExprPtr& e, size_t stop) {
  size_t n = 0;
  count_nodes(e, stop, n);
  return n;
}

void collect_accesses(const ExprPtr& e, std::vector<const Expr*>& out) {
  if (!e) return;
  if (e->kind == ExprKind::access) out.push_back(e.get());
  collect_accesses(e->a, out);
  collect_accesses(e->b, out);
}

std::string format_literal(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep it a floating-point literal
  return s;
}

namespace {

int precedence(ExprKind k) {
  switch (k) {
    case ExprKind::add:
    case ExprKind::sub: return 1;
    case ExprKind::mul: return 2;
    case ExprKind::neg: return 3;
    default: return 4;
  }
}

std::string print(const ExprPtr& e, const std::vector<std::string>& tn, const std::vector<std::string>& vn, int ctx) {
  std::string s;
  switch (e->kind) {
    case ExprKind::access: {
      s = tn[e->tensor] + "(";
      for (size_t d = 0; d < e->vars.size(); ++d) s += (d ? "," : "") + vn[e->vars[d]];
      return s + ")";
    }
    case ExprKind::literal: return format_literal(e->value);
    case ExprKind::neg: s = "-" + print(e->a, tn, vn, 3); break;
    case ExprKind::add: s = print(e->a, tn, vn, 1) + " + " + print(e->b, tn, vn, 2); break;
    case ExprKind::sub: s = print(e->a, tn, vn, 1) + " - " + print(e->b, tn, vn, 2); break;
    case ExprKind::mul: s = print(e->a, tn, vn, 2) + " * " + print(e->b, tn, vn, 3); break;
  }
  return precedence(e->kind) < ctx ? "(" + s + ")" : s;
}

std::string print_statement(const Statement& st, const std::vector<std::string>& tn,
                            const std::vector<std::string>& vn) {
  std::string s = "out(";
  for (size_t d = 0; d < st.out_vars.size(); ++d) s += (d ? "," : "") + vn[st.out_vars[d]];
  return s + ") = " + print(st.rhs, tn, vn, 0);
}

}  // namespace

std::string to_string(const ExprPtr& e, const std::vector<std::string>& tn, const std::vector<std::string>& vn) {
  return print(e, tn, vn, 0);
}

std::string Statement::canonical() const {
  std::vector<std::string> tn, vn;
  for (int t = 0; t < num_tensors(); ++t) tn.push_back(fmt::format("t{}", t));
  for (int v = 0; v < num_vars(); ++v) vn.push_back(fmt::format("i{}", v));
  return print_statement(*this, tn, vn);
}

std::string Statement::str() const { return print_statement(*this, tensor_names, var_names); }

std::string caret_message(const std::string& msg, const std::string& source, size_t pos) {
  // A long source (a generated expression) is shown as a window around the caret.
  constexpr size_t kBefore = 60, kAfter = 40;
  pos = std::min(pos, source.size());
  if (source.size() <= kBefore + kAfter + 20)
    return fmt::format("{}\n  {}\n  {}^", msg, source, std::string(pos, ' '));
  const size_t begin = pos > kBefore ? pos - kBefore : 0;
  const size_t end = std::min(source.size(), pos + kAfter);
  const std::string head = begin > 0 ? "..." : "", tail = end < source.size() ? "..." : "";
  return fmt::format("{}\n  {}{}{}\n  {}^", msg, head, source.substr(begin, end - begin), tail,
                     std::string(head.size() + pos - begin, ' '));
}

void Statement::fail_at(size_t pos, const std::string& msg) const {
  throw_error(ErrorKind::value, caret_message(msg, source, pos));
}

}  // namespace scorch::ir
