// The flash forward kernel compiled for the avx512 target.
#include "cpu/flash.h"
#if defined(__x86_64__)

#define ATTNCORE_TARGET_NS avx512
#define ATTNCORE_TARGET_PRAGMA _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\")")
#define ATTNCORE_LANES 16
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 8
#include "cpu/flash_kernel-inl.h"

namespace attncore::detail {
FlashTarget flash_target_avx512() { return {"avx512", avx512::kLayout, &avx512::run_block, &avx512::pack_tiles}; }
}  // namespace attncore::detail
#endif
