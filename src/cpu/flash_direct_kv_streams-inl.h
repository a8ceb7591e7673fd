// DirectKv's whole key tiles of one head read with the previous tile's P . V, so that K and V
// are read at once, for one SIMD target: as 4 sequential K streams, the scores of one row or a
// GQA group's rows (score_tile_streams), P . V run between their groups of keys (RowsProduct,
// which also runs between the groups of keys of several heads' scores:
// DirectKv::heads_with_product); or key by key, one row's (score_tile_paired), each key's P . V
// after its score. AVX2 reads one row as streams always; AVX-512 either way where the core's
// decode plan says (decode_plan.h). (The rest of the scores: flash_direct_kv_scores-inl.h.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/decode_plan.h"
#include "cpu/flash_direct_kv_heads-inl.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// Which tiles are read as streams, and their scores (DirectKvScores derives from it).
struct DirectKvStreams : DirectKvHeads {
  // The rows the in-place products compute for an item of `rows` rows: 1, 2, 4, kTileRows or
  // kDirectRows (the rows past `rows` have P = 0 and alpha = 1). Decode items have one row per
  // query head of the group: computing kTileRows rows for MHA's one row made P . V 8x the work it
  // is. GQA groups of 3-4 rows: 4 (GQA Hq=32 Hkv=8 Lk=16384, 1 thread, GB/s: bf16 17-18 with 4
  // against 14 with 8; f32, once each slice's V lines were all prefetched, % of the probe,
  // Lk=4096/16384, interleaved: [B, Hkv, L, D] 78/60 with 8 against 89/66 with 4 in one run of 5
  // passes, 59/56 against 63/60 in one of 3; [B, L, Hkv, D] and pages within 3 points either way).
  ATTNCORE_TARGET static int rows_computed(std::int64_t rows) {
    if (rows <= 2) return rows <= 1 ? 1 : 2;
    if (rows <= 4 && kTileRows > 4) return 4;
    return rows <= kTileRows ? kTileRows : kDirectRows;
  }

  // Whether score_tile_streams scores this tile: AVX2, or AVX-512 where the decode plan says
  // (one_row_streams) and the scores are not on bf16 pairs; one row of one head, a whole tile of
  // rows that lie together ([B, Hkv, L, D]), D a multiple of kLanes.
  ATTNCORE_TARGET static bool tile_streams(std::int64_t d, std::int64_t keys, std::int64_t heads,
                                           std::int64_t rows, bool pairs,
                                           const std::int64_t* k_at) {
    return (kLanes == 8 || (!pairs && decode_plan().one_row_streams)) && heads == 1 && rows == 1 &&
           d % kLanes == 0 && keys == kKeyTile && k_at[1] - k_at[0] == d;
  }

  // Whether score_tile_streams<R> scores this tile: R = rows_computed(rows) rows, 2 to 4, of
  // one head whose rows lie together, a whole tile, D a multiple of kLanes and at least R
  // kLanes (the scratch the lane sums take), not on bf16 pairs, where the decode plan says
  // (rows_streams).
  ATTNCORE_TARGET static bool tile_rows_streams(std::int64_t d, std::int64_t keys,
                                                std::int64_t heads, std::int64_t rows, bool pairs,
                                                const std::int64_t* k_at) {
    const int r = rows_computed(rows);
    return rows > 1 && r <= 4 && heads == 1 && !pairs && decode_plan().rows_streams &&
           d % kLanes == 0 && d >= r * kLanes && keys == kKeyTile && k_at[1] - k_at[0] == d;
  }

  // Whether score_heads_key_groups scores a tile of one row per head over several heads
  // ([B, L, Hkv, D], pages: MHA), or of a GQA group's 2 to 4 rows per head with 16-bit K and V,
  // with the previous tile's P . V between its groups of keys (DirectKv::heads_with_product):
  // AVX-512 where the decode plan says (heads_overlap, with heads_key_groups), not on bf16
  // pairs, D a multiple of kLanes, the partial sums within the scratch (as
  // DirectKvScores::scores takes them).
  ATTNCORE_TARGET static bool heads_key_groups_overlap(std::int64_t d, std::int64_t heads,
                                                       std::int64_t rows, bool pairs, DType dtype) {
    const DecodePlan& plan = decode_plan();
    const std::int64_t r = rows_computed(rows);
    return kLanes == 16 && plan.heads_overlap &&
           plan.heads_key_groups(dtype == DType::f32 ? 4 : 2) && heads > 1 &&
           (rows == 1 || (r <= 4 && dtype != DType::f32)) && !pairs && d % kLanes == 0 &&
           heads * (r * kLanes * kLanes + d / 2) <= d * kKeyTile;
  }

  // Whether score_tile_paired scores this tile with the previous one's P . V: AVX-512 where the
  // decode plan says (one_row_paired); one row of one head, a whole tile whose first rows lie
  // together ([B, Hkv, L, D], or a page of it: the rows are read through k_at), D a multiple of
  // kLanes (of 2 * kLanes on bf16 pairs), Dv of kPairedVectors vectors (128: each output vector
  // a register of its own, no test per key; other sizes read as before).
  static constexpr int kPairedVectors = 8;
  ATTNCORE_TARGET static bool tile_paired(std::int64_t d, std::int64_t dv, std::int64_t keys,
                                          std::int64_t heads, std::int64_t rows, bool pairs,
                                          const std::int64_t* k_at) {
    return kLanes == 16 && decode_plan().one_row_paired && heads == 1 && rows == 1 &&
           d % (pairs ? 2 * kLanes : kLanes) == 0 && dv == kPairedVectors * kLanes &&
           keys == kKeyTile && k_at[1] - k_at[0] == d;
  }

  // One row of one head against a whole key tile (s [kKeyTile]), key by key, each key's score
  // followed by the previous tile's product of the same key (its P in `probs`, which may be s
  // itself: each P is read before that key's score is written), so that K and V are read as one
  // sequential stream each, at once: out [kPairedVectors * kLanes] (scaled by the previous
  // tile's alpha) += P [pv_keys] . V, in registers.
  // Each score is score_keys' (score_keys_pairs' with `q_pairs`, the query as bf16 pairs, d / 2
  // floats): one accumulator over the key's vectors in order, summed across lanes by
  // reduce_sum, which is reduce_sums' lane for the key; each output element takes its keys in
  // order as accumulate<T, 1> does: the same bits.
  // Zen 5, MHA Hq = Hkv = 32, D = 128, Lk = 16384, 1 thread, in one process with 256 MiB read
  // before each call: a scratch loop of this order read 0.96-1.06 of a plain read of the same
  // K and V (8 accumulators, one stream), where a tile's scores and then its P . V read 0.87-0.95
  // and 2 to 16 keys of K then as many of V 0.74-0.93; its scores in one accumulator per key,
  // each key's sum kept for reduce_sums at the end of the tile (stored): 0.75-0.78, summed by
  // reduce_sum at once: 0.91; its outputs through memory key by key: 0.94 of them in registers.
  // K and V rows are prefetched kPairedLeadBytes of each ahead (of the rows known: k_ahead and
  // v_ahead, TileRows::count), into L1. The same A/B in the library against the plan before (a
  // tile's scores, then its P . V), median speed ratio of 11 rounds, Lk = 4096/16384: f32 (4 keys
  // ahead) 1.17/1.16, f16 (8 keys) 1.15/1.11, bf16 on pairs 1.00/1.01, where the order with no
  // prefetch gave f32 1.05-1.09, f16 1.02-1.03, bf16 0.93-0.98 (4 KiB ahead: f32 1.13-1.16, f16
  // 1.10-1.12, bf16 0.97-0.98; 16-bit 1 KiB: f16 1.02-1.09, bf16 0.92-0.94; K alone 8 keys 0.97,
  // V alone 1.02).
  static constexpr std::int64_t kPairedLeadBytes = 2048;
  static constexpr std::int64_t paired_lead(std::int64_t row_bytes) {
    return std::clamp<std::int64_t>(kPairedLeadBytes / row_bytes, 1, kRowLead);
  }
  template <bool kPairs, class T, class Known>
  ATTNCORE_TARGET static void score_tile_paired(const T* k, const std::int64_t* k_at,
                                                std::int64_t k_ahead, std::int64_t d, Known known,
                                                const float* q,
                                                [[maybe_unused]] const float* q_pairs, float* s,
                                                const T* v, const std::int64_t* v_at,
                                                std::int64_t v_ahead, std::int64_t pv_keys,
                                                const float* probs, float* out) {
    Vec o[kPairedVectors];
#pragma GCC unroll 8
    for (int x = 0; x < kPairedVectors; ++x) o[x] = load(out + x * kLanes);
    constexpr std::int64_t kDv = kPairedVectors * kLanes;
    const std::int64_t k_lead = paired_lead(d * static_cast<std::int64_t>(sizeof(T)));
    const std::int64_t v_lead = paired_lead(kDv * static_cast<std::int64_t>(sizeof(T)));
    for (int j = 0; j < kKeyTile; ++j) {
      const T* row = k + k_at[j];
      if (j + k_lead < k_ahead) prefetch_lines<3>(k + k_at[j + k_lead], d);
      if (j + v_lead < v_ahead) prefetch_lines<3>(v + v_at[j + v_lead], kDv);
      Vec acc = {};
#if ATTNCORE_BF16_DOT
      if constexpr (kPairs) {
        __m512 sum = acc;
        const auto step = [&](std::int64_t e0) ATTNCORE_TARGET {
          const __m512i qv = _mm512_loadu_si512(q_pairs + e0 / 2);
          const __m512i kv = _mm512_loadu_si512(row + e0);
          sum = _mm512_dpbf16_ps(sum, reinterpret_cast<const __m512bh&>(qv),
                                 reinterpret_cast<const __m512bh&>(kv));
        };
        if (d == kPairedVectors * kLanes) {
#pragma GCC unroll 4
          for (int e0 = 0; e0 < kPairedVectors * kLanes; e0 += 2 * kLanes) step(e0);
        } else {
          for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) step(e0);
        }
        acc = sum;
      } else
#endif
      if (d == kPairedVectors * kLanes) {
#pragma GCC unroll 8
        for (int e0 = 0; e0 < kPairedVectors * kLanes; e0 += kLanes) {
          acc = fmadd(load(q + e0), load_part(row + e0, kLanes, known), acc);
        }
      } else {
        for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
          acc = fmadd(load(q + e0), load_part(row + e0, kLanes, known), acc);
        }
      }
      if (j < pv_keys) {
        const T* v_row = v + v_at[j];
        const Vec weight = splat(probs[j]);
#pragma GCC unroll 8
        for (int x = 0; x < kPairedVectors; ++x) {
          o[x] = fmadd(weight, load_part(v_row + x * kLanes, kLanes, known), o[x]);
        }
      }
      s[j] = reduce_sum(acc);
    }
#pragma GCC unroll 8
    for (int x = 0; x < kPairedVectors; ++x) store(out + x * kLanes, o[x]);
  }

  // The scores of R rows (q [R][d]: one row, or a GQA group's) against a whole key tile of one
  // head (s [R][kKeyTile]), the keys at k + k_at[c], kStreams keys kKeyTile / kStreams apart at
  // a time: each of their rows read in order with one query load per row for all of them (each
  // K vector loaded once for the R rows), so that K is read as kStreams sequential streams,
  // which the hardware prefetcher follows with no software prefetch (rows of one head lying
  // together, [B, Hkv, L, D]). Each (row, key) lane sum is formed as score_keys and score_rows
  // form it (one accumulator per key over its vectors in order), then summed by reduce_sums over
  // `parts` (R * kKeyTile * kLanes floats): the same bits.
  // One row, AVX2, MHA f32 decode, Zen 3, 1 thread, % of the probe, Lk=16384, four runs of 3
  // interleaved passes against score_keys' blocks of kLanes adjacent keys with K prefetched 6
  // and 12 KiB ahead: 74, 75, 78, 71 -> 83, 82, 80, 83 (2 streams 74-84, 8 streams 81-83);
  // bf16 63, 61, 66, 64 -> 67, 64, 67, 62, f16 66, 66, 66, 65 -> 73, 66, 66, 66; score_keys
  // without its prefetches 53. (GQA f32 there, each row's scores so: 49-57 -> 45-54; a group's
  // at once, on the Intel Xeon: decode_plan.cpp.)
  // With `between`, between(kStreams * j, kStreams) runs after the j-th group of keys (the
  // previous tile's P . V: RowsProduct), so that V is read as K is; s is
  // written after the last group, so `between` may read the previous tile's P from it.
  template <int R, class T, class Known, class Between = NoWork>
  ATTNCORE_TARGET static void score_tile_streams(const T* k, const std::int64_t* k_at,
                                                 std::int64_t d, Known dtype, const float* q,
                                                 float* s, float* parts,
                                                 const Between& between = {}) {
    constexpr int kStreams = 4;
    constexpr int kSpan = kKeyTile / kStreams;
    for (int j = 0; j < kSpan; ++j) {
      const T* row[kStreams];
      Vec acc[R][kStreams];
#pragma GCC unroll 8
      for (int i = 0; i < kStreams; ++i) {
        row[i] = k + k_at[j + i * kSpan];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][i] = Vec{};
      }
      for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
        Vec qv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) qv[r] = load(q + r * d + e0);
#pragma GCC unroll 8
        for (int i = 0; i < kStreams; ++i) {
          const Vec kv = load_part(row[i] + e0, kLanes, dtype);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][i] = fmadd(qv[r], kv, acc[r][i]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int i = 0; i < kStreams; ++i) {
          store(parts + (r * kKeyTile + j + i * kSpan) * kLanes, acc[r][i]);
        }
      }
      between(kStreams * j, kStreams);
    }
    for (int r = 0; r < R; ++r) {
      for (int c0 = 0; c0 < kKeyTile; c0 += kLanes) {
        Vec t[kLanes];
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) t[j] = load(parts + (r * kKeyTile + c0 + j) * kLanes);
        store(s + r * kKeyTile + c0, reduce_sums(t));
      }
    }
  }
};

// The P . V of R rows (1, 2 or 4: one row, a GQA group's rows, or one head's row of several
// heads) over a tile's keys c < keys, run a few keys at a time between the next tile's scores
// (score_tile_streams, score_heads_key_groups: K and V then read as concurrent streams): out
// [R][out_stride] += P [R][kKeyTile] . V, out already scaled by each row's alpha. Each group of
// keys' V vectors are loaded (and widened) once for the R rows, and each row's output vector
// takes the group's keys in order through one register: the products of accumulate<T, R> in
// the same order, the same bits. Dv a multiple of kLanes. (One row's through memory key by key
// instead, as a separate kernel did: from L2, Hq = Hkv = 4, Lk = 512, on the Intel Xeon, bf16
// took 1.13-1.15x the time on avx512 and avx2, f16 1.07-1.17x, f32 the same; from memory, MHA
// [B, Hkv, L, D], Lk = 16384, in-process A/B: 0.97-1.04 on either target.)
template <class T, class Known, int R, int kLocality = 3>
struct RowsProduct {
  const T* v;  // V rows: key c at v + at[c]
  const std::int64_t* at;
  std::int64_t keys;
  const float* probs;  // [R][kKeyTile]: P
  float* out;          // [R][out_stride]
  std::int64_t dv, out_stride;
  std::int64_t ahead;  // rows known: at[c] for c < ahead (TileRows::count)
  // V rows prefetched `lead` keys ahead (where `ahead` allows: none with `ahead` 0), into L1
  // (kLocality 3) or L2 (2): one head's rows (one row, a GQA group's), kLead keys into L1;
  // several heads' 16-bit rows, DirectKv::heads_overlap_lead keys into L2. (The level a constant:
  // as a field, tested per key, MHA 16-bit [B, Hkv, L, D] decode read 0.97 of it on the Xeon.)
  std::int64_t lead = kLead;
  // One row, Zen 3, 1 thread, % of the probe, Lk=16384, five runs of 5 interleaved passes
  // (scratch harness), none / 8 / 16 keys: f32 88-102 / 90-101 / 91-100, bf16 70-85 / 76-95 /
  // 77-89, f16 72-85 / 81-96 / 79-90 (means: bf16 77 / 86 / 83, f16 80 / 87 / 84; into L2, one
  // run of 3 passes: 32 keys bf16 73-86, f16 79-85, 64 keys 79-93, 82-98).
  static constexpr std::int64_t kLead = 8;
  static constexpr int kMaxKeys = 4;  // keys per call (score_tile_streams' groups)
  // A GQA group's rows prefetch their keys' V line by line through the products, each
  // key's line of a step after one row's product of it (prefetch_after), instead of each key's
  // whole row before them. Intel Xeon, Hq = 32, Hkv = 8, 1 thread, bench --decode against the
  // commit before, separate processes in turn, 3 rounds, median ratio, Lk = 4096/16384: bf16
  // [B, Hkv, L, D] 1.03/1.04, [B, L, Hkv, D] 1.05/1.08, p256 1.05/1.04, p16 1.03/0.97; f16
  // 0.99/1.01, 1.02/1.07, 1.00/1.05, 1.02/1.01; f32 [B, Hkv, L, D] 1.02/1.05 (in an earlier
  // run bf16 [B, Hkv, L, D] 1.06/1.06, p16 0.96-0.97). Not spread: one row's (MHA, also with
  // its K spread in score_heads_key_groups: 16-bit pages 0.93-1.00), nor a group's K over
  // several heads (0.94-1.00 against each key's line of a step at once), nor f32 groups' K in
  // score_rows (0.99-1.04). Measured for groups of 3-4 rows (R = 4) on AVX-512 only, and rows
  // of whole lines (Dv * element size a multiple of 64 bytes: each line's slot lies within the
  // row); otherwise each key's whole row is prefetched before the products (prefetch_lines).
  static constexpr bool kSpread = R == 4 && kLanes == 16;
  static constexpr int kStepBytes = kLanes * sizeof(T) < 64 ? kLanes * sizeof(T) : 64;
  static constexpr int kStepsPerLine = 64 / kStepBytes;
  ATTNCORE_TARGET __attribute__((always_inline)) void operator()(std::int64_t c0,
                                                                 std::int64_t n) const {
    const std::int64_t count =
        std::clamp<std::int64_t>(keys - c0, 0, std::min<std::int64_t>(n, kMaxKeys));
    if (count == kMaxKeys) return products(c0, std::integral_constant<int, kMaxKeys>{});
    products(c0, count);
  }
  // The products of keys c0 .. c0 + count - 1 (count a constant for whole groups: no test per
  // key), the fields and weights read into locals first (the stores to out would otherwise
  // make the compiler read them again after each).
  template <class Count>
  ATTNCORE_TARGET __attribute__((always_inline)) void products(std::int64_t c0, Count count) const {
    const std::int64_t d = dv, stride = out_stride;
    float* const o = out;
    const T* row[kMaxKeys] = {};
    float w[R][kMaxKeys] = {};
    // The rows lead keys on where the products spread their prefetches, else null: the loop
    // tests kSpread, a constant, and the row (with `spread` tested there as well, GQA 16-bit
    // [B, Hkv, L, D] decode, Lk = 16384, read 0.96-0.97 of what it read without; 7 rounds of
    // bench --decode in turn, the Intel Xeon).
    const T* next[kMaxKeys] = {};
    const bool spread = kSpread && d * static_cast<std::int64_t>(sizeof(T)) % 64 == 0;
#pragma GCC unroll 4
    for (int c = 0; c < kMaxKeys; ++c) {
      if (c < count) {
        if (c0 + c + lead < ahead) {
          if (spread) {
            next[c] = v + at[c0 + c + lead];
          } else {
            prefetch_lines<kLocality>(v + at[c0 + c + lead], d);
          }
        }
        row[c] = v + at[c0 + c];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) w[r][c] = probs[r * kKeyTile + c0 + c];
      }
    }
    for (std::int64_t e = 0; e < d; e += kLanes) {
      Vec vv[kMaxKeys] = {};
#pragma GCC unroll 4
      for (int c = 0; c < kMaxKeys; ++c) {
        if (c < count) vv[c] = load_part(row[c] + e, kLanes, Known{});
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        Vec acc = load(o + r * stride + e);
#pragma GCC unroll 4
        for (int c = 0; c < kMaxKeys; ++c) {
          if (c < count) {
            acc = fmadd(splat(w[r][c]), vv[c], acc);
            // Key c's line of this step, once per line: after row c % R's product of it.
            if (kSpread && c % R == r && next[c] != nullptr &&
                (e * static_cast<std::int64_t>(sizeof(T))) % 64 ==
                    c * kStepsPerLine / kMaxKeys * kStepBytes) {
              prefetch_after<kLocality>(next[c] + e, acc);
            }
          }
        }
        store(o + r * stride + e, acc);
      }
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
