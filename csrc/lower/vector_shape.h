// What lowering needs to know of the machine a kernel is compiled for. runtime/target.h resolves it from the
// target's instruction set (Target::vector_shape()): nothing width- or register-dependent is a constant of the
// lowerer.
#pragma once

namespace scorch {

struct VectorShape {
  int vector_bytes = 0;  // vector register width the generated code uses; 0: no vector code
  int tile_vectors = 0;  // vector accumulators a register tile keeps live
  // Architectural vector registers of that width (16 on x86-64 up to AVX2, 32 with AVX-512 and on AArch64).
  // 0: not given; kernels that size their tiles by it then assume twice tile_vectors (the rule
  // Target::tile_vectors follows).
  int vector_registers = 0;
  // A row's vector sum reads its indexed operands (x[crd[p]]) into vectors with scalar loads rather than
  // leaving the loop to the C++ compiler, which uses the gather instruction (pass_vectorize.cpp).
  bool soft_gathers = false;

  int registers() const { return vector_registers > 0 ? vector_registers : 2 * tile_vectors; }
};

}  // namespace scorch
