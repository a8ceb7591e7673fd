// The vector vocabulary of the flash kernels for one SIMD target (the macros are described in
// flash_layout-inl.h): Vec with its loads, stores and horizontal reductions, exp2v, register
// transposes (transpose_keys: a key tile's rows into columns) and load_part (part of a row as
// f32, widening 16-bit inputs).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if ATTNCORE_LANES == 16  // the AVX-512 targets: intrinsics for bf16 dots and transposes
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 warns, wrongly, that its own _mm512_undefined_* placeholders (`__m512 __Y = __Y;`)
// may be read uninitialised wherever a masked or widening intrinsic is inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#elif ATTNCORE_LANES == 8  // AVX2: F16C's f16 widening
#include <immintrin.h>
#endif

#include "attncore/dtype.h"
#include "cpu/flash_layout-inl.h"
#include "policy/score_mod.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = std::int32_t __attribute__((vector_size(kLanes * sizeof(float))));

ATTNCORE_TARGET inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ATTNCORE_TARGET inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
// c + a * b with one rounding on the x86 targets (FMA): written out, so that the bits do not
// depend on a compiler's choice to fuse (clang 14 left some decode products of -ffp-contract=fast
// unfused on AVX2: the layouts of an f32 query over a bf16 cache rounded apart). The baseline
// target writes the expression (fused where its ISA can: aarch64).
ATTNCORE_TARGET inline Vec fmadd(Vec a, Vec b, Vec c) {
#if ATTNCORE_LANES == 16
  return _mm512_fmadd_ps(a, b, c);
#elif ATTNCORE_LANES == 8
  return _mm256_fmadd_ps(a, b, c);
#else
  return c + a * b;
#endif
}
// x - (+0) == x exactly: folds to a broadcast.
ATTNCORE_TARGET inline Vec splat(float x) { return x - Vec{}; }
// a * b - c with the product unrounded (the exponent of P, whose terms must keep the
// differences of huge scores): fused on the x86 targets, and on the baseline target where its
// ISA fuses (aarch64, or x86-64 built with FMA); elsewhere (x86-64 without FMA: scores of 1e5
// lost 1e-3 of their weights) the product in double, exact for two floats (the forward there,
// Hq 4, L 1024, D 128, 1 thread, 3 rounds in turn against the rounded product: 0.96-1.03,
// median 0.99).
ATTNCORE_TARGET inline Vec fmsub_exact(Vec a, float b, float c) {
#if ATTNCORE_LANES == 16 || ATTNCORE_LANES == 8
  return fmadd(a, splat(b), splat(-c));
#elif defined(__aarch64__) || defined(__FMA__)
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = std::fma(a[i], b, -c);
  return r;
#else
  Vec r;
  for (int i = 0; i < kLanes; ++i) {
    r[i] = static_cast<float>(static_cast<double>(a[i]) * static_cast<double>(b) -
                              static_cast<double>(c));
  }
  return r;
#endif
}
// max that propagates NaN from either side (a NaN score must make its row NaN).
ATTNCORE_TARGET inline Vec vmax(Vec a, Vec b) { return ((a > b) | (a != a)) ? a : b; }
// Horizontal max and sum by halving (log2 lanes vector steps instead of a scalar loop).
template <int N>
struct VecOf {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};
// (The halves are taken by shuffles: through memcpy, GCC 12 kept the vector in memory, and an
// accumulator summed that way went to the stack and back at every step of the loop forming it:
// bf16 MHA decode [B, L, Hkv, D], 1 thread, spent a third of its scoring there.)
template <int N, class Op, std::size_t... kLow>
ATTNCORE_TARGET inline float reduce_halves(typename VecOf<N>::type v, Op op,
                                           std::index_sequence<kLow...>);
template <int N, class Op>
ATTNCORE_TARGET inline float reduce(typename VecOf<N>::type v, Op op) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return reduce_halves<N>(v, op, std::make_index_sequence<N / 2>{});
  }
}
template <int N, class Op, std::size_t... kLow>
ATTNCORE_TARGET inline float reduce_halves(typename VecOf<N>::type v, Op op,
                                           std::index_sequence<kLow...>) {
  const typename VecOf<N / 2>::type lo = __builtin_shufflevector(v, v, kLow...);
  const typename VecOf<N / 2>::type hi = __builtin_shufflevector(v, v, (kLow + N / 2)...);
  return reduce<N / 2>(op(lo, hi), op);
}
ATTNCORE_TARGET inline float reduce_max(Vec v) {
  return reduce<kLanes>(
      v, [](auto a, auto b) ATTNCORE_TARGET { return ((a > b) | (a != a)) ? a : b; });
}
ATTNCORE_TARGET inline float reduce_sum(Vec v) {
  return reduce<kLanes>(v, [](auto a, auto b) ATTNCORE_TARGET { return a + b; });
}

// reduce_sum of kLanes vectors at once: lane j of reduce_sums(v) is reduce_sum(v[j]), bit for
// bit (the same halving tree), in log2(kLanes) stages of two-input shuffles. A stage holds
// kLanes / g vectors of a key's g partial sums each, and turns each pair (x, y) into one vector
// of x's keys then y's with g / 2 partial sums each: partial i plus partial i + g / 2.
template <int kGroup>
constexpr int halving_source(int lane, int upper) {
  const int half = kGroup / 2, keys = kLanes / kGroup;
  const int slot = lane / half, i = lane % half + upper * half;
  return slot < keys ? slot * kGroup + i : kLanes + (slot - keys) * kGroup + i;
}
template <int kGroup, int kPairs, int... kLane>
ATTNCORE_TARGET inline void halving_stage(Vec* v, std::integer_sequence<int, kLane...>) {
  for (int i = 0; i < kPairs; ++i) {  // 2 kPairs vectors in, kPairs out
    const Vec x = v[2 * i], y = v[2 * i + 1];
    v[i] = __builtin_shufflevector(x, y, halving_source<kGroup>(kLane, 0)...) +
           __builtin_shufflevector(x, y, halving_source<kGroup>(kLane, 1)...);
  }
}
// The stages from kGroup down to 2 over v [kGroup] (each of kLanes / kGroup keys' kGroup
// partial sums), into v[0].
template <int kGroup>
ATTNCORE_TARGET inline void halving_stages(Vec* v) {
  if constexpr (kGroup > 1) {
    halving_stage<kGroup, kGroup / 2>(v, std::make_integer_sequence<int, kLanes>{});
    halving_stages<kGroup / 2>(v);
  }
}
ATTNCORE_TARGET inline Vec reduce_sums(Vec (&v)[kLanes]) {
#if ATTNCORE_LANES == 8
  // AVX2: the same stages, each pair's two shuffles within 128-bit lanes but the first's (whole
  // halves), the keys left out of order until one permute at the end (the same bits:
  // reduce_sums_test). GCC 12 built the generic stages with cross-lane permutes and blends.
  // Zen 3, TSC ticks: 8 vectors reduced per call in a loop 44-48 -> 31-32 per call; a GQA
  // group's scores alone (4 rows, one kv head, Lk=512 from L2, best of 41 rounds per key) bf16
  // 56-60 -> 49-52, f16 56-63 -> 46-52, f32 74-76 -> 57-68; whole decode from memory (Lk=16384,
  // 1 thread, the two alternating call by call, 15 rounds, median speed ratio): MHA [B, L, Hkv,
  // D] bf16 1.05, f16 1.00, f32 1.00, p16 bf16 1.01; GQA bf16 1.01-1.02, f16 1.02, f32 1.01.
  __m256 half[4];  // half[i]: key 2i's 4 partial sums (low 128 bits), key 2i + 1's (high)
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m256 x = v[2 * i], y = v[2 * i + 1];
    half[i] = _mm256_permute2f128_ps(x, y, 0x20) + _mm256_permute2f128_ps(x, y, 0x31);
  }
  __m256 quarter[2];  // quarter[i]: keys 4i, 4i + 2 (2 partials each; low), 4i + 1, 4i + 3 (high)
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m256 x = half[2 * i], y = half[2 * i + 1];
    quarter[i] = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)) +
                 _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2));
  }
  const __m256 sums =  // keys 0, 2, 4, 6 (low), 1, 3, 5, 7 (high)
      _mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(2, 0, 2, 0)) +
      _mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 1, 3, 1));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  halving_stages<kLanes>(v);
  return v[0];
#endif
}

// reduce_sums in two steps, for sums formed a group of G keys at a time (G a power of 2 that
// divides kLanes; not on AVX2, whose reduce_sums orders its stages otherwise): reduce_group<G>
// takes a group's G vectors (keys j0 .. j0 + G - 1, j0 a multiple of G) through reduce_sums'
// first log2(G) stages, which pair those keys only, into one vector (its keys' kLanes / G
// partial sums each); reduce_groups<G> takes the kLanes / G such vectors, in key order,
// through the rest. Lane j is reduce_sums' (so reduce_sum's) bits: reduce_groups_test.
template <int G, int kGroup = kLanes>
ATTNCORE_TARGET inline Vec reduce_group(Vec* v) {
  static_assert(ATTNCORE_LANES != 8 && G >= 1 && kLanes % G == 0, "a group of reduce_sums");
  if constexpr (G > 1) {
    halving_stage<kGroup, G / 2>(v, std::make_integer_sequence<int, kLanes>{});
    return reduce_group<G / 2, kGroup / 2>(v);
  } else {
    return v[0];
  }
}
template <int G>
ATTNCORE_TARGET inline Vec reduce_groups(Vec* v) {
  static_assert(ATTNCORE_LANES != 8 && kLanes % G == 0, "a group of reduce_sums");
  halving_stages<kLanes / G>(v);
  return v[0];
}

// 2^x for a vector: x = n + f with n integral and |f| <= 1/2, 2^f by a degree-5 polynomial
// with constant term exactly 1 (so 2^0 = 1: a rescale by an unchanged max is exact) and the
// other coefficients fitted for least relative error on [-1/2, 1/2] (1.6e-7 evaluated in f32),
// 2^n by building the exponent bits. Below -126.5 the result is 0 (so 2^-inf = 0); NaN stays
// NaN.
ATTNCORE_TARGET inline Vec exp2v(Vec x) {
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

// x * factor (scores times the scale, or into log2 units), a finite x's product held within
// +-FLT_MAX: scores past FLT_MAX / log2 e, as an additive mask of f32's lowest value makes
// them, became infinities, which softmax reads as keys masked out (a row masked with such
// values alone gave 0 and LSE -inf, where torch averages its values), and a scale of 1e38
// times q.k of 10 an infinity that a -inf mask made NaN. Infinite and NaN x give their
// products. (The scalar is policy/score_mod.h's, which the unfused backends use.)
ATTNCORE_TARGET inline float held_product(float x, float factor) {
  return detail::held_product(x, factor);  // (the unfused backends' own, one definition)
}
ATTNCORE_TARGET inline Vec held_product(Vec x, float factor) {
  const Vec y = x * factor;
  const Vec held = y < -FLT_MAX ? splat(-FLT_MAX) : y > FLT_MAX ? splat(FLT_MAX) : y;
  return x - x == Vec{} ? held : y;  // (x - x: 0 where x is finite, NaN elsewhere)
}

// Transposes a kLanes x kLanes block of floats in registers: r[i][j] becomes r[j][i]. A scalar
// transpose moves one element per load and store (packing K for decode ran at ~7 GB/s with
// it). AVX-512: pairs of rows interleaved, then pairs of pairs, then 128-bit quarters twice, 64
// shuffles for 256 elements. Other widths: log2(kLanes) stages of two-input shuffles (Eklundh):
// at stage s, rows i and i + s (i & s == 0) swap the lanes j & s of one with j - s of the other.
#if ATTNCORE_LANES == 16
ATTNCORE_TARGET inline void transpose_lanes(Vec (&rows)[kLanes]) {
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
// Stage s on rows i and i + s (i & s == 0), as two-input shuffles of (row i, row i + s) in which
// index kLanes + j is lane j of row i + s: row i takes lane j - s of row i + s into each lane j
// with j & s, and row i + s takes lane j + s of row i into each lane j without.
template <int kStage, int... kLane>
ATTNCORE_TARGET inline void transpose_stage(Vec (&r)[kLanes],
                                            std::integer_sequence<int, kLane...>) {
  for (int i = 0; i < kLanes; ++i) {
    if ((i & kStage) != 0) continue;
    const Vec a = r[i], b = r[i + kStage];
    r[i] =
        __builtin_shufflevector(a, b, ((kLane & kStage) != 0 ? kLanes + kLane - kStage : kLane)...);
    r[i + kStage] =
        __builtin_shufflevector(a, b, ((kLane & kStage) != 0 ? kLanes + kLane : kLane + kStage)...);
  }
}
ATTNCORE_TARGET inline void transpose_lanes(Vec (&r)[kLanes]) {
  static_assert(kLanes == 4 || kLanes == 8, "transpose_lanes: kLanes must be 4, 8 or 16");
  constexpr auto lanes = std::make_integer_sequence<int, kLanes>{};
  if constexpr (kLanes == 8) transpose_stage<4>(r, lanes);
  transpose_stage<2>(r, lanes);
  transpose_stage<1>(r, lanes);
}
#endif

// A key tile's rows transposed, kLanes keys x kLanes 32-bit columns at a time through
// registers: row c (c < keys; zeros for keys <= c < cols) starts at row(c) and has `width`
// columns of `per_column` input elements each; load(row, e0, n) reads its n columns from e0 as
// a Vec (zero past n); columns e of keys c0 .. c0 + kLanes - 1 go to store(e, c0, vector). Rows
// 32 keys on (row(c) for c < `ahead`: the next tile's too) are prefetched: packing K for decode
// from memory went twice as fast with it (AVX-512; the README has the figures).
template <class Row, class Load, class Store>
ATTNCORE_TARGET inline void transpose_keys(std::int64_t keys, std::int64_t cols, std::int64_t width,
                                           std::int64_t per_column, std::int64_t ahead, Row row,
                                           Load load, Store store) {
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
        if (c0 + 32 + i < ahead) __builtin_prefetch(row(c0 + 32 + i) + e0 * per_column);
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
ATTNCORE_TARGET inline Vec load_part(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
ATTNCORE_TARGET inline Vec load_part(const std::uint16_t* p, int n, DType dtype) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  if (dtype == DType::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
ATTNCORE_TARGET inline Vec load_part(const float* p, int n) {
  if (n == kLanes) return load(p);
  float x[kLanes] = {};
  for (int e = 0; e < n; ++e) x[e] = p[e];
  return load(x);
}
ATTNCORE_TARGET inline Vec load_part(const std::uint16_t* p, int n, DType dtype) {
#if ATTNCORE_LANES == 8
  // AVX2 (with F16C): one widening instruction per vector. (GCC 12 built bf16's generic
  // conversion below from four: AVX2 bf16 MHA decode read K/V at 52-54% of the probe, f16
  // 69%, 1 thread, Zen 4.)
  if (n == kLanes) {
    __m128i h;
    std::memcpy(&h, p, sizeof h);
    const __m256 x = dtype == DType::bf16
                         ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                         : _mm256_cvtph_ps(h);
    Vec v;
    std::memcpy(&v, &x, sizeof v);
    return v;
  }
#else
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
#endif
  float x[kLanes] = {};
  for (int e = 0; e < n; ++e)
    x[e] = dtype == DType::f16 ? f16::to_float(p[e]) : bf16::to_float(p[e]);
  return load(x);
}
#endif
// A row of the input's dtype (f32 or 16-bit) from element e0, n <= kLanes of them.
ATTNCORE_TARGET inline Vec load_part(const float* p, int n, DType) { return load_part(p, n); }

// dst [n] = src [n], a row of bf16 or f16 widened to f32 by load_part (exact: the values the
// flash kernels compute with): the math backend's copies of 16-bit operands (GemmTarget::widen).
ATTNCORE_TARGET inline void widen_row(const std::uint16_t* src, DType dtype, std::int64_t n,
                                      float* dst) {
  std::int64_t e = 0;
  if (dtype == DType::bf16) {
    for (; e + kLanes <= n; e += kLanes) store(dst + e, load_part(src + e, kLanes, DType::bf16));
  } else {
    for (; e + kLanes <= n; e += kLanes) store(dst + e, load_part(src + e, kLanes, DType::f16));
  }
  if (e < n) {
    float tail[kLanes];
    store(tail, load_part(src + e, static_cast<int>(n - e), dtype));
    std::memcpy(dst + e, tail, static_cast<std::size_t>(n - e) * sizeof(float));
  }
}

// dst [n] = src [n] rounded to bf16 or f16 (`dtype`), to nearest even: the bits of
// bf16::from_float and f16::from_float for every input (a NaN: bf16 quiets it keeping its
// payload's top bits, f16 gives the canonical quiet NaN with its sign), by whole vectors (f16
// by F16C on AVX2 and AVX-512; element by element, f16 prefill ran at 94.8 GFLOP/s against
// 100.7, Hq 8 L 2048 D 128, 1 thread, AVX-512, Zen 4).
ATTNCORE_TARGET inline void narrow_row(const float* src, DType dtype, std::int64_t n,
                                       std::uint16_t* dst) {
  using Bits = std::uint32_t __attribute__((vector_size(kLanes * sizeof(float))));
  using Halves = std::uint16_t __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
  auto narrow = [dtype](Vec x) ATTNCORE_TARGET {
    Bits u;
    std::memcpy(&u, &x, sizeof u);
    Halves h = {};
    if (dtype == DType::bf16) {
      const Bits rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const Bits quiet = (u >> 16) | 0x40u;
      return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded, Halves);
    }
#if ATTNCORE_LANES == 16 || ATTNCORE_LANES == 8
#if ATTNCORE_LANES == 16
    const __m256i f16c = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
#else
    const __m128i f16c = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
#endif
    std::memcpy(&h, &f16c, sizeof h);
    // F16C keeps a NaN's payload: the canonical quiet NaN instead. (The immediate's rounding,
    // to nearest even, ignores the caller's MXCSR rounding mode; FTZ does not apply.)
    using Mask = std::int16_t __attribute__((vector_size(kLanes * sizeof(std::uint16_t))));
    const Mask nan = __builtin_convertvector(x != x, Mask);
    const Halves canonical = __builtin_convertvector(((u >> 16) & 0x8000u) | 0x7e00u, Halves);
    return nan ? canonical : h;
#else
    for (int e = 0; e < kLanes; ++e) h[e] = f16::from_float(x[e]);
    return h;
#endif
  };
  std::int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    const Halves h = narrow(load(src + e));
    std::memcpy(dst + e, &h, sizeof h);
  }
  if (e < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, src + e, static_cast<std::size_t>(n - e) * sizeof(float));
    const Halves h = narrow(load(tail));
    std::memcpy(dst + e, &h, static_cast<std::size_t>(n - e) * sizeof(std::uint16_t));
  }
}

// dst [kTileCols] = src [0, n) as f32 (f32, or a 16-bit row widened as `dtype`, exact), 0 past n
// (n <= kTileCols; src not read, and may be null, where n = 0): one micro-tile column block of a
// packed operand, by whole vectors (element by element, f16 prefill, D 128, 1 thread, Zen 4:
// AVX2 Hq 4 L 1024 77.7 GFLOP/s against 87.1, AVX-512 Hq 8 L 2048 94.4 against 96.0).
template <class T>
ATTNCORE_TARGET inline void widen_cols(const T* src, std::int64_t n, DType dtype, float* dst) {
#pragma GCC unroll 4
  for (int x = 0; x < kTileVectors; ++x) {
    const int m = static_cast<int>(std::clamp<std::int64_t>(n - x * kLanes, 0, kLanes));
    store(dst + x * kLanes, m > 0 ? load_part(src + x * kLanes, m, dtype) : Vec{});
  }
}

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
