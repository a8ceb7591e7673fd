// The math backend's matrix products: C = alpha * A B + beta * C in f32 and f64, written here
// (no BLAS), so that a call changes no process-wide state (docs/design.md section 8) and one
// product's bits depend only on its operands and the SIMD target, never on threads: each call
// runs on the calling thread alone, and every element of C sums its k products in order.
//
// Compiled once per SIMD target (gemm-inl.h, included by src/cpu/gemm_<target>.cpp) and
// chosen once per call: the target of the flash kernels' ISA (set_simd_target picks both).
#pragma once

#include <cstdint>

#include "attncore/dtype.h"
#include "core/convert.h"  // NarrowFn

namespace attncore::detail {

// A matrix operand: element (r, c) at data[r * row_stride + c * col_stride]. A row-major
// [rows, cols] matrix with leading dimension ld is {data, ld, 1}; its transpose {data, 1, ld}.
template <class T>
struct GemmMatrix {
  const T* data;
  std::int64_t row_stride, col_stride;
};

// Blocking (gemm-inl.h): products over k run in chunks of kGemmKc, A is packed kGemmMc rows at
// a time (L2) and B kGemmNc columns at a time. kGemmMc = 144 holds a 128-row math block whole
// and is a multiple of every micro-tile height (6, 8); kGemmNc is a multiple of every width.
constexpr std::int64_t kGemmKc = 256;
constexpr std::int64_t kGemmMc = 144;
constexpr std::int64_t kGemmNc = 1024;
// The largest micro-tile of any target: rows (AVX-512: 8) and columns (AVX-512 f32: 32).
constexpr std::int64_t kGemmMaxTileRows = 8;
constexpr std::int64_t kGemmMaxTileCols = 32;

// The packing buffer a product of these sizes needs, in elements of its type: a kGemmKc deep
// block of B (at most kGemmNc columns, padded to whole micro-panels) and one of A (at most
// kGemmMc rows, likewise); at most 1.2 MB in f32.
constexpr std::int64_t gemm_pack_elements(std::int64_t m, std::int64_t n, std::int64_t k) {
  const std::int64_t kc = k < kGemmKc ? k : kGemmKc;
  const std::int64_t nc = n + kGemmMaxTileCols < kGemmNc ? n + kGemmMaxTileCols : kGemmNc;
  const std::int64_t mc = m + kGemmMaxTileRows < kGemmMc ? m + kGemmMaxTileRows : kGemmMc;
  return kc * (nc + mc);
}

// C [m, n] (row-major, leading dimension ldc) = alpha * A [m, k] B [k, n] + beta * C; beta = 0
// overwrites C without reading it (so it may hold anything). `pack` holds
// gemm_pack_elements(m, n, k).
using SgemmFn = void (*)(std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                         GemmMatrix<float> a, GemmMatrix<float> b, float beta, float* c,
                         std::int64_t ldc, float* pack);
using DgemmFn = void (*)(std::int64_t m, std::int64_t n, std::int64_t k, double alpha,
                         GemmMatrix<double> a, GemmMatrix<double> b, double beta, double* c,
                         std::int64_t ldc, double* pack);

// dst [n] = src [n], a row of bf16 or f16 (dtype) widened to f32, exactly (the flash kernels'
// own widening, flash_simd-inl.h's widen_row).
using WidenFn = void (*)(const std::uint16_t* src, DType dtype, std::int64_t n, float* dst);

struct GemmTarget {
  const char* name;  // "avx512", "avx2", "generic": the ISA, as the flash targets name it
  SgemmFn sgemm;
  DgemmFn dgemm;
  WidenFn widen;    // the math backend's f32 copies of 16-bit operands
  NarrowFn narrow;  // and its 16-bit outputs
};

// The products for the ISA of the flash target in use (flash_target_chosen): the first
// compiled GEMM target whose name begins that target's name (avx512bf16 -> avx512).
const GemmTarget& gemm_target_chosen();

GemmTarget gemm_target_avx512();
GemmTarget gemm_target_avx2();
GemmTarget gemm_target_generic();

}  // namespace attncore::detail
