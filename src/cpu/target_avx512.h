// The SIMD target avx512: its namespace, ISA and micro-tile, for every file compiled for it
// (flash_avx512.cpp, gemm_avx512.cpp), so that the inline code they share in the target's namespace
// is compiled alike (flash_layout-inl.h describes the macros). The ISA as the compiler names it,
// and as CpuInfo::features names it: keep them equal.
#define ATTNCORE_TARGET_NS avx512
#define ATTNCORE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define ATTNCORE_TARGET_FEATURES "avx512f avx512bw avx512vl avx512dq avx2 fma f16c"
#define ATTNCORE_LANES 16
#define ATTNCORE_BF16_DOT 0
#define ATTNCORE_TILE_VECTORS 2
#define ATTNCORE_TILE_ROWS 8
