// Variants of a region program that read some of its compressed operands dense: a call whose ReLU output comes
// out half nonzero co-iterates it with a pruned weight at many times the cost of reading it as a dense matrix.
// The choice is made per call by density (region.cpp: run_region); a deployed model bundles every variant's
// kernel (region_sparse_calls).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "region.h"

namespace scorch::torch_glue {

// The program with the operands in `demoted` (a bit per operand) read dense (a pattern on the output's letters
// becomes a mask); built once per program and set, its text living as long as the process.
const std::string* variant_of(const RegionProgram& p, uint64_t demoted);

// The variant this call runs, or null: `densities` per operand (< 0 where not measured).
const std::string* demoted_variant(const RegionProgram& p, const std::vector<double>& densities);

// The variant with every compressed operand read dense (patterns on the output's letters as masks), or null
// when some compressed operand cannot be (packed, or a pattern over other letters): eager's exact semantics
// when a value is not finite (region.cpp: values_finite).
const std::string* fully_demoted(const RegionProgram& p);

// Every variant some call may run: each set of demotable operands that leaves one compressed. Programs have a
// handful of compressed operands; past 6 demotable ones, none is listed.
std::vector<const std::string*> all_variants(const RegionProgram& p);

}  // namespace scorch::torch_glue
