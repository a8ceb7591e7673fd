// The flash kernels (forward and backward) compiled for AVX-512 (F, BW, VL, DQ), every dtype
// in f32.
#include "cpu/flash.h"
#if defined(__x86_64__)

// The ISA as the compiler names it, and as CpuInfo::features names it: keep them equal.
#define ATTNCORE_TARGET_NS avx512
#define ATTNCORE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define ATTNCORE_TARGET_FEATURES "avx512f avx512bw avx512vl avx512dq avx2 fma f16c"
#define ATTNCORE_LANES 16
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 8
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_avx512() {
  return {"avx512",           ATTNCORE_TARGET_FEATURES, avx512::kLayout,
          &avx512::run_block, &avx512::pack_tiles,      &avx512::run_backward_heads};
}
}  // namespace attncore::detail
#endif  // __x86_64__
