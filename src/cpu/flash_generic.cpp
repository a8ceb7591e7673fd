// The flash kernels (forward and backward) compiled for the baseline ISA (SSE2 on x86-64, NEON
// on aarch64), every dtype in f32.
#include "cpu/flash.h"

// The ISA as the compiler names it, and as CpuInfo::features names it: keep them equal.
#define ATTNCORE_TARGET_NS generic
#define ATTNCORE_TARGET
#define ATTNCORE_TARGET_FEATURES ""
#define ATTNCORE_LANES 4
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 6
#include "cpu/flash_backward-inl.h"
#include "cpu/flash_tile_loop-inl.h"

namespace attncore::detail {
FlashTarget flash_target_generic() {
  return {"generic",           ATTNCORE_TARGET_FEATURES, generic::kLayout,
          &generic::run_block, &generic::pack_tiles,     &generic::run_backward_heads};
}
}  // namespace attncore::detail
