// The flash kernels (forward and backward) compiled for AVX2 with FMA, every dtype in f32.
#include "cpu/flash.h"
#if defined(__x86_64__)

#include "cpu/target_avx2.h"
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_avx2() {
  return {"avx2",
          ATTNCORE_TARGET_FEATURES,
          avx2::kLayout,
          &avx2::run_block,
          &avx2::pack_tiles,
          &avx2::run_backward_heads,
          &avx2::narrow_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
