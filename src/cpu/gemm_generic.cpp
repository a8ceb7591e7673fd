// The math backend's GEMM (cpu/gemm-inl.h) compiled for the baseline ISA (SSE2 on x86-64, NEON on
// aarch64).
#include "cpu/gemm.h"

// As in src/cpu/flash_generic.cpp: the same ISA and micro-tile.
#define ATTNCORE_TARGET_NS generic
#define ATTNCORE_TARGET
#define ATTNCORE_LANES 4
#define ATTNCORE_TILE_ROWS 6
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_BF16_DOT 0  // (flash_simd-inl.h, for widen_row: no bf16 dot products here)
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_generic() {
  return {"generic", &generic::sgemm, &generic::dgemm, &generic::widen_row};
}
}  // namespace attncore::detail
