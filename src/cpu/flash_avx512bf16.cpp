// The flash kernels (forward and backward) compiled for AVX-512 (F, BW, VL, DQ) with
// AVX512-BF16: bf16 inputs on native bf16 dot products.
#include "cpu/flash.h"
#if defined(__x86_64__)

#include "cpu/target_avx512bf16.h"
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_avx512bf16() {
  return {"avx512bf16",
          ATTNCORE_TARGET_FEATURES,
          avx512bf16::kLayout,
          &avx512bf16::run_block,
          &avx512bf16::pack_tiles,
          &avx512bf16::run_backward_heads,
          &avx512bf16::narrow_row};
}
}  // namespace attncore::detail
#endif  // __x86_64__
