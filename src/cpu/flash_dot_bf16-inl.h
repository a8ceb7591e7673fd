// Bf16Dot, the flash kernels' dot products on native bf16 pairs (AVX512-BF16), for the targets
// that define ATTNCORE_BF16_DOT: packing of K and V tiles and of queries in bf16 pairs, rounding
// of P to bf16, and the register-blocked products on vdpbf16ps.
#pragma once

#if ATTNCORE_BF16_DOT
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash_simd-inl.h"  // and <immintrin.h>
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// bf16 inputs on vdpbf16ps (AVX512-BF16): q and K as bf16 pairs along D, P rounded to bf16 and
// V as bf16 pairs along keys, f32 accumulation. q stays the exact input (S is scaled after),
// so only P's rounding is added to what an f32 computation on the same inputs would do.
struct Bf16Dot {
  static constexpr bool kScaledQueries = false;
  // Packed tiles on native bf16 dots stay faster than DirectKv's f32 (4.8 against 5.6-7.5 ms on
  // the decode shape of F32Dot's note, flash_dot_f32-inl.h).
  static constexpr bool kDirectDecode = false;
  using Operand = std::uint32_t;  // a bf16 pair: the element at the lower index in the low half
  static_assert(kLanes == 16, "one zmm of f32 lanes per vector");
  static_assert(kTileRows % 2 == 0, "micro-tiles hold whole pairs of rows");

  ATTNCORE_TARGET static std::int64_t pairs(std::int64_t n) { return (n + 1) / 2; }
  // Tiles in units of bf16 pairs, each micro-kernel call streaming one contiguous block:
  // K as [kKeyTile / kTileCols][D / 2][kTileCols], V as [dv_pad / kTileCols][kKeyTile /
  // 2][kTileCols].
  ATTNCORE_TARGET static std::int64_t k_index(std::int64_t d_pairs, std::int64_t e2,
                                              std::int64_t c) {
    return (c / kTileCols) * d_pairs * kTileCols + e2 * kTileCols + c % kTileCols;
  }
  ATTNCORE_TARGET static std::int64_t v_index(std::int64_t c2, std::int64_t e) {
    return (e / kTileCols) * (kKeyTile / 2) * kTileCols + c2 * kTileCols + e % kTileCols;
  }
  // The floats' worth of a V tile, and key c's half of its pairs set to 0 (dv_pad columns).
  ATTNCORE_TARGET static std::int64_t v_tile_floats(std::int64_t dv_pad) {
    return kKeyTile / 2 * dv_pad;
  }
  // Whether key c's half of its pairs in a V tile is finite (exponent bits not all ones).
  ATTNCORE_TARGET static bool key_finite(const float* vt_floats, std::int64_t c,
                                         std::int64_t dv_pad) {
    const auto* vt = reinterpret_cast<const std::uint32_t*>(vt_floats);
    const int shift = c % 2 == 0 ? 0 : 16;
    IVec nonfinite = IVec{};
    for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kLanes) {
      IVec x;
      std::memcpy(&x, vt + v_index(c / 2, e0), sizeof x);
      nonfinite |= ((x >> shift) & 0x7f80) == 0x7f80;
    }
    return reduce_sum(__builtin_convertvector(nonfinite, Vec)) == 0.0f;
  }
  ATTNCORE_TARGET static void zero_key(float* vt_floats, std::int64_t c, std::int64_t dv_pad) {
    auto* vt = reinterpret_cast<std::uint32_t*>(vt_floats);
    const std::uint32_t keep = c % 2 == 0 ? 0xFFFF0000u : 0x0000FFFFu;  // the other key's half
    for (std::int64_t e = 0; e < dv_pad; ++e) vt[v_index(c / 2, e)] &= keep;
  }
  ATTNCORE_TARGET static __m512bh splat_pair(std::uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }
  ATTNCORE_TARGET static __m512bh load_pairs(const std::uint32_t* p) {
    return (__m512bh)_mm512_loadu_si512(p);
  }

  // dst[e2 * stride] = the bf16 pair (row[2 e2], row[2 e2 + 1]) for e2 < (d + 1) / 2, 0 past d;
  // zeros for a null row.
  ATTNCORE_TARGET static void pair_along(const std::uint16_t* row, std::int64_t d,
                                         std::uint32_t* dst, std::int64_t stride) {
    if (row == nullptr) {
      for (std::int64_t e2 = 0; e2 < pairs(d); ++e2) dst[e2 * stride] = 0;
      return;
    }
    for (std::int64_t e2 = 0; e2 < d / 2; ++e2) {
      std::uint32_t pair;  // little-endian: row[2 e2] in the low half
      std::memcpy(&pair, row + 2 * e2, sizeof pair);
      dst[e2 * stride] = pair;
    }
    if (d % 2 != 0) dst[(d / 2) * stride] = row[d - 1];
  }
  // dst[e] = the bf16 pair (lo[e], hi[e]) for e < n, dst[e] = 0 for n <= e < width; a null row
  // reads as zeros.
  ATTNCORE_TARGET static void pair_across(const std::uint16_t* lo, const std::uint16_t* hi,
                                          std::int64_t n, std::int64_t width, std::uint32_t* dst) {
    if (lo != nullptr && hi != nullptr) {
      for (std::int64_t e = 0; e < n; ++e) dst[e] = lo[e] | (std::uint32_t{hi[e]} << 16);
    } else if (lo != nullptr) {
      for (std::int64_t e = 0; e < n; ++e) dst[e] = lo[e];
    } else {
      n = 0;
    }
    for (std::int64_t e = n; e < width; ++e) dst[e] = 0;
  }

  // K tile t: pairs (d, d+1) of one key; V tile (unless vt_floats is null): pairs (key j,
  // key j+1) of one column; zero past Lk, D and Dv.
  ATTNCORE_TARGET static void pack_tile(const Params& p, const ForwardArgs& a, std::int64_t b,
                                        std::int64_t kv_head, std::int64_t t, float* kt_floats,
                                        float* vt_floats, std::int64_t dv_pad) {
    auto* kt = reinterpret_cast<std::uint32_t*>(kt_floats);
    auto* vt = reinterpret_cast<std::uint32_t*>(vt_floats);
    const std::int64_t d = p.head_dim, dv = p.head_dim_v, d_pairs = pairs(d);
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, p.seq.lk - j0);
    const std::int64_t cols = tile_cols(keys);
    const std::int64_t ahead = p.seq.lk - j0;
    // The tile's rows (and up to kRowLead after it: the prefetches), pages resolved.
    TileRows k_rows, v_rows;
    resolve_rows(p, a.k, b, kv_head, j0, k_rows);
    resolve_rows(p, a.v, b, kv_head, j0, v_rows);
    const auto* k = static_cast<const std::uint16_t*>(a.k.data);
    // 16 keys x 16 pairs (32 bf16) at a time, as F32Dot's transpose.
    transpose_keys(
        keys, cols, d_pairs, 2, ahead,
        [&](std::int64_t c) ATTNCORE_TARGET { return k + k_rows.at[c]; },
        [&](const std::uint16_t* row, std::int64_t e2, int) ATTNCORE_TARGET {
          const std::int64_t n = std::min<std::int64_t>(32, d - 2 * e2);  // bf16 elements
          const auto mask = static_cast<__mmask32>((std::uint64_t{1} << n) - 1);
          return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, row + 2 * e2));
        },
        [&](std::int64_t e2, std::int64_t c0, Vec x)
            ATTNCORE_TARGET { store(reinterpret_cast<float*>(kt + k_index(d_pairs, e2, c0)), x); });
    if (vt == nullptr) return;
    const auto* v = static_cast<const std::uint16_t*>(a.v.data);
    for (std::int64_t c2 = 0; c2 < cols / 2; ++c2) {
      const std::uint16_t* lo = 2 * c2 < keys ? v + v_rows.at[2 * c2] : nullptr;
      const std::uint16_t* hi = 2 * c2 + 1 < keys ? v + v_rows.at[2 * c2 + 1] : nullptr;
      if (2 * c2 + 16 < ahead) {  // the next rows' lines, 16 keys on
        for (std::int64_t e = 0; e < dv; e += 32)
          __builtin_prefetch(v + v_rows.at[2 * c2 + 16] + e);
      }
      if (2 * c2 + 17 < ahead) {
        for (std::int64_t e = 0; e < dv; e += 32)
          __builtin_prefetch(v + v_rows.at[2 * c2 + 17] + e);
      }
      for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
        const std::int64_t n = std::clamp<std::int64_t>(dv - e0, 0, kTileCols);
        pair_across(lo != nullptr ? lo + e0 : nullptr, hi != nullptr ? hi + e0 : nullptr, n,
                    kTileCols, vt + v_index(c2, e0));
      }
    }
  }

  // q as [padded_rows / kTileRows][D/2][kTileRows] bf16 pairs (zero rows past `rows`).
  ATTNCORE_TARGET static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                                           const std::int64_t* head_of,
                                           const std::int64_t* index_of, std::int64_t rows,
                                           std::int64_t padded_rows, float* q_floats) {
    auto* q = reinterpret_cast<std::uint32_t*>(q_floats);
    const std::int64_t d = p.head_dim, d_pairs = pairs(d);
    for (std::int64_t r = 0; r < padded_rows; ++r) {
      std::uint32_t* dst = q + (r / kTileRows) * d_pairs * kTileRows + r % kTileRows;
      const std::uint16_t* src = r < rows ? static_cast<const std::uint16_t*>(a.q.data) +
                                                offset4(a.q, b, head_of[r], index_of[r], 0)
                                          : nullptr;
      pair_along(src, d, dst, kTileRows);
    }
  }

  // out[n / 2] = the bf16 pair (x[n], x[n + 1]), rounded to nearest even, for n < count (a
  // multiple of 2 * kLanes).
  ATTNCORE_TARGET static void round_pairs(const float* x, std::int64_t count, std::uint32_t* out) {
    for (std::int64_t n = 0; n < count; n += 2 * kLanes) {
      const __m512bh pair =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + n + kLanes), _mm512_loadu_ps(x + n));
      _mm512_storeu_si512(out + n / 2, (__m512i)pair);
    }
  }
  // out[c] = the bf16 pair (lo[c], hi[c]) for c < count (a multiple of kLanes): two rows
  // interleaved, so that a product can sum over rows two at a time.
  ATTNCORE_TARGET static void round_interleaved(const float* lo, const float* hi,
                                                std::int64_t count, std::uint32_t* out) {
    alignas(64) static constexpr std::uint16_t kZip[32] = {
        0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i zip = _mm512_load_si512(kZip);
    for (std::int64_t c = 0; c < count; c += kLanes) {
      // [lo[c..c+16], hi[c..c+16]] as bf16, then zipped: lo[c], hi[c], lo[c+1], ...
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi + c), _mm512_loadu_ps(lo + c));
      _mm512_storeu_si512(out + c, _mm512_permutexvar_epi16(zip, (__m512i)both));
    }
  }

  // The register-blocked core of every bf16 product: acc[r][c] += sum_n a(r, n) . b[n][c] for
  // r < kTileRows, c < kTileCols, n < steps (in pairs), with a(r, n) = a[r * kRowStride + n *
  // kStepStride] a bf16 pair broadcast and b's rows of pairs kTileCols apart.
  template <int kRowStride, int kStepStride>
  ATTNCORE_TARGET static void rank1_updates(Vec (&acc)[kTileRows][kTileVectors],
                                            const std::uint32_t* a, const std::uint32_t* b,
                                            std::int64_t steps) {
    for (std::int64_t n = 0; n < steps; ++n) {
      __m512bh row[kTileVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kTileVectors; ++v) row[v] = load_pairs(b + n * kTileCols + v * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
        const __m512bh x = splat_pair(a[r * kRowStride + n * kStepStride]);
#pragma GCC unroll 4
        for (int v = 0; v < kTileVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, row[v]);
      }
    }
  }

  // S [padded_rows][kKeyTile] = q . K_tile^T (unscaled), columns [0, cols)
  ATTNCORE_TARGET static void scores(const Params& p, const float* q_floats, const float* kt_floats,
                                     std::int64_t padded_rows, std::int64_t cols, float* s) {
    const auto* q = reinterpret_cast<const std::uint32_t*>(q_floats);
    const auto* kt = reinterpret_cast<const std::uint32_t*>(kt_floats);
    const std::int64_t d_pairs = pairs(p.head_dim);
    for (std::int64_t r0 = 0; r0 < padded_rows; r0 += kTileRows) {
      for (std::int64_t c = 0; c < cols; c += kTileCols) {
        Vec acc[kTileRows][kTileVectors] = {};
        rank1_updates<1, kTileRows>(acc, q + r0 * d_pairs, kt + k_index(d_pairs, 0, c), d_pairs);
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
          for (int v = 0; v < kTileVectors; ++v)
            store(s + (r0 + r) * kKeyTile + c + v * kLanes, acc[r][v]);
        }
      }
    }
  }

  // O [padded_rows][dv_pad] = alpha O + bf16(P) . V_tile over the tile's first `cols` keys, P
  // rounded into probs16.
  ATTNCORE_TARGET static void accumulate(const float* probs, const float* vt_floats,
                                         std::int64_t dv_pad, std::int64_t padded_rows,
                                         std::int64_t cols, const float* alpha,
                                         float* probs16_floats, float* out) {
    auto* p16 = reinterpret_cast<std::uint32_t*>(probs16_floats);  // [padded_rows][kKeyTile / 2]
    for (std::int64_t r = 0; r < padded_rows; ++r) {
      round_pairs(probs + r * kKeyTile, cols, p16 + r * (kKeyTile / 2));
    }
    const auto* vt = reinterpret_cast<const std::uint32_t*>(vt_floats);
    for (std::int64_t r0 = 0; r0 < padded_rows; r0 += kTileRows) {
      for (std::int64_t c = 0; c < dv_pad; c += kTileCols) {
        Vec acc[kTileRows][kTileVectors];
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
          const Vec a = splat(alpha[r0 + r]);
#pragma GCC unroll 4
          for (int v = 0; v < kTileVectors; ++v)
            acc[r][v] = load(out + (r0 + r) * dv_pad + c + v * kLanes) * a;
        }
        rank1_updates<kKeyTile / 2, 1>(acc, p16 + r0 * (kKeyTile / 2), vt + v_index(0, c),
                                       cols / 2);
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
          for (int v = 0; v < kTileVectors; ++v)
            store(out + (r0 + r) * dv_pad + c + v * kLanes, acc[r][v]);
        }
      }
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS

#endif  // ATTNCORE_BF16_DOT
