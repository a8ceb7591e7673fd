// The flash kernels (forward and backward) compiled for the baseline ISA (SSE2 on x86-64, NEON
// on aarch64), every dtype in f32.
#include "cpu/flash.h"

#include "cpu/target_generic.h"
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_generic() {
  return {"generic",
          ATTNCORE_TARGET_FEATURES,
          generic::kLayout,
          &generic::run_block,
          &generic::pack_tiles,
          &generic::run_backward_heads,
          &generic::narrow_row};
}
}  // namespace attncore::detail
