// The flash forward kernel compiled for the generic target.
#include "cpu/flash.h"


#define ATTNCORE_TARGET_NS generic
#define ATTNCORE_TARGET_PRAGMA 
#define ATTNCORE_LANES 4
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 6
#include "cpu/flash_kernel-inl.h"

namespace attncore::detail {
FlashTarget flash_target_generic() { return {"generic", generic::kLayout, &generic::run_block, &generic::pack_tiles}; }
}  // namespace attncore::detail

