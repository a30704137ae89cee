// Variants of a region program that read some compressed operands dense (region_variants.h).
#include "region_variants.h"

#include <algorithm>
#include <map>
#include <mutex>

namespace scorch::torch_glue {
namespace {

// A product of several compressed operands, one of them dense enough (a ReLU output at 0.5 times a pruned
// weight): co-iterating both costs far more than reading the denser one as a dense matrix (on a 64x512x512
// linear against a 90%-pruned weight, 3 ms against 0.03 ms; helper-43 F8: a 60%-pruned MLP's second layer,
// activation 0.5 against weight 0.4, ran co-iterated 90x slower than dense, and measuring it took 4.8 s). The
// text of the same program with such operands read dense, or null when there are none: the densest first,
// each holding at least kDemoteDensity of its entries, until one compressed operand is left (the sparsest, which
// the kernel then iterates alone). Below that share, co-iterating can pay (the product of two densities of 0.01 is
// 1e-4 of the work). Packed operands are never demoted. A pattern cannot be read dense (the kernel would multiply
// by its values, not by 1); one on exactly the output's letters becomes a mask instead, applied to the product's
// result (the sampled gradient of a pruned layer's ReLU input, pattern 0.5 against a 0.1 weight: 64x512x512,
// 0.60-0.70 ms co-iterated, 0.14-0.16 ms as the product then the mask).
constexpr double kDemoteDensity = 0.25;

// The operands a variant may read dense in place of compressed: sparse ones compressed at run time, and
// patterns over the output's letters (read as masks then); and how many operands are compressed in all.
std::pair<std::vector<size_t>, int> demotable(const RegionProgram& p) {
  std::vector<size_t> ks;
  int compressed = 0;
  auto on_output = [&](const RegionOperand& o) {  // the output's letters, each once, nothing broadcast
    return o.expand == 0 && o.letters.size() == p.out.size() &&
           std::all_of(p.out.begin(), p.out.end(), [&](char c) { return o.letters.find(c) != std::string::npos; });
  };
  for (size_t k = 0; k < p.operands.size(); ++k) {
    const auto& o = p.operands[k];
    if (o.kind != RegionOperand::Kind::sparse && o.kind != RegionOperand::Kind::pattern) continue;
    ++compressed;
    const bool maskable = o.kind == RegionOperand::Kind::pattern && on_output(o);
    if ((o.kind == RegionOperand::Kind::sparse || maskable) && o.packed.empty()) ks.push_back(k);
  }
  return {ks, compressed};
}

}  // namespace

// The program with the operands in `demoted` (a bit per operand) read dense. Built once per program and set
// (its text then parsed once, as every program's).
const std::string* variant_of(const RegionProgram& p, uint64_t demoted) {
  static std::mutex mu;
  static std::map<std::pair<const RegionProgram*, uint64_t>, std::string> variants;  // programs live forever
  std::lock_guard lock(mu);
  auto [it, fresh] = variants.try_emplace({&p, demoted});
  if (fresh) {
    RegionProgram v = p;
    for (size_t k = 0; k < v.operands.size(); ++k) {
      if (!(demoted >> k & 1)) continue;
      RegionOperand& o = v.operands[k];
      o.kind = o.kind == RegionOperand::Kind::pattern ? RegionOperand::Kind::mask : RegionOperand::Kind::dense;
      o.col_major = false;
      o.nonempty = 0;  // (checked by the program the variant comes from, before it is chosen)
    }
    it->second = v.text();
  }
  return &it->second;
}

// The variant this call runs, if any: compressed operands whose density came out high (a ReLU that is not
// sparse on this input) are read dense, as long as one compressed operand is left.
const std::string* demoted_variant(const RegionProgram& p, const std::vector<double>& densities) {
  if (p.operands.size() > 64) return nullptr;
  auto [ks, compressed] = demotable(p);
  if (compressed < 2 || ks.empty()) return nullptr;
  // Packed operands (sparse by construction, never demoted) count among those left; so does any compressed
  // operand whose density is unknown (< 0).
  std::stable_sort(ks.begin(), ks.end(), [&](size_t a, size_t b) { return densities[a] > densities[b]; });
  uint64_t demoted = 0;
  int left = compressed;
  for (size_t k : ks) {
    if (left <= 1 || densities[k] < kDemoteDensity) break;
    demoted |= uint64_t{1} << k;
    --left;
  }
  return demoted ? variant_of(p, demoted) : nullptr;
}

const std::string* fully_demoted(const RegionProgram& p) {
  if (p.operands.size() > 64) return nullptr;
  const auto [ks, compressed] = demotable(p);
  if (ks.empty() || static_cast<int>(ks.size()) != compressed) return nullptr;
  uint64_t demoted = 0;
  for (size_t k : ks) demoted |= uint64_t{1} << k;
  return variant_of(p, demoted);
}

std::vector<const std::string*> all_variants(const RegionProgram& p) {
  std::vector<const std::string*> out;
  const auto [ks, compressed] = demotable(p);
  if (compressed < 2 || ks.empty() || ks.size() > 6 || p.operands.size() > 64) return out;
  for (uint64_t subset = 1; subset < (uint64_t{1} << ks.size()); ++subset) {
    if (__builtin_popcountll(subset) > compressed - 1) continue;
    uint64_t demoted = 0;
    for (size_t q = 0; q < ks.size(); ++q)
      if (subset >> q & 1) demoted |= uint64_t{1} << ks[q];
    out.push_back(variant_of(p, demoted));
  }
  return out;
}

}  // namespace scorch::torch_glue
