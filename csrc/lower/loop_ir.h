// Loop IR: the structured program lowering produces and codegen prints. Statements are loops, branches,
// blocks and single lines; expressions inside are text built by lowering from its own generated names and
// numbers only (never user text), so printing them is safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace scorch::loops {

#define SCORCH_LOOP_KINDS(X) \
  X(block)                   \
  X(line)                    \
  X(comment)                 \
  X(for_range)               \
  X(while_loop)              \
  X(if_chain)                \
  X(parallel)

enum class Kind {
#define SCORCH_ENUM(k) k,
  SCORCH_LOOP_KINDS(SCORCH_ENUM)
#undef SCORCH_ENUM
};

struct Stmt;
using StmtPtr = std::shared_ptr<const Stmt>;
using Stmts = std::vector<StmtPtr>;

struct Stmt {
  Kind kind;
  std::string text;               // line, comment; for: loop variable; while: condition
  std::string begin, end;         // for: [begin, end)
  bool simd = false;              // for: vectorizable
  std::string reduction;          // for with simd: a scalar summed across iterations
  std::string threads;            // parallel: number of threads
  Stmts body;                     // block, for, while, parallel
  std::vector<std::string> conds; // if: one condition per branch ("" = else)
  std::vector<Stmts> branches;
};

StmtPtr line(std::string text);
StmtPtr comment(std::string text);
StmtPtr block(Stmts body);
StmtPtr for_range(std::string var, std::string begin, std::string end, Stmts body, bool simd = false,
                  std::string reduction = "");
StmtPtr while_loop(std::string cond, Stmts body);
StmtPtr if_chain(std::vector<std::string> conds, std::vector<Stmts> branches);
StmtPtr parallel(std::string threads, Stmts body);

// Indented text of the IR (C++ syntax), for SCORCH_DEBUG and for the code generator.
std::string print(const Stmts& stmts, int indent = 0);

}  // namespace scorch::loops
