// The flash backend's entry in the backend table: what it cannot run, its cost term (fitted
// to its measured times; core/cost.h says how) and the kernel shapes the model reads.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/cost.h"
#include "core/cpu_info.h"
#include "cpu/flash.h"
#include "cpu/flash_split_kv.h"

namespace attncore::detail {

namespace {

// flash: packing K and V (and in the backward q and dO) into tiles, per element of the padded
// tiles, in FMA-equivalent flops, for f32 tiles and for bf16 pairs: decode B=1 Hq=8 Lq=1 Lk=128
// D=128 (262144 packed elements, in cache) took 51 us in f32 and 23 us in bf16, 27 and 8 us
// beyond the products (perf: pack_tile 54% and 46% of the call).
constexpr double kFlashPackFlops[] = {25, 8};  // f32 tiles, bf16 pairs
// flash forward, decode items of at most flash_direct_rows rows on f32 tiles (DirectKv: K and V
// read in place, rows not padded): per K/V element, B=1 Hq=8 Lq=1 D=128 Lk=128 took 26.5 us
// and Lk=1024 196 us (in cache, 240 GFLOP/s), 20.6 and 19.7 flops an element beyond the rest.
constexpr double kFlashDirectFlops = 20;
// flash backward: the same per packed element (q and dO rows, K in two layouts, V in one) with
// each run's dK and dV reduced and stored: B=1 Hq=8 D=64 f32 L=32 took 118 us, L=64 285 us,
// 39 and 82 us beyond the other terms for 81920 and 163840 elements: 114 and 118 flops at 237
// GFLOP/s (bf16 L=32: 124). The term is 2% of the L=2048 backward.
constexpr double kFlashBackwardPackFlops = 115;
// flash: K and V read from memory when the call's K and V exceed this (below, a call that
// repeats finds them in the caches: L2 + L3 of the measuring machine hold 33 MiB), at this
// share of the measured bandwidth (packing and reading overlap): decode B=4 Hq=32 Hkv=8 Lq=1
// Lk=4096 D=128 (134 MB of f32, 67 MB of bf16) took 8.5 and 4.6 ms, 5.5 and 2.8 ms beyond the
// products, at 35.7 GB/s measured: 0.68 and 0.67.
constexpr double kFlashCachedBytes = 8 << 20;
constexpr double kFlashStreamEfficiency = 0.68;
// flash: the extra cost of a query row in a tile that mask code cuts (the band's edge, or the
// last tile when it is short), FMA-equivalent flops (its scalar mask loop and the row's fixed
// softmax work, which a full tile spreads over 128 keys): B=1 Hq=8 D=64 L=32 (256 rows, every
// tile cut) took 48.8 us in f32 and 32.2 us in bf16, 26 and 18 us beyond the other terms; L=64
// (512 rows) 125 and 82 us, 53 and 35 us beyond: 24.8K and 25K flops a row in f32, 17K and
// 16.5K in bf16, at 241 GFLOP/s (per row, not per pair: the per-pair fits disagreed 2x).
constexpr double kFlashCutRowFlops[] = {25000, 17000};  // f32 tiles, bf16 pairs
// flash forward: D=128 108 ms, D=64 61.8 ms: 0.88 of the FMA peak on the products, and 106
// FMA-equivalent flops per score for the online softmax (exp2 polynomial, max, sum, rescale).
constexpr double kFlashEfficiency = 0.88;
constexpr double kFlashSoftmaxFlops = 106;
// flash forward with native bf16 dot products (vdpbf16ps: twice the flops of an FMA): bf16
// D=128 65.8 ms, with the softmax term above: 1.67 of the f32 FMA peak.
constexpr double kFlashBf16DotEfficiency = 1.67;
// flash backward (2.5x the forward's flops), for f32 tiles and for bf16 pairs on native dots:
// B=1 Hq=16 L=2048, medians of 3 at 237 GFLOP/s: f32 D=128 427 ms, D=64 215 ms: 0.854 of the
// peak and 10 flops a pair beyond the products; bf16 244 and 128 ms: 1.56 and 42.
constexpr double kFlashBackwardEfficiency[] = {0.854, 1.56};
constexpr double kFlashBackwardSoftmaxFlops[] = {10, 42};

// Fixed cost per call, forward and backward (validation, allocation, the row loops' setup):
// with these, B=1 Hq=1 L=16 D=64 on 1 thread is estimated at flash 4.3 and 13 us, math 3.9 and
// 11 us, measured 4.4 and 9, 3.4 and 7 (the backward's other terms run over by the same 4 us
// on both, which keeps their order).
constexpr double kFlashCallSeconds[] = {1e-6, 5e-6};

// Memory traffic is shared by the threads (the decode shapes barely speed up with a second
// thread on the measuring machine: flash 24.5 -> 21.2 ms, math 52.9 -> 46.2 ms), so byte
// terms are not divided by the thread count; work terms are, over the threads that get work.
double estimate_flash(Pass pass, const Params& p, const Launch& launch, const CostModel& m) {
  const Sizes s = sizes_of(p, launch);
  const double flops_per_s = m.machine.fma_gflops * 1e9;
  const double bytes_per_s = m.machine.memory_gbps * 1e9;
  const double tile = m.flash_key_tile;
  const bool bf16_dot = p.dtype == DType::bf16 && m.flash_bf16_dot;  // bf16 pairs, native dots
  const double groups = s.batch * s.heads_kv;
  const double group_rows = s.heads_q / s.heads_kv * s.lq;
  // Keys per query row the kernel computes: whole tiles, the last one's keys rounded up to
  // whole micro-tiles, and along a band's edge half a tile more on average (a band that hides
  // nothing, as lower-right causal at Lq = 1, cuts no tile).
  const bool banded = (p.causal != Causal::none || p.window_left >= 0 || p.window_right >= 0) &&
                      visible_pairs(p) < s.lq * s.lk;
  const double lk_pad = round_up_to(s.lk, m.flash_tile_cols);
  const bool short_last_tile = std::fmod(s.lk, tile) != 0;
  const double keys = !banded    ? lk_pad
                      : s.lq > 0 ? std::min(lk_pad, visible_pairs(p) / s.lq + tile / 2)
                                 : 0;
  // Decode items of at most flash_direct_rows rows read K and V in place (f32 tiles): their
  // rows are not padded, and no tile is packed; a group cut into two such items reads its K
  // and V twice.
  const double direct_items =
      pass == Pass::forward ? static_cast<double>(flash_in_place_items(p, m.flash_tile_rows)) : 0;
  const bool direct = direct_items > 0;
  const double rows_pad =
      groups * (direct ? group_rows : round_up_to(group_rows, m.flash_tile_rows));
  const double pairs = rows_pad * keys;
  // Rows of tiles the mask code cuts: one tile per row along a band's edge, and the last tile
  // when Lk is not a whole number of tiles.
  const double cut_rows =
      rows_pad * std::min(std::ceil(keys / tile), (banded ? 1.0 : 0.0) + (short_last_tile ? 1 : 0));
  // Packed elements: K and V once per group (the packing reads them); the backward also packs
  // q and dO. Other traffic: q read and out written (backward: and the gradients).
  double packed = groups * lk_pad * s.dims * std::max(direct_items, 1.0);
  double compute, bytes, items;
  if (pass == Pass::forward) {
    const double efficiency = bf16_dot ? kFlashBf16DotEfficiency : kFlashEfficiency;
    compute = pairs * (2 * s.dims / efficiency + kFlashSoftmaxFlops) / flops_per_s;
    bytes = s.batch * s.heads_q * s.lq * s.dims * s.element;
    items = groups * (direct ? direct_items : std::ceil(group_rows / m.flash_block_rows));
    // Split-KV (cpu/flash_split_kv.h): each group's keys in parts run as items of their own,
    // then every row's parts (f32 outputs and LSEs) written and read back by the merge.
    const FlashLayout layout{0,
                             m.flash_block_rows,
                             m.flash_key_tile,
                             m.flash_tile_cols,
                             m.flash_tile_rows,
                             m.flash_bf16_dot};
    const double splits = static_cast<double>(plan_kv_splits(p, layout, machine_threads()));
    if (splits > 1) {
      items *= splits;
      bytes += 2 * splits * s.batch * s.heads_q * s.lq * (p.head_dim_v + 1) * sizeof(float);
    }
  } else {
    compute = pairs *
              (kBackwardFlops * 2 * s.dims / kFlashBackwardEfficiency[bf16_dot ? 1 : 0] +
               kFlashBackwardSoftmaxFlops[bf16_dot ? 1 : 0]) /
              flops_per_s;
    // Items as flash_backward cuts them; each run of heads packs the K/V tiles it visits, K in
    // two layouts (for S and for dQ) and V in one (for dP).
    const FlashBackwardPlan plan = plan_flash_backward(p, m.flash_key_tile, p.compute_dbias);
    const double runs = groups * static_cast<double>(plan.runs);
    packed = runs * lk_pad * static_cast<double>(2 * p.head_dim + p.head_dim_v) +
             s.batch * s.heads_q * s.lq * s.dims;
    bytes = (groups * s.lk * s.kv_element + 3 * s.batch * s.heads_q * s.lq * s.element) * s.dims;
    items = runs * static_cast<double>(plan.parts);
  }
  compute += cut_rows * kFlashCutRowFlops[bf16_dot ? 1 : 0] / flops_per_s;
  // Packing: per-element work, or reading K and V from memory, whichever is slower (each
  // thread reads its own groups: decode B=4 Hq=32 Hkv=8 Lk=4096 ran 2.0x faster on 2 threads).
  const double kv_bytes = groups * s.lk * s.dims * s.kv_element * std::max(direct_items, 1.0);
  const double read =
      kv_bytes > kFlashCachedBytes ? kv_bytes / (bytes_per_s * kFlashStreamEfficiency) : 0;
  const double per_element = pass == Pass::backward ? kFlashBackwardPackFlops
                             : direct               ? kFlashDirectFlops
                                                    : kFlashPackFlops[bf16_dot ? 1 : 0];
  const double pack = std::max(packed * per_element / flops_per_s, read);
  const double threads = std::max(1.0, std::min(s.threads, items));
  return kFlashCallSeconds[pass == Pass::forward ? 0 : 1] +
         parallel_seconds(compute + pack, threads, m.machine.dispatch_seconds) +
         bytes / bytes_per_s;
}

}  // namespace

void flash_can_use(Pass, const Params& p, std::vector<std::string>& reasons) {
  if (p.dtype == DType::f64) {
    reasons.push_back(
        "flash: dtype f64 is not supported (dtype=f64, expected f32, bf16 or f16); math and "
        "reference run f64");
  }
  // Flash scores in log2 units, scale x log2(e) in f32: past FLT_MAX / log2(e) that factor is
  // inf, and scores it turned to inf gave wrong outputs where the scores themselves were finite
  // (scale 3e38 over keys of 1e-3: errors of 2, LSE 2.36e38 for 1.06e36).
  constexpr double kMaxScale = 3.4028234663852886e38 / 1.4426950408889634;
  if (std::abs(p.scale) > kMaxScale) {
    char text[200];
    std::snprintf(text, sizeof text,
                  "flash: scale is too large for its log2 units (scale=%.6g, expected |scale| <= "
                  "%.6g: scale x log2(e) within f32); math and reference take it",
                  p.scale, std::floor(kMaxScale / 1e33) * 1e33);  // (the bound rounded down)
    reasons.push_back(text);
  }
}

double flash_estimate(Pass pass, const Params& p, const Launch& launch, const CostModel& m) {
  return estimate_flash(pass, p, launch, m);
}

void flash_describe(CostModel& m) {
  const FlashTarget& target = flash_target_chosen();
  m.flash_key_tile = target.layout.key_tile;
  m.flash_tile_cols = target.layout.dv_align;
  m.flash_tile_rows = target.layout.tile_rows;
  m.flash_block_rows = target.layout.block_rows;
  m.flash_bf16_dot = target.layout.bf16_dot;
}

}  // namespace attncore::detail
