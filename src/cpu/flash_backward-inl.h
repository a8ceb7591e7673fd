// The fused backward for one SIMD target (the macros are described in flash_layout-inl.h),
// built on the forward's vector helpers, score mods, packing and micro-kernels.
//
// One work item is a run of query heads [h_begin, h_end) of one kv head (one head, unless Lq is
// short: flash_backward_driver.cpp) or, for fewer than 4 heads in all, a part of its key tiles,
// owned by one thread: its dQ rows are written by nobody else, and its dK and dV of each key tile
// go to put_kv_tile, which sums the items of a kv group in head order
// (src/cpu/flash_backward_driver.cpp). No atomic adds: bitwise the same for any thread count.
//   Delta_i = <dO_i, O_i>;  q, dO packed once
//   for each key tile:  dK = dV = 0
//     for each head, each block of its rows the band reaches:
//       S = q K^T (with the score mods), P = exp(S - LSE)   (P = 0 where masked or LSE = -inf)
//       dP = dO V^T * M                                      (M: the dropout factor)
//       dS = P (dP - Delta), dBias += dS, dS *= softcap' * scale
//       dV += (P M)^T dO,  dK += dS^T q,  dQ += dS K            (register-blocked products)
//     put_kv_tile(dK, dV)
//   store dQ
// Matches docs/design.md section 1.9 and src/reference/reference.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash.h"
#include "cpu/flash_dot_bf16-inl.h"
#include "cpu/flash_dot_f32-inl.h"
#include "cpu/flash_hidden_keys-inl.h"
#include "cpu/flash_layout-inl.h"
#include "cpu/flash_score_mods-inl.h"
#include "cpu/flash_simd-inl.h"
#include "policy/mask.h"
#include "policy/score_row.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// out[r][c] += sum_n a(r, n) * b[n][c] for r < rows (a multiple of kTileRows), c < cols_pad (a
// multiple of kTileCols), n < steps, with a(r, n) = a[r * kRowStride + n * kStepStride] and b
// packed as [cols_pad / kTileCols][b_steps][kTileCols] (b_steps >= steps), in Dot's operands
// (f32, or bf16 pairs: then n counts pairs).
template <class Dot, int kRowStride, int kStepStride>
ATTNCORE_TARGET void add_product(const typename Dot::Operand* a, std::int64_t rows,
                                 std::int64_t steps, const typename Dot::Operand* b,
                                 std::int64_t b_steps, std::int64_t cols_pad, float* out) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    for (std::int64_t c0 = 0; c0 < cols_pad; c0 += kTileCols) {
      Vec acc[kTileRows][kTileVectors];
      float* o = out + r0 * cols_pad + c0;
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
        for (int v = 0; v < kTileVectors; ++v) acc[r][v] = load(o + r * cols_pad + v * kLanes);
      }
      Dot::template rank1_updates<kRowStride, kStepStride>(
          acc, a + r0 * kRowStride, b + (c0 / kTileCols) * b_steps * kTileCols, steps);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
        for (int v = 0; v < kTileVectors; ++v) store(o + r * cols_pad + v * kLanes, acc[r][v]);
      }
    }
  }
}

// Rows (head_of[r], index_of[r]) of a [B, H, L, width] view as
// [width_pad / kTileCols][padded_rows][kTileCols] floats, zero past `rows` and `width`; or, for
// Bf16Dot, as [width_pad / kTileCols][padded_rows / 2][kTileCols] bf16 pairs of rows (2 r2, 2 r2
// + 1), so that a product sums over rows two at a time.
template <class Dot>
ATTNCORE_TARGET void pack_rows(const TensorView& t, std::int64_t b, const std::int64_t* head_of,
                               const std::int64_t* index_of, std::int64_t rows,
                               std::int64_t padded_rows, std::int64_t width, std::int64_t width_pad,
                               float* out_floats) {
  if constexpr (std::is_same_v<typename Dot::Operand, std::uint32_t>) {  // bf16 input, pairs
    auto* out = reinterpret_cast<std::uint32_t*>(out_floats);
    const auto* data = static_cast<const std::uint16_t*>(t.data);
    for (std::int64_t r2 = 0; r2 < padded_rows / 2; ++r2) {
      const std::uint16_t* lo =
          2 * r2 < rows ? data + offset4(t, b, head_of[2 * r2], index_of[2 * r2], 0) : nullptr;
      const std::uint16_t* hi =
          2 * r2 + 1 < rows ? data + offset4(t, b, head_of[2 * r2 + 1], index_of[2 * r2 + 1], 0)
                            : nullptr;
      for (std::int64_t c0 = 0; c0 < width_pad; c0 += kTileCols) {
        const std::int64_t n = std::clamp<std::int64_t>(width - c0, 0, kTileCols);
        Dot::pair_across(lo != nullptr ? lo + c0 : nullptr, hi != nullptr ? hi + c0 : nullptr, n,
                         kTileCols, out + c0 * (padded_rows / 2) + r2 * kTileCols);
      }
    }
  } else {
    // By whole vectors (widen_cols), each row's kTileCols columns at a time.
    auto pack = [&](const auto* data) ATTNCORE_TARGET {
      for (std::int64_t r = 0; r < padded_rows; ++r) {
        const auto* src = r < rows ? data + offset4(t, b, head_of[r], index_of[r], 0) : nullptr;
        for (std::int64_t c0 = 0; c0 < width_pad; c0 += kTileCols) {
          const std::int64_t n = r < rows ? std::clamp<std::int64_t>(width - c0, 0, kTileCols) : 0;
          widen_cols(n > 0 ? src + c0 : src, n, t.dtype,
                     out_floats + (c0 / kTileCols) * padded_rows * kTileCols + r * kTileCols);
        }
      }
    };
    if (t.dtype == DType::f32) {
      pack(static_cast<const float*>(t.data));
    } else {  // bf16 or f16
      pack(static_cast<const std::uint16_t*>(t.data));
    }
  }
}

// S [padded_rows][kKeyTile] = a . K_tile^T (unscaled), columns [0, cols), with a's rows as
// pack_rows<F32Dot> lays them out ([d_pad / kTileCols][padded_rows][kTileCols]) and the tile in
// F32Dot's k-layout: the rows the dK and dV products read serve S and dP too, so no second copy
// is packed.
ATTNCORE_TARGET inline void scores_from_rows(const float* rows, const float* k_tile,
                                             std::int64_t width, std::int64_t padded_rows,
                                             std::int64_t cols, float* s) {
  for (std::int64_t r0 = 0; r0 < padded_rows; r0 += kTileRows) {
    for (std::int64_t c = 0; c < cols; c += kTileCols) {
      Vec acc[kTileRows][kTileVectors] = {};
      for (std::int64_t e0 = 0; e0 < width; e0 += kTileCols) {
        F32Dot::rank1_updates<kTileCols, 1>(acc, rows + e0 * padded_rows + r0 * kTileCols,
                                            k_tile + F32Dot::k_index(width, e0, c),
                                            std::min<std::int64_t>(kTileCols, width - e0));
      }
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
        for (int v = 0; v < kTileVectors; ++v)
          store(s + (r0 + r) * kKeyTile + c + v * kLanes, acc[r][v]);
      }
    }
  }
}

// dV += (P M)^T dO and dK += dS^T q (rows: the tile's keys, keys_pad of them); dQ += dS K
// (rows: this block; sums over the tile's first `cols` keys), in f32 straight from S and dS.
ATTNCORE_TARGET inline void tile_products(F32Dot, const FlashBackwardScratch& w,
                                          const float* q_rows, const float* do_rows,
                                          std::int64_t padded_rows, std::int64_t keys_pad,
                                          std::int64_t cols, float* dq) {
  add_product<F32Dot, 1, kKeyTile>(w.s, keys_pad, padded_rows, do_rows, padded_rows, w.dv_pad,
                                   w.dv);
  add_product<F32Dot, 1, kKeyTile>(w.ds, keys_pad, padded_rows, q_rows, padded_rows, w.d_pad, w.dk);
  add_product<F32Dot, kKeyTile, 1>(w.ds, padded_rows, cols, w.k_rows, kKeyTile, w.d_pad, dq);
}

#if ATTNCORE_BF16_DOT
// The same products on bf16 pairs: P M and dS rounded to bf16 (as a bf16 autograd run rounds
// them), interleaved by rows for dV and dK and paired along keys for dQ; f32 accumulation.
ATTNCORE_TARGET inline void tile_products(Bf16Dot, const FlashBackwardScratch& w,
                                          const float* q_rows_floats, const float* do_rows_floats,
                                          std::int64_t padded_rows, std::int64_t keys_pad,
                                          std::int64_t cols, float* dq) {
  auto* pm_rows = reinterpret_cast<std::uint32_t*>(w.pairs);        // [padded_rows / 2][kKeyTile]
  std::uint32_t* ds_rows = pm_rows + (padded_rows / 2) * kKeyTile;  // [padded_rows / 2][kKeyTile]
  std::uint32_t* ds_keys = ds_rows + (padded_rows / 2) * kKeyTile;  // [padded_rows][kKeyTile / 2]
  for (std::int64_t r2 = 0; r2 < padded_rows / 2; ++r2) {
    const float* lo = w.s + 2 * r2 * kKeyTile;
    Bf16Dot::round_interleaved(lo, lo + kKeyTile, cols, pm_rows + r2 * kKeyTile);
    const float* dlo = w.ds + 2 * r2 * kKeyTile;
    Bf16Dot::round_interleaved(dlo, dlo + kKeyTile, cols, ds_rows + r2 * kKeyTile);
  }
  for (std::int64_t r = 0; r < padded_rows; ++r) {
    Bf16Dot::round_pairs(w.ds + r * kKeyTile, cols, ds_keys + r * (kKeyTile / 2));
  }
  const auto* do_rows = reinterpret_cast<const std::uint32_t*>(do_rows_floats);
  const auto* q_rows = reinterpret_cast<const std::uint32_t*>(q_rows_floats);
  const auto* k_rows = reinterpret_cast<const std::uint32_t*>(w.k_rows);
  const std::int64_t row_pairs = padded_rows / 2;
  add_product<Bf16Dot, 1, kKeyTile>(pm_rows, keys_pad, row_pairs, do_rows, row_pairs, w.dv_pad,
                                    w.dv);
  add_product<Bf16Dot, 1, kKeyTile>(ds_rows, keys_pad, row_pairs, q_rows, row_pairs, w.d_pad, w.dk);
  add_product<Bf16Dot, kKeyTile / 2, 1>(ds_keys, padded_rows, cols / 2, k_rows, kKeyTile / 2,
                                        w.d_pad, dq);
}
#endif

template <class Dot>
ATTNCORE_TARGET void run_backward_heads_with(const Params& p, const BackwardArgs& a, std::int64_t b,
                                             std::int64_t h_begin, std::int64_t h_end,
                                             const FlashBackwardScratch& w,
                                             DbiasAccumulator* dbias) {
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, lq = p.seq.lq, lk = p.seq.lk;
  const std::int64_t d_pad = w.d_pad, dv_pad = w.dv_pad, kv_head = h_begin / p.group;
  const std::int64_t lq_pad = w.lq_pad;  // each head's rows, padded to whole micro-tiles
  const CausalWindowMask band(p);
  const float scale = static_cast<float>(p.scale), cap = static_cast<float>(p.softcap);
  // The problems whose packing and products the forward's code serves: K as both K and V
  // (k-layout for S, rows for dQ), V as K (k-layout for dP), dO as unscaled queries.
  Params pk = p;
  pk.head_dim_v = d;
  Params pv = p;
  pv.head_dim = dv;
  Params pdo = pv;
  pdo.scale = 1.0;
  Params mods = p;  // ALiBi and the mask; softcap is applied here to keep its derivative
  mods.softcap = 0.0;
  const bool has_mods = p.alibi != nullptr || p.mask_kind != MaskKind::none;
  // No modifier: P's exponent S scale - LSE from the unrounded product (fmsub_exact), as the
  // forward's, so that huge scores keep their differences (else each S scale is rounded first).
  const bool plain = cap == 0.0f && !has_mods;
  const bool may_hide = keys_may_be_hidden(p);
  const ForwardArgs k_as_kv{a.q, a.k, a.k, {}, {}}, v_as_kv{a.dout, a.v, a.v, {}, {}};
  const ForwardArgs q_args{a.q, a.k, a.v, {}, {}}, do_args{a.dout, a.v, a.v, {}, {}};
  // Where the block starting at row `at` of the item's padded rows (head h's rows start at
  // (h - h_begin) * lq_pad) starts in the packed rows: f32 rows, or bf16 pairs of rows (half as
  // many floats' worth); the bf16 kernel also packs pairs along D for S and dP (q_t, do_t).
  constexpr bool kPairs = std::is_same_v<typename Dot::Operand, std::uint32_t>;
  const std::int64_t q_rows_per_row = kPairs ? d_pad / 2 : d_pad;
  const std::int64_t do_rows_per_row = kPairs ? dv_pad / 2 : dv_pad;
  const std::int64_t d_pairs = (d + 1) / 2, dv_pairs = (dv + 1) / 2;

  // Delta_i = <dO_i, O_i> and LSE_i for every row of the heads; dQ accumulators to zero.
  for (std::int64_t h = h_begin; h < h_end; ++h) {
    for (std::int64_t i = 0; i < lq; ++i) {
      const std::int64_t o_row = offset4(a.out, b, h, i, 0), do_row = offset4(a.dout, b, h, i, 0);
      float delta = 0.0f;
      for (std::int64_t e = 0; e < dv; ++e) {
        delta += load_element<float>(a.dout.data, a.dout.dtype, do_row + e) *
                 load_element<float>(a.out.data, a.out.dtype, o_row + e);
      }
      const std::int64_t n = (h - h_begin) * lq + i;
      w.delta[n] = delta;
      w.lse[n] = load_element<float>(
          a.lse.data, a.lse.dtype, b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2]);
    }
  }
  for (std::int64_t e = 0; e < (h_end - h_begin) * lq_pad * d_pad; ++e) w.dq[e] = 0.0f;

  // The heads' queries and output gradients in the layouts the products read, once (not once
  // per key tile).
  const std::int64_t blocks = (lq + kBlockRows - 1) / kBlockRows;
  for (std::int64_t h = h_begin; h < h_end; ++h) {
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      const std::int64_t row0 = blk * kBlockRows,
                         rows = std::min<std::int64_t>(kBlockRows, lq - row0);
      const std::int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
      const std::int64_t at = (h - h_begin) * lq_pad + row0;
      std::int64_t head_of[kBlockRows], index_of[kBlockRows];
      for (std::int64_t r = 0; r < rows; ++r) {
        head_of[r] = h;
        index_of[r] = row0 + r;
      }
      if constexpr (kPairs) {
        Dot::load_queries(p, q_args, b, head_of, index_of, rows, padded_rows, w.q_t + at * d_pairs);
        Dot::load_queries(pdo, do_args, b, head_of, index_of, rows, padded_rows,
                          w.do_t + at * dv_pairs);
      }
      pack_rows<Dot>(a.q, b, head_of, index_of, rows, padded_rows, d, d_pad,
                     w.q_rows + at * q_rows_per_row);
      pack_rows<Dot>(a.dout, b, head_of, index_of, rows, padded_rows, dv, dv_pad,
                     w.do_rows + at * do_rows_per_row);
    }
  }

  for (std::int64_t t = w.tile_begin; t < w.tile_end; ++t) {
    if (t > w.tile_begin && w.launch != nullptr) w.launch->check_cancel();
    const std::int64_t j0 = t * kKeyTile, keys = std::min<std::int64_t>(kKeyTile, lk - j0);
    const std::int64_t cols = tile_cols(keys);  // S, dS and the dQ product: columns [0, cols)
    // dK/dV rows: whole micro-tiles (rows past the tile's keys are scratch, never stored; with
    // 6-row micro-tiles they may pass `cols`: those columns of S and dS are zeroed below).
    const std::int64_t keys_pad = (keys + kTileRows - 1) / kTileRows * kTileRows;
    const std::int64_t tail_end = std::min<std::int64_t>(keys_pad, kKeyTile);
    Dot::pack_tile(pk, k_as_kv, b, kv_head, t, w.k_t, w.k_rows, d_pad);
    Dot::pack_tile(pv, v_as_kv, b, kv_head, t, w.v_t, nullptr, dv_pad);  // V's k-layout only
    // Keys whose K holds inf or NaN, where some row may not see them: left out of the dQ
    // product (zeroed in k_rows) and added to the rows that see them (flash_hidden_keys-inl.h).
    // dS is exactly 0 wherever P is, whatever K and V hold.
    std::int64_t bad[kKeyTile], bad_count = 0;
    if (may_hide) {
      bad_count = nonfinite_keys(a.k, b, kv_head, j0, keys, d, bad);
      for (std::int64_t n = 0; n < bad_count; ++n) Dot::zero_key(w.k_rows, bad[n], d_pad);
    }
    for (std::int64_t e = 0; e < keys_pad * d_pad; ++e) w.dk[e] = 0.0f;
    for (std::int64_t e = 0; e < keys_pad * dv_pad; ++e) w.dv[e] = 0.0f;
    for (std::int64_t h = h_begin; h < h_end; ++h) {
      for (std::int64_t blk = 0; blk < blocks; ++blk) {
        const std::int64_t row0 = blk * kBlockRows,
                           rows = std::min<std::int64_t>(kBlockRows, lq - row0);
        const std::int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
        RowSetKeys seen;
        for (std::int64_t r = 0; r < rows; ++r) seen.add(band.row(row0 + r));
        if (seen.classify(j0, j0 + keys) == TileKind::empty) continue;
        const std::int64_t at = (h - h_begin) * lq_pad + row0;  // in the packed rows
        const float* q_rows = w.q_rows + at * q_rows_per_row;
        const float* do_rows = w.do_rows + at * do_rows_per_row;
        if constexpr (kPairs) {
          Dot::scores(p, w.q_t + at * d_pairs, w.k_t, padded_rows, cols, w.s);       // S = q.k
          Dot::scores(pdo, w.do_t + at * dv_pairs, w.v_t, padded_rows, cols, w.ds);  // dP = dO.v
        } else {
          scores_from_rows(q_rows, w.k_t, d, padded_rows, cols, w.s);
          scores_from_rows(do_rows, w.v_t, dv, padded_rows, cols, w.ds);
        }
        for (std::int64_t r = 0; r < padded_rows; ++r) {
          float* s = w.s + r * kKeyTile;
          float* ds = w.ds + r * kKeyTile;
          const std::int64_t i = row0 + r;
          const float lse = r < rows ? w.lse[(h - h_begin) * lq + i] : -INFINITY;
          for (std::int64_t c = cols; c < tail_end; ++c) s[c] = ds[c] = 0.0f;  // dK/dV rows' tail
          if (lse == -INFINITY) {  // padding rows and rows with no visible key: P = dS = 0
            for (std::int64_t c = 0; c < cols; ++c) s[c] = ds[c] = 0.0f;
            continue;
          }
          if (!plain) {
            for (std::int64_t c = 0; c < cols; c += kLanes) store(s + c, load(s + c) * scale);
          }
          float* dcap = w.dcap;  // [kKeyTile] the softcap derivative of this row
          for (std::int64_t c = 0; c < cols; ++c) dcap[c] = 1.0f;
          if (cap != 0.0f) apply_softcap(cap, cols, s, dcap);
          if (has_mods) apply_score_mods(mods, b, h, i, j0, keys, s);
          // P = exp(S - LSE) on the row's visible keys, 0 elsewhere.
          const KeyRange visible = band.row(i);
          const std::int64_t lo = std::clamp<std::int64_t>(visible.begin - j0, 0, kKeyTile);
          const std::int64_t hi = std::clamp<std::int64_t>(visible.end - j0, lo, keys);
          for (std::int64_t c = 0; c < cols; c += kLanes) {  // (0 where masked, even for LSE NaN)
            const Vec x = load(s + c);
            const Vec exponent = plain ? fmsub_exact(x, scale, lse) : x - lse;
            store(s + c, x == -INFINITY ? Vec{} : exp2v(exponent * kLog2e));
          }
          for (std::int64_t c = 0; c < lo; ++c) s[c] = 0.0f;
          for (std::int64_t c = hi; c < cols; ++c) s[c] = 0.0f;
          const float delta = w.delta[(h - h_begin) * lq + i];
          const DropoutRow dropout(p, b, h, i);
          if (!dropout.active() && dbias == nullptr) {
            for (std::int64_t c = 0; c < cols;
                 c += kLanes) {  // dS = P (dP - Delta) * softcap' * scale, 0 where P is
              const Vec prob = load(s + c);
              const Vec dscore = prob * (load(ds + c) - delta) * load(dcap + c) * scale;
              store(ds + c, prob != 0.0f ? dscore : Vec{});
            }
            continue;
          }
          double* dbias_row = dbias != nullptr ? dbias->row(b, h, i) : nullptr;
          for (std::int64_t c = 0; c < cols; ++c) {
            const float prob = s[c];
            const float keep = prob != 0.0f ? dropout.factor<float>(j0 + c) : 0.0f;
            // dS = P (dP - Delta), 0 where P is
            const float dscore = prob != 0.0f ? prob * (keep * ds[c] - delta) : 0.0f;
            if (dbias_row != nullptr && c < keys) {
              dbias_row[(j0 + c) * dbias->column_stride()] += dscore;
            }
            ds[c] = prob != 0.0f ? dscore * dcap[c] * scale : 0.0f;  // the gradient of <q_i, k_j>
            s[c] = prob * keep;                                      // dV's weights
          }
        }
        tile_products(Dot{}, w, q_rows, do_rows, padded_rows, keys_pad, cols, w.dq + at * d_pad);
        if (bad_count > 0) {
          std::int64_t head_of[kBlockRows], index_of[kBlockRows];
          for (std::int64_t r = 0; r < rows; ++r) {
            head_of[r] = h;
            index_of[r] = row0 + r;
          }
          add_bad_keys(p, band, a.k, b, kv_head, j0, bad, bad_count, head_of, index_of, rows, w.ds,
                       d, w.dq + at * d_pad, d_pad);
        }
      }
    }
    w.put_kv_tile(w.put_context, t, w.dk, w.dv);
  }
  if (!w.store_dq) return;  // a part of the key tiles: the caller sums the dQ parts
  for (std::int64_t h = h_begin; h < h_end; ++h) {
    for (std::int64_t i = 0; i < lq; ++i) {
      store_row_narrowed(narrow_row, w.dq + ((h - h_begin) * lq_pad + i) * d_pad, d, a.dq.data,
                         a.dq.dtype, offset4(a.dq, b, h, i, 0));
    }
  }
}

// The exported entry point: native bf16 products for bf16 inputs where this target has them, f32
// for everything else.
ATTNCORE_TARGET void run_backward_heads(const Params& p, const BackwardArgs& a, std::int64_t b,
                                        std::int64_t h_begin, std::int64_t h_end,
                                        const FlashBackwardScratch& w, DbiasAccumulator* dbias) {
#if ATTNCORE_BF16_DOT
  if (p.dtype == DType::bf16) {
    return run_backward_heads_with<Bf16Dot>(p, a, b, h_begin, h_end, w, dbias);
  }
#endif
  run_backward_heads_with<F32Dot>(p, a, b, h_begin, h_end, w, dbias);
}

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
