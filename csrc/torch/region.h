// scorch::region in C++: a region of a compiled model (one einsum over graph tensors, some of them
// compressed), run with the operand cache, the dense-or-sparse choice and the executor, and differentiated
// by more region calls. The program text is the JSON the backend writes (scorch_backend/custom_ops/region.py: Program);
// it is parsed once per text.
//
// Python is asked only for the recording of operands that `explain` asks for and log lines, through hooks the _C
// module installs; every path (the grouped one of a one-hot gated product included: grouped.cpp) runs in C++.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "executor.h"

namespace scorch::torch_glue {

struct RegionOperand {
  std::string letters;
  // add: an addend of the result (a linear's bias, a residual), not a factor of the product. Its letters are
  // output letters; it is broadcast along the others and added after the product (and its coefficient).
  // mask: a 0/1 factor on exactly the output's letters, not run as a factor of the product: the product's result
  // is zeroed where the tensor is 0 (before any addend). The run-time form of a pattern dense enough that the
  // kernel should not co-iterate it (region.cpp: demoted_variant); such a program is never differentiated.
  enum class Kind { dense, sparse, pattern, add, mask } kind = Kind::dense;
  bool cached = false;  // a parameter or buffer: compressed once per version
  bool grad = true;     // false for pattern factors
  int expand = 0;       // pattern factors: leading letters the tensor lacks (broadcast along them)
  bool weight = false;  // frozen_weights: checked by version counter only
  // Its gradient is needed only where it is nonzero (a ReLU's output: the ReLU's backward zeroes the rest), so
  // the gradient program samples it there (the operand itself joins as a pattern factor).
  bool masked_grad = false;
  // A 2-D compressed operand whose first letter the program sums away and whose second it keeps (a weight's
  // gradient g^T h): compressed in column order, its second letter the outer loop, so threads write rows of
  // their own instead of each summing into a private copy of the output. Program text: "col_major" list.
  bool col_major = false;
  // A compressed operand handed over already packed (a rewritten model's weight, stored compressed): its
  // format, its full size and how many index buffers the format keeps. Its slot in the operand list holds
  // the stored values; the index buffers follow all slots, operand by operand. Never differentiated.
  // The operand is relu(tensor): the call hands over a ReLU's input and the op applies the ReLU itself, in the
  // pass that measures and compresses it (an inference graph's activation read only compressed: no ReLU
  // kernel writes the activation first). A sparse or dense operand, not cached, packed or broadcast. Program
  // text: the "relu" list. Differentiated as relu(tensor) given to the program without the flags (region_op.cpp).
  bool relu = false;
  // Pattern (or sparse) factors: a letter along which every fiber of the operand must hold an entry for its zeros
  // to be right (a softmax of -inf-masked scores is zero outside the mask except in a row the mask leaves empty, which
  // is NaN throughout). Checked per call, once per version of a cached tensor; where a fiber is empty the call
  // runs the dense path, which gives the NaN. 0: none. Program text: the "nonempty" list of [index, letter].
  char nonempty = 0;
  std::string packed;  // the format's text; empty: not packed
  std::vector<int64_t> packed_size;  // -1 where the call gives the size (region.cpp: resolve_packed_size)
  int packed_buffers = 0;
  std::string tensor_letters() const { return letters.substr(expand); }
};

struct RegionProgram {
  std::vector<RegionOperand> operands;
  std::string out;
  double coef = 1.0;
  bool frozen = false;
  // The output's gradient is mostly zeros (the region feeds a ReLU or a top-k measured sparse): the gradient
  // programs take it as a compressed operand (the run-time choice still runs them dense when it is not).
  bool sparse_grad_out = false;
  // The result is handed back contiguous in the requested order (`out`), not as a permuted view of its storage
  // order: a parameter's gradient, which autograd would otherwise copy into the parameter's layout itself (a
  // weight gradient g^T h is stored as its transpose). Program text: "out_order": "requested".
  bool requested_order = false;
  std::string name, label;

  // Derived once: the loop order's letters, the output's storage letters and the permutation giving back the
  // requested order, the kernel's equation and each operand's letters in it, the dense path's equation.
  std::string loop_letters, storage;
  std::vector<int64_t> back;
  std::string kernel_equation, dense_equation;
  std::vector<std::string> kernel_letters;
  std::string title, profile_name;
  int packed_buffers = 0;  // index buffers of all packed operands (they follow the operand slots)

  // A program with addends (or masks) runs (and is differentiated) as its product, a program of its own without
  // them (`product_text`; `product_operands`: its operands' indices here), then masks the result and adds them.
  std::vector<int> product_operands;
  std::string product_text;
  bool has_addends() const { return !product_text.empty(); }
  bool has_masks = false;
  bool has_relu = false;  // some operand is relu(tensor) (RegionOperand::relu)
  bool has_nonempty = false;  // some pattern must keep an entry in every fiber (RegionOperand::nonempty)
  bool call_sized = false;    // some packed operand's size is given by the call (a -1 in its packed size)
  // What the finiteness check reads (region.cpp: values_finite): the operands whose values are multiplied by
  // a compressed operand's skipped zeros (dense ones not under a pattern, and compressed ones; not packed), none
  // when no operand is compressed. `selects_on_output`: a pattern over the output's letters (a select in eager).
  std::vector<int> finite_checked;
  bool selects_on_output = false;
  // The same program with every relu flag cleared (its operands then take the ReLU's output): the text autograd
  // differentiates. Empty when no operand has the flag.
  std::string plain_text;

  std::string text() const;  // JSON, as the backend writes it
};

// Parsed and validated once per text (ValueError for a malformed program).
const RegionProgram& region_program(const std::string& text);

// The program of d out / d operand k: its text, the operands it takes (-1 is the output gradient) and the
// letters it produces. Derived once per program and operand. A packed operand whose size the call gives keeps
// its -1 there: the caller hands the sizes it resolved over with GivenPackedSizes (region_operands.h), so that
// one text serves every size (a text per size grew the program cache by one entry per graph in training).
struct RegionGradient {
  std::string text;
  std::vector<int> operands;
  std::string produced;
};
const RegionGradient& region_gradient(const std::string& text, int k);

// How many programs have been parsed (the cache never shrinks; tests check it does not grow per call).
size_t region_program_count();

// Run a program. `operands`: one tensor per program operand (a packed operand's stored values), then the index
// buffers of the packed operands. `force`: "" (choose), "dense", "sparse" or "grouped".
at::Tensor run_region(const std::string& text, at::TensorList operands, const std::string& force = "");

// What the sparse path would run: the kernel's equation and its operands (compressed ones from the cache).
std::pair<std::string, std::vector<Operand>> region_sparse_call(const std::string& text, at::TensorList operands);

// Every sparse call a program may make, its own first: a call may also run a variant that reads compressed
// operands dense (their density came out high on that input). What a deployed model's kernels are built from.
std::vector<std::pair<std::string, std::vector<Operand>>> region_sparse_calls(const std::string& text,
                                                                             at::TensorList operands);

// The path the choice takes for these operands ("dense", "sparse" or "grouped").
std::string region_choose(const std::string& text, at::TensorList operands);

// A tensor compressed as operand `o` of a program would be (through the same cache, as a data input), and
// its density: for ops that share the cache (masked attention's mask). `lead`: the broadcast sizes of a
// pattern operand's leading letters.
std::pair<double, Operand> cached_compressed(const at::Tensor& t, const RegionOperand& o, at::ScalarType dtype,
                                             const std::vector<int64_t>& lead, bool frozen);

// The bytes of the fingerprint entries of a weight (32 entries spread over it, any strides, and the first nonzero
// after each).
std::vector<uint8_t> region_fingerprint(const at::Tensor& t);

// The density of a tensor, through the same cache (measured once per version).
double cached_density(const at::Tensor& t, bool frozen);
// A tensor derived from t, made by `make` the first time and kept in t's entry of the operand cache under `key`
// while t's version and fingerprint stay, as the region op keeps a weight's dense layouts; cleared with the
// cache. `weight`: t is kept on the weights' side (parameters, buffers), else on the data inputs' (a mask).
// Made anew at every call for a tensor without a version counter. A key holding '#' names a form sized by the
// call ("family#sizes"): only the few most recently used of those are kept per tensor (region.cpp: touch_sized).
at::Tensor cached_derived(const at::Tensor& t, const std::string& key, const std::function<at::Tensor()>& make,
                          bool weight = true);

struct RegionStats {
  int64_t compressions = 0, cache_hits = 0, sparse_runs = 0, dense_runs = 0, grouped_runs = 0;
  int64_t measured = 0, measured_dense = 0;  // decisions made by timing both paths, and how many kept dense
  int64_t measured_contended = 0, remeasured = 0;  // of those, timed on a busy machine; taken again for that
  int64_t demoted = 0;  // calls that read a much denser compressed operand dense (region.cpp: demoted_variant)
  int64_t content_hashes = 0;  // hashes of a data input's bytes (taken for a cache entry, or to check one)
};
RegionStats region_stats();
// Entries in the cache of weights and of data inputs, their limits, and the forms (compressed operands, dense
// layouts, derived tensors) their entries hold.
struct RegionCacheSizes {
  size_t weights, inputs, max_weights, max_inputs, forms;
};
RegionCacheSizes region_cache_sizes();
void region_clear_cache();

struct RegionHooks {
  std::function<void(const std::string&, at::TensorList)> capture;  // while `explain` records
  // The run-time path while SCORCH_DEBUG >= 1 (logged once per region and path; loop IR dumped at 2).
  std::function<void(const std::string&, const std::string&, const std::vector<double>&, at::TensorList)> note_path;
  // A decision made by timing both paths (SCORCH_MEASURE): the program, the path kept, and the two times (ms).
  std::function<void(const std::string&, const std::string&, double, double)> note_measured;
};
void set_region_hooks(RegionHooks hooks);
void set_region_capture(bool on);
// Hand a program's operands to `explain`'s recorder while it records (scorch::chain's too).
void region_capture(const std::string& text, at::TensorList operands);

}  // namespace scorch::torch_glue
