#include "attention.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <utility>
#include <type_traits>

#include <fmt/format.h>

#include "convert.h"
#include "executor.h"
#include "forward_ad.h"
#include "region.h"
#include "region_fingerprint.h"
#include "region_kernels.h"
#include "runtime/settings.h"

namespace scorch::torch_glue {
namespace {

std::atomic<int64_t> n_sparse{0}, n_dense{0}, n_sparse_backward{0}, n_dense_backward{0};

// The kernels of the sparse path, in one table that the run path and the ahead-of-time prediction
// (attention_kernel_specs) both read. Letters: a batch, i query rows, j key rows, e the q/k width, f the v
// width; the first operand is the mask's pattern (batched CSR), the others dense. An empty output format keeps
// the pattern's positions (a sampled product).
struct AttentionKernel {
  const char* equation;
  const char* out_format;
};
constexpr AttentionKernel kScores{"aij,aie,aje->aij", ""};      // S = (q k^T) at the pattern
constexpr AttentionKernel kWeighted{"aij,ajf->aif", "strided"};  // out = P v
// The products with P^T and dS^T read the transposed pattern (a, j, i) by rows, as the forward's product
// reads the pattern: a kernel that scattered into rows of its output would be about twice as slow.
constexpr AttentionKernel kGradV{"aji,aif->ajf", "strided"};     // dv = P^T g
constexpr AttentionKernel kGradP{"aij,aif,ajf->aij", ""};        // dP = (g v^T) at the pattern
constexpr AttentionKernel kGradQ{"aij,aje->aie", "strided"};     // dq = dS k
constexpr AttentionKernel kGradK{"aji,aie->aje", "strided"};     // dk = dS^T q
constexpr AttentionKernel kForwardKernels[] = {kScores, kWeighted};
constexpr AttentionKernel kBackwardKernels[] = {kGradV, kGradP, kGradQ, kGradK};
AttentionHooks hooks;
std::atomic<bool> capturing{false};

// A shape as Python prints a tuple: "(2, 3)", "(8,)", "()". The messages read as the Python op's did.
template <typename Sizes>
std::string py_shape(const Sizes& s) {
  std::string out = "(";
  for (size_t d = 0; d < s.size(); ++d) out += fmt::format("{}{}", d ? ", " : "", s[d]);
  return out + (s.size() == 1 ? ",)" : ")");
}

void check_ranks(int64_t q, int64_t k, int64_t v, int64_t mask) {
  SCORCH_CHECK(q >= 2 && k == q && v == q, "masked_attention: q, k, v must have the same rank >= 2, got {}, {}, {}", q,
               k, v);
  SCORCH_CHECK(mask == 2, "masked_attention: the mask must have 2 dimensions (query rows, key rows), got {}", mask);
}

// The batch dimensions flattened into one: (nb, rows, width), contiguous.
at::Tensor flat3(const at::Tensor& t, int64_t nb) { return t.reshape({nb, t.size(-2), t.size(-1)}).contiguous(); }

int64_t batch_elements(const at::Tensor& q) {
  int64_t nb = 1;
  for (int64_t d = 0; d + 2 < q.dim(); ++d) nb *= q.size(d);
  return nb;
}

Operand dense_operand(const at::Tensor& t) { return Operand{nullptr, t.sizes().vec(), {}, t}; }

// The mask's pattern as a batched CSR (a, i, j) of ones in `dtype`, broadcast over the nb batch entries:
// compressed once per version of the mask (and fingerprint) by the region op's cache of data inputs.
Operand pattern_of(const at::Tensor& mask, int64_t nb, at::ScalarType dtype) {
  RegionOperand o;
  o.letters = "aij";
  o.kind = RegionOperand::Kind::pattern;
  o.expand = 1;
  Operand p = cached_compressed(mask, o, dtype, {nb}, /*frozen=*/false).second;
  SCORCH_ASSERT(p.sparse() && p.buffers.size() == 2, "the mask's pattern is a batched CSR (pos, crd)");
  return p;
}

// The stored range [pos[r], pos[r + 1]) of each row r of the pattern (a batched CSR: a * rows + i), handed
// to f(begin, end, values) in parallel over rows, with the values as `scalar_t*` (one floating dtype).
template <typename F>
void for_each_row(const at::Tensor& pos, const at::Tensor& values, F&& f) {
  const int64_t rows = pos.numel() - 1, nnz = values.numel();
  const int64_t grain = std::max<int64_t>(1, thread_grain() / std::max<int64_t>(1, nnz / std::max<int64_t>(1, rows)));
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "attention_rows", [&] {
    const index_t* p = pos.const_data_ptr<index_t>();
    AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "attention_rows", [&] {
      scalar_t* v = values.data_ptr<scalar_t>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) f(static_cast<int64_t>(p[r]), static_cast<int64_t>(p[r + 1]), v);
      });
    });
  });
}

// The sampled scores become each stored position's softmax probability within its row, in place: scaled and
// shifted by the row's largest score (one pass), exponentiated (ATen's vectorised exp), divided by the row's
// sum (one pass). A row with nothing stored has nothing to write.
void softmax_rows(const at::Tensor& pos, at::Tensor& scores, double scale) {
  if (!single_or_double(scores)) {  // half and bfloat16 scores: computed in float, written back
    at::Tensor f = scores.to(at::kFloat);
    softmax_rows(pos, f, scale);
    scores.copy_(f);
    return;
  }
  for_each_row(pos, scores, [scale](int64_t b, int64_t e, auto* v) {
    using T = std::remove_pointer_t<decltype(v)>;
    const T c = static_cast<T>(scale);
    T top = -std::numeric_limits<T>::infinity();
    for (int64_t x = b; x < e; ++x) top = std::max(top, v[x] *= c);
    for (int64_t x = b; x < e; ++x) v[x] -= top;
  });
  scores.exp_();
  for_each_row(pos, scores, [](int64_t b, int64_t e, auto* v) {
    using T = std::remove_pointer_t<decltype(v)>;
    T total = 0;
    for (int64_t x = b; x < e; ++x) total += v[x];
    for (int64_t x = b; x < e; ++x) v[x] /= total;
  });
}

// The softmax's backward pass on the stored values, in place on dP: dS = P (dP - sum_row(P dP)) * scale.
void softmax_backward_rows(const at::Tensor& pos, const at::Tensor& p, at::Tensor& dp, double scale) {
  if (!single_or_double(dp)) {  // as in softmax_rows
    at::Tensor f = dp.to(at::kFloat);
    softmax_backward_rows(pos, p.to(at::kFloat), f, scale);
    dp.copy_(f);
    return;
  }
  const at::Tensor pc = p.to(dp.scalar_type()).contiguous();
  for_each_row(pos, dp, [&pc, scale](int64_t b, int64_t e, auto* d) {
    using T = std::remove_pointer_t<decltype(d)>;
    const T* pv = pc.const_data_ptr<T>();
    T dot = 0;
    for (int64_t x = b; x < e; ++x) dot += pv[x] * d[x];
    const T c = static_cast<T>(scale);
    for (int64_t x = b; x < e; ++x) d[x] = pv[x] * (d[x] - dot) * c;
  });
}

// The pattern transposed in each batch entry, (a, j, i) as a batched CSR of the same format, and for each of
// its stored positions the pattern's position of the same entry (`order`, the pattern's index type).
struct Transposed {
  at::Tensor pos, crd, order;
};

Transposed transpose_pattern(const Operand& pattern) {
  const int64_t nb = pattern.shape[0], rows = pattern.shape[1], cols = pattern.shape[2];
  const at::Tensor& pos = pattern.buffers[0];
  const at::Tensor crd = pattern.buffers[1].contiguous();
  Transposed t{at::zeros({nb * cols + 1}, pos.options()), at::empty({crd.numel()}, crd.options()),
               at::empty({crd.numel()}, crd.options())};
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "attention_transpose", [&] {
    const index_t* p = pos.const_data_ptr<index_t>();
    const index_t* c = crd.const_data_ptr<index_t>();
    index_t* tp = t.pos.data_ptr<index_t>();
    index_t* tc = t.crd.data_ptr<index_t>();
    index_t* to = t.order.data_ptr<index_t>();
    at::parallel_for(0, nb, 1, [&](int64_t a0, int64_t a1) {
      for (int64_t a = a0; a < a1; ++a) {
        index_t* count = tp + a * cols + 1;  // the entries of column j of batch entry a, then where they start
        for (int64_t x = p[a * rows]; x < p[(a + 1) * rows]; ++x) ++count[c[x]];
        index_t next = p[a * rows];  // batch entry a's positions follow those of the entries before it
        for (int64_t j = 0; j < cols; ++j) next += std::exchange(count[j], next);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t x = p[a * rows + i]; x < p[a * rows + i + 1]; ++x) {
            const index_t dst = count[c[x]]++;
            tc[dst] = static_cast<index_t>(i);
            to[dst] = static_cast<index_t>(x);
          }
      }
    });
    // count[j] ended where column j + 1 starts: tp[a * cols + j + 1] already holds it.
  });
  return t;
}

// The transposed pattern of the mask's pattern, built once per version of the mask and kept in the mask's
// entry of the region op's operand cache, next to the pattern it comes from (both are valid while the mask's
// version and fingerprint stay, and both go with clear_cache). The entry keeps one tensor: pos, crd and
// order one after the other (one index type), read back here as views.
Transposed transposed_of(const at::Tensor& mask, const Operand& pattern) {
  const int64_t nb = pattern.shape[0], cols = pattern.shape[2], nnz = pattern.buffers[1].numel();
  const at::Tensor kept = cached_derived(
      mask, fmt::format("attention-transposed|{}#{}", c10::toString(pattern.buffers[0].scalar_type()), nb),
      [&] {
        const Transposed t = transpose_pattern(pattern);
        return at::cat({t.pos, t.crd, t.order});
      },
      /*weight=*/false);
  SCORCH_ASSERT(kept.numel() == nb * cols + 1 + 2 * nnz, "the kept transposed pattern fits its pattern");
  return Transposed{kept.slice(0, 0, nb * cols + 1), kept.slice(0, nb * cols + 1, nb * cols + 1 + nnz),
                    kept.slice(0, nb * cols + 1 + nnz)};
}

// The transposed pattern holding `values` (in the pattern's order) in its own order.
Operand transposed_with(const Operand& pattern, const Transposed& t, const at::Tensor& values) {
  const at::Tensor src = values.contiguous();
  at::Tensor out = at::empty_like(src);
  AT_DISPATCH_INDEX_TYPES(t.order.scalar_type(), "attention_gather", [&] {
    const index_t* o = t.order.const_data_ptr<index_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "attention_gather", [&] {
      const scalar_t* in = src.const_data_ptr<scalar_t>();
      scalar_t* dst = out.data_ptr<scalar_t>();
      at::parallel_for(0, src.numel(), thread_grain(), [&](int64_t b, int64_t e) {
        for (int64_t x = b; x < e; ++x) dst[x] = in[o[x]];
      });
    });
  });
  return Operand{pattern.format, {pattern.shape[0], pattern.shape[2], pattern.shape[1]}, {t.pos, t.crd}, out};
}

// Whether each row (a * rows + i) of the pattern has nothing stored.
at::Tensor empty_rows(const at::Tensor& pos) { return at::eq(pos.slice(0, 1), pos.slice(0, 0, -1)); }

// The kernels share work among threads by batch entry (their outer loop). When the entries do not divide
// evenly among the threads, each entry's rows are cut into `parts` runs of equal length, seen as entries of
// their own: a batched CSR's offsets do not tell entries from rows, so the pattern keeps its buffers; the rows'
// dense operand (q, or g) is a view, and one read whole by every row of an entry (k, v, or q for dk) is repeated
// once per part.
struct RowSplit {
  int64_t parts = 1;

  Operand pattern(const Operand& p) const {
    if (parts == 1) return p;
    return Operand{p.format, {p.shape[0] * parts, p.shape[1] / parts, p.shape[2]}, p.buffers, p.values};
  }
  at::Tensor rows(const at::Tensor& t) const {  // (nb, rows, w), contiguous -> (nb * parts, rows / parts, w)
    return parts == 1 ? t : t.view({t.size(0) * parts, t.size(1) / parts, t.size(2)});
  }
  at::Tensor whole(const at::Tensor& t) const {  // (nb, n, w) -> (nb * parts, n, w), entry a's copied per part
    if (parts == 1) return t;
    return t.unsqueeze(1).expand({t.size(0), parts, t.size(1), t.size(2)}).reshape({-1, t.size(1), t.size(2)});
  }
};

// The split for nb entries of `rows` rows each: none when the entries divide among the threads; else the fewest
// parts (up to twice the threads) that divide the rows and make the entries divide, with runs of at least 32 rows.
RowSplit split_rows(int64_t nb, int64_t rows) {
  const int64_t threads = at::get_num_threads();
  RowSplit s;
  if (threads <= 1 || nb % threads == 0) return s;
  for (int64_t parts = 2; parts <= 2 * threads && rows / parts >= 32; ++parts)
    if (rows % parts == 0 && (nb * parts) % threads == 0) {
      s.parts = parts;
      break;
    }
  return s;
}

Operand run_kernel(const AttentionKernel& k, const std::vector<Operand>& ops) {
  return run_einsum(k.equation, ops, k.out_format, at::get_num_threads(), false, /*decide=*/false).result;
}

// Each stored score's softmax probability within its row. The backward pass computes them again (one sampled
// product) rather than trusting a cache keyed by tensor identity: a write through .data (gradcheck's
// perturbations) bypasses the version counter.
at::Tensor probabilities(const Operand& pattern, const at::Tensor& q3, const at::Tensor& k3, double scale,
                         const RowSplit& split) {
  Operand s = run_kernel(kScores, {split.pattern(pattern), dense_operand(split.rows(q3)), dense_operand(split.whole(k3))});
  SCORCH_ASSERT(s.sparse() && s.nnz() == pattern.nnz() && s.values.is_contiguous(),
                "the sampled product keeps the mask's pattern");
  softmax_rows(pattern.buffers[0], s.values, scale);
  return s.values;
}

std::vector<int64_t> output_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.back() = v.size(-1);
  return shape;
}

// The same memory and strides as a tensor of its own, not a view (autograd forbids in-place updates of a
// custom op's output that is a view).
at::Tensor owning(const at::Tensor& view) {
  if (!view.is_view()) return view;
  at::Tensor out = at::empty({0}, view.options());
  out.set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
  return out;
}

at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask, double scale) {
  return (at::matmul(q, k.transpose(-2, -1)) * scale)
      .masked_fill(at::eq(mask, 0), -std::numeric_limits<double>::infinity());
}

at::Tensor dense_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale) {
  return at::matmul(at::softmax(masked_scores(q, k, mask, scale), -1), v).contiguous();
}

// The gradients of the dense formula, written out (this runs below autograd).
std::vector<at::Tensor> dense_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& mask, double scale, const at::Tensor& g) {
  const at::Tensor p = at::softmax(masked_scores(q, k, mask, scale), -1);
  const at::Tensor dv = at::matmul(p.transpose(-2, -1), g);
  const at::Tensor dp = at::matmul(g, v.transpose(-2, -1));
  // The -inf fill's backward zeroes the scores' gradient where the mask is 0 (a fully masked row's NaN included).
  const at::Tensor ds = (p * (dp - (p * dp).sum(-1, /*keepdim=*/true)) * scale).masked_fill(mask.eq(0), 0);
  return {at::matmul(ds, k).contiguous(), at::matmul(ds.transpose(-2, -1), q).contiguous(), dv.contiguous()};
}

bool degenerate(const at::Tensor& q, const at::Tensor& v) { return q.numel() == 0 || v.numel() == 0; }

std::string path_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                    const std::string& force) {
  if (degenerate(q, v)) return "dense";
  if (!force.empty()) {
    SCORCH_CHECK(force == "dense" || force == "sparse", "masked_attention: unknown path '{}' (dense or sparse)",
                 force);
    return force;
  }
  return attention_choose(q, k, mask);
}

void check_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const char* names[] = {"q", "k", "v", "mask"};
  const at::Tensor* ts[] = {&q, &k, &v, &mask};
  for (int i = 0; i < 4; ++i)
    SCORCH_CHECK(ts[i]->device().is_cpu(), "masked_attention: {} is on {}; Scorch runs on the CPU", names[i],
                 ts[i]->device().str());
}

}  // namespace

void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  check_ranks(q.dim(), k.dim(), v.dim(), 2);
  const auto qs = q.sizes(), ks = k.sizes(), vs = v.sizes();
  const int64_t r = q.dim();
  SCORCH_CHECK(qs.slice(0, r - 2) == ks.slice(0, r - 2) && ks.slice(0, r - 1) == vs.slice(0, r - 1) &&
                   qs[r - 1] == ks[r - 1],
               "masked_attention: shapes q {}, k {}, v {} do not agree", py_shape(qs), py_shape(ks), py_shape(vs));
  SCORCH_CHECK(mask.dim() == 2 && mask.size(0) == qs[r - 2] && mask.size(1) == ks[r - 2],
               "masked_attention: mask of shape {}, expected {}", py_shape(mask.sizes()),
               py_shape(std::vector<int64_t>{qs[r - 2], ks[r - 2]}));
  SCORCH_CHECK(q.is_floating_point() && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
               "masked_attention: q, k, v must have the same floating dtype, got {}, {}, {}",
               c10::toString(q.scalar_type()), c10::toString(k.scalar_type()), c10::toString(v.scalar_type()));
  SCORCH_CHECK(!mask.is_complex(), "masked_attention: the mask must be real or bool, got {}",
               c10::toString(mask.scalar_type()));
}

std::string attention_choose(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask) {
  const double density = cached_density(mask, /*frozen=*/false);
  const int64_t elements = q.numel() + k.numel() + mask.numel();
  return choose_by_density({density}, elements, at::get_num_threads(), false).dense ? "dense" : "sparse";
}

at::Tensor run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale, const std::string& force) {
  check_attention(q, k, v, mask);
  check_cpu(q, k, v, mask);
  if (capturing && hooks.capture) hooks.capture(scale, {q, k, v, mask});
  const std::string path = path_of(q, k, v, mask, force);
  if (hooks.note_path && debug_level() >= 1) hooks.note_path(path, cached_density(mask, false), {q, k, v, mask});
  // Eager multiplies a NaN or inf of v by the exact zeros the mask gives the probabilities (NaN in every query
  // row); the kernel skips them, so such a call runs dense, whatever the dispatch (helper-59; the regions' rule,
  // region.cpp: values_finite). q and k need no check: masked_fill replaces the scores they make there.
  if (path == "dense" || !all_finite(v)) {
    ++n_dense;
    return dense_forward(q, k, v, mask, scale);
  }
  ++n_sparse;
  const int64_t nb = batch_elements(q);
  const at::Tensor q3 = flat3(q, nb), k3 = flat3(k, nb), v3 = flat3(v, nb);
  const Operand pattern = pattern_of(mask, nb, q.scalar_type());
  const RowSplit split = split_rows(nb, q.size(-2));
  const at::Tensor p = probabilities(pattern, q3, k3, scale, split);
  at::Tensor out = run_kernel(kWeighted, {split.pattern(pattern.with_values(p)), dense_operand(split.whole(v3))})
                       .values.reshape({nb, q.size(-2), v.size(-1)});
  // A row with nothing stored is NaN, as the dense formula's softmax over only -inf is.
  // (In place on the kernel's own output, and only when some row is empty: a copy of the whole output else.)
  const at::Tensor empty = empty_rows(pattern.buffers[0]);
  if (empty.any().item<bool>())
    out.masked_fill_(empty.reshape({nb, q.size(-2), 1}), std::numeric_limits<double>::quiet_NaN());
  return owning(out.reshape(output_shape(q, v)));
}

std::vector<at::Tensor> run_attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& mask, double scale, const at::Tensor& grad,
                                               const std::string& force) {
  check_attention(q, k, v, mask);
  check_cpu(q, k, v, mask);
  SCORCH_CHECK(grad.device().is_cpu(), "masked_attention_backward: the gradient is on {}; Scorch runs on the CPU",
               grad.device().str());
  SCORCH_CHECK(grad.sizes() == c10::IntArrayRef(output_shape(q, v)),
               "masked_attention_backward: the gradient has shape {}, the output {}", py_shape(grad.sizes()),
               py_shape(output_shape(q, v)));
  const at::Tensor g = grad.scalar_type() == q.scalar_type() ? grad : grad.to(q.scalar_type());
  // Backward, every factor meets the masked positions' zeros in eager's products (dv = P^T g, dP = g v^T, and
  // dq = dS k, dk = dS^T q with dS exactly 0 there): any of them not finite runs dense, as the forward.
  const bool finite = all_finite(v) && all_finite(g) && all_finite(q) && all_finite(k);
  if (!finite || path_of(q, k, v, mask, force) == "dense") {
    ++n_dense_backward;
    return dense_backward(q, k, v, mask, scale, g);
  }
  ++n_sparse_backward;
  const int64_t nb = batch_elements(q);
  const at::Tensor q3 = flat3(q, nb), k3 = flat3(k, nb), v3 = flat3(v, nb), g3 = flat3(g, nb);
  const Operand pattern = pattern_of(mask, nb, q.scalar_type());
  const RowSplit by_q = split_rows(nb, q.size(-2)), by_k = split_rows(nb, k.size(-2));  // (the transposed rows)
  const at::Tensor p = probabilities(pattern, q3, k3, scale, by_q);
  // dv = P^T g; dP = (g v^T) at the pattern; dS = P (dP - rowsum(P dP)) * scale; dq = dS k; dk = dS^T q.
  const Transposed t = transposed_of(mask, pattern);
  const at::Tensor dv =
      run_kernel(kGradV, {by_k.pattern(transposed_with(pattern, t, p)), dense_operand(by_k.whole(g3))}).values;
  const Operand sampled = run_kernel(
      kGradP, {by_q.pattern(pattern), dense_operand(by_q.rows(g3)), dense_operand(by_q.whole(v3))});
  SCORCH_ASSERT(sampled.sparse() && sampled.nnz() == pattern.nnz(), "the sampled product keeps the mask's pattern");
  at::Tensor ds_values = sampled.values.contiguous();
  softmax_backward_rows(pattern.buffers[0], p, ds_values, scale);
  const at::Tensor dq =
      run_kernel(kGradQ, {by_q.pattern(pattern.with_values(ds_values)), dense_operand(by_q.whole(k3))}).values;
  const at::Tensor dk =
      run_kernel(kGradK, {by_k.pattern(transposed_with(pattern, t, ds_values)), dense_operand(by_k.whole(q3))})
          .values;
  // A row with nothing stored has NaN probabilities (the forward's output row is NaN), and dv = P^T g sums them
  // into every row of its batch entry: NaN there, as eager's. (dq and dk stay finite: the -inf fill's backward
  // zeroes the whole row's score gradient.)
  at::Tensor dv_entries = dv.reshape({nb, v.size(-2), v.size(-1)});
  const at::Tensor dead = empty_rows(pattern.buffers[0]).reshape({nb, q.size(-2)}).any(1);
  if (dead.any().item<bool>())
    dv_entries = dv_entries.masked_fill(dead.reshape({nb, 1, 1}), std::numeric_limits<double>::quiet_NaN());
  return {dq.reshape(q.sizes()).contiguous(), dk.reshape(k.sizes()).contiguous(),
          dv_entries.reshape(v.sizes()).contiguous()};
}

std::vector<std::string> attention_kernel_specs(const std::vector<int64_t>& q_shape,
                                                const std::vector<int64_t>& k_shape,
                                                const std::vector<int64_t>& v_shape, at::ScalarType dtype,
                                                bool training) {
  check_ranks(static_cast<int64_t>(q_shape.size()), static_cast<int64_t>(k_shape.size()),
              static_cast<int64_t>(v_shape.size()), 2);
  int64_t nb = 1;
  for (size_t d = 0; d + 2 < q_shape.size(); ++d) nb *= q_shape[d];
  const auto size = [&](char c) -> int64_t {
    switch (c) {
      case 'a': return nb;
      case 'i': return q_shape[q_shape.size() - 2];
      case 'j': return k_shape[k_shape.size() - 2];
      case 'e': return q_shape.back();
      default: return v_shape.back();  // 'f'
    }
  };
  const FormatRef& pattern = region_compressed_format(3);  // as pattern_of compresses the mask
  std::vector<std::string> specs;
  const auto add = [&](const AttentionKernel& k) {
    const std::string eq = k.equation;
    const std::string inputs = eq.substr(0, eq.find("->"));
    std::vector<OperandDesc> descs;
    bool wide = false;
    for (size_t start = 0; start <= inputs.size();) {
      const size_t end = std::min(inputs.find(',', start), inputs.size());
      std::vector<int64_t> shape;
      int64_t n = 1;
      for (size_t c = start; c < end; ++c) n *= shape.emplace_back(size(inputs[c]));
      if (descs.empty()) wide = needs_index64(&pattern, n, shape);  // a mask with every entry kept
      descs.push_back({descs.empty() ? pattern.text : "strided", shape, n});
      start = end + 1;
    }
    // Index width follows the mask's stored count: when a full mask would need 64-bit indices, both kernels.
    for (bool idx64 : wide ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
      std::string spec = plan_einsum(eq, descs, k.out_format, compute_dtype(dtype) == at::kDouble, idx64).spec;
      if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(std::move(spec));
    }
  };
  for (const auto& k : kForwardKernels) add(k);
  if (training)
    for (const auto& k : kBackwardKernels) add(k);
  return specs;
}

AttentionStats attention_stats() {
  return {n_sparse.load(), n_dense.load(), n_sparse_backward.load(), n_dense_backward.load()};
}

void set_attention_hooks(AttentionHooks h) { hooks = std::move(h); }
void set_attention_capture(bool on) { capturing = on; }

// --- the ops -----------------------------------------------------------------------------------------------
namespace {

at::Tensor attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         double scale) {
  return translate_errors([&] { return run_attention(q, k, v, mask, scale); });
}

std::vector<at::Tensor> attention_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& mask, double scale, const at::Tensor& grad) {
  return translate_errors([&] { return run_attention_backward(q, k, v, mask, scale, grad); });
}

// Shapes only (sizes may be symbolic): the ranks are checked, the sizes left to the real kernel.
at::Tensor attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double) {
  return translate_errors([&] {
    check_ranks(q.dim(), k.dim(), v.dim(), mask.dim());
    std::vector<c10::SymInt> shape = q.sym_sizes().vec();
    shape.back() = v.sym_size(-1);
    return at::empty_symint(shape, q.options());
  });
}

std::vector<at::Tensor> attention_backward_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& mask, double, const at::Tensor&) {
  return translate_errors([&] {
    check_ranks(q.dim(), k.dim(), v.dim(), mask.dim());
    return std::vector<at::Tensor>{at::empty_symint(q.sym_sizes(), q.options()),
                                   at::empty_symint(k.sym_sizes(), k.options()),
                                   at::empty_symint(v.sym_sizes(), v.options())};
  });
}

const auto& forward_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::masked_attention", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return h;
}

const auto& backward_handle() {
  static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow("scorch::masked_attention_backward", "").typed<
      std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              const at::Tensor&)>();
  return h;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                                                double scale) {
    ctx->saved_data["scale"] = scale;
    // q, k, v are read in storage order by both passes (the kernels' dense operands): made contiguous once
    // here and kept so, the backward pass does not copy them again (heads split out of one projection are not).
    const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    ctx->save_for_backward({qc, kc, vc, mask});
    at::AutoDispatchBelowADInplaceOrView guard;
    return {forward_handle().call(qc, kc, vc, mask, scale)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &mask = saved[3];
    torch::autograd::variable_list result(5);  // q, k, v; none for the mask and the scale
    if (!grads[0].defined()) {
      for (int i = 0; i < 3; ++i)
        if (ctx->needs_input_grad(i)) result[i] = at::zeros_like(saved[i]);
      return result;
    }
    // Through the dispatcher: AOTAutograd and torch.export trace this call as the backward op.
    auto g = backward_handle().call(q, k, v, mask, ctx->saved_data["scale"].toDouble(), grads[0].contiguous());
    for (int i = 0; i < 3; ++i)
      if (ctx->needs_input_grad(i)) result[i] = g[i];
    return result;
  }
};

at::Tensor attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              double scale) {
  refuse_forward_ad("scorch::masked_attention", {q, k, v, mask});
  const bool wants_grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!wants_grad) {  // contiguous here too: traced, the copies join the graph (Inductor fuses them)
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_handle().call(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale);
  }
  return AttentionFunction::apply(q, k, v, mask, scale)[0];
}

// The backward op is not differentiated itself: a gradient of the gradient (create_graph=True) would
// otherwise silently miss this op's part.
std::vector<at::Tensor> attention_backward_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& mask, double scale, const at::Tensor& grad) {
  const bool wants_grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                                         v.requires_grad() || grad.requires_grad());
  if (wants_grad)
    translate_errors([] {
      SCORCH_CHECK(false, "masked_attention: the gradient of its gradient (double backward, create_graph=True) is "
                          "not supported");
    });
  at::AutoDispatchBelowADInplaceOrView guard;
  return backward_handle().call(q, k, v, mask, scale, grad);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(scorch, m) {
  m.def("masked_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("masked_attention_backward(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor grad) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(scorch, CPU, m) {
  m.impl("masked_attention", attention_cpu);
  m.impl("masked_attention_backward", attention_backward_cpu);
}
TORCH_LIBRARY_IMPL(scorch, Meta, m) {
  m.impl("masked_attention", attention_meta);
  m.impl("masked_attention_backward", attention_backward_meta);
}
TORCH_LIBRARY_IMPL(scorch, Autograd, m) {
  m.impl("masked_attention", attention_autograd);
  m.impl("masked_attention_backward", attention_backward_autograd);
}

}  // namespace scorch::torch_glue
