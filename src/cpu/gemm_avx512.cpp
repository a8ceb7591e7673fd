// The math backend's GEMM (cpu/gemm-inl.h) compiled for AVX-512 (with FMA).
#include "cpu/gemm.h"
#if defined(__x86_64__)

// As in src/cpu/flash_avx512.cpp: the same ISA and micro-tile.
#define ATTNCORE_TARGET_NS avx512
#define ATTNCORE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define ATTNCORE_LANES 16
#define ATTNCORE_TILE_ROWS 8
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_BF16_DOT 0  // (flash_simd-inl.h, for widen_row: no bf16 dot products here)
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_avx512() {
  return {"avx512", &avx512::sgemm, &avx512::dgemm, &avx512::widen_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
