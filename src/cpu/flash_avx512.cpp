// The flash kernels (forward and backward) compiled for AVX-512 (F, BW, VL, DQ), every dtype
// in f32.
#include "cpu/flash.h"
#if defined(__x86_64__)

#include "cpu/target_avx512.h"
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_avx512() {
  return {"avx512",
          ATTNCORE_TARGET_FEATURES,
          avx512::kLayout,
          &avx512::run_block,
          &avx512::pack_tiles,
          &avx512::run_backward_heads,
          &avx512::narrow_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
