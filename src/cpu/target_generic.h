// The SIMD target generic: its namespace, ISA and micro-tile, for every file compiled for it
// (flash_generic.cpp, gemm_generic.cpp), so that the inline code they share in the target's
// namespace is compiled alike (flash_layout-inl.h describes the macros). The ISA as the compiler
// names it, and as CpuInfo::features names it: keep them equal.
#define ATTNCORE_TARGET_NS generic
#define ATTNCORE_TARGET
#define ATTNCORE_TARGET_FEATURES ""
#define ATTNCORE_LANES 4
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 6
