// Conversions between torch tensors and the core's plain views, and the mapping of core errors to the
// Python exception types torch raises (ValueError, TypeError). Only csrc/torch/ includes torch headers.
#pragma once

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "common/error.h"
#include "format/format.h"
#include "format/level.h"

namespace scorch::torch_glue {

// float32 or float64: the dtypes the hand-written passes over values (compression, softmax) run in directly.
inline bool single_or_double(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

// Runs f, re-raising scorch::Error as the c10 error type Python maps to the matching exception.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const scorch::Error& e) {
    switch (e.kind()) {
      case ErrorKind::type: TORCH_CHECK_TYPE(false, e.what());
      case ErrorKind::value: TORCH_CHECK_VALUE(false, e.what());
      case ErrorKind::memory: TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());  // torch.OutOfMemoryError
      default: TORCH_CHECK(false, e.what());
    }
  }
}

// Index buffers must be 1-D CPU int32/int64; returns contiguous versions (kept alive by the caller).
std::vector<at::Tensor> checked_index_buffers(at::TensorList buffers, const std::vector<std::string>& names);
std::vector<IndexSpan> spans_of(const std::vector<at::Tensor>& buffers);

// Values must be a 1-D CPU tensor of a supported dtype (float32, float64, bfloat16, float16).
void check_values(const at::Tensor& values, const char* what);

// Pack coordinates ([ndim][nnz], any order, repeats summed) and their values into a format's buffers.
std::tuple<std::vector<at::Tensor>, at::Tensor> pack_to_tensors(const Format& f, const std::vector<int64_t>& shape,
                                                                 const int64_t* coords, int64_t nnz,
                                                                 const at::Tensor& values, at::ScalarType index_dtype);

}  // namespace scorch::torch_glue
