#include "ir/parser.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>

#include <fmt/ranges.h>

#include "common/error.h"
#include "common/text_cursor.h"

namespace scorch::ir {
namespace {

bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Renumber variables in canonical order (output first, then the right side left to right), so that printing
// the canonical form and parsing it back gives the same statement.
void renumber_vars(Statement& st) {
  std::vector<int> map(st.var_names.size(), -1);
  std::vector<std::string> names;
  auto visit = [&](int v) {
    if (map[v] < 0) {
      map[v] = static_cast<int>(names.size());
      names.push_back(st.var_names[v]);
    }
  };
  for (int v : st.out_vars) visit(v);
  std::vector<const Expr*> acc;
  collect_accesses(st.rhs, acc);
  for (const Expr* a : acc)
    for (int v : a->vars) visit(v);
  for (int& v : st.out_vars) v = map[v];
  // Rebuild the tree with renumbered accesses (nodes are immutable).
  std::function<ExprPtr(const ExprPtr&)> rebuild = [&](const ExprPtr& e) -> ExprPtr {
    switch (e->kind) {
      case ExprKind::access: {
        std::vector<int> vars;
        for (int v : e->vars) vars.push_back(map[v]);
        return Expr::access(e->tensor, e->access_id, vars, e->var_pos, e->pos);
      }
      case ExprKind::literal: return e;
      case ExprKind::neg: return Expr::neg(rebuild(e->a), e->pos);
      default: return Expr::binary(e->kind, rebuild(e->a), rebuild(e->b), e->pos);
    }
  };
  st.rhs = rebuild(st.rhs);
  st.var_names = names;
}

class NotationParser : public TextCursor {
 public:
  NotationParser(const std::string& text, const std::vector<std::string>& tensors, Statement& st)
      : TextCursor(text), tensors_(tensors), st_(st) {}

  void parse() {
    skip();
    const size_t lhs_pos = i_;
    std::string name = ident("the output tensor's name");
    (void)lhs_pos;
    if (eat('(')) {
      if (!eat(')')) {
        do {
          skip();
          const size_t at = i_;
          int v = var(ident("an index variable"));
          if (std::find(st_.out_vars.begin(), st_.out_vars.end(), v) != st_.out_vars.end())
            fail(at, fmt::format("index '{}' appears twice in the output", st_.var_names[v]));
          st_.out_vars.push_back(v);
          st_.out_var_pos.push_back(at);
        } while (eat(','));
        expect(')');
      }
    }
    expect('=');
    st_.rhs = expr();
    skip();
    if (i_ != s_.size()) fail(i_, "expected '+', '-', '*' or the end");
    // Every output index must be bound by the right side.
    std::vector<const Expr*> acc;
    collect_accesses(st_.rhs, acc);
    for (size_t d = 0; d < st_.out_vars.size(); ++d) {
      bool bound = false;
      for (const Expr* a : acc) bound |= std::count(a->vars.begin(), a->vars.end(), st_.out_vars[d]) > 0;
      if (!bound)
        fail(st_.out_var_pos[d],
             fmt::format("output index '{}' does not appear on the right side", st_.var_names[st_.out_vars[d]]));
    }
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& msg) { st_.fail_at(at, msg); }
  void expect(char c) {
    if (!eat(c)) fail(i_, fmt::format("expected '{}'", c));
  }
  std::string ident(const char* what) {
    std::string n = name();
    if (n.empty()) fail(i_, fmt::format("expected {}", what));
    return n;
  }
  int var(const std::string& name) {
    auto it = std::find(st_.var_names.begin(), st_.var_names.end(), name);
    if (it != st_.var_names.end()) return static_cast<int>(it - st_.var_names.begin());
    st_.var_names.push_back(name);
    return static_cast<int>(st_.var_names.size()) - 1;
  }

  // A parsed subexpression and the height of its tree (an access or a number is 1).
  struct Parsed {
    ExprPtr e;
    int height;
  };
  Parsed node(ExprKind k, const Parsed& a, const Parsed& b, size_t at) {
    Parsed p{Expr::binary(k, a.e, b.e, at), std::max(a.height, b.height) + 1};
    grown(p, at);
    return p;
  }
  // Every node counts towards the size limit and every new level towards the height limit: checked as the
  // tree grows, so an oversized expression is refused before anything walks it.
  void grown(const Parsed& p, size_t at) {
    if (++nodes_ > kMaxExprNodes)
      fail(at, fmt::format("expression too large: more than {} operators and operands", kMaxExprNodes));
    if (p.height > kMaxExprHeight)
      fail(at, fmt::format("expression nested too deeply: more than {} levels of operators (a sum or product "
                           "of more than {} terms counts one level per term)",
                           kMaxExprHeight, kMaxExprHeight));
  }
  // Parentheses and unary minus recurse: bounded too, so that the parser's own stack stays small.
  struct Nest {
    NotationParser& p;
    Nest(NotationParser& parser, size_t at) : p(parser) {
      if (++p.nesting_ > kMaxExprHeight)
        p.fail(at, fmt::format("expression nested too deeply: more than {} levels of parentheses or signs",
                               kMaxExprHeight));
    }
    ~Nest() { --p.nesting_; }
  };

  ExprPtr expr() { return sum().e; }
  Parsed sum() {
    Parsed e = term();
    for (;;) {
      skip();
      const size_t at = i_;
      if (eat('+')) e = node(ExprKind::add, e, term(), at);
      else if (eat('-')) e = node(ExprKind::sub, e, term(), at);
      else return e;
    }
  }
  Parsed term() {
    Parsed e = unary();
    for (;;) {
      skip();
      const size_t at = i_;
      if (eat('*')) e = node(ExprKind::mul, e, unary(), at);
      else return e;
    }
  }
  Parsed unary() {
    skip();
    const size_t at = i_;
    if (eat('-')) {
      Nest nest(*this, at);
      Parsed a = unary();
      Parsed p{Expr::neg(a.e, at), a.height + 1};
      grown(p, at);
      return p;
    }
    return primary();
  }
  Parsed primary() {
    skip();
    const size_t at = i_;
    if (eat('(')) {
      Nest nest(*this, at);
      Parsed e = sum();
      expect(')');
      return e;
    }
    if (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.')) {
      const char* begin = s_.c_str() + i_;
      char* end = nullptr;
      const double v = std::strtod(begin, &end);
      if (end == begin) fail(at, "expected a number");
      i_ += static_cast<size_t>(end - begin);
      if (i_ < s_.size() && is_name_char(s_[i_])) fail(i_, "unexpected character after a number");
      // 1e999 overflows to infinity: a constant must be a finite number (infinities and NaNs have no
      // spelling in the notation, and a kernel's text must parse back to the same statement).
      if (!std::isfinite(v))
        fail(at, fmt::format("number '{}' is out of range: constants must be finite (at most {:g} in magnitude)",
                             std::string(begin, static_cast<const char*>(end)), std::numeric_limits<double>::max()));
      Parsed p{Expr::literal(v, at), 1};
      grown(p, at);
      return p;
    }
    if (i_ >= s_.size() || !is_name_start(s_[i_])) fail(at, "expected a tensor access, a number or '('");
    const std::string name = ident("a tensor name");
    auto it = std::find(tensors_.begin(), tensors_.end(), name);
    if (it == tensors_.end()) fail(at, fmt::format("unknown tensor '{}'", name));
    const int t = static_cast<int>(it - tensors_.begin());
    std::vector<int> vars;
    std::vector<size_t> pos;
    if (eat('(')) {
      if (!eat(')')) {
        do {
          skip();
          pos.push_back(i_);
          vars.push_back(var(ident("an index variable")));
        } while (eat(','));
        expect(')');
      }
    }
    Parsed p{Expr::access(t, next_access_++, vars, pos, at), 1};
    grown(p, at);
    return p;
  }

  const std::vector<std::string>& tensors_;
  Statement& st_;
  int next_access_ = 0;
  int nodes_ = 0;
  int nesting_ = 0;
};

void check_ranks(const Statement& st, const std::vector<int>& ndims) {
  if (ndims.empty()) return;
  SCORCH_ASSERT(static_cast<int>(ndims.size()) == st.num_tensors(), "rank list does not match the operands");
  std::vector<const Expr*> acc;
  collect_accesses(st.rhs, acc);
  for (const Expr* a : acc) {
    if (static_cast<int>(a->vars.size()) != ndims[a->tensor])
      st.fail_at(a->pos, fmt::format("'{}' has {} dimensions but is indexed with {}", st.tensor_names[a->tensor],
                                     ndims[a->tensor], a->vars.size()));
  }
}

}  // namespace

Statement parse_index_notation(const std::string& text, const std::vector<std::string>& tensor_names,
                               const std::vector<int>& ndims) {
  Statement st;
  st.source = text;
  st.tensor_names = tensor_names;
  NotationParser(text, tensor_names, st).parse();
  // Constants alone give no dtype, no sizes and no tensor for the kernel op's dispatcher to run on (it failed
  // with torch's "There were no tensor arguments to this function"; helper-53).
  std::vector<const Expr*> reads;
  collect_accesses(st.rhs, reads);
  if (reads.empty()) {
    const size_t eq = text.find('=');
    st.fail_at(eq == std::string::npos ? 0 : eq + 1,
               "the right side reads no operand: a constant alone has no dtype or sizes (give it as a 0-d tensor "
               "operand, e.g. s = c with c=torch.tensor(2.0))");
  }
  check_ranks(st, ndims);
  renumber_vars(st);
  return st;
}

Statement parse_einsum(const std::string& eq, const std::vector<int>& ndims) {
  Statement st;
  st.source = eq;
  const size_t n = eq.size();
  size_t i = 0;
  auto skip = [&] {
    while (i < n && std::isspace(static_cast<unsigned char>(eq[i]))) ++i;
  };
  auto var_of = [&](char c) {
    const std::string name(1, c);
    auto it = std::find(st.var_names.begin(), st.var_names.end(), name);
    if (it != st.var_names.end()) return static_cast<int>(it - st.var_names.begin());
    st.var_names.push_back(name);
    return static_cast<int>(st.var_names.size()) - 1;
  };
  // Ellipsis dimensions get names that cannot clash with letters.
  int ellipsis_dims = -1;
  auto ellipsis_var = [&](int k) { return var_of(static_cast<char>('0' + k)); };

  // Parse "subscripts" for operand `t` (or the output when t < 0): letters and at most one "...".
  struct Sub {
    std::vector<int> vars;
    std::vector<size_t> pos;
    size_t start;
  };
  auto subscripts = [&](int t, int rank) {
    Sub s;
    skip();
    s.start = i;
    int ellipsis_at = -1;
    size_t ellipsis_pos = 0;
    std::vector<char> letters;
    std::vector<size_t> letter_pos;
    auto ascii_letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
    auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
    while (i < n && (ascii_letter(eq[i]) || eq[i] == '.' || space(eq[i]))) {
      if (space(eq[i])) {
        ++i;
        continue;
      }
      if (eq[i] == '.') {
        if (eq.compare(i, 3, "...") != 0) st.fail_at(i, "expected '...'");
        if (ellipsis_at >= 0) st.fail_at(i, "only one '...' per operand");
        ellipsis_at = static_cast<int>(letters.size());
        ellipsis_pos = i;
        i += 3;
        continue;
      }
      letters.push_back(eq[i]);
      letter_pos.push_back(i);
      ++i;
    }
    // What may follow subscripts: ',' or "->" (the parser checks which), the end, or spaces. Anything else is
    // named here rather than surfacing later as a count mismatch.
    if (i < n && eq[i] != ',' && eq[i] != '-') {
      const auto c = static_cast<unsigned char>(eq[i]);
      st.fail_at(i, c >= 0x80 ? std::string("subscripts must be ASCII letters a-z or A-Z; found a non-ASCII character")
                              : fmt::format("subscripts must be letters a-z or A-Z or '...'; found '{}'",
                                            c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c))
                                                                  : fmt::format("\\x{:02x}", c)));
    }
    int nell = 0;
    if (ellipsis_at >= 0) {
      if (t >= 0) {
        nell = rank - static_cast<int>(letters.size());
        if (nell < 0)
          st.fail_at(s.start, fmt::format("operand {} has {} dimensions but {} subscripts", t, rank, letters.size()));
        if (ellipsis_dims >= 0 && ellipsis_dims != nell)
          st.fail_at(ellipsis_pos, fmt::format("'...' covers {} dimensions here but {} in an earlier operand (einsum "
                                               "broadcasts them first: their sizes do not broadcast)",
                                               nell, ellipsis_dims));
        ellipsis_dims = nell;
      } else {
        nell = std::max(ellipsis_dims, 0);
      }
    }
    for (size_t k = 0; k <= letters.size(); ++k) {
      if (static_cast<int>(k) == ellipsis_at)
        for (int e = 0; e < nell; ++e) {
          s.vars.push_back(ellipsis_var(e));
          s.pos.push_back(ellipsis_pos);
        }
      if (k < letters.size()) {
        s.vars.push_back(var_of(letters[k]));
        s.pos.push_back(letter_pos[k]);
      }
    }
    if (t >= 0 && static_cast<int>(s.vars.size()) != rank)
      st.fail_at(s.start, fmt::format("operand {} has {} dimensions but {} subscripts", t, rank, s.vars.size()));
    return s;
  };

  std::vector<Sub> ops;
  for (;;) {
    const int t = static_cast<int>(ops.size());
    if (t >= static_cast<int>(ndims.size()))
      st.fail_at(i, fmt::format("the equation has more operands than the {} given", ndims.size()));
    ops.push_back(subscripts(t, ndims[t]));
    skip();
    if (i < n && eq[i] == ',') {
      ++i;
      continue;
    }
    break;
  }
  skip();
  if (i < n && eq[i] != '-') st.fail_at(i, "unexpected character in the equation");
  if (ops.size() != ndims.size())
    st.fail_at(i, fmt::format("the equation has {} operands but {} were given", ops.size(), ndims.size()));
  if (static_cast<int>(ops.size()) > kMaxExprHeight)
    st.fail_at(0, fmt::format("too many operands: {} (at most {})", ops.size(), kMaxExprHeight));
  for (size_t t = 0; t < ops.size(); ++t) st.tensor_names.push_back(fmt::format("operand {}", t));

  skip();
  Sub out;
  bool explicit_out = false;
  if (i < n && eq[i] == '-') {
    if (i + 1 >= n || eq[i + 1] != '>') st.fail_at(i, "expected '->'");
    i += 2;
    out = subscripts(-1, 0);
    explicit_out = true;
    skip();
  }
  if (i != n) st.fail_at(i, "unexpected character in the equation");

  // Build the right side: a product of all operands.
  ExprPtr rhs;
  for (size_t t = 0; t < ops.size(); ++t) {
    ExprPtr a = Expr::access(static_cast<int>(t), static_cast<int>(t), ops[t].vars, ops[t].pos, ops[t].start);
    rhs = rhs ? Expr::binary(ExprKind::mul, rhs, a, ops[t].start) : a;
  }
  st.rhs = rhs;
  if (explicit_out) {
    for (size_t d = 0; d < out.vars.size(); ++d) {
      const int v = out.vars[d];
      if (std::find(st.out_vars.begin(), st.out_vars.end(), v) != st.out_vars.end())
        st.fail_at(out.pos[d], fmt::format("index '{}' appears twice in the output", st.var_names[v]));
      bool bound = false;
      for (const auto& o : ops) bound |= std::count(o.vars.begin(), o.vars.end(), v) > 0;
      if (!bound) st.fail_at(out.pos[d], fmt::format("output index '{}' appears in no operand", st.var_names[v]));
      st.out_vars.push_back(v);
      st.out_var_pos.push_back(out.pos[d]);
    }
  } else {
    // Implicit: ellipsis dimensions first, then indices used exactly once, in alphabetical order.
    std::map<std::string, int> count;
    for (const auto& o : ops)
      for (int v : o.vars) count[st.var_names[v]]++;
    for (int e = 0; e < std::max(ellipsis_dims, 0); ++e) {
      st.out_vars.push_back(ellipsis_var(e));
      st.out_var_pos.push_back(n);
    }
    std::vector<std::string> once;
    for (auto& [name, c] : count)
      if (c == 1 && std::isalpha(static_cast<unsigned char>(name[0]))) once.push_back(name);
    std::sort(once.begin(), once.end());  // ASCII: upper case before lower case, as numpy and torch do
    for (auto& name : once) {
      st.out_vars.push_back(var_of(name[0]));
      st.out_var_pos.push_back(n);
    }
  }
  renumber_vars(st);
  return st;
}

std::vector<int64_t> infer_var_sizes(const Statement& st, const std::vector<std::vector<int64_t>>& shapes) {
  SCORCH_CHECK(static_cast<int>(shapes.size()) == st.num_tensors(), "expected {} operands, got {}", st.num_tensors(),
               shapes.size());
  std::vector<int64_t> size(st.var_names.size(), -1);
  std::vector<const Expr*> acc;
  collect_accesses(st.rhs, acc);
  for (const Expr* a : acc) {
    const auto& shape = shapes[a->tensor];
    if (shape.size() != a->vars.size())
      st.fail_at(a->pos, fmt::format("{} has {} dimensions but is indexed with {}", st.tensor_names[a->tensor],
                                     shape.size(), a->vars.size()));
    for (size_t d = 0; d < a->vars.size(); ++d) {
      const int v = a->vars[d];
      if (size[v] < 0) size[v] = shape[d];
      else if (size[v] != shape[d])
        st.fail_at(a->var_pos[d],
                   std::isdigit(static_cast<unsigned char>(st.var_names[v][0]))  // a dimension under "..."
                       ? fmt::format("dimension {} of '...' has size {} here but {} elsewhere",
                                     st.var_names[v], shape[d], size[v])
                       : fmt::format("index '{}' has size {} here but {} elsewhere", st.var_names[v], shape[d],
                                     size[v]));
    }
  }
  for (size_t v = 0; v < size.size(); ++v) SCORCH_ASSERT(size[v] >= 0, "index {} has no size", st.var_names[v]);
  return size;
}

std::vector<std::vector<int64_t>> broadcast_shapes(const std::string& equation,
                                                   const std::vector<std::vector<int64_t>>& shapes,
                                                   const std::vector<bool>& sparse) {
  // Each input term's subscripts, read without checks (parse_einsum checks them): letters, and where the
  // "..." sits among them (-1: none).
  struct Term {
    std::string letters;
    int ellipsis_at = -1;
  };
  std::vector<Term> terms(1);
  const size_t arrow = equation.find("->");
  const std::string lhs = equation.substr(0, arrow);
  for (size_t i = 0; i < lhs.size(); ++i) {
    const char c = lhs[i];
    if (c == ',') {
      terms.emplace_back();
    } else if (c == '.') {
      if (lhs.compare(i, 3, "...") != 0 || terms.back().ellipsis_at >= 0) return {};
      terms.back().ellipsis_at = static_cast<int>(terms.back().letters.size());
      i += 2;
    } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      terms.back().letters += c;
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      return {};
    }
  }
  if (terms.size() != shapes.size() || sparse.size() != shapes.size()) return {};
  // Each term's dimensions as keys: a letter, or the ellipsis dimension counted from the right (as torch and
  // numpy align them), written as a negative number.
  int ell = 0;
  std::vector<std::vector<int>> keys(terms.size());
  for (size_t t = 0; t < terms.size(); ++t) {
    const int rank = static_cast<int>(shapes[t].size()), named = static_cast<int>(terms[t].letters.size());
    const int nell = terms[t].ellipsis_at >= 0 ? rank - named : 0;
    if (nell < 0 || (terms[t].ellipsis_at < 0 && rank != named)) return {};
    ell = std::max(ell, nell);
    for (int d = 0, l = 0; d < rank; ++d) {
      const bool in_ellipsis = terms[t].ellipsis_at >= 0 && d >= terms[t].ellipsis_at && d < terms[t].ellipsis_at + nell;
      keys[t].push_back(in_ellipsis ? -(nell - (d - terms[t].ellipsis_at)) : terms[t].letters[l++]);
    }
  }
  // Each key's size: the one size other than 1 it has anywhere (1 if none); two different ones do not
  // broadcast (the parser's size check then names them).
  std::map<int, int64_t> size;
  for (size_t t = 0; t < terms.size(); ++t)
    for (size_t d = 0; d < keys[t].size(); ++d) {
      const int64_t s = shapes[t][d];
      // A letter repeated in one term (a diagonal) must have one size there: torch.einsum does not stretch it.
      for (size_t e = 0; e < d; ++e)
        if (keys[t][e] == keys[t][d] && shapes[t][e] != s) return {};
      auto [it, fresh] = size.emplace(keys[t][d], s);
      if (fresh || s == 1 || it->second == s) continue;
      if (it->second != 1) return {};
      it->second = s;
    }
  std::vector<std::vector<int64_t>> out;
  bool changed = false;
  for (size_t t = 0; t < terms.size(); ++t) {
    std::vector<int64_t> shape;
    const int nell = terms[t].ellipsis_at >= 0 ? static_cast<int>(shapes[t].size() - terms[t].letters.size()) : 0;
    for (size_t d = 0; d < keys[t].size(); ++d) {
      if (static_cast<int>(d) == terms[t].ellipsis_at)  // leading ellipsis dimensions this operand lacks
        for (int e = ell; e > nell; --e) shape.push_back(size.count(-e) ? size.at(-e) : 1);
      shape.push_back(size.at(keys[t][d]));
    }
    if (terms[t].ellipsis_at == static_cast<int>(terms[t].letters.size()) && nell == 0)  // "..." last and empty
      for (int e = ell; e > 0; --e) shape.push_back(size.count(-e) ? size.at(-e) : 1);
    if (shape != shapes[t]) {
      SCORCH_CHECK(!sparse[t],
                   "einsum operand {} is sparse and would have to broadcast from shape [{}] to [{}]: only dense "
                   "operands broadcast; give the sparse operand its full shape",
                   t, fmt::join(shapes[t], ", "), fmt::join(shape, ", "));
      changed = true;
    }
    out.push_back(std::move(shape));
  }
  if (!changed) return {};
  return out;
}

}  // namespace scorch::ir
