// Region operands: slots, packed operands and their sizes given by the call (region_operands.h).
#include "region_operands.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "common/error.h"
#include "tensor_version.h"
#include "validated_once.h"

namespace scorch::torch_glue {
namespace {

// Packed operand k's size in this call. The program gives each dimension's size, or -1 where only the call
// knows it (a rewritten model's sparse input: a new graph each call). A -1 is the size of the same letter in
// another operand, or, for the dimension of a dense first level above a compressed one, the number of row
// pointers less one.
std::vector<int64_t> resolve_packed_size(const RegionProgram& p, size_t k, const Slots& s) {
  const RegionOperand& o = p.operands[k];
  std::vector<int64_t> size = o.packed_size;
  const std::vector<int64_t>* given = p.call_sized ? GivenPackedSizes::find(p, k) : nullptr;
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] >= 0) continue;
    if (given && d < given->size() && (*given)[d] >= 0) {
      size[d] = (*given)[d];
      continue;
    }
    const char c = o.letters[d];
    for (size_t j = 0; j < p.operands.size() && size[d] < 0; ++j) {
      const std::string letters = p.operands[j].tensor_letters();
      const size_t at = letters.find(c);
      if (j == k || at == std::string::npos) continue;
      if (!p.operands[j].packed.empty()) {
        size[d] = p.operands[j].packed_size[at];
      } else if (s.slots[j].dim() == static_cast<int64_t>(letters.size())) {
        size[d] = s.slots[j].size(static_cast<int64_t>(at));
      }
    }
    const Format& f = interned_format(o.packed, static_cast<int>(size.size())).format;
    const auto& levels = f.levels();
    if (size[d] < 0 && levels.size() >= 2 && levels[0].kind->name() == "dense" &&
        levels[0].expr.part == LevelExpr::Part::whole && levels[0].expr.dim == static_cast<int>(d) &&
        levels[1].kind->name() == "compressed" && !s.buffers[k].empty() && s.buffers[k][0].dim() == 1)
      size[d] = s.buffers[k][0].numel() - 1;
    SCORCH_CHECK(size[d] >= 0, "scorch::region {}: packed operand {} has no size for its letter '{}' (give it in "
                 "the program, or pass an operand that has that letter)", p.title, k, c);
  }
  return size;
}

ValidatedOnce validated;

thread_local const GivenPackedSizes* innermost_given = nullptr;  // packed operands' buffers (a deployed model's are data read from a file)

}  // namespace

Slots split_operands(const RegionProgram& p, at::TensorList operands, bool resolve) {
  const size_t n = p.operands.size();
  SCORCH_CHECK(operands.size() == n + static_cast<size_t>(p.packed_buffers),
               "scorch::region {}: {} operands expected ({} index buffers of packed operands included), got {}",
               p.title, n + p.packed_buffers, p.packed_buffers, operands.size());
  Slots s{operands.slice(0, n), std::vector<at::TensorList>(n), std::vector<std::vector<int64_t>>(n)};
  size_t at = n;
  for (size_t k = 0; k < n; ++k) {
    const int nb = p.operands[k].packed_buffers;
    if (p.operands[k].packed.empty()) continue;
    s.buffers[k] = operands.slice(at, nb);
    at += nb;
  }
  for (size_t k = 0; k < n && resolve; ++k)
    if (!p.operands[k].packed.empty()) s.packed_sizes[k] = resolve_packed_size(p, k, s);
  return s;
}

// Packed operand k as the executor takes it, its buffers validated (once per version) against its format.
Operand packed_operand(const RegionProgram& p, size_t k, const Slots& s, at::ScalarType dtype) {
  static const auto validate = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::validate", "").typed<
      void(at::TensorList, const at::Tensor&, c10::SymIntArrayRef, c10::string_view)>();
  const RegionOperand& o = p.operands[k];
  const at::Tensor& values = s.slots[k];
  SCORCH_CHECK(values.dim() == 1, "scorch::region {}: packed operand {} takes its stored values (1-D), got {} dimensions",
               p.title, k, values.dim());
  ValidatedOnce::Key key{{reinterpret_cast<int64_t>(&p), static_cast<int64_t>(k)}};
  key.add(values);
  for (const auto& b : s.buffers[k]) key.add(b);
  const std::vector<int64_t>& size = s.packed_sizes[k];
  key.words.insert(key.words.end(), size.begin(), size.end());
  validated.check_once(std::move(key), [&] { validate.call(s.buffers[k], values, c10::fromIntArrayRefSlow(size), o.packed); });
  const FormatRef& f = interned_format(o.packed, static_cast<int>(size.size()));
  std::vector<at::Tensor> buffers;
  for (const auto& b : s.buffers[k]) buffers.push_back(b.contiguous());
  return Operand{&f, size, std::move(buffers),
                 values.scalar_type() == dtype ? values.contiguous() : values.to(dtype)};
}

GivenPackedSizes::GivenPackedSizes(const RegionProgram& program, std::vector<std::vector<int64_t>> sizes)
    : program_(&program), sizes_(std::move(sizes)), outer_(innermost_given) {
  innermost_given = this;
}

GivenPackedSizes::~GivenPackedSizes() { innermost_given = outer_; }

const std::vector<int64_t>* GivenPackedSizes::find(const RegionProgram& program, size_t k) {
  for (const GivenPackedSizes* g = innermost_given; g; g = g->outer_)
    if (g->program_ == &program) return k < g->sizes_.size() && !g->sizes_[k].empty() ? &g->sizes_[k] : nullptr;
  return nullptr;
}

namespace {
thread_local bool half_as_float = false;
}  // namespace

HalfAsFloat::HalfAsFloat() : before_(half_as_float) { half_as_float = true; }
HalfAsFloat::~HalfAsFloat() { half_as_float = before_; }

at::ScalarType region_dtype(const RegionProgram& p, at::TensorList operands) {
  std::optional<at::ScalarType> t;
  for (size_t k = 0; k < p.operands.size(); ++k) {
    if (p.operands[k].kind == RegionOperand::Kind::pattern || !operands[k].is_floating_point()) continue;
    t = t ? c10::promoteTypes(*t, operands[k].scalar_type()) : operands[k].scalar_type();
  }
  const at::ScalarType d = t.value_or(at::kFloat);
  return half_as_float && (d == at::kHalf || d == at::kBFloat16) ? at::kFloat : d;
}

}  // namespace scorch::torch_glue
