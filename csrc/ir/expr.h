// Tensor index notation: index variables, tensor accesses, +, -, *, negation and constants, and the
// assignment statement "out(i,j) = expr" in which variables absent from the output are summed. Nodes are
// immutable and shared. Source positions are kept only to point at user mistakes; generated code never sees
// user text, only the numbers of variables and tensors.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace scorch::ir {

// X-macro of the expression kinds, so visitors and printers list them all.
#define SCORCH_EXPR_KINDS(X) \
  X(access)                  \
  X(literal)                 \
  X(add)                     \
  X(sub)                     \
  X(mul)                     \
  X(neg)

enum class ExprKind {
#define SCORCH_ENUM(k) k,
  SCORCH_EXPR_KINDS(SCORCH_ENUM)
#undef SCORCH_ENUM
};

// Limits on what the parsers accept. Everything that walks an expression (printing, collecting accesses,
// splitting reductions, differentiating, lowering) recurses over the tree, so its height bounds the stack
// those walks use; its size bounds their time and the kernel's code. A sum or product of n terms parses to a
// chain of height n. Deeper or larger input is refused with a ValueError at parse time.
inline constexpr int kMaxExprHeight = 1000;
inline constexpr int kMaxExprNodes = 20000;

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  ExprKind kind;
  size_t pos = 0;             // where it starts in the source text
  // access
  int tensor = -1;            // operand number (0-based)
  int access_id = -1;         // distinct for each occurrence of an access in a statement
  std::vector<int> vars;      // index variable of each tensor dimension
  std::vector<size_t> var_pos;  // source position of each of those variables
  // literal
  double value = 0;
  // add, sub, mul: a, b; neg: a
  ExprPtr a, b;

  static ExprPtr access(int tensor, int access_id, std::vector<int> vars, std::vector<size_t> var_pos, size_t pos);
  static ExprPtr literal(double v, size_t pos);
  static ExprPtr binary(ExprKind k, ExprPtr a, ExprPtr b, size_t pos);
  static ExprPtr neg(ExprPtr a, size_t pos);
};

struct Statement {
  std::string source;                     // the user's text, for error messages only
  std::vector<std::string> var_names;     // for messages and printing
  std::vector<std::string> tensor_names;  // operand names, for messages and printing
  std::vector<int> out_vars;
  std::vector<size_t> out_var_pos;
  ExprPtr rhs;

  int num_vars() const { return static_cast<int>(var_names.size()); }
  int num_tensors() const { return static_cast<int>(tensor_names.size()); }
  // Variables not in the output: summed over.
  std::vector<int> reduction_vars() const;
  // Canonical text with generated names: "out(i0,i1) = t0(i0,i2) * t1(i2,i1)". Parses back to the same.
  std::string canonical() const;
  // Readable text with the user's names.
  std::string str() const;
  // Raise ValueError with a caret under source position `pos`.
  [[noreturn]] void fail_at(size_t pos, const std::string& msg) const;
};

// The height of an expression's tree (an access or a number is 1) and its number of nodes, counted up to
// `stop` (subtrees shared between parents count once per parent, as they are printed).
int expr_height(const ExprPtr& e);
size_t expr_size(const ExprPtr& e, size_t stop);

// All accesses of an expression, left to right.
void collect_accesses(const ExprPtr& e, std::vector<const Expr*>& out);
std::string to_string(const ExprPtr& e, const std::vector<std::string>& tensor_names,
                      const std::vector<std::string>& var_names);
std::string format_literal(double v);

// "message\n  source\n     ^" for error reports.
std::string caret_message(const std::string& msg, const std::string& source, size_t pos);

}  // namespace scorch::ir
