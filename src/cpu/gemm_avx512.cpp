// The math backend's GEMM (cpu/gemm-inl.h) compiled for AVX-512 (with FMA).
#include "cpu/gemm.h"
#if defined(__x86_64__)

#include "cpu/target_avx512.h"  // the flash kernels' ISA and micro-tile
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_avx512() {
  return {"avx512", &avx512::sgemm, &avx512::dgemm, &avx512::widen_row, &avx512::narrow_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
