// The math backend's GEMM (cpu/gemm-inl.h) compiled for the baseline ISA (SSE2 on x86-64, NEON on
// aarch64).
#include "cpu/gemm.h"

#include "cpu/target_generic.h"  // the flash kernels' ISA and micro-tile
#include "cpu/flash_simd-inl.h"
#include "cpu/gemm-inl.h"

namespace attncore::detail {
GemmTarget gemm_target_generic() {
  return {"generic", &generic::sgemm, &generic::dgemm, &generic::widen_row, &generic::narrow_row};
}
}  // namespace attncore::detail
