// The golden corpus of the lowering: a fixed list of kernel specs taken from the tests and benchmarks, each
// lowered (by the general lowering, or for the BSR cases by their native form) for the machine shapes of
// shapes() (an AVX2-like vector target, for the native forms also an AVX-512-like one, and scalar code), and
// the C++ source it gives saved under tests/cpp/golden/. A refactor of lowering or
// codegen must leave every saved source as it is; a change of the generated code on purpose is reviewed as a
// diff of these files (regenerate them with SCORCH_UPDATE_GOLDEN=1, see docs/loop_ir.md).
#pragma once

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "lower/lower.h"

namespace scorch::golden {

struct Case {
  const char* name;
  const char* spec;
  // Lowered as `lower` does, native forms first (native_forms.h); otherwise by the general lowering alone
  // (lower_general), so that a native form added for a spec (sparse-output assembly, n:m, ...) does not
  // change the general path's golden, and the general path stays covered.
  bool native = false;
};

// SpMV, SpMM (register tiles), SDDMM, SpGEMM, SpAdd, linear merges, MTTKRP on CSF, COO, workspaces, row
// sums, BSR, bitmap operands (walked with a cursor), and the other output modes (sampled, coordinates, private copies).
inline const std::vector<Case>& corpus() {
  static const std::vector<Case> cases = {
      {"spmv_csr_f32", "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32"},
      {"spmv_csr_f64_i64", "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f64; i64"},
      {"spmv_csc", "out(i0) = t0(i0,i1) * t1(i1); t0=csc; t1=strided; out=strided; f64; i64"},
      {"spmv_coo", "out(i0) = t0(i0,i1) * t1(i1); t0=coo; t1=strided; out=strided; f32; i32"},
      {"spmm_csr", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f32; i32"},
      {"spmm_csr_f64", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f64; i32"},
      {"linear_csr", "out(i0,i1) = t0(i0,i2) * t1(i1,i2); t0=strided; t1=csr; out=strided; f32; i32"},
      {"sddmm", "out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i1,i2); t0=csr; t1=strided; t2=strided; out=csr; f32; i32"},
      {"sddmm_dense_out", "out(i0,i1) = t0(i0,i1) * t1(i0,i2) * t2(i2,i1); t0=csr; t1=strided; t2=strided; out=strided; f32; i32"},
      {"spgemm", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=csr; out=csr; f32; i32"},
      {"spgemm_dense_out", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=csr; out=strided; f32; i32"},
      {"spadd", "out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=csr; t1=csr; out=csr; f32; i32"},
      {"spadd_dense_out", "out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=csr; t1=csr; out=strided; f32; i32"},
      {"spadd_coo_dcsr", "out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=dense(0),compressed(1); t1=compressed[nonunique](0),singleton(1); out=dense(0),compressed(1); f64; i64"},
      {"spmul", "out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=csr; t1=csr; out=csr; f32; i32"},
      {"sum3_csr", "out(i0,i1) = t0(i0,i1) + t1(i0,i1) + t2(i0,i1); t0=csr; t1=csr; t2=csr; out=csr; f32; i32"},
      {"sum4_csr", "out(i0,i1) = t0(i0,i1) + t1(i0,i1) + t2(i0,i1) + t3(i0,i1); t0=csr; t1=csr; t2=csr; t3=csr; out=csr; f32; i32"},
      {"sum5_mixed_dense_out", "out(i0,i1) = t0(i0,i1) + t1(i0,i1) * t2(i0,i1) + t3(i0,i1) + t4(i0,i1); t0=csr; t1=csr; t2=strided; t3=coo; t4=csr; out=strided; f32; i32"},
      {"sum4_vectors", "out(i0) = t0(i0) + t1(i0) + t2(i0) + t3(i0); t0=compressed(0); t1=compressed(0); t2=compressed(0); t3=compressed[nonunique](0); out=compressed(0); f64; i64"},
      {"vector_add", "out(i0) = t0(i0) + t1(i0); t0=compressed(0); t1=compressed(0); out=compressed(0); f32; i64"},
      {"vector_add_dense", "out(i0) = t0(i0) + t1(i0); t0=compressed(0); t1=strided; out=strided; f32; i64"},
      {"mttkrp_csf", "out(i0,i1) = t0(i0,i2,i3) * t1(i2,i1) * t2(i3,i1); t0=csf; t1=strided; t2=strided; out=strided; f32; i32"},
      {"ttm_csf", "out(i0,i1,i2) = t0(i0,i1,i3) * t1(i3,i2); t0=csf; t1=strided; out=strided; f32; i32"},
      {"ttm_csf_fibers", "out(i0,i1,i2) = t0(i0,i1,i3) * t1(i3,i2); t0=csf; t1=strided; out=compressed(0),compressed(1),dense(2); f32; i32"},
      {"ttv_csf_fibers", "out(i0,i1) = t0(i0,i1,i2) * t1(i2); t0=csf; t1=strided; out=compressed(0),compressed(1); f64; i64"},
      {"row_sums", "out(i0) = t0(i0,i1); t0=csr; out=strided; f32; i32"},
      {"col_sums", "out(i1) = t0(i0,i1); t0=csr; out=strided; f32; i32"},
      {"total_sum", "out() = t0(i0,i1); t0=csr; out=strided; f64; i64"},
      {"dense_dot", "out() = t0(i0) * t1(i0); t0=strided; t1=strided; out=strided; f32; i32"},
      {"scale_dense", "out(i0) = t0(i0) * 7.0; t0=strided; out=strided; f64; i64"},
      {"sampled_mask", "out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=csr; t1=strided; out=csr; f32; i32"},
      {"transpose_to_csc", "out(i0,i1) = t0(i0,i1) * 2.0; t0=csr; out=csc; f32; i32"},
      {"dcsr_spmv", "out(i0) = t0(i0,i1) * t1(i1); t0=dcsr; t1=strided; out=strided; f32; i32"},
      {"bsr4_spmm", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=bsr(4,4); t1=strided; out=strided; f32; i32", true},
      {"bsr16_spmm", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=bsr(16,16); t1=strided; out=strided; f32; i32", true},
      {"bsr_linear", "out(i0,i1) = t0(i0,i2) * t1(i1,i2); t0=strided; t1=bsr(4,4); out=strided; f32; i32", true},
      {"bitmap_spmm", "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=dense(0),bitmap(1); t1=strided; out=strided; f32; i32"},
      {"bitmap_spmv", "out(i0) = t0(i0,i1) * t1(i1); t0=dense(0),bitmap(1); t1=strided; out=strided; f32; i32"},
      {"bitmap_spadd", "out(i0,i1) = t0(i0,i1) + t1(i0,i1); t0=dense(0),bitmap(1); t1=csr; out=strided; f64; i64"},
      {"neg_sub", "out(i0,i1) = -(t0(i0,i1) - t1(i0,i1)) * t2(); t0=csr; t1=strided; t2=strided; out=strided; f64; i64"},
  };
  return cases;
}

struct Shape {
  const char* name;
  VectorShape machine;
  bool native_only = false;  // only the native-form cases (their tiles follow the register count)
  const char* prefix = "";   // only the cases whose name starts with it
};

// v32: 32-byte vectors, 8 tile accumulators, 16 registers (AVX2, x86-64-v3); v64: 64-byte vectors and 32
// registers (AVX-512), for the native forms only; v32g: v32 with gathers built from scalar loads
// (Target::soft_gathers), for the CSR SpMV cases (their long rows' sums); scalar code.
inline const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {{"v32", VectorShape{32, 8, 16}},
                                       {"v64", VectorShape{64, 8, 32}, true},
                                       {"v32g", VectorShape{32, 8, 16, true}, false, "spmv_csr"},
                                       {"scalar", VectorShape{0, 0}}};
  return s;
}

// Whether shape `s` saves a source for case `c`.
inline bool applies(const Shape& s, const Case& c) {
  return (!s.native_only || c.native) && std::string(c.name).rfind(s.prefix, 0) == 0;
}

// Sources the corpus saves: every case for every shape that applies to it.
inline int expected_sources() {
  int n = 0;
  for (const auto& c : corpus())
    for (const auto& s : shapes()) n += applies(s, c);
  return n;
}

inline std::string golden_dir() { return std::string(SCORCH_TEST_SOURCE_DIR) + "/golden"; }

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) return "";
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

inline bool update_requested() {
  const char* u = std::getenv("SCORCH_UPDATE_GOLDEN");
  return u && std::string(u) == "1";
}

}  // namespace scorch::golden
