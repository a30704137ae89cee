// Region programs: the JSON text the backend writes (scorch_backend/custom_ops/region.py: Program), read once per text
// into a RegionProgram with its derived layouts (loop order, storage order, kernel equation), written back,
// and differentiated (the program of d out / d operand k).
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "json.h"
#include "region.h"

namespace scorch::torch_glue {
namespace {

using json::as;
using json::field;
using json::Json;
using json::JsonArray;
using json::JsonObject;
using json::JsonReader;
using json::json_string;

// Each operand that the list field `name` names by index (col_major, masked_grads, relu) handed to `f`; an
// index that names no operand is a ValueError.
template <typename F>
void listed_operands(const JsonObject& o, const char* name, RegionProgram& p, F&& f) {
  const Json* m = field(o, name);
  if (!m) return;
  for (const Json& e : as<JsonArray>(*m, "a list of operand indices expected")) {
    const double k = as<double>(e, "an operand index expected");
    SCORCH_CHECK(k >= 0 && k < static_cast<double>(p.operands.size()) && k == static_cast<int>(k),
                 "scorch::region: {} names no operand ({})", name, k);
    f(p.operands[static_cast<size_t>(k)]);
  }
}

const char* kind_name(RegionOperand::Kind k) {
  return k == RegionOperand::Kind::sparse    ? "sparse"
         : k == RegionOperand::Kind::pattern ? "pattern"
         : k == RegionOperand::Kind::add     ? "add"
         : k == RegionOperand::Kind::mask    ? "mask"
                                             : "dense";
}

void derive(RegionProgram& p) {
  // The kernel's loop order: the compressed operands' letters outermost, then the output's, then the rest.
  // Addends are not factors: they take no part in the loops or the equations (their letters are output ones).
  std::string& order = p.loop_letters;
  auto add = [&](const std::string& letters) {
    for (char c : letters)
      if (order.find(c) == std::string::npos) order += c;
  };
  auto factor = [](const RegionOperand& o) {
    return o.kind != RegionOperand::Kind::add && o.kind != RegionOperand::Kind::mask;
  };
  // a column-order operand is walked with its letters swapped
  auto walked = [](const RegionOperand& o) {
    return o.col_major ? std::string{o.letters[1], o.letters[0]} : o.letters;
  };
  for (const auto& o : p.operands)
    if (o.kind != RegionOperand::Kind::dense && factor(o)) add(walked(o));
  add(p.out);
  for (const auto& o : p.operands)
    if (factor(o)) add(o.letters);
  auto by_order = [&](std::string s) {
    std::sort(s.begin(), s.end(), [&](char a, char b) { return order.find(a) < order.find(b); });
    return s;
  };
  p.storage = by_order(p.out);
  for (char c : p.out) p.back.push_back(static_cast<int64_t>(p.storage.find(c)));
  std::string kernel, dense;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const auto& o = p.operands[k];
    p.kernel_letters.push_back(o.kind == RegionOperand::Kind::sparse || o.kind == RegionOperand::Kind::pattern
                                   ? walked(o)
                                   : by_order(o.letters));
    if (!factor(o)) continue;
    kernel += (kernel.empty() ? "" : ",") + p.kernel_letters.back();
    dense += (dense.empty() ? "" : ",") + o.tensor_letters();
  }
  p.kernel_equation = kernel + "->" + p.storage;
  p.dense_equation = dense + "->" + p.storage;
  p.title = p.name.empty() && p.label.empty() ? "region" : p.label.empty() ? p.name
                                                         : p.name.empty() ? p.label : p.name + " " + p.label;
  p.profile_name = "scorch::region " + p.title;
}

// {"format": "dense(0),compressed(1)", "size": [rows, cols]}: a packed operand (see RegionOperand); a size
// of -1 is given by the call.
void read_packed(const JsonObject& o, RegionOperand& r) {
  const Json* f = field(o, "format");
  const Json* size = field(o, "size");
  SCORCH_CHECK(f && size, "scorch::region: malformed program text (a packed operand needs format and size)");
  SCORCH_CHECK(r.kind == RegionOperand::Kind::sparse && r.expand == 0,
               "scorch::region: only sparse operands without broadcast letters can be packed");
  for (const Json& d : as<JsonArray>(*size, "packed size must be a list")) {
    const double n = as<double>(d, "packed size");  // -1: given by the call (region.cpp, resolve_packed_size)
    SCORCH_CHECK(n >= -1 && n < 9.2e18 && n == static_cast<double>(static_cast<int64_t>(n)),
                 "scorch::region: bad packed size {}", n);
    r.packed_size.push_back(static_cast<int64_t>(n));
  }
  SCORCH_CHECK(r.packed_size.size() == r.letters.size(),
               "scorch::region: a packed operand of letters '{}' has {} sizes", r.letters, r.packed_size.size());
  r.packed = as<std::string>(*f, "packed format");
  const FormatRef& fr = interned_format(r.packed, static_cast<int>(r.letters.size()));  // ValueError if malformed
  r.packed = fr.text;
  r.packed_buffers = fr.format.buffer_count();
}

// RegionProgram::finite_checked and selects_on_output. Addends are added, never multiplied; patterns and masks
// are read for their ones; packed operands are the caller's sparse tensors (unstored entries are never
// multiplied in eager either); a dense operand under a pattern is zero outside it by construction.
void finite_operands(RegionProgram& p) {
  using Kind = RegionOperand::Kind;
  bool compressed = false;
  for (const auto& o : p.operands) {
    compressed = compressed || o.kind == Kind::sparse || o.kind == Kind::pattern;
    p.selects_on_output = p.selects_on_output ||
                          ((o.kind == Kind::pattern || o.kind == Kind::mask) && o.expand == 0 &&
                           o.letters.size() == p.out.size() &&
                           std::all_of(p.out.begin(), p.out.end(), [&](char c) { return o.letters.find(c) != std::string::npos; }));
  }
  if (!compressed) return;  // (the dense path runs anyway)
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& o = p.operands[k];
    if ((o.kind != Kind::dense && o.kind != Kind::sparse) || !o.packed.empty()) continue;
    const std::string letters = o.tensor_letters();
    const bool under_pattern = o.kind == Kind::dense && std::any_of(p.operands.begin(), p.operands.end(), [&](const auto& q) {
      const std::string ql = q.tensor_letters();
      return q.kind == Kind::pattern &&
             std::all_of(ql.begin(), ql.end(), [&](char c) { return letters.find(c) != std::string::npos; });
    });
    if (!under_pattern) p.finite_checked.push_back(static_cast<int>(k));
  }
}

RegionProgram parse_text(const std::string& text) {
  const Json doc = JsonReader(text).document();
  const auto& o = as<JsonObject>(doc, "an object expected");
  RegionProgram p;
  const Json* ops = field(o, "operands");
  const Json* out = field(o, "out");
  SCORCH_CHECK(ops && out, "scorch::region: malformed program text (operands and out are required)");
  for (const Json& e : as<JsonArray>(*ops, "operands must be a list")) {
    const auto& a = as<JsonArray>(e, "an operand must be a list");
    SCORCH_CHECK(a.size() == 6 || a.size() == 7,
                 "scorch::region: malformed program text (an operand has 6 fields, 7 when packed)");
    RegionOperand r;
    r.letters = as<std::string>(a[0], "operand letters");
    const std::string kind = as<std::string>(a[1], "operand kind");
    SCORCH_CHECK(kind == "dense" || kind == "sparse" || kind == "pattern" || kind == "add" || kind == "mask",
                 "scorch::region: unknown operand kind '{}'", kind);
    r.kind = kind == "sparse"    ? RegionOperand::Kind::sparse
             : kind == "pattern" ? RegionOperand::Kind::pattern
             : kind == "add"     ? RegionOperand::Kind::add
             : kind == "mask"    ? RegionOperand::Kind::mask
                                 : RegionOperand::Kind::dense;
    r.cached = as<bool>(a[2], "cached flag");
    r.grad = as<bool>(a[3], "grad flag");
    const double expand = as<double>(a[4], "expand count");
    SCORCH_CHECK(expand >= 0 && expand <= 26 && expand == static_cast<int>(expand),
                 "scorch::region: bad expand count {}", expand);
    r.expand = static_cast<int>(expand);
    r.weight = as<bool>(a[5], "weight flag");
    if (a.size() == 7) read_packed(as<JsonObject>(a[6], "packed operand: an object expected"), r);
    for (int64_t d : r.packed_size) p.call_sized = p.call_sized || d < 0;
    p.packed_buffers += r.packed_buffers;
    p.operands.push_back(std::move(r));
  }
  p.out = as<std::string>(*out, "out letters");
  if (const Json* c = field(o, "coef")) p.coef = as<double>(*c, "coef");
  if (const Json* f = field(o, "frozen")) p.frozen = as<bool>(*f, "frozen flag");
  if (const Json* n = field(o, "name")) p.name = as<std::string>(*n, "name");
  if (const Json* l = field(o, "label")) p.label = as<std::string>(*l, "label");
  if (const Json* g = field(o, "grad_out")) {
    const std::string kind = as<std::string>(*g, "grad_out");
    SCORCH_CHECK(kind == "dense" || kind == "sparse", "scorch::region: grad_out is 'dense' or 'sparse', got '{}'", kind);
    p.sparse_grad_out = kind == "sparse";
  }
  if (const Json* g = field(o, "out_order")) {
    const std::string order = as<std::string>(*g, "out_order");
    SCORCH_CHECK(order == "storage" || order == "requested",
                 "scorch::region: out_order is 'storage' or 'requested', got '{}'", order);
    p.requested_order = order == "requested";
  }
  listed_operands(o, "col_major", p, [](RegionOperand& r) {
    SCORCH_CHECK((r.kind == RegionOperand::Kind::sparse || r.kind == RegionOperand::Kind::pattern) &&
                     r.letters.size() == 2 && r.expand == 0 && r.packed.empty(),
                 "scorch::region: only a 2-D compressed operand (not packed, not broadcast) can be in column order");
    r.col_major = true;
  });
  listed_operands(o, "masked_grads", p, [](RegionOperand& r) {
    SCORCH_CHECK(r.kind != RegionOperand::Kind::pattern && r.kind != RegionOperand::Kind::add && r.expand == 0 &&
                     r.packed.empty(),
                 "scorch::region: only a dense or sparse operand's gradient can be masked");
    r.masked_grad = true;
  });
  listed_operands(o, "relu", p, [&](RegionOperand& r) {
    SCORCH_CHECK((r.kind == RegionOperand::Kind::sparse || r.kind == RegionOperand::Kind::dense) && !r.cached &&
                     r.expand == 0 && r.packed.empty() && !r.col_major,
                 "scorch::region: only a sparse or dense operand that is neither cached, packed, broadcast nor in "
                 "column order can be a ReLU's output");
    r.relu = p.has_relu = true;
  });
  if (const Json* m = field(o, "nonempty")) {
    for (const Json& e : as<JsonArray>(*m, "nonempty: a list of [operand index, letter] expected")) {
      const auto& pair = as<JsonArray>(e, "nonempty: an [operand index, letter] pair expected");
      SCORCH_CHECK(pair.size() == 2, "scorch::region: nonempty holds [operand index, letter] pairs");
      const double k = as<double>(pair[0], "an operand index expected");
      const std::string c = as<std::string>(pair[1], "a letter expected");
      SCORCH_CHECK(k >= 0 && k < static_cast<double>(p.operands.size()) && k == static_cast<int>(k),
                   "scorch::region: nonempty names no operand ({})", k);
      RegionOperand& r = p.operands[static_cast<size_t>(k)];
      SCORCH_CHECK((r.kind == RegionOperand::Kind::pattern || r.kind == RegionOperand::Kind::sparse) && !r.relu &&
                       c.size() == 1 && r.tensor_letters().find(c[0]) != std::string::npos,
                   "scorch::region: a nonempty letter names one of a pattern's or sparse operand's own letters, got "
                   "'{}' for operand {} ('{}')", c, k, r.letters);
      r.nonempty = c[0];
      p.has_nonempty = true;
    }
  }

  std::string seen;
  for (const auto& r : p.operands) {
    bool ok = !r.letters.empty() || r.kind == RegionOperand::Kind::dense;
    for (size_t i = 0; i < r.letters.size(); ++i) {
      const char c = r.letters[i];
      ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) && r.letters.find(c) == i;
    }
    SCORCH_CHECK(ok || r.letters.empty(), "scorch::region: bad operand letters '{}'", r.letters);
    SCORCH_CHECK(!r.expand || (r.kind == RegionOperand::Kind::pattern && r.expand <= static_cast<int>(r.letters.size())),
                 "scorch::region: only pattern operands broadcast");
    seen += r.letters;
  }
  for (size_t i = 0; i < p.out.size(); ++i)
    SCORCH_CHECK(seen.find(p.out[i]) != std::string::npos && p.out.find(p.out[i]) == i,
                 "scorch::region: bad output letters '{}'", p.out);
  // Addends: output letters only, as they are (no broadcast letters, not packed); the product needs a factor.
  RegionProgram product;
  bool addends = false;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const RegionOperand& r = p.operands[k];
    if (r.kind == RegionOperand::Kind::mask) {  // exactly the output's letters, as they are, no gradient
      std::string a = r.letters, b = p.out;
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      SCORCH_CHECK(a == b && r.expand == 0 && r.packed.empty() && !r.masked_grad && !r.col_major && !r.grad,
                   "scorch::region: a mask has the output's letters ('{}', got '{}'), is neither broadcast nor "
                   "packed, and has no gradient",
                   p.out, r.letters);
      addends = p.has_masks = true;
      continue;
    }
    if (r.kind != RegionOperand::Kind::add) {
      product.operands.push_back(r);
      p.product_operands.push_back(static_cast<int>(k));
      continue;
    }
    addends = true;
    SCORCH_CHECK(r.expand == 0 && r.packed.empty(), "scorch::region: an addend is neither broadcast nor packed");
    for (char c : r.letters)
      SCORCH_CHECK(p.out.find(c) != std::string::npos,
                   "scorch::region: addend letters '{}' must be output letters ('{}')", r.letters, p.out);
  }
  SCORCH_CHECK(!product.operands.empty(), "scorch::region: a program of addends only has no product");
  if (addends) {
    product.out = p.out;
    product.coef = p.coef;
    product.frozen = p.frozen;
    product.sparse_grad_out = p.sparse_grad_out;
    product.requested_order = p.requested_order;
    product.name = p.name;
    product.label = p.label;
    product.packed_buffers = p.packed_buffers;
    p.product_text = product.text();
  } else {
    p.product_operands.clear();
  }
  derive(p);
  finite_operands(p);
  if (p.has_relu) {
    RegionProgram plain = p;
    for (auto& r : plain.operands) r.relu = false;
    p.plain_text = plain.text();
  }
  return p;
}

}  // namespace

std::string RegionProgram::text() const {
  std::string s = "{\"operands\":[";
  for (size_t k = 0; k < operands.size(); ++k) {
    const auto& o = operands[k];
    s += fmt::format("{}[{},\"{}\",{},{},{},{}", k ? "," : "", json_string(o.letters), kind_name(o.kind),
                     o.cached ? "true" : "false", o.grad ? "true" : "false", o.expand, o.weight ? "true" : "false");
    if (!o.packed.empty()) s += fmt::format(",{{\"format\":{},\"size\":[{}]}}", json_string(o.packed),
                                            fmt::join(o.packed_size, ","));
    s += "]";
  }
  s += fmt::format("],\"out\":{},\"coef\":{},\"frozen\":{},\"name\":{}", json_string(out), coef,
                   frozen ? "true" : "false", json_string(name));
  if (!label.empty()) s += ",\"label\":" + json_string(label);
  if (sparse_grad_out) s += ",\"grad_out\":\"sparse\"";
  if (requested_order) s += ",\"out_order\":\"requested\"";
  // ,"name":[k, ...] for the operands with a flag (none: nothing)
  auto listed = [&](const char* name, bool RegionOperand::*flag) {
    std::vector<size_t> ks;
    for (size_t k = 0; k < operands.size(); ++k)
      if (operands[k].*flag) ks.push_back(k);
    if (!ks.empty()) s += fmt::format(",\"{}\":[{}]", name, fmt::join(ks, ","));
  };
  listed("masked_grads", &RegionOperand::masked_grad);
  listed("col_major", &RegionOperand::col_major);
  listed("relu", &RegionOperand::relu);
  std::string nonempty;
  for (size_t k = 0; k < operands.size(); ++k)
    if (operands[k].nonempty) nonempty += fmt::format("{}[{},\"{}\"]", nonempty.empty() ? "" : ",", k, operands[k].nonempty);
  if (!nonempty.empty()) s += ",\"nonempty\":[" + nonempty + "]";
  return s + "}";
}

namespace {
std::mutex programs_mu;
std::unordered_map<std::string, std::unique_ptr<RegionProgram>> programs;
}  // namespace

const RegionProgram& region_program(const std::string& text) {
  {
    std::lock_guard lock(programs_mu);
    auto it = programs.find(text);
    if (it != programs.end()) return *it->second;
  }
  auto p = std::make_unique<RegionProgram>(parse_text(text));
  std::lock_guard lock(programs_mu);  // never shrinks: callers hold references (a process has a bounded set of regions)
  return *programs.emplace(text, std::move(p)).first->second;
}

namespace {
RegionGradient derive_gradient(const std::string& text, int k) {
  const RegionProgram& p = region_program(text);
  SCORCH_CHECK(k >= 0 && k < static_cast<int>(p.operands.size()), "scorch::region: no operand {}", k);
  const RegionOperand& target = p.operands[k];
  SCORCH_CHECK(target.kind != RegionOperand::Kind::add,
               "scorch::region: operand {} is an addend: its gradient is the output's, summed (no program)", k);
  SCORCH_CHECK(!p.has_masks, "scorch::region {}: a program with a mask operand (a run-time variant) has no gradient "
               "programs", p.title);
  SCORCH_CHECK(!p.has_relu, "scorch::region {}: a program applying a ReLU to an operand is differentiated as its "
               "plain variant on the ReLU's output", p.title);
  if (p.has_addends()) {  // the product's gradient program; its operands named by their indices here
    const auto at = std::find(p.product_operands.begin(), p.product_operands.end(), k);
    RegionGradient r = derive_gradient(p.product_text, static_cast<int>(at - p.product_operands.begin()));
    for (int& j : r.operands)
      if (j >= 0) j = p.product_operands[static_cast<size_t>(j)];
    return r;
  }
  std::string present = p.out;
  RegionProgram g;
  RegionOperand grad_out;
  grad_out.letters = p.out;
  // Not cached: the gradient is a buffer of the backward graph, which Inductor may reuse for another value
  // without moving its version counter (see scorch_backend/compiler/passes/fuse.py); each program compresses it.
  if (p.sparse_grad_out) grad_out.kind = RegionOperand::Kind::sparse;
  g.operands.push_back(grad_out);
  RegionGradient r;
  r.operands.push_back(-1);
  for (int j = 0; j < static_cast<int>(p.operands.size()); ++j) {
    if (j == k) continue;
    present += p.operands[j].letters;
    g.operands.push_back(p.operands[j]);
    g.operands.back().masked_grad = false;  // the flags speak of this program's gradients, not of its gradients'
    g.packed_buffers += p.operands[j].packed_buffers;
    r.operands.push_back(j);
  }
  if (target.masked_grad) {  // sampled where operand k is nonzero: the rest is zeroed by the op that made it
    RegionOperand mask = target;
    mask.kind = RegionOperand::Kind::pattern;
    mask.grad = false;
    mask.masked_grad = false;
    g.operands.push_back(mask);
    r.operands.push_back(k);
  }
  for (char c : target.letters)
    if (present.find(c) != std::string::npos) r.produced += c;
  g.out = r.produced;
  // A compressed matrix whose first letter this program sums away and whose second it keeps: column order.
  for (RegionOperand& o : g.operands)
    o.col_major = (o.kind == RegionOperand::Kind::sparse || o.kind == RegionOperand::Kind::pattern) &&
                  o.letters.size() == 2 && o.expand == 0 && o.packed.empty() &&
                  g.out.find(o.letters[0]) == std::string::npos && g.out.find(o.letters[1]) != std::string::npos;
  // Every gradient comes back contiguous in its tensor's own order. A parameter's goes to autograd's
  // accumulation, which wants the parameter's layout. An activation's goes on into the backward graph, where
  // torch 2.13's Inductor miscompiled a layout with the last dimension outermost: summed with another and
  // passed through RMSNorm's backward into embedding_dense_backward, its vectorized scatter wrote wrong
  // values, or out of bounds (helper-67: a pruned Llama's embedding gradient off by 1.56 relative, heap
  // corruption in training; the same graph fails in plain torch.compile with inputs so laid out). The copy
  // costs one pass over the gradient.
  g.requested_order = true;
  g.coef = p.coef;
  g.frozen = p.frozen;
  g.name = p.name + ".grad" + std::to_string(k);
  g.label = p.label;
  r.text = g.text();
  return r;
}
}  // namespace

const RegionGradient& region_gradient(const std::string& text, int k) {
  const RegionProgram& p = region_program(text);
  static std::mutex mu;
  static std::map<std::pair<const RegionProgram*, int>, std::unique_ptr<RegionGradient>> derived;
  {
    std::lock_guard lock(mu);
    auto it = derived.find({&p, k});
    if (it != derived.end()) return *it->second;
  }
  auto r = std::make_unique<RegionGradient>(derive_gradient(text, k));  // ValueError for no such gradient
  std::lock_guard lock(mu);  // as the programs: never shrinks, callers hold references
  return *derived.emplace(std::make_pair(&p, k), std::move(r)).first->second;
}

size_t region_program_count() {
  std::lock_guard lock(programs_mu);
  return programs.size();
}

}  // namespace scorch::torch_glue
