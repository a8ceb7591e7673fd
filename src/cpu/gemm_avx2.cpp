// The math backend's GEMM (cpu/gemm-inl.h) compiled for AVX2 with FMA.
#include "cpu/gemm.h"
#if defined(__x86_64__)

#include "cpu/target_avx2.h"  // the flash kernels' ISA and micro-tile
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_avx2() {
  return {"avx2", &avx2::sgemm, &avx2::dgemm, &avx2::widen_row, &avx2::narrow_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
