// F32Dot, the flash kernels' dot products with every dtype computed in f32, for one SIMD target:
// packing of K and V tiles and of queries, and the register-blocked QK and PV micro-kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// Every dtype computed in f32: queries pre-scaled and transposed per micro-tile, P in f32.
// Tiles are laid out so that each micro-kernel call streams one contiguous block:
// K as [kKeyTile / kTileCols][D][kTileCols], V as [dv_pad / kTileCols][kKeyTile][kTileCols].
struct F32Dot {
  static constexpr bool kScaledQueries = true;
  // Decode-shaped items read K and V in place (DirectKv): 1.3x faster than packing each tile
  // (B=4 Hq=32 Hkv=8 Lq=1 Lk=4096 D=128 f32, 1 thread: 7.6-7.9 against 9.8-10.8 ms).
  static constexpr bool kDirectDecode = true;
  using Operand = float;

  ATTNCORE_TARGET static std::int64_t k_index(std::int64_t d_count, std::int64_t e,
                                              std::int64_t c) {
    return (c / kTileCols) * d_count * kTileCols + e * kTileCols + c % kTileCols;
  }
  ATTNCORE_TARGET static std::int64_t v_index(std::int64_t c, std::int64_t e) {
    return (e / kTileCols) * kKeyTile * kTileCols + c * kTileCols + e % kTileCols;
  }
  // The floats of a V tile, and key c's row of one set to 0 (dv_pad columns).
  ATTNCORE_TARGET static std::int64_t v_tile_floats(std::int64_t dv_pad) {
    return kKeyTile * dv_pad;
  }
  // Whether key c's row of a V tile is finite (x * 0 is 0 for finite x, NaN for inf and NaN).
  ATTNCORE_TARGET static bool key_finite(const float* vt, std::int64_t c, std::int64_t dv_pad) {
    Vec acc = Vec{};
    for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kLanes) acc += load(vt + v_index(c, e0)) * 0.0f;
    return reduce_sum(acc) == 0.0f;
  }
  ATTNCORE_TARGET static void zero_key(float* vt, std::int64_t c, std::int64_t dv_pad) {
    for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
      std::fill_n(vt + v_index(c, e0), kTileCols, 0.0f);
    }
  }

  // The register-blocked core of both products: acc[r][c] += sum_n a(r, n) * b[n][c] for
  // r < kTileRows, c < kTileCols, n < steps, with a(r, n) = a[r * kRowStride + n * kStepStride]
  // broadcast and b's rows kTileCols apart.
  template <int kRowStride, int kStepStride>
  ATTNCORE_TARGET static void rank1_updates(Vec (&acc)[kTileRows][kTileVectors], const float* a,
                                            const float* b, std::int64_t steps) {
    for (std::int64_t n = 0; n < steps; ++n) {
      Vec row[kTileVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kTileVectors; ++v) row[v] = load(b + n * kTileCols + v * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
        const Vec x = splat(a[r * kRowStride + n * kStepStride]);
#pragma GCC unroll 4
        for (int v = 0; v < kTileVectors; ++v) acc[r][v] += x * row[v];
      }
    }
  }

  // s[r][c] = sum_d q_t[d][r] * k_tile[d][c]. The queries come transposed ([D][kTileRows]) so
  // that one pointer with constant offsets reaches every row.
  ATTNCORE_TARGET static void qk_micro(const float* q_t, const float* k_tile, std::int64_t d_count,
                                       float* s) {
    Vec acc[kTileRows][kTileVectors] = {};
    rank1_updates<1, kTileRows>(acc, q_t, k_tile, d_count);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kTileVectors; ++v) store(s + r * kKeyTile + v * kLanes, acc[r][v]);
    }
  }

  // o[r][c] = alpha[r] * o[r][c] + sum_{j < keys} p[r][j] * v[j][c].
  ATTNCORE_TARGET static void pv_micro(const float* p, const float* v, std::int64_t keys,
                                       const float* alpha, float* o, std::int64_t ldo) {
    Vec acc[kTileRows][kTileVectors];
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const Vec a = splat(alpha[r]);
#pragma GCC unroll 4
      for (int c = 0; c < kTileVectors; ++c) acc[r][c] = load(o + r * ldo + c * kLanes) * a;
    }
    rank1_updates<kKeyTile, 1>(acc, p, v, keys);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < kTileVectors; ++c) store(o + r * ldo + c * kLanes, acc[r][c]);
    }
  }

  // Packs key tile t of (b, kv_head) in f32: K transposed into kt [D][kKeyTile] and V into
  // vt [kKeyTile][dv_pad] (unless vt is null), zero past Lk and past Dv.
  ATTNCORE_TARGET static void pack_tile(const Params& p, const ForwardArgs& a, std::int64_t b,
                                        std::int64_t kv_head, std::int64_t t, float* kt, float* vt,
                                        std::int64_t dv_pad) {
    const std::int64_t d = p.head_dim, dv = p.head_dim_v;
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, p.seq.lk - j0);
    const std::int64_t cols = tile_cols(keys), lk = p.seq.lk;
    // The tile's rows (and up to kRowLead after it: the prefetches), pages resolved.
    TileRows k_rows, v_rows;
    resolve_rows(p, a.k, b, kv_head, j0, k_rows);
    resolve_rows(p, a.v, b, kv_head, j0, v_rows);
    // K and V through registers (load_part widens 16-bit rows: bf16 or f16 by the dtype). K and
    // V share a dtype (validated), which may differ from q's (a 16-bit cache under an f32 query).
    auto transpose = [&](const auto* src) ATTNCORE_TARGET {
      transpose_keys(
          keys, cols, d, 1, lk - j0,
          [&](std::int64_t c) ATTNCORE_TARGET { return src + k_rows.at[c]; },
          [&](const auto* row, std::int64_t e0, int n)
              ATTNCORE_TARGET { return load_part(row + e0, n, a.k.dtype); },
          [&](std::int64_t e, std::int64_t c0, Vec x)
              ATTNCORE_TARGET { store(kt + k_index(d, e, c0), x); });
    };
    auto copy_v = [&](const auto* v) ATTNCORE_TARGET {
      for (std::int64_t c = 0; c < cols; ++c) {
        const auto* row = c < keys ? v + v_rows.at[c] : nullptr;  // (padding: nothing read)
        for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
          const std::int64_t n = c < keys ? std::clamp<std::int64_t>(dv - e0, 0, kTileCols) : 0;
          if (j0 + c + 16 < lk) {  // the same columns 16 keys on (the next tile's too)
            const auto* ahead = v + v_rows.at[c + 16] + e0;
            __builtin_prefetch(ahead);
            __builtin_prefetch(ahead + kTileCols - 1);
          }
          widen_cols(n > 0 ? row + e0 : row, n, a.v.dtype, vt + v_index(c, e0));  // key c's, e0 on
        }
      }
    };
    const bool with_v = vt != nullptr;  // null: K only
    if (a.k.dtype == DType::f32) {
      transpose(static_cast<const float*>(a.k.data));
      if (with_v) copy_v(static_cast<const float*>(a.v.data));
    } else {  // bf16 or f16
      transpose(static_cast<const std::uint16_t*>(a.k.data));
      if (with_v) copy_v(static_cast<const std::uint16_t*>(a.v.data));
    }
  }

  // q = Q rows * scale, as [padded_rows / kTileRows][D][kTileRows] (zero rows past `rows`).
  ATTNCORE_TARGET static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                                           const std::int64_t* head_of,
                                           const std::int64_t* index_of, std::int64_t rows,
                                           std::int64_t padded_rows, float* q) {
    const std::int64_t d = p.head_dim;
    const float scale = static_cast<float>(p.scale);
    for (std::int64_t r = 0; r < padded_rows; ++r) {
      float* dst = q + (r / kTileRows) * d * kTileRows + r % kTileRows;
      if (r < rows) {
        const std::int64_t src = offset4(a.q, b, head_of[r], index_of[r], 0);
        for (std::int64_t e0 = 0; e0 < d; e0 += kTileCols) {
          float chunk[kTileCols];  // the row's columns from e0, widened
          const std::int64_t n = std::min<std::int64_t>(kTileCols, d - e0);
          if (a.q.dtype == DType::f32) {
            widen_cols(static_cast<const float*>(a.q.data) + src + e0, n, a.q.dtype, chunk);
          } else {
            widen_cols(static_cast<const std::uint16_t*>(a.q.data) + src + e0, n, a.q.dtype, chunk);
          }
          for (std::int64_t e = 0; e < n; ++e) dst[(e0 + e) * kTileRows] = chunk[e] * scale;
        }
      } else {
        for (std::int64_t e = 0; e < d; ++e) dst[e * kTileRows] = 0.0f;
      }
    }
  }

  // S [padded_rows][kKeyTile] = q . K_tile^T, columns [0, cols)
  ATTNCORE_TARGET static void scores(const Params& p, const float* q, const float* k_tile,
                                     std::int64_t padded_rows, std::int64_t cols, float* s) {
    for (std::int64_t r = 0; r < padded_rows; r += kTileRows) {
      for (std::int64_t c = 0; c < cols; c += kTileCols) {
        qk_micro(q + r * p.head_dim, k_tile + k_index(p.head_dim, 0, c), p.head_dim,
                 s + r * kKeyTile + c);
      }
    }
  }

  // O [padded_rows][dv_pad] = alpha O + P . V_tile, over the tile's first `cols` keys
  ATTNCORE_TARGET static void accumulate(const float* probs, const float* v_tile,
                                         std::int64_t dv_pad, std::int64_t padded_rows,
                                         std::int64_t cols, const float* alpha, float* /*probs16*/,
                                         float* out) {
    for (std::int64_t r = 0; r < padded_rows; r += kTileRows) {
      for (std::int64_t c = 0; c < dv_pad; c += kTileCols) {
        pv_micro(probs + r * kKeyTile, v_tile + v_index(0, c), cols, alpha + r,
                 out + r * dv_pad + c, dv_pad);
      }
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
