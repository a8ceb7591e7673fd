// The math backend's GEMM (cpu/gemm-inl.h) compiled for AVX2 with FMA.
#include "cpu/gemm.h"
#if defined(__x86_64__)

// As in src/cpu/flash_avx2.cpp: the same ISA and micro-tile.
#define ATTNCORE_TARGET_NS avx2
#define ATTNCORE_TARGET __attribute__((target("avx2,fma,f16c")))
#define ATTNCORE_LANES 8
#define ATTNCORE_TILE_ROWS 6
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_BF16_DOT 0  // (flash_simd-inl.h, for widen_row: no bf16 dot products here)
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_avx2() { return {"avx2", &avx2::sgemm, &avx2::dgemm, &avx2::widen_row}; }
}  // namespace attncore::detail
#endif  // __x86_64__
