#include "dense_first.h"

#include <algorithm>
#include <cctype>
#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "ir/parser.h"

namespace scorch::torch_glue {

namespace {

constexpr size_t kMaxCachedDecisions = 8192;  // a process with more distinct calls starts over

}  // namespace

std::optional<DenseFirst> plan_dense_first(const std::string& equation, const std::vector<Operand>& ops) {
  bool any_sparse = false;
  for (const auto& o : ops) any_sparse = any_sparse || o.sparse();
  if (!any_sparse || ops.size() < 3) return std::nullopt;
  std::vector<int> ndims;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& o : ops) {
    ndims.push_back(static_cast<int>(o.shape.size()));
    shapes.push_back(o.shape);
  }
  std::vector<bool> sparse;
  for (const auto& o : ops) sparse.push_back(o.sparse());
  // Operands that broadcast are expanded first (run_einsum), and this is asked again of the expanded ones.
  if (!ir::broadcast_shapes(equation, shapes, sparse).empty()) return std::nullopt;
  const ir::Statement st = ir::parse_einsum(equation, ndims);
  const std::vector<int64_t> sizes = ir::infer_var_sizes(st, shapes);
  std::vector<const ir::Expr*> acc;
  ir::collect_accesses(st.rhs, acc);
  const int nv = st.num_vars();
  if (acc.size() != ops.size() || nv > 52) return std::nullopt;
  std::vector<const ir::Expr*> of(ops.size(), nullptr);
  for (const ir::Expr* a : acc) of.at(a->tensor) = a;
  std::vector<bool> in_sparse(nv), in_out(nv), reduced(nv), in_group(nv);
  for (int v : st.out_vars) in_out[v] = true;
  for (const ir::Expr* a : acc)
    if (ops[a->tensor].sparse())
      for (int v : a->vars) in_sparse[v] = true;
  bool any = false;
  for (int v = 0; v < nv; ++v) any = any || (reduced[v] = !in_out[v] && !in_sparse[v]);
  if (!any) return std::nullopt;
  DenseFirst d;
  for (size_t t = 0; t < ops.size(); ++t) {
    bool g = false;
    for (int v : of[t]->vars) g = g || reduced[v];
    (g ? d.group : d.rest).push_back(static_cast<int>(t));
    if (g)
      for (int v : of[t]->vars) in_group[v] = true;
  }
  double nnz = 0, outside = 1, dense = 1, after = 1;
  for (const auto& o : ops)
    if (o.sparse()) nnz += static_cast<double>(o.nnz());
  for (int v = 0; v < nv; ++v) {
    const double n = static_cast<double>(std::max<int64_t>(sizes[v], 1));
    if (!in_sparse[v]) outside *= n;
    if (in_group[v]) dense *= n;
    if (!in_sparse[v] && !reduced[v]) after *= n;
  }
  const double fused = nnz * outside, split = dense + nnz * after;
  if (!(2 * split < fused)) return std::nullopt;
  auto letter = [](int v) { return static_cast<char>(v < 26 ? 'a' + v : 'A' + (v - 26)); };
  // The equations run over letters of their own (an ellipsis's indices have none); `why` uses the user's names.
  auto subscripts = [&](const std::vector<int>& vars, bool named) {
    std::string s;
    for (int v : vars) {
      const std::string& n = st.var_names[v];  // an ellipsis's indices are named by number: shown in brackets
      s += !named ? std::string(1, letter(v)) : n.size() == 1 && std::isalpha(static_cast<unsigned char>(n[0])) ? n : "[" + n + "]";
    }
    return s;
  };
  std::vector<int> kept;  // the contraction's result: the group's indices not summed away
  for (int v = 0; v < nv; ++v)
    if (in_group[v] && !reduced[v]) kept.push_back(v);
  std::string shown_dense, shown_rest;
  for (bool named : {false, true}) {
    std::string& de = named ? shown_dense : d.dense_eq;
    std::string& re = named ? shown_rest : d.rest_eq;
    for (size_t k = 0; k < d.group.size(); ++k) de += (k ? "," : "") + subscripts(of[d.group[k]]->vars, named);
    de += "->" + subscripts(kept, named);
    for (int t : d.rest) re += subscripts(of[t]->vars, named) + ",";
    re += subscripts(kept, named) + "->" + subscripts(st.out_vars, named);
  }
  d.why = fmt::format("dense factors contracted first ({}: about {:.3g} multiply-adds with the rest {}, against "
                      "{:.3g} as one loop nest)", shown_dense, split, shown_rest, fused);
  return d;
}

std::shared_ptr<const std::optional<DenseFirst>> dense_first_for(const std::string& key, const std::string& equation,
                                                                   const std::vector<Operand>& ops) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const std::optional<DenseFirst>>> cache;
  {
    std::lock_guard lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto d = std::make_shared<const std::optional<DenseFirst>>(plan_dense_first(equation, ops));
  std::lock_guard lock(mu);
  if (cache.size() >= kMaxCachedDecisions) cache.clear();
  return cache.emplace(key, std::move(d)).first->second;
}


}  // namespace scorch::torch_glue
