// The flash forward kernel for one SIMD target. Included once by each src/cpu/flash_<target>.cpp,
// which first defines
//   ATTNCORE_TARGET_NS      the target's namespace (avx512, avx2, generic)
//   ATTNCORE_TARGET_PRAGMA  _Pragma("GCC target(...)") for the target's ISA, or nothing
//   ATTNCORE_TARGET_FEATURES the CPU features the target needs (CpuInfo names, space-separated)
//   ATTNCORE_LANES          f32 lanes per vector (16, 8, 4)
//   ATTNCORE_TILE_ROWS      rows of the QK and PV micro-tiles
//   ATTNCORE_TILE_VECTORS   width of the micro-tiles in vectors
//   ATTNCORE_BF16_DOT       1: bf16 inputs run on native bf16 dot products (AVX512-BF16)
// The headers come first, outside the target region, so that their inline helpers stay
// baseline code (a target function may inline them; no baseline caller ever gets a target
// copy). Everything in the region lives in the target's namespace.
//
// Per work item (rows [row0, row0 + rows) of one query head):
//   q = Q rows * scale;  O = 0;  m = -inf;  l = 0
//   for each key tile intersecting the rows' causal / window band:
//     S = q . K_tile^T                       (micro-kernel 1; keys in vector lanes)
//     S = score mods (softcap, ALiBi, mask)   (only when the call has them)
//     S = -inf outside each row's band        (only on tiles the band cuts: "partial" tiles)
//     online softmax: m' = max(m, rowmax S); alpha = exp(m - m'); P = exp(S - m')
//                     l = alpha l + rowsum P;  P *= dropout factor
//     O = alpha O + P . V_tile                (micro-kernel 2; Dv in vector lanes)
//   out = O / l (0 where l = 0);  lse = m + log l (-inf where l = 0)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if ATTNCORE_LANES == 16  // the AVX-512 targets: intrinsics for bf16 dots and transposes
// GCC 12 warns, wrongly, that its own _mm512_undefined_* placeholders (`__m512 __Y = __Y;`)
// may be read uninitialised wherever a masked or widening intrinsic is inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include "core/convert.h"
#include "cpu/flash.h"
#include "policy/mask.h"
#include "policy/score_row.h"

#pragma GCC push_options
ATTNCORE_TARGET_PRAGMA

namespace attncore::detail::ATTNCORE_TARGET_NS {

constexpr int kLanes = ATTNCORE_LANES;
constexpr int kTileRows = ATTNCORE_TILE_ROWS;
constexpr int kTileVectors =
    ATTNCORE_TILE_VECTORS;  // micro-tile width in vectors (QK: keys, PV: Dv)
constexpr int kTileCols = kTileVectors * kLanes;
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
inline std::int64_t tile_cols(std::int64_t keys) {
  return (keys + kTileCols - 1) / kTileCols * kTileCols;
}

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = std::int32_t __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec splat(float x) { return x - Vec{}; }  // x - (+0) == x exactly: folds to a broadcast
// max that propagates NaN from either side (a NaN score must make its row NaN).
inline Vec vmax(Vec a, Vec b) { return (a > b) | (a != a) ? a : b; }
// Horizontal max and sum by halving (log2 lanes vector steps instead of a scalar loop).
template <int N>
struct VecOf {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};
template <int N, class Op>
inline float reduce(typename VecOf<N>::type v, Op op) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    typename VecOf<N / 2>::type lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return reduce<N / 2>(op(lo, hi), op);
  }
}
inline float reduce_max(Vec v) {
  return reduce<kLanes>(v, [](auto a, auto b) { return (a > b) | (a != a) ? a : b; });
}
inline float reduce_sum(Vec v) {
  return reduce<kLanes>(v, [](auto a, auto b) { return a + b; });
}

// 2^x for a vector: x = n + f with n integral and |f| <= 1/2, 2^f by a degree-5 polynomial
// with constant term exactly 1 (so 2^0 = 1: a rescale by an unchanged max is exact) and the
// other coefficients fitted for least relative error on [-1/2, 1/2] (1.6e-7 evaluated in f32),
// 2^n by building the exponent bits. Below -126.5 the result is 0 (so 2^-inf = 0); NaN stays
// NaN.
inline Vec exp2v(Vec x) {
  x = x < splat(-127.0f) ? splat(-127.0f) : x;
  x = x > splat(127.0f) ? splat(127.0f) : x;
  const Vec n = (x + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const Vec f = x - n;
  Vec poly = splat(1.3218672470e-3f);
  poly = poly * f + 9.6716979384e-3f;
  poly = poly * f + 5.5508929525e-2f;
  poly = poly * f + 2.4022238003e-1f;
  poly = poly * f + 6.9314685594e-1f;
  poly = poly * f + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;  // n = -127: +0
  Vec two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return poly * two_n;
}

constexpr float kLog2e = 1.4426950408889634f;

// Transposes a kLanes x kLanes block of floats in registers: r[i][j] becomes r[j][i]. A scalar
// transpose moves one element per load and store (packing K for decode ran at ~7 GB/s with
// it). AVX-512: pairs of rows interleaved, then pairs of pairs, then 128-bit quarters twice, 64
// shuffles for 256 elements. Other widths: log2(kLanes) stages of two-input shuffles (Eklundh):
// at stage s, rows i and i + s (i & s == 0) swap the lanes j & s of one with j - s of the other.
#if ATTNCORE_LANES == 16
inline void transpose_lanes(Vec (&rows)[kLanes]) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    rows[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
#else
template <int kStage>
inline void transpose_stage(Vec (&r)[kLanes], IVec first, IVec second) {
  for (int i = 0; i < kLanes; ++i) {
    if ((i & kStage) != 0) continue;
    const Vec a = r[i], b = r[i + kStage];
    r[i] = __builtin_shuffle(a, b, first);
    r[i + kStage] = __builtin_shuffle(a, b, second);
  }
}
inline void transpose_lanes(Vec (&r)[kLanes]) {
#if ATTNCORE_LANES == 8
  transpose_stage<4>(r, IVec{0, 1, 2, 3, 8, 9, 10, 11}, IVec{4, 5, 6, 7, 12, 13, 14, 15});
  transpose_stage<2>(r, IVec{0, 1, 8, 9, 4, 5, 12, 13}, IVec{2, 3, 10, 11, 6, 7, 14, 15});
  transpose_stage<1>(r, IVec{0, 8, 2, 10, 4, 12, 6, 14}, IVec{1, 9, 3, 11, 5, 13, 7, 15});
#elif ATTNCORE_LANES == 4
  transpose_stage<2>(r, IVec{0, 1, 4, 5}, IVec{2, 3, 6, 7});
  transpose_stage<1>(r, IVec{0, 4, 2, 6}, IVec{1, 5, 3, 7});
#else
#error "transpose_lanes: kLanes must be 4, 8 or 16"
#endif
}
#endif

// A key tile's rows transposed, kLanes keys x kLanes 32-bit columns at a time through
// registers: row c (c < keys; zeros for keys <= c < cols) starts at row(c) and has `width`
// columns of `per_column` input elements each; load(row, e0, n) reads its n columns from e0 as
// a Vec (zero past n); columns e of keys c0 .. c0 + kLanes - 1 go to store(e, c0, vector). Rows
// 32 keys on are prefetched while below `ahead` (the next tile's too): packing K for decode
// from memory went twice as fast with it (AVX-512; the README has the figures).
template <class Row, class Load, class Store>
inline void transpose_keys(std::int64_t keys, std::int64_t cols, std::int64_t width,
                           std::int64_t per_column, std::int64_t ahead, std::int64_t row_stride,
                           Row row, Load load, Store store) {
  static_assert(kTileCols % kLanes == 0, "kLanes keys lie in one micro-tile column");
  for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
    for (std::int64_t e0 = 0; e0 < width; e0 += kLanes) {
      const int n = static_cast<int>(std::min<std::int64_t>(kLanes, width - e0));
      Vec r[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        if (c0 + i >= keys) {  // padding keys (then no row is ahead within Lk either)
          r[i] = Vec{};
          continue;
        }
        const auto* at = row(c0 + i);
        if (c0 + 32 + i < ahead) __builtin_prefetch(at + 32 * row_stride + e0 * per_column);
        r[i] = load(at, e0, n);
      }
      transpose_lanes(r);
      for (int e = 0; e < n; ++e) store(e0 + e, c0, r[e]);
    }
  }
}

// n <= kLanes elements of a row as f32, zero past n: f32, or 16-bit (bf16: exact widening; f16).
// Whole vectors never pass through memory (scalar stores read back as a vector stall store
// forwarding: bf16 decode on AVX2 ran 1.5x slower that way).
#if ATTNCORE_LANES == 16
inline Vec load_part(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline Vec load_part(const std::uint16_t* p, int n, DType dtype) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  if (dtype == DType::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
inline Vec load_part(const float* p, int n) {
  if (n == kLanes) return load(p);
  float x[kLanes] = {};
  for (int e = 0; e < n; ++e) x[e] = p[e];
  return load(x);
}
inline Vec load_part(const std::uint16_t* p, int n, DType dtype) {
  if (n == kLanes && dtype == DType::bf16) {
    using Halves = std::uint16_t __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
    Halves h;
    std::memcpy(&h, p, sizeof h);
    const IVec bits = __builtin_convertvector(h, IVec) << 16;
    Vec x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
  if (n == kLanes) {
    Vec x;
#pragma GCC unroll 16
    for (int e = 0; e < kLanes; ++e) x[e] = f16::to_float(p[e]);
    return x;
  }
  float x[kLanes] = {};
  for (int e = 0; e < n; ++e)
    x[e] = dtype == DType::f16 ? f16::to_float(p[e]) : bf16::to_float(p[e]);
  return load(x);
}
#endif
// A row of the input's dtype (f32 or 16-bit) from element e0, n <= kLanes of them.
inline Vec load_part(const float* p, int n, DType) { return load_part(p, n); }

// tanh(y) = 1 - 2 / (e^(2y) + 1): saturates to +-1, NaN stays NaN.
inline Vec tanhv(Vec y) { return 1.0f - 2.0f / (exp2v(y * (2.0f * kLog2e)) + 1.0f); }

// The score modifiers of DESIGN.md section 1.2 on one row of a tile (keys j0 .. j0 + keys).
inline void apply_score_mods(const Params& p, std::int64_t b, std::int64_t h, std::int64_t i,
                             std::int64_t j0, std::int64_t keys, float* s) {
  if (p.softcap != 0.0) {
    const float cap = static_cast<float>(p.softcap), inv_cap = 1.0f / cap;
    for (std::int64_t c = 0; c < keys; c += kLanes) {
      store(s + c, cap * tanhv(load(s + c) * inv_cap));
    }
  }
  if (p.alibi != nullptr) {
    const float slope = p.alibi[b * p.alibi_stride_b + h * p.alibi_stride_h];
    const std::int64_t diag = i + p.seq.lk - p.seq.lq;  // |diag - j| is the distance
    for (std::int64_t c = 0; c < keys; ++c) {
      const std::int64_t distance = diag - (j0 + c);
      s[c] -= slope * static_cast<float>(distance < 0 ? -distance : distance);
    }
  }
  if (p.mask_kind != MaskKind::none) {
    const std::int64_t base = offset4(p.mask, b, h, i, j0);
    const std::int64_t stride = p.mask.stride[3];
    if (p.mask_kind == MaskKind::additive) {
      if (p.mask.dtype == DType::f32 && stride == 1) {
        const float* m = static_cast<const float*>(p.mask.data) + base;
        for (std::int64_t c = 0; c < keys; ++c) s[c] += m[c];
      } else {
        for (std::int64_t c = 0; c < keys; ++c) {
          s[c] += load_element<float>(p.mask.data, p.mask.dtype, base + c * stride);
        }
      }
    } else {
      const auto* m = static_cast<const std::uint8_t*>(p.mask.data) + base;
      for (std::int64_t c = 0; c < keys; ++c) {
        if (m[c * stride] == 0) s[c] = -INFINITY;
      }
    }
  }
}

// Every dtype computed in f32: queries pre-scaled and transposed per micro-tile, P in f32.
// Tiles are laid out so that each micro-kernel call streams one contiguous block:
// K as [kKeyTile / kTileCols][D][kTileCols], V as [dv_pad / kTileCols][kKeyTile][kTileCols].
struct F32Dot {
  static constexpr bool kScaledQueries = true;
  // Decode-shaped items read K and V in place (DirectKv): 1.3x faster than packing each tile
  // (B=4 Hq=32 Hkv=8 Lq=1 Lk=4096 D=128 f32, 1 thread: 7.6-7.9 against 9.8-10.8 ms).
  static constexpr bool kDirectDecode = true;
  using Operand = float;

  static std::int64_t k_index(std::int64_t d_count, std::int64_t e, std::int64_t c) {
    return (c / kTileCols) * d_count * kTileCols + e * kTileCols + c % kTileCols;
  }
  static std::int64_t v_index(std::int64_t c, std::int64_t e) {
    return (e / kTileCols) * kKeyTile * kTileCols + c * kTileCols + e % kTileCols;
  }

  // The register-blocked core of both products: acc[r][c] += sum_n a(r, n) * b[n][c] for
  // r < kTileRows, c < kTileCols, n < steps, with a(r, n) = a[r * kRowStride + n * kStepStride]
  // broadcast and b's rows kTileCols apart.
  template <int kRowStride, int kStepStride>
  static void rank1_updates(Vec (&acc)[kTileRows][kTileVectors], const float* a, const float* b,
                            std::int64_t steps) {
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
  static void qk_micro(const float* q_t, const float* k_tile, std::int64_t d_count, float* s) {
    Vec acc[kTileRows][kTileVectors] = {};
    rank1_updates<1, kTileRows>(acc, q_t, k_tile, d_count);
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < kTileVectors; ++v) store(s + r * kKeyTile + v * kLanes, acc[r][v]);
    }
  }

  // o[r][c] = alpha[r] * o[r][c] + sum_{j < keys} p[r][j] * v[j][c].
  static void pv_micro(const float* p, const float* v, std::int64_t keys, const float* alpha,
                       float* o, std::int64_t ldo) {
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
  static void pack_tile(const Params& p, const ForwardArgs& a, std::int64_t b,
                        std::int64_t kv_head, std::int64_t t, float* kt, float* vt,
                        std::int64_t dv_pad) {
    const std::int64_t d = p.head_dim, dv = p.head_dim_v;
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, p.seq.lk - j0);
    const std::int64_t cols = tile_cols(keys), lk = p.seq.lk;
    const std::int64_t k0 = offset4(a.k, b, kv_head, j0, 0), ldk = a.k.stride[2];
    // K through registers (load_part widens 16-bit rows: bf16 or f16 by a.k.dtype); V by one
    // copy loop per input dtype (f32, bf16, f16: the flash backend's), none inside.
    auto transpose = [&](const auto* src) {
      transpose_keys(
          keys, cols, d, 1, lk - j0, ldk, [&](std::int64_t c) { return src + c * ldk; },
          [&](const auto* row, std::int64_t e0, int n) {
            return load_part(row + e0, n, a.k.dtype);
          },
          [&](std::int64_t e, std::int64_t c0, Vec x) { store(kt + k_index(d, e, c0), x); });
    };
    auto copy_v = [&](const auto* v, auto to_float) {
      for (std::int64_t c = 0; c < cols; ++c) {
        const auto* row = c < keys ? v + offset4(a.v, b, kv_head, j0 + c, 0) : v;
        for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
          float* chunk = vt + v_index(c, e0);  // kTileCols columns of key c
          const std::int64_t n = c < keys ? std::clamp<std::int64_t>(dv - e0, 0, kTileCols) : 0;
          if (j0 + c + 16 < lk) {  // the same columns 16 keys on (the next tile's too)
            const auto* ahead = v + offset4(a.v, b, kv_head, j0 + c + 16, e0);
            __builtin_prefetch(ahead);
            __builtin_prefetch(ahead + kTileCols - 1);
          }
          for (std::int64_t e = 0; e < n; ++e) chunk[e] = to_float(row[e0 + e]);
          for (std::int64_t e = n; e < kTileCols; ++e) chunk[e] = 0.0f;
        }
      }
    };
    const auto* k16 = static_cast<const std::uint16_t*>(a.k.data) + k0;
    const auto* v16 = static_cast<const std::uint16_t*>(a.v.data);
    const bool with_v = vt != nullptr;  // null: K only
    switch (a.k.dtype) {
      case DType::bf16:
        transpose(k16);
        if (with_v) copy_v(v16, [](std::uint16_t x) { return bf16::to_float(x); });
        break;
      case DType::f16:
        transpose(k16);
        if (with_v) copy_v(v16, [](std::uint16_t x) { return f16::to_float(x); });
        break;
      default:  // f32
        transpose(static_cast<const float*>(a.k.data) + k0);
        if (with_v) copy_v(static_cast<const float*>(a.v.data), [](float x) { return x; });
        break;
    }
  }

  // q = Q rows * scale, as [padded_rows / kTileRows][D][kTileRows] (zero rows past `rows`).
  static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                           const std::int64_t* head_of, const std::int64_t* index_of,
                           std::int64_t rows, std::int64_t padded_rows, float* q) {
    const std::int64_t d = p.head_dim;
    const float scale = static_cast<float>(p.scale);
    for (std::int64_t r = 0; r < padded_rows; ++r) {
      float* dst = q + (r / kTileRows) * d * kTileRows + r % kTileRows;
      if (r < rows) {
        const std::int64_t src = offset4(a.q, b, head_of[r], index_of[r], 0);
        for (std::int64_t e = 0; e < d; ++e) {
          dst[e * kTileRows] = load_element<float>(a.q.data, a.q.dtype, src + e) * scale;
        }
      } else {
        for (std::int64_t e = 0; e < d; ++e) dst[e * kTileRows] = 0.0f;
      }
    }
  }

  // S [padded_rows][kKeyTile] = q . K_tile^T, columns [0, cols)
  static void scores(const Params& p, const float* q, const float* k_tile,
                     std::int64_t padded_rows, std::int64_t cols, float* s) {
    for (std::int64_t r = 0; r < padded_rows; r += kTileRows) {
      for (std::int64_t c = 0; c < cols; c += kTileCols) {
        qk_micro(q + r * p.head_dim, k_tile + k_index(p.head_dim, 0, c), p.head_dim,
                 s + r * kKeyTile + c);
      }
    }
  }

  // O [padded_rows][dv_pad] = alpha O + P . V_tile, over the tile's first `cols` keys
  static void accumulate(const float* probs, const float* v_tile, std::int64_t dv_pad,
                         std::int64_t padded_rows, std::int64_t cols, const float* alpha,
                         float* /*probs16*/, float* out) {
    for (std::int64_t r = 0; r < padded_rows; r += kTileRows) {
      for (std::int64_t c = 0; c < dv_pad; c += kTileCols) {
        pv_micro(probs + r * kKeyTile, v_tile + v_index(0, c), cols, alpha + r,
                 out + r * dv_pad + c, dv_pad);
      }
    }
  }
};

#if ATTNCORE_BF16_DOT
// bf16 inputs on vdpbf16ps (AVX512-BF16): q and K as bf16 pairs along D, P rounded to bf16 and
// V as bf16 pairs along keys, f32 accumulation. q stays the exact input (S is scaled after),
// so only P's rounding is added to what an f32 computation on the same inputs would do.
struct Bf16Dot {
  static constexpr bool kScaledQueries = false;
  // Packed tiles on native bf16 dots stay faster than DirectKv's f32 (4.8 against 5.6-7.5 ms on
  // the decode shape of F32Dot's note).
  static constexpr bool kDirectDecode = false;
  using Operand = std::uint32_t;  // a bf16 pair: the element at the lower index in the low half
  static_assert(kLanes == 16, "one zmm of f32 lanes per vector");
  static_assert(kTileRows % 2 == 0, "micro-tiles hold whole pairs of rows");

  static std::int64_t pairs(std::int64_t n) { return (n + 1) / 2; }
  // Tiles in units of bf16 pairs, each micro-kernel call streaming one contiguous block:
  // K as [kKeyTile / kTileCols][D / 2][kTileCols], V as [dv_pad / kTileCols][kKeyTile /
  // 2][kTileCols].
  static std::int64_t k_index(std::int64_t d_pairs, std::int64_t e2, std::int64_t c) {
    return (c / kTileCols) * d_pairs * kTileCols + e2 * kTileCols + c % kTileCols;
  }
  static std::int64_t v_index(std::int64_t c2, std::int64_t e) {
    return (e / kTileCols) * (kKeyTile / 2) * kTileCols + c2 * kTileCols + e % kTileCols;
  }
  static __m512bh splat_pair(std::uint32_t pair) {
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static __m512bh load_pairs(const std::uint32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

  // dst[e2 * stride] = the bf16 pair (row[2 e2], row[2 e2 + 1]) for e2 < (d + 1) / 2, 0 past d;
  // zeros for a null row.
  static void pair_along(const std::uint16_t* row, std::int64_t d, std::uint32_t* dst,
                         std::int64_t stride) {
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
  static void pair_across(const std::uint16_t* lo, const std::uint16_t* hi, std::int64_t n,
                          std::int64_t width, std::uint32_t* dst) {
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
  static void pack_tile(const Params& p, const ForwardArgs& a, std::int64_t b,
                        std::int64_t kv_head, std::int64_t t, float* kt_floats, float* vt_floats,
                        std::int64_t dv_pad) {
    auto* kt = reinterpret_cast<std::uint32_t*>(kt_floats);
    auto* vt = reinterpret_cast<std::uint32_t*>(vt_floats);
    const std::int64_t d = p.head_dim, dv = p.head_dim_v, d_pairs = pairs(d);
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, p.seq.lk - j0);
    const std::int64_t cols = tile_cols(keys);
    const std::int64_t ldk = a.k.stride[2], ldv = a.v.stride[2], ahead = p.seq.lk - j0;
    const auto* k = static_cast<const std::uint16_t*>(a.k.data) + offset4(a.k, b, kv_head, j0, 0);
    // 16 keys x 16 pairs (32 bf16) at a time, as F32Dot's transpose.
    transpose_keys(
        keys, cols, d_pairs, 2, ahead, ldk, [&](std::int64_t c) { return k + c * ldk; },
        [&](const std::uint16_t* row, std::int64_t e2, int) {
          const std::int64_t n = std::min<std::int64_t>(32, d - 2 * e2);  // bf16 elements
          const auto mask = static_cast<__mmask32>((std::uint64_t{1} << n) - 1);
          return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, row + 2 * e2));
        },
        [&](std::int64_t e2, std::int64_t c0, Vec x) {
          store(reinterpret_cast<float*>(kt + k_index(d_pairs, e2, c0)), x);
        });
    if (vt == nullptr) return;
    const auto* v = static_cast<const std::uint16_t*>(a.v.data) + offset4(a.v, b, kv_head, j0, 0);
    for (std::int64_t c2 = 0; c2 < cols / 2; ++c2) {
      const std::uint16_t* lo = 2 * c2 < keys ? v + 2 * c2 * ldv : nullptr;
      const std::uint16_t* hi = 2 * c2 + 1 < keys ? v + (2 * c2 + 1) * ldv : nullptr;
      if (2 * c2 + 16 < ahead) {  // the next rows' lines, 16 keys on
        for (std::int64_t e = 0; e < dv; e += 32) __builtin_prefetch(v + (2 * c2 + 16) * ldv + e);
      }
      if (2 * c2 + 17 < ahead) {
        for (std::int64_t e = 0; e < dv; e += 32) __builtin_prefetch(v + (2 * c2 + 17) * ldv + e);
      }
      for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
        const std::int64_t n = std::clamp<std::int64_t>(dv - e0, 0, kTileCols);
        pair_across(lo != nullptr ? lo + e0 : nullptr, hi != nullptr ? hi + e0 : nullptr, n,
                    kTileCols, vt + v_index(c2, e0));
      }
    }
  }

  // q as [padded_rows / kTileRows][D/2][kTileRows] bf16 pairs (zero rows past `rows`).
  static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                           const std::int64_t* head_of, const std::int64_t* index_of,
                           std::int64_t rows, std::int64_t padded_rows, float* q_floats) {
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
  static void round_pairs(const float* x, std::int64_t count, std::uint32_t* out) {
    for (std::int64_t n = 0; n < count; n += 2 * kLanes) {
      const __m512bh pair =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + n + kLanes), _mm512_loadu_ps(x + n));
      _mm512_storeu_si512(out + n / 2, (__m512i)pair);
    }
  }
  // out[c] = the bf16 pair (lo[c], hi[c]) for c < count (a multiple of kLanes): two rows
  // interleaved, so that a product can sum over rows two at a time.
  static void round_interleaved(const float* lo, const float* hi, std::int64_t count,
                                std::uint32_t* out) {
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
  static void rank1_updates(Vec (&acc)[kTileRows][kTileVectors], const std::uint32_t* a,
                            const std::uint32_t* b, std::int64_t steps) {
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
  static void scores(const Params& p, const float* q_floats, const float* kt_floats,
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
  static void accumulate(const float* probs, const float* vt_floats, std::int64_t dv_pad,
                         std::int64_t padded_rows, std::int64_t cols, const float* alpha,
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
#endif

// Decode-shaped items (one per kv group, at most kTileRows query rows) read K and V where they
// lie, in f32, instead of packing each tile first: packing is most of such an item's work.
struct DirectKv {
  // q [kTileRows][D]: the rows' queries, unscaled, in f32 (zero rows past `rows`).
  static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                           const std::int64_t* head_of, const std::int64_t* index_of,
                           std::int64_t rows, float* q) {
    const std::int64_t d = p.head_dim;
    for (std::int64_t r = 0; r < kTileRows; ++r) {
      if (r < rows) {
        load_row(a.q.data, a.q.dtype, offset4(a.q, b, head_of[r], index_of[r], 0), d, q + r * d);
      } else {
        std::fill_n(q + r * d, d, 0.0f);
      }
    }
  }

  // S [rows][kKeyTile] = q . K[j0 + c]^T for c < keys, 0 for keys <= c < cols: kLanes keys at a
  // time, one accumulator per key (in registers: the key loop is unrolled) summed across lanes
  // by a register transpose. Rows 32 keys on (the next tile's too) are prefetched.
  template <class T>
  static void scores(const Params& p, const T* k, std::int64_t ldk, DType dtype, std::int64_t keys,
                     std::int64_t cols, std::int64_t ahead, const float* q, std::int64_t rows,
                     float* s) {
    const std::int64_t d = p.head_dim;
    constexpr std::int64_t kLine = 64 / sizeof(T);  // elements per cache line
    for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        if (c0 + 32 + j >= ahead) break;
        for (std::int64_t e = 0; e < d; e += kLine) __builtin_prefetch(k + (c0 + 32 + j) * ldk + e);
      }
      const std::int64_t block = std::clamp<std::int64_t>(keys - c0, 0, kLanes);
      for (std::int64_t r = 0; r < rows; ++r) {
        Vec acc[kLanes] = {};
        for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
          const int n = static_cast<int>(std::min<std::int64_t>(kLanes, d - e0));
          const Vec qv = load_part(q + r * d + e0, n);
          const T* at = k + c0 * ldk + e0;
#pragma GCC unroll 16
          for (int j = 0; j < kLanes; ++j) {
            if (j < block) acc[j] += qv * load_part(at + j * ldk, n, dtype);
          }
        }
        transpose_lanes(acc);
        Vec sum = acc[0];
#pragma GCC unroll 16
        for (int j = 1; j < kLanes; ++j) sum += acc[j];
        store(s + r * kKeyTile + c0, sum);
      }
    }
  }

  // O [kTileRows][dv_pad] = alpha O + P . V[j0 .. j0 + keys): V rows read once, kTileCols
  // columns at a time for every row.
  template <class T>
  static void accumulate(const Params& p, const T* v, std::int64_t ldv, DType dtype,
                         std::int64_t keys, std::int64_t ahead, const float* probs,
                         std::int64_t dv_pad, const float* alpha, float* out) {
    const std::int64_t dv = p.head_dim_v;
    for (std::int64_t e0 = 0; e0 < dv_pad; e0 += kTileCols) {
      Vec acc[kTileRows][kTileVectors];
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
        const Vec scale = splat(alpha[r]);
#pragma GCC unroll 4
        for (int x = 0; x < kTileVectors; ++x)
          acc[r][x] = load(out + r * dv_pad + e0 + x * kLanes) * scale;
      }
      for (std::int64_t c = 0; c < keys; ++c) {
        const T* row = v + c * ldv + e0;
        if (c + 16 < ahead) {  // this chunk of the row 16 keys on
          __builtin_prefetch(row + 16 * ldv);
          __builtin_prefetch(row + 16 * ldv + kTileCols - 1);
        }
        Vec vrow[kTileVectors];
#pragma GCC unroll 4
        for (int x = 0; x < kTileVectors; ++x) {
          const std::int64_t n = std::clamp<std::int64_t>(dv - e0 - x * kLanes, 0, kLanes);
          vrow[x] = n > 0 ? load_part(row + x * kLanes, static_cast<int>(n), dtype) : Vec{};
        }
#pragma GCC unroll 16
        for (int r = 0; r < kTileRows; ++r) {
          const Vec weight = splat(probs[r * kKeyTile + c]);
#pragma GCC unroll 4
          for (int x = 0; x < kTileVectors; ++x) acc[r][x] += weight * vrow[x];
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) {
#pragma GCC unroll 4
        for (int x = 0; x < kTileVectors; ++x) store(out + r * dv_pad + e0 + x * kLanes, acc[r][x]);
      }
    }
  }

  // Both for key tile t of (b, kv_head), in the input's dtype.
  static void tile_scores(const Params& p, const ForwardArgs& a, std::int64_t b,
                          std::int64_t kv_head, std::int64_t j0, std::int64_t keys,
                          std::int64_t cols, const float* q, std::int64_t rows, float* s) {
    const std::int64_t at = offset4(a.k, b, kv_head, j0, 0), ahead = p.seq.lk - j0;
    if (a.k.dtype == DType::f32) {
      scores(p, static_cast<const float*>(a.k.data) + at, a.k.stride[2], a.k.dtype, keys, cols,
             ahead, q, rows, s);
    } else {
      scores(p, static_cast<const std::uint16_t*>(a.k.data) + at, a.k.stride[2], a.k.dtype, keys,
             cols, ahead, q, rows, s);
    }
  }
  static void tile_accumulate(const Params& p, const ForwardArgs& a, std::int64_t b,
                              std::int64_t kv_head, std::int64_t j0, std::int64_t keys,
                              const float* probs, std::int64_t dv_pad, const float* alpha,
                              float* out) {
    const std::int64_t at = offset4(a.v, b, kv_head, j0, 0), ahead = p.seq.lk - j0;
    if (a.v.dtype == DType::f32) {
      accumulate(p, static_cast<const float*>(a.v.data) + at, a.v.stride[2], a.v.dtype, keys, ahead,
                 probs, dv_pad, alpha, out);
    } else {
      accumulate(p, static_cast<const std::uint16_t*>(a.v.data) + at, a.v.stride[2], a.v.dtype,
                 keys, ahead, probs, dv_pad, alpha, out);
    }
  }
};

// One work item: see the top of this file.
template <class Dot>
void run_block_with(const Params& p, const ForwardArgs& a, const FlashPanel& panel,
                    const FlashItem& item, const FlashScratch& w) {
  const std::int64_t d = p.head_dim, dv_pad = panel.dv_pad, lk = p.seq.lk, b = item.b;
  const std::int64_t rows = item.rows;
  const std::int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const CausalWindowMask band(p);
  const bool has_mods = p.softcap != 0.0 || p.alibi != nullptr || p.mask_kind != MaskKind::none;

  // Each row's head and query index, and the keys the rows see (which tiles to visit, and
  // which of them are full: seen entirely by every row, so that no mask code runs).
  std::int64_t head_of[kBlockRows], index_of[kBlockRows];
  RowSetKeys seen;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t n = item.first + r;
    head_of[r] = item.kv_head * p.group + n / p.seq.lq;
    index_of[r] = n % p.seq.lq;
    seen.add(band.row(index_of[r]));
  }

  // A group's only item of at most one micro-tile of rows (decode) reads K and V in place;
  // flash.cpp gives every such problem no panel, whatever the thread count
  // (flash_reads_kv_in_place: the same rule).
  const bool direct = Dot::kDirectDecode && panel.k_tiles == nullptr && rows <= kTileRows;
  if (direct) {
    DirectKv::load_queries(p, a, b, head_of, index_of, rows, w.q);
  } else {
    Dot::load_queries(p, a, b, head_of, index_of, rows, padded_rows, w.q);
  }
  // S is in units of q.k times score_scale: scale is in the queries already, or applied here.
  const float score_scale = Dot::kScaledQueries && !direct ? 1.0f : static_cast<float>(p.scale);
  for (std::int64_t e = 0; e < padded_rows * dv_pad; ++e) w.out[e] = 0.0f;
  for (std::int64_t r = 0; r < padded_rows; ++r) {
    w.row_max[r] = -INFINITY;
    w.row_sum[r] = 0.0f;
    w.alpha[r] = 1.0f;
  }

  const KeyRange span = seen.span();
  const std::int64_t tile_begin = span.begin / kKeyTile;
  const std::int64_t tile_end = span.empty() ? tile_begin : (span.end + kKeyTile - 1) / kKeyTile;
  for (std::int64_t t = tile_begin; t < tile_end; ++t) {
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, lk - j0);
    const std::int64_t cols = tile_cols(keys);  // S, P and the products: columns [0, cols)
    // The last tile's keys past Lk are padding: such a tile is never full.
    const bool full = keys == kKeyTile && seen.classify(j0, j0 + kKeyTile) == TileKind::full;
    // The panel's tile, or (panel without tiles: a single item of its group) this tile packed
    // now into scratch, where it stays in L1/L2 for its one use.
    const float* k_tile = w.k_tile;
    const float* v_tile = w.v_tile;
    if (direct) {
      DirectKv::tile_scores(p, a, b, item.kv_head, j0, keys, cols, w.q, rows, w.scores);
    } else if (panel.k_tiles != nullptr) {
      k_tile = panel.k_tiles + t * d * kKeyTile;
      v_tile = panel.v_rows + j0 * dv_pad;
    } else {
      Dot::pack_tile(p, a, b, item.kv_head, t, w.k_tile, w.v_tile, dv_pad);
    }
    if (!direct) Dot::scores(p, w.q, k_tile, padded_rows, cols, w.scores);
    for (std::int64_t r = 0; r < padded_rows; ++r) {
      float* s = w.scores + r * kKeyTile;
      if (r >= rows) {  // padding rows take no part
        for (std::int64_t c = 0; c < cols; ++c) s[c] = 0.0f;
        continue;
      }
      const std::int64_t h = head_of[r], i = index_of[r];
      float row_scale = score_scale;  // S * row_scale is the score of DESIGN.md section 1.1
      if (has_mods) {
        if (row_scale != 1.0f) {
          for (std::int64_t c = 0; c < cols; c += kLanes) store(s + c, load(s + c) * row_scale);
          row_scale = 1.0f;
        }
        apply_score_mods(p, b, h, i, j0, keys, s);
      }
      if (!full) {
        const KeyRange visible = band.row(i);
        const std::int64_t lo = std::max<std::int64_t>(visible.begin - j0, 0);
        const std::int64_t hi = std::min<std::int64_t>(visible.end - j0, keys);
        for (std::int64_t c = 0; c < cols; ++c) {
          if (c < lo || c >= hi) s[c] = -INFINITY;
        }
      }
      // Online softmax: the one place the running max and sum are updated. The max is kept in
      // log2 units (score * log2 e, rounded once): P = 2^(S * factor - max) and the rescale
      // alpha = 2^(old max - new max) use the same rounded values, and alpha is exactly 1
      // while the max stays.
      const float factor = row_scale * kLog2e;
      Vec vmx = load(s);
      for (std::int64_t c = kLanes; c < cols; c += kLanes) vmx = vmax(load(s + c), vmx);
      const float tile_max = reduce_max(vmx) * factor;
      const float old_max = w.row_max[r];
      // NaN scores make the row NaN (never "nothing visible").
      const float new_max = tile_max > old_max || std::isnan(tile_max) ? tile_max : old_max;
      if (new_max == -INFINITY) {  // nothing visible yet: P = 0, nothing to rescale
        for (std::int64_t c = 0; c < cols; ++c) s[c] = 0.0f;
        w.alpha[r] = 1.0f;
        continue;
      }
      const float alpha = old_max == -INFINITY ? 0.0f
                          : old_max == new_max ? 1.0f
                                               : exp2v(splat(old_max - new_max))[0];
      Vec vsum = splat(0.0f);
      for (std::int64_t c = 0; c < cols; c += kLanes) {
        const Vec prob = exp2v(load(s + c) * factor - new_max);
        vsum += prob;
        store(s + c, prob);
      }
      w.row_sum[r] = w.row_sum[r] * alpha + reduce_sum(vsum);
      w.row_max[r] = new_max;
      w.alpha[r] = alpha;
      if (p.dropout.p > 0.0) {  // after the sum: the normaliser is the pre-dropout sum
        const DropoutRow dropout(p, b, h, i);
        for (std::int64_t c = 0; c < keys; ++c) s[c] *= dropout.factor<float>(j0 + c);
      }
    }
    if (direct) {
      DirectKv::tile_accumulate(p, a, b, item.kv_head, j0, keys, w.scores, dv_pad, w.alpha, w.out);
    } else {
      Dot::accumulate(w.scores, v_tile, dv_pad, padded_rows, cols, w.alpha, w.probs16, w.out);
    }
  }

  // out = O / l, lse = m ln 2 + log l; rows with no visible key: exactly 0 (even where V holds
  // inf or NaN, which 0-weighted keys still bring into O) and -inf.
  for (std::int64_t r = 0; r < rows; ++r) {
    const float sum = w.row_sum[r];
    float* o = w.out + r * dv_pad;
    if (sum == 0.0f) {
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) o[e] = 0.0f;
    } else {
      const float inv = 1.0f / sum;
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) o[e] *= inv;
    }
    const std::int64_t h = head_of[r], i = index_of[r];
    store_row(o, p.head_dim_v, a.out.data, a.out.dtype, offset4(a.out, b, h, i, 0));
    if (a.lse.data != nullptr) {
      constexpr float kLn2 = 0.6931471805599453f;
      const float lse = sum == 0.0f ? -INFINITY : w.row_max[r] * kLn2 + std::log(sum);
      store_element(a.lse.data, a.lse.dtype,
                    b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2], lse);
    }
  }
}

// The exported entry points: native bf16 dot products for bf16 inputs where this target has
// them, f32 for everything else.
void run_block(const Params& p, const ForwardArgs& a, const FlashPanel& panel,
               const FlashItem& item, const FlashScratch& w) {
#if ATTNCORE_BF16_DOT
  if (p.dtype == DType::bf16) return run_block_with<Bf16Dot>(p, a, panel, item, w);
#endif
  run_block_with<F32Dot>(p, a, panel, item, w);
}

// Packs tiles [t_begin, t_end) into a panel: K [tiles][D][kKeyTile] floats' worth, then V
// [tiles * kKeyTile][dv_pad] floats' worth.
void pack_tiles(const Params& p, const ForwardArgs& a, std::int64_t b, std::int64_t kv_head,
                std::int64_t t_begin, std::int64_t t_end, float* k_tiles, float* v_rows,
                std::int64_t dv_pad) {
  for (std::int64_t t = t_begin; t < t_end; ++t) {
    float* kt = k_tiles + t * p.head_dim * kKeyTile;
    float* vt = v_rows + t * kKeyTile * dv_pad;
#if ATTNCORE_BF16_DOT
    if (p.dtype == DType::bf16) {
      Bf16Dot::pack_tile(p, a, b, kv_head, t, kt, vt, dv_pad);
      continue;
    }
#endif
    F32Dot::pack_tile(p, a, b, kv_head, t, kt, vt, dv_pad);
  }
}

constexpr FlashLayout kLayout{kLanes,    kBlockRows, kKeyTile,
                              kTileCols, kTileRows,  ATTNCORE_BF16_DOT != 0};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS

#pragma GCC pop_options
