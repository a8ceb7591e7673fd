// The tile geometry of the flash kernels for one SIMD target: vector width, micro-tiles, work
// items and key tiles, and the FlashLayout that flash.cpp reads.
//
// The flash kernel headers (flash_*-inl.h) are compiled once per SIMD target: each
// src/cpu/flash_<target>.cpp includes src/cpu/target_<target>.h (also math's gemm_<target>.cpp:
// one definition per target of the code they share), which defines
//   ATTNCORE_TARGET_NS      the target's namespace (avx512bf16, avx512, avx2, generic)
//   ATTNCORE_TARGET         __attribute__((target("..."))) for the target's ISA, or nothing
//   ATTNCORE_TARGET_FEATURES the CPU features the target needs (CpuInfo names, space-separated)
//   ATTNCORE_LANES          f32 lanes per vector (16, 8, 4)
//   ATTNCORE_TILE_ROWS      rows of the QK and PV micro-tiles
//   ATTNCORE_TILE_VECTORS   width of the micro-tiles in vectors
//   ATTNCORE_BF16_DOT       1: bf16 inputs run on native bf16 dot products (AVX512-BF16)
// and then includes flash_tile_loop-inl.h (the forward) and flash_backward-inl.h. Everything in
// these headers lives in the target's namespace, and every function and lambda in them carries
// ATTNCORE_TARGET, so that it is compiled for the target's ISA: a lambda does not take the
// attribute of the function it is written in, and GCC and clang inline a callee only into a
// caller whose ISA includes the callee's. The library headers they include carry no attribute:
// their inline helpers stay baseline code, which a target function may inline, and no baseline
// caller ever gets a target copy.
#pragma once

#include <cstdint>

#include "cpu/flash.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

constexpr int kLanes = ATTNCORE_LANES;
constexpr int kTileRows = ATTNCORE_TILE_ROWS;
constexpr int kTileVectors =
    ATTNCORE_TILE_VECTORS;  // micro-tile width in vectors (QK: keys, PV: Dv)
constexpr int kTileCols = kTileVectors * kLanes;
// The most rows of a work item that reads K and V in place (flash.h).
constexpr int kDirectRows = flash_direct_rows(kTileRows);
// Rows per work item: 8 micro-tiles. 64 rows (AVX-512) keep q, S, O of a D=128 block at
// 80 KiB, well inside L2, and give 2 threads 8 items at L = 256 per head.
constexpr int kBlockRows = 8 * kTileRows;
// Keys per tile: 128. S[64][128] f32 is 32 KiB and a D=128 K tile 64 KiB, L2-resident; the
// per-row softmax work (max, rescale, horizontal reductions) is paid once per 128 keys.
// Measured against 64 keys (1 thread, interleaved A/B, % of the FMA peak on the Zen 5 dev
// machine, 4 runs each): D=128 L=2048 f32 71-74 vs 68-69; L=8192 63-67 vs 61-64; D=64 60-63
// vs 48-59; causal and bf16 equal within noise.
constexpr int kKeyTile = 128;
static_assert(kKeyTile % kTileCols == 0, "a key tile is whole QK micro-tiles");

// The columns of a tile with `keys` keys that are computed: whole QK micro-tiles, so a short
// last tile (or a short Lk) costs its keys, not kKeyTile. Columns past them are never read.
ATTNCORE_TARGET inline std::int64_t tile_cols(std::int64_t keys) {
  return (keys + kTileCols - 1) / kTileCols * kTileCols;
}

constexpr FlashLayout kLayout{kLanes,    kBlockRows, kKeyTile,
                              kTileCols, kTileRows,  ATTNCORE_BF16_DOT != 0};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
