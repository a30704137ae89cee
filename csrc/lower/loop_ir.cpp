#include "lower/loop_ir.h"

#include <fmt/format.h>

#include <type_traits>

#include "common/error.h"
#include "ir/expr.h"

namespace scorch::loops {

// ---------------------------------------------------------------------------------------------------------
// Names.

const char* kind_name(ExprKind k) {
  switch (k) {
#define SCORCH_NAME(n) \
  case ExprKind::n: return #n;
    SCORCH_LOOP_EXPR_NODES(SCORCH_NAME)
#undef SCORCH_NAME
  }
  return "?";
}

const char* kind_name(StmtKind k) {
  switch (k) {
#define SCORCH_NAME(n) \
  case StmtKind::n: return #n;
    SCORCH_LOOP_STMT_NODES(SCORCH_NAME)
#undef SCORCH_NAME
  }
  return "?";
}

const char* op_text(UnOp op) {
  static const char* t[] = {"-", "!", "&", "++", "++"};
  return t[static_cast<int>(op)];
}
const char* op_text(BinOp op) {
  static const char* t[] = {"+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!=", "&&", "||"};
  return t[static_cast<int>(op)];
}
const char* op_text(AssignOp op) {
  static const char* t[] = {"=", "+=", "|="};
  return t[static_cast<int>(op)];
}

// ---------------------------------------------------------------------------------------------------------
// Visitor and Mutator: the dispatch comes from the node lists, the children from each node's `fields`.

namespace {

// Calls `on_expr` / `on_stmt` on every child of a node, in field order.
template <class N, class OnExpr, class OnStmt>
void each_child(const N& n, OnExpr&& on_expr, OnStmt&& on_stmt) {
  N::fields(n, [&](const char*, const auto& field) {
    using T = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<T, ExprPtr>) {
      if (field) on_expr(field);
    } else if constexpr (std::is_same_v<T, Exprs>) {
      for (const auto& e : field)
        if (e) on_expr(e);
    } else if constexpr (std::is_same_v<T, Stmts>) {
      for (const auto& s : field) on_stmt(s);
    } else if constexpr (std::is_same_v<T, std::vector<Stmts>>) {
      for (const auto& b : field)
        for (const auto& s : b) on_stmt(s);
    }
  });
}

}  // namespace

void Visitor::visit(const ExprPtr& e) {
  if (!e) return;
  switch (e->kind) {
#define SCORCH_DISPATCH(k) \
  case ExprKind::k: visit_##k(static_cast<const k&>(*e)); break;
    SCORCH_LOOP_EXPR_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
  }
}

void Visitor::visit(const StmtPtr& s) {
  switch (s->kind) {
#define SCORCH_DISPATCH(k) \
  case StmtKind::k: visit_##k(static_cast<const k&>(*s)); break;
    SCORCH_LOOP_STMT_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
  }
}

template <class N>
void Visitor::visit_children(const N& n) {
  each_child(n, [&](const ExprPtr& e) { visit(e); }, [&](const StmtPtr& s) { visit(s); });
}

#define SCORCH_VISIT_DEFAULT(k) \
  void Visitor::visit_##k(const k& n) { visit_children(n); }
SCORCH_LOOP_EXPR_NODES(SCORCH_VISIT_DEFAULT)
SCORCH_LOOP_STMT_NODES(SCORCH_VISIT_DEFAULT)
#undef SCORCH_VISIT_DEFAULT

ExprPtr Mutator::mutate(const ExprPtr& e) {
  if (!e) return e;
  switch (e->kind) {
#define SCORCH_DISPATCH(k) \
  case ExprKind::k: return mutate_##k(std::static_pointer_cast<const k>(e));
    SCORCH_LOOP_EXPR_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
  }
  return e;
}

Stmts Mutator::mutate(const StmtPtr& s) {
  switch (s->kind) {
#define SCORCH_DISPATCH(k) \
  case StmtKind::k: return mutate_##k(std::static_pointer_cast<const k>(s));
    SCORCH_LOOP_STMT_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
  }
  return {s};
}

Stmts Mutator::mutate(const Stmts& ss) {
  Stmts out;
  out.reserve(ss.size());
  for (const auto& s : ss) {
    Stmts r = mutate(s);
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

template <class N>
std::shared_ptr<const N> Mutator::mutate_children(const std::shared_ptr<const N>& n) {
  auto copy = std::make_shared<N>(*n);
  bool changed = false;
  N::fields(*copy, [&](const char*, auto& field) {
    using T = std::decay_t<decltype(field)>;
    if constexpr (std::is_same_v<T, ExprPtr>) {
      ExprPtr m = mutate(field);
      changed |= m != field;
      field = std::move(m);
    } else if constexpr (std::is_same_v<T, Exprs>) {
      for (auto& e : field) {
        ExprPtr m = mutate(e);
        changed |= m != e;
        e = std::move(m);
      }
    } else if constexpr (std::is_same_v<T, Stmts>) {
      Stmts m = mutate(field);
      changed |= m != field;
      field = std::move(m);
    } else if constexpr (std::is_same_v<T, std::vector<Stmts>>) {
      for (auto& b : field) {
        Stmts m = mutate(b);
        changed |= m != b;
        b = std::move(m);
      }
    }
  });
  if (!changed) return n;
  return copy;
}

// Instantiated for every kind, for subclasses in other files.
#define SCORCH_INSTANTIATE(k)                                 \
  template void Visitor::visit_children<k>(const k&);          \
  template std::shared_ptr<const k> Mutator::mutate_children<k>(const std::shared_ptr<const k>&);
SCORCH_LOOP_EXPR_NODES(SCORCH_INSTANTIATE)
SCORCH_LOOP_STMT_NODES(SCORCH_INSTANTIATE)
#undef SCORCH_INSTANTIATE

#define SCORCH_MUTATE_EXPR_DEFAULT(k) \
  ExprPtr Mutator::mutate_##k(const std::shared_ptr<const k>& n) { return mutate_children(n); }
#define SCORCH_MUTATE_STMT_DEFAULT(k) \
  Stmts Mutator::mutate_##k(const std::shared_ptr<const k>& n) { return {mutate_children(n)}; }
SCORCH_LOOP_EXPR_NODES(SCORCH_MUTATE_EXPR_DEFAULT)
SCORCH_LOOP_STMT_NODES(SCORCH_MUTATE_STMT_DEFAULT)
#undef SCORCH_MUTATE_EXPR_DEFAULT
#undef SCORCH_MUTATE_STMT_DEFAULT

// ---------------------------------------------------------------------------------------------------------
// The printer: C++ syntax of each kind; the dispatch is generated.

namespace {

class Printer {
 public:
  std::string out;

  void expr(const ExprPtr& e) {
    SCORCH_ASSERT(e != nullptr, "loop IR: a missing expression");
    switch (e->kind) {
#define SCORCH_DISPATCH(k) \
  case ExprKind::k: print_expr(static_cast<const k&>(*e)); break;
      SCORCH_LOOP_EXPR_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
    }
  }

  // compact: on one line (inside a Line), else indented lines at `indent`.
  void stmt(const StmtPtr& s, int indent, bool compact) {
    switch (s->kind) {
#define SCORCH_DISPATCH(k) \
  case StmtKind::k: print_stmt(static_cast<const k&>(*s), indent, compact); break;
      SCORCH_LOOP_STMT_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
    }
  }

  void stmts(const Stmts& ss, int indent) {
    for (const auto& s : ss) stmt(s, indent, false);
  }

 private:
  static std::string pad(int indent) { return std::string(static_cast<size_t>(indent) * 2, ' '); }

  void list(const Exprs& es) {
    for (size_t q = 0; q < es.size(); ++q) {
      if (q) out += ", ";
      expr(es[q]);
    }
  }

  void print_expr(const Var& n) { out += n.name; }
  void print_expr(const Int& n) { out += std::to_string(n.value); }
  void print_expr(const Bool& n) { out += n.value ? "true" : "false"; }
  void print_expr(const Float& n) { out += ir::format_literal(n.value); }
  void print_expr(const Text& n) { out += n.text; }
  void print_expr(const Load& n) {
    expr(n.base);
    out += "[";
    expr(n.index);
    out += "]";
  }
  void print_expr(const Unary& n) {
    if (n.op == UnOp::post_inc) {
      expr(n.a);
      out += "++";
      return;
    }
    out += op_text(n.op);
    expr(n.a);
  }
  void print_expr(const Binary& n) {
    expr(n.a);
    out += fmt::format(" {} ", op_text(n.op));
    expr(n.b);
  }
  void print_expr(const Paren& n) {
    out += "(";
    expr(n.a);
    out += ")";
  }
  void print_expr(const Cast& n) {
    out += "(" + n.type + ")";
    expr(n.a);
  }
  void print_expr(const Call& n) {
    out += n.fn + "(";
    list(n.args);
    out += ")";
  }
  void print_expr(const Select& n) {
    expr(n.c);
    out += " ? ";
    expr(n.a);
    out += " : ";
    expr(n.b);
  }
  void print_expr(const InitList& n) {
    out += "{";
    list(n.items);
    out += "}";
  }

  // A statement's text without indentation or newline (simple statements), for both forms.
  void simple(const Decl& n) {
    out += n.type + " ";
    for (size_t q = 0; q < n.names.size(); ++q) {
      if (q) out += ", ";
      out += n.names[q];
      if (q < n.inits.size() && n.inits[q]) {
        out += " = ";
        expr(n.inits[q]);
      }
    }
    out += ";";
  }
  void simple(const Assign& n) {
    expr(n.lhs);
    out += fmt::format(" {} ", op_text(n.op));
    expr(n.rhs);
    out += ";";
  }
  void simple(const Eval& n) {
    expr(n.e);
    out += ";";
  }

  // Body of a compound statement on one line: a single simple statement bare, else in braces.
  void compact_body(const Stmts& body) {
    const bool bare = body.size() == 1 && (body[0]->kind == StmtKind::Decl || body[0]->kind == StmtKind::Assign ||
                                           body[0]->kind == StmtKind::Eval || body[0]->kind == StmtKind::Raw);
    if (bare) {
      out += " ";
      stmt(body[0], 0, true);
      return;
    }
    out += " {";
    for (const auto& s : body) {
      out += " ";
      stmt(s, 0, true);
    }
    out += " }";
  }

  template <class N>
  void simple_stmt(const N& n, int indent, bool compact) {
    if (!compact) out += pad(indent);
    simple(n);
    if (!compact) out += "\n";
  }
  void print_stmt(const Decl& n, int indent, bool compact) { simple_stmt(n, indent, compact); }
  void print_stmt(const Assign& n, int indent, bool compact) { simple_stmt(n, indent, compact); }
  void print_stmt(const Eval& n, int indent, bool compact) { simple_stmt(n, indent, compact); }

  void print_stmt(const Raw& n, int indent, bool compact) { out += compact ? n.text : pad(indent) + n.text + "\n"; }
  void print_stmt(const Comment& n, int indent, bool compact) {
    SCORCH_ASSERT(!compact, "loop IR: a comment inside a one-line statement");
    out += pad(indent) + "// " + n.text + "\n";
  }
  void print_stmt(const Line& n, int indent, bool compact) {
    if (!compact) out += pad(indent);
    for (size_t q = 0; q < n.parts.size(); ++q) {
      if (q) out += " ";
      stmt(n.parts[q], 0, true);
    }
    if (!compact) out += "\n";
  }
  void print_stmt(const Block& n, int indent, bool compact) {
    if (compact) {
      out += "{";
      for (const auto& s : n.body) {
        out += " ";
        stmt(s, 0, true);
      }
      out += " }";
      return;
    }
    out += pad(indent) + "{\n";
    stmts(n.body, indent + 1);
    out += pad(indent) + "}\n";
  }
  void print_stmt(const If& n, int indent, bool compact) {
    if (compact) {
      SCORCH_ASSERT(n.branches.size() == 1 && n.conds[0], "loop IR: a one-line if has one branch");
      out += "if (";
      expr(n.conds[0]);
      out += ")";
      compact_body(n.branches[0]);
      return;
    }
    const std::string p = pad(indent);
    for (size_t b = 0; b < n.branches.size(); ++b) {
      const ExprPtr& c = n.conds[b];
      if (b == 0) {
        out += p;
      } else {
        out += p + "} else ";
      }
      if (c) {
        out += "if (";
        expr(c);
        out += ") {\n";
      } else {
        out += "{\n";
      }
      stmts(n.branches[b], indent + 1);
    }
    if (!n.branches.empty()) out += p + "}\n";
  }
  void print_stmt(const For& n, int indent, bool compact) {
    SCORCH_ASSERT(!compact, "loop IR: a for loop inside a one-line statement");
    const std::string p = pad(indent);
    if (!n.reduction.empty()) out += p + "#pragma omp simd reduction(+:" + n.reduction + ")\n";
    else if (n.simd) out += p + "#pragma omp simd\n";
    out += p + "for (";
    if (n.begin) {
      out += "int64_t " + n.var + " = ";
      expr(n.begin);
    }
    out += "; ";
    expr(n.cond);
    out += n.step == 1 ? "; ++" + n.var + ") {\n" : fmt::format("; {} += {}) {{\n", n.var, n.step);
    stmts(n.body, indent + 1);
    out += p + "}\n";
  }
  void print_stmt(const While& n, int indent, bool compact) {
    if (compact) {
      out += "while (";
      expr(n.cond);
      out += ")";
      compact_body(n.body);
      return;
    }
    out += pad(indent) + "while (";
    expr(n.cond);
    out += ") {\n";
    stmts(n.body, indent + 1);
    out += pad(indent) + "}\n";
  }
  void print_stmt(const Parallel& n, int indent, bool compact) {
    SCORCH_ASSERT(!compact, "loop IR: a parallel region inside a one-line statement");
    out += pad(indent) + "#pragma omp parallel num_threads(";
    expr(n.threads);
    out += ")\n" + pad(indent) + "{\n";
    stmts(n.body, indent + 1);
    out += pad(indent) + "}\n";
  }
};

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}

// The structural dump: kind and plain fields per node, children indented below.
class Dumper {
 public:
  std::string out;

  void node(const ExprPtr& e, int indent, const char* role) {
    switch (e->kind) {
#define SCORCH_DISPATCH(k) \
  case ExprKind::k: fields(static_cast<const k&>(*e), #k, indent, role); break;
      SCORCH_LOOP_EXPR_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
    }
  }
  void node(const StmtPtr& s, int indent, const char* role) {
    switch (s->kind) {
#define SCORCH_DISPATCH(k) \
  case StmtKind::k: fields(static_cast<const k&>(*s), #k, indent, role); break;
      SCORCH_LOOP_STMT_NODES(SCORCH_DISPATCH)
#undef SCORCH_DISPATCH
    }
  }

 private:
  template <class N>
  void fields(const N& n, const char* kind, int indent, const char* role) {
    std::string head = std::string(static_cast<size_t>(indent) * 2, ' ');
    if (role && *role) head += std::string(role) + ": ";
    head += kind;
    N::fields(n, [&](const char* name, const auto& f) {
      using T = std::decay_t<decltype(f)>;
      if constexpr (std::is_same_v<T, std::string>) {
        head += fmt::format(" {}={}", name, quoted(f));
      } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
        head += fmt::format(" {}=[", name);
        for (size_t q = 0; q < f.size(); ++q) head += fmt::format("{}{}", q ? ", " : "", quoted(f[q]));
        head += "]";
      } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
        head += fmt::format(" {}={}", name, f);
      } else if constexpr (std::is_same_v<T, bool>) {
        if (f) head += fmt::format(" {}", name);
      } else if constexpr (std::is_enum_v<T>) {
        head += fmt::format(" {}={}", name, op_text(f));
      }
    });
    out += head + "\n";
    N::fields(n, [&](const char* name, const auto& f) {
      using T = std::decay_t<decltype(f)>;
      if constexpr (std::is_same_v<T, ExprPtr>) {
        if (f) node(f, indent + 1, name);
      } else if constexpr (std::is_same_v<T, Exprs>) {
        for (const auto& e : f)
          if (e) node(e, indent + 1, name);
      } else if constexpr (std::is_same_v<T, Stmts>) {
        for (const auto& s : f) node(s, indent + 1, name);
      } else if constexpr (std::is_same_v<T, std::vector<Stmts>>) {
        for (size_t b = 0; b < f.size(); ++b) {
          const std::string role_b = fmt::format("{}[{}]", name, b);
          if (f[b].empty()) out += std::string(static_cast<size_t>(indent + 1) * 2, ' ') + role_b + ": (empty)\n";
          for (const auto& s : f[b]) node(s, indent + 1, role_b.c_str());
        }
      }
    });
  }
};

}  // namespace

std::string print(const Stmts& stmts, int indent) {
  Printer p;
  p.stmts(stmts, indent);
  return p.out;
}

std::string print(const ExprPtr& e) {
  Printer p;
  p.expr(e);
  return p.out;
}

std::string dump(const Stmts& stmts) {
  Dumper d;
  for (const auto& s : stmts) d.node(s, 0, "");
  return d.out;
}

// ---------------------------------------------------------------------------------------------------------
// Construction.

namespace {
template <class N>
std::shared_ptr<N> make() {
  return std::make_shared<N>();
}
}  // namespace

ExprPtr var(std::string name) {
  auto n = make<Var>();
  n->name = std::move(name);
  return n;
}
ExprPtr integer(int64_t v) {
  auto n = make<Int>();
  n->value = v;
  return n;
}
ExprPtr boolean(bool v) {
  auto n = make<Bool>();
  n->value = v;
  return n;
}
ExprPtr floating(double v) {
  auto n = make<Float>();
  n->value = v;
  return n;
}
ExprPtr text(std::string t) {
  auto n = make<Text>();
  n->text = std::move(t);
  return n;
}
ExprPtr load(ExprPtr base, ExprPtr index) {
  auto n = make<Load>();
  n->base = std::move(base);
  n->index = std::move(index);
  return n;
}
ExprPtr unary(UnOp op, ExprPtr a) {
  auto n = make<Unary>();
  n->op = op;
  n->a = std::move(a);
  return n;
}
ExprPtr binary(BinOp op, ExprPtr a, ExprPtr b) {
  auto n = make<Binary>();
  n->op = op;
  n->a = std::move(a);
  n->b = std::move(b);
  return n;
}
ExprPtr paren(ExprPtr a) {
  auto n = make<Paren>();
  n->a = std::move(a);
  return n;
}
ExprPtr cast(std::string type, ExprPtr a) {
  auto n = make<Cast>();
  n->type = std::move(type);
  n->a = std::move(a);
  return n;
}
ExprPtr call(std::string fn, Exprs args) {
  auto n = make<Call>();
  n->fn = std::move(fn);
  n->args = std::move(args);
  return n;
}
ExprPtr select(ExprPtr c, ExprPtr a, ExprPtr b) {
  auto n = make<Select>();
  n->c = std::move(c);
  n->a = std::move(a);
  n->b = std::move(b);
  return n;
}
ExprPtr init_list(Exprs items) {
  auto n = make<InitList>();
  n->items = std::move(items);
  return n;
}

StmtPtr decl(std::string type, std::string name, ExprPtr init) {
  return decl(std::move(type), std::vector<std::string>{std::move(name)}, Exprs{std::move(init)});
}
StmtPtr decl(std::string type, std::vector<std::string> names, Exprs inits) {
  auto n = make<Decl>();
  n->type = std::move(type);
  n->names = std::move(names);
  n->inits = std::move(inits);
  return n;
}
StmtPtr assign(ExprPtr lhs, ExprPtr rhs, AssignOp op) {
  auto n = make<Assign>();
  n->lhs = std::move(lhs);
  n->op = op;
  n->rhs = std::move(rhs);
  return n;
}
StmtPtr eval(ExprPtr e) {
  auto n = make<Eval>();
  n->e = std::move(e);
  return n;
}
StmtPtr on_one_line(Stmts parts) {
  auto n = make<Line>();
  n->parts = std::move(parts);
  return n;
}
StmtPtr block(Stmts body) {
  auto n = make<Block>();
  n->body = std::move(body);
  return n;
}
StmtPtr if_then(ExprPtr cond, Stmts then) { return if_chain(Exprs{std::move(cond)}, {std::move(then)}); }
StmtPtr if_chain(Exprs conds, std::vector<Stmts> branches) {
  SCORCH_ASSERT(conds.size() == branches.size(), "loop IR: one condition per branch");
  auto n = make<If>();
  n->conds = std::move(conds);
  n->branches = std::move(branches);
  return n;
}
StmtPtr for_range(std::string var_name, ExprPtr begin, ExprPtr end, Stmts body, bool simd, std::string reduction) {
  auto n = make<For>();
  n->cond = lt(var(var_name), std::move(end));
  n->var = std::move(var_name);
  n->begin = std::move(begin);
  n->simd = simd || !reduction.empty();
  n->reduction = std::move(reduction);
  n->body = std::move(body);
  return n;
}
StmtPtr for_step(std::string var_name, ExprPtr begin, ExprPtr cond, int64_t step, Stmts body) {
  auto n = make<For>();
  n->var = std::move(var_name);
  n->begin = std::move(begin);
  n->cond = std::move(cond);
  n->step = step;
  n->body = std::move(body);
  return n;
}
StmtPtr while_loop(ExprPtr cond, Stmts body) {
  auto n = make<While>();
  n->cond = std::move(cond);
  n->body = std::move(body);
  return n;
}
StmtPtr parallel(ExprPtr threads, Stmts body) {
  auto n = make<Parallel>();
  n->threads = std::move(threads);
  n->body = std::move(body);
  return n;
}
StmtPtr comment(std::string t) {
  auto n = make<Comment>();
  n->text = std::move(t);
  return n;
}

StmtPtr line(std::string t) {
  auto n = make<Raw>();
  n->text = std::move(t);
  return n;
}
StmtPtr for_range(std::string var_name, std::string begin, std::string end, Stmts body, bool simd, std::string reduction) {
  return for_range(std::move(var_name), text(std::move(begin)), text(std::move(end)), std::move(body), simd,
                   std::move(reduction));
}
StmtPtr while_loop(std::string cond, Stmts body) { return while_loop(text(std::move(cond)), std::move(body)); }
StmtPtr if_chain(std::vector<std::string> conds, std::vector<Stmts> branches) {
  Exprs c;
  for (auto& s : conds) c.push_back(s.empty() ? nullptr : text(std::move(s)));
  return if_chain(std::move(c), std::move(branches));
}
StmtPtr parallel(std::string threads, Stmts body) { return parallel(text(std::move(threads)), std::move(body)); }

}  // namespace scorch::loops
