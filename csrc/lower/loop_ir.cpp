#include "lower/loop_ir.h"

#include <fmt/format.h>

namespace scorch::loops {

namespace {
std::shared_ptr<Stmt> make(Kind k) {
  auto s = std::make_shared<Stmt>();
  s->kind = k;
  return s;
}
}  // namespace

StmtPtr line(std::string text) {
  auto s = make(Kind::line);
  s->text = std::move(text);
  return s;
}
StmtPtr comment(std::string text) {
  auto s = make(Kind::comment);
  s->text = std::move(text);
  return s;
}
StmtPtr block(Stmts body) {
  auto s = make(Kind::block);
  s->body = std::move(body);
  return s;
}
StmtPtr for_range(std::string var, std::string begin, std::string end, Stmts body, bool simd, std::string reduction) {
  auto s = make(Kind::for_range);
  s->text = std::move(var);
  s->begin = std::move(begin);
  s->end = std::move(end);
  s->body = std::move(body);
  s->simd = simd || !reduction.empty();
  s->reduction = std::move(reduction);
  return s;
}
StmtPtr while_loop(std::string cond, Stmts body) {
  auto s = make(Kind::while_loop);
  s->text = std::move(cond);
  s->body = std::move(body);
  return s;
}
StmtPtr if_chain(std::vector<std::string> conds, std::vector<Stmts> branches) {
  auto s = make(Kind::if_chain);
  s->conds = std::move(conds);
  s->branches = std::move(branches);
  return s;
}
StmtPtr parallel(std::string threads, Stmts body) {
  auto s = make(Kind::parallel);
  s->threads = std::move(threads);
  s->body = std::move(body);
  return s;
}

namespace {

void print_into(const Stmts& stmts, int indent, std::string& out) {
  const std::string pad(static_cast<size_t>(indent) * 2, ' ');
  for (const auto& s : stmts) {
    switch (s->kind) {
      case Kind::line: out += pad + s->text + "\n"; break;
      case Kind::comment: out += pad + "// " + s->text + "\n"; break;
      case Kind::block:
        out += pad + "{\n";
        print_into(s->body, indent + 1, out);
        out += pad + "}\n";
        break;
      case Kind::for_range:
        if (!s->reduction.empty()) out += pad + "#pragma omp simd reduction(+:" + s->reduction + ")\n";
        else if (s->simd) out += pad + "#pragma omp simd\n";
        out += pad + fmt::format("for (int64_t {0} = {1}; {0} < {2}; ++{0}) {{\n", s->text, s->begin, s->end);
        print_into(s->body, indent + 1, out);
        out += pad + "}\n";
        break;
      case Kind::while_loop:
        out += pad + "while (" + s->text + ") {\n";
        print_into(s->body, indent + 1, out);
        out += pad + "}\n";
        break;
      case Kind::if_chain:
        for (size_t b = 0; b < s->branches.size(); ++b) {
          const std::string& c = s->conds[b];
          if (b == 0) out += pad + (c.empty() ? "{\n" : "if (" + c + ") {\n");
          else out += pad + (c.empty() ? "} else {\n" : "} else if (" + c + ") {\n");
          print_into(s->branches[b], indent + 1, out);
        }
        if (!s->branches.empty()) out += pad + "}\n";
        break;
      case Kind::parallel:
        out += pad + "#pragma omp parallel num_threads(" + s->threads + ")\n" + pad + "{\n";
        print_into(s->body, indent + 1, out);
        out += pad + "}\n";
        break;
    }
  }
}

}  // namespace

std::string print(const Stmts& stmts, int indent) {
  std::string out;
  print_into(stmts, indent, out);
  return out;
}

}  // namespace scorch::loops
