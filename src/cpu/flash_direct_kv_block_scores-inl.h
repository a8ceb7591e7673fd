// DirectKv's scores against one block of keys, for one SIMD target: one row, a group's rows
// (score_rows), or a bf16 query's pairs, K read where it lies and widened in registers; the
// tiles' scores that call them: DirectKvScores (flash_direct_kv_scores-inl.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/params.h"
#include "cpu/decode_plan.h"
#include "cpu/flash_direct_kv_streams-inl.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// The scores of DirectKv items against a block of at most kLanes keys: one row, a group's rows,
// or one row per head (a block for each head in turn: score_block).
struct DirectKvBlockScores : DirectKvStreams {
  // The scores of one row against keys c0 .. c0 + block - 1 (block <= kLanes) of `k` (rows ldk
  // apart) into s[0 .. kLanes): one accumulator per key, in registers, summed across lanes by
  // reduce_sums (0 for keys past block; a transpose and a sum instead ran bf16 decode at 63-66%
  // of the read probe against 80-81%, [B, Hkv, L, D] Lk=16384, 1 thread). Full blocks test nothing
  // per load: with a test per key GCC 12 kept the accumulators on the stack (f32 decode, 1 thread:
  // 20-21 GB/s against 22-23 before).
  // f32 rows of whole vectors (D a multiple of kLanes) test nothing per load: MHA decode [B, Hkv,
  // L, D] 1 thread, % of the probe, Lk=4096/16384: f32 80/78 against 73/74 with the test; 16-bit
  // rows ran slower that way on AVX-512 (bf16 72/71 against 79/81), and faster on AVX2, where
  // they are widened as their known dtype (Zen 3: bf16 MHA from L3 about 13 -> 15 GB/s). (On
  // AVX2, MHA [B, Hkv, L, D]'s whole tiles go through score_tile_streams instead: here only its
  // last tile.)
  template <bool kFull, class T>
  ATTNCORE_TARGET __attribute__((noinline)) static void score_keys(const T* k, std::int64_t ldk,
                                                                   DType dtype, std::int64_t d,
                                                                   std::int64_t block,
                                                                   const float* q, float* s) {
    using Whole = std::true_type;
    if (d % kLanes == 0 && sizeof(T) == 4) {
      return score_keys_as<kFull, Whole>(k, ldk, F32{}, d, block, q, s);
    }
    if constexpr (sizeof(T) == 2 && kLanes == 8) {
      if (d % kLanes == 0 && dtype == DType::f16) {
        return score_keys_as<kFull, Whole>(k, ldk, F16{}, d, block, q, s);
      }
      if (d % kLanes == 0) {
        return score_keys_as<kFull, Whole>(k, ldk, Bf16{}, d, block, q, s);
      }
    }
    score_keys_as<kFull, std::false_type>(k, ldk, dtype, d, block, q, s);
  }
  // score_keys' loop: D a multiple of kLanes (Whole) or not, the dtype a constant (an
  // integral_constant: no test per load) or `dtype`, tested per load. (The accumulators are
  // this function's own: with their address taken, as by a lambda's capture, GCC 12 kept them
  // on the stack.)
  template <bool kFull, class Whole, class T, class Known>
  ATTNCORE_TARGET __attribute__((always_inline)) static inline void score_keys_as(
      const T* k, std::int64_t ldk, Known dtype, std::int64_t d, std::int64_t block, const float* q,
      float* s) {
    Vec acc[kLanes] = {};
    for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
      const int n =
          Whole::value ? kLanes : static_cast<int>(std::min<std::int64_t>(kLanes, d - e0));
      const Vec qv = load_part(q + e0, n);
      const T* at = k + e0;
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) {
        if (kFull || j < block) acc[j] = fmadd(qv, load_part(at + j * ldk, n, dtype), acc[j]);
      }
    }
    // (Summed in a copy: with acc's address taken, GCC 12 stored every accumulator to the
    // stack at each step of the loop above.)
    Vec t[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) t[j] = acc[j];
    store(s, reduce_sums(t));
  }
#if ATTNCORE_BF16_DOT
  // score_keys for a bf16 query against bf16 K (AVX512-BF16): q . k on vdpbf16ps, a pair of
  // elements per lane and instruction (the query's f32 copy holds bf16 values, so rounding it
  // back to bf16 pairs is exact), the keys' rows at k + at[j] (any spacing: pages, so paged and
  // dense give the same bits). Each lane adds its pairs' products with a rounding after each
  // (the instruction's own order): the scores differ in the last bits from the f32 path's,
  // within the oracle's tolerance. A quarter of the instructions of widening K: bench --decode,
  // 1 thread, % of the probe, Lk=4096/16384, interleaved: MHA [B, Hkv, L, D] 69/70 -> 75/75,
  // GQA (Hkv=8) 56/53 -> 65/59; [B, L, Hkv, D] MHA unchanged (57-60).
  template <bool kFull>
  ATTNCORE_TARGET __attribute__((noinline)) static void score_keys_pairs(const std::uint16_t* k,
                                                                         const std::int64_t* at,
                                                                         std::int64_t d,
                                                                         std::int64_t block,
                                                                         const float* q, float* s) {
    __m512 acc[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
    for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {
      const int n = static_cast<int>(std::min<std::int64_t>(2 * kLanes, d - e0));
      const __m512bh qv = _mm512_cvtne2ps_pbh(load_part(q + e0 + kLanes, std::max(n - kLanes, 0)),
                                              load_part(q + e0, std::min(n, kLanes)));
      const __mmask32 mask = n == 2 * kLanes ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) {
        if (kFull || j < block) {
          const __m512i kv = _mm512_maskz_loadu_epi16(mask, k + at[j] + e0);
          acc[j] = _mm512_dpbf16_ps(acc[j], qv, reinterpret_cast<const __m512bh&>(kv));
        }
      }
    }
    Vec t[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) t[j] = acc[j];
    store(s, reduce_sums(t));
  }
#endif

  // The scores of R rows (q rows d apart; rows past the item's are zero) against the block's
  // keys c < block, at k + at[c], into s[r * kKeyTile + c] for c < kLanes (0 past block): a
  // group of keys at a time, each K vector loaded (widened) once for the R rows, every (row,
  // key) lane sum in its own register, formed in score_keys' order and summed across lanes by
  // reduce_sums' stages (put_group and sum_groups over `parts`, R * kLanes * kLanes floats):
  // the same bits. Keys past
  // block read key c0's row and their scores are then set to 0; a block of no keys reads
  // nothing. GQA Hq=32 Hkv=8
  // decode, 1 thread, % of the probe, Lk=4096/16384, 5 interleaved passes, against one key at
  // a time with each row's q loaded per product: f16 [B, Hkv, L, D] 61/58 -> 64/62, [B, L, Hkv,
  // D] 43/54 -> 51/58, p16 53/49 -> 57/53; f32 from cache (Lk=1024) 54-56 -> 58-59 GB/s, from
  // memory within noise.
  // A group is kLanes / R keys (kLanes accumulators), but 3 keys for 4 rows on AVX2 (groups of
  // 3, 3 and 2): 12 chains of multiply-adds in flight instead of 8, where 8 barely cover the
  // FMA's latency at two a cycle. Zen 3, a standalone copy of the loop, 4 rows' f32 scores from
  // L1, TSC ticks per key: 39-51 -> 23-27 (64 multiply-adds at two a cycle: ~25); whole decode,
  // Hq=32 Hkv=8, 1 thread, the two alternating call by call in one process, median speed ratio
  // of 9-11 rounds, Lk=16384 (4096 for pages): bf16 [B, Hkv, L, D] 1.04, [B, L, Hkv, D] 1.05,
  // p16 1.07; f16 [B, Hkv, L, D] 1.04, p16 1.06; f32 [B, L, Hkv, D] 1.02, p16 1.06.
  // With lead > 0, the rows `lead` keys on, of those known (at[c] for c < ahead), are
  // prefetched into L2: on AVX2 each group of keys' before it, on AVX-512 each line as the
  // products read the same line of their key's row (DecodePlan::group_k_spread).
  template <int R, class T>
  ATTNCORE_TARGET __attribute__((noinline)) static void score_rows(
      const T* k, const std::int64_t* at, std::int64_t block, DType dtype, std::int64_t d,
      const float* q, float* s, float* parts, std::int64_t lead, std::int64_t ahead) {
    constexpr int kKeys = kLanes == 8 && R == 4 ? 3 : kLanes / R > 0 ? kLanes / R : 1;
    constexpr int kLast = kLanes % kKeys;  // keys of a last, smaller group (0: none)
    // A block of no keys (past the tile's last) reads nothing: `k` itself is no row of the
    // sequence, and in a page pool it is page 0, which another sequence, or none, may hold.
    if (block <= 0) return clear_past(0, R, s);
    const bool into_l1 = R > 2 && decode_plan().group_k_into_l1;  // (2 rows: into L2)
    // Whole vectors (D a multiple of kLanes) test nothing per load, and 16-bit K is widened as
    // its known dtype, with d and q in registers (with the dtype tested per load and both read
    // from the lambda's captures in the loop, GQA f16 decode, 1 thread, % of the probe,
    // Lk=4096/16384, 7 interleaved passes: [B, Hkv, L, D] 63/63 against 68/67, [B, L, Hkv, D]
    // 58/58 against 62/62, p16 57/52 against 62/54).
    // The G keys from key j0 on.
    auto group = [&](auto keys_in_group, int j0, auto whole, auto known) ATTNCORE_TARGET {
      constexpr int G = decltype(keys_in_group)::value;
      const std::int64_t dd = d, lead_keys = lead, known_keys = ahead;
      const bool k_into_l1 = into_l1;
      const float* qq = q;
      const T* row[G];
      const T* next[G];  // the rows lead_keys on, or null
      group_rows(k, at, j0, block, lead_keys, known_keys, row, next);  // (block > 0 here)
      for (int j = 0; kLanes == 8 && j < G; ++j) {
        if (next[j] != nullptr) prefetch_lines<2>(next[j], dd);
      }
      Vec acc[R][G];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j) acc[r][j] = Vec{};
      }
      for (std::int64_t e0 = 0; e0 < dd; e0 += kLanes) {
        const int n = decltype(whole)::value
                          ? kLanes
                          : static_cast<int>(std::min<std::int64_t>(kLanes, dd - e0));
        Vec qv[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) qv[r] = load_part(qq + r * dd + e0, n);
        if (kLanes == 16 && (e0 * static_cast<std::int64_t>(sizeof(T))) % 64 == 0) {
#pragma GCC unroll 16
          for (int j = 0; j < G; ++j) {
            if (next[j] != nullptr) prefetch_line(next[j] + e0, k_into_l1);
          }
        }
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j) {
          const Vec kv = load_part(row[j] + e0, n, decltype(known)::value);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[r][j] = fmadd(qv[r], kv, acc[r][j]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) put_group<G>(acc[r], j0, parts + r * kLanes * kLanes);
    };
    auto keys = [&](auto whole, auto known) ATTNCORE_TARGET {
      for (int j0 = 0; j0 + kKeys <= kLanes; j0 += kKeys) {
        group(std::integral_constant<int, kKeys>{}, j0, whole, known);
      }
      if constexpr (kLast > 0) {
        group(std::integral_constant<int, kLast>{}, kLanes - kLast, whole, known);
      }
    };
    auto with_known = [&](auto whole) ATTNCORE_TARGET {
      if constexpr (sizeof(T) == 2) {
        if (dtype == DType::f16) return keys(whole, F16{});
        return keys(whole, Bf16{});
      } else {
        keys(whole, F32{});
      }
    };
    if (d % kLanes == 0) {
      with_known(std::true_type{});
    } else {
      with_known(std::false_type{});
    }
    sum_groups<kKeys>(parts, R, kKeyTile, s);
    clear_past(block, R, s);
  }
#if ATTNCORE_BF16_DOT
  // score_rows on bf16 pairs (AVX512-BF16, as score_keys_pairs): q_pairs [R][d / 2], the rows'
  // queries as bf16 pairs; D a multiple of 2 * kLanes. Each (row, key) lane sum is formed as
  // score_keys_pairs forms it: the same bits. K rows `lead` keys on prefetched line by line as
  // score_rows prefetches them (Zen 4, GQA Hq=32 Hkv=8 Lk=16384, 1 thread, 9 rounds in turn
  // against a burst per block before the scores: [B, L, Hkv, D] 1.05, p16 1.03 in separate
  // processes, 1.02-1.03 in one). GQA Hq=32 Hkv=8 bf16 decode, 1 thread, % of the
  // probe, Lk=4096/16384, 5 interleaved passes, against score_keys_pairs row by row: [B, L,
  // Hkv, D] 50/60 -> 57/65, p16 60/55 -> 66/58, [B, Hkv, L, D] equal (71/70).
  template <int R>
  ATTNCORE_TARGET __attribute__((noinline)) static void score_rows_pairs(
      const std::uint16_t* k, const std::int64_t* at, std::int64_t block, std::int64_t d,
      const float* q_pairs, float* s, float* parts, std::int64_t lead, std::int64_t ahead) {
    constexpr int kKeys = kLanes / R > 0 ? kLanes / R : 1;
    static_assert(kLanes % kKeys == 0, "whole groups of keys in a block");
    if (block <= 0) return clear_past(0, R, s);  // (no key: nothing read, as score_rows)
    const bool into_l1 = R > 2 && decode_plan().group_k_into_l1;  // (2 rows: into L2)
    for (int j0 = 0; j0 < kLanes; j0 += kKeys) {
      const std::uint16_t* row[kKeys];
      const std::uint16_t* next[kKeys];  // the rows `lead` keys on, or null (as score_rows)
      group_rows(k, at, j0, block, lead, ahead, row, next);  // (block > 0 here)
      __m512 acc[R][kKeys];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) acc[r][j] = _mm512_setzero_ps();
      }
      for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {  // (one 64-byte line of each row)
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          if (next[j] != nullptr) prefetch_line(next[j] + e0, into_l1);
        }
        __m512i qv[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_si512(q_pairs + r * (d / 2) + e0 / 2);
#pragma GCC unroll 16
        for (int j = 0; j < kKeys; ++j) {
          const __m512i kv = _mm512_loadu_si512(row[j] + e0);
#pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], reinterpret_cast<const __m512bh&>(qv[r]),
                                         reinterpret_cast<const __m512bh&>(kv));
          }
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) put_group<kKeys>(acc[r], j0, parts + r * kLanes * kLanes);
    }
    sum_groups<kKeys>(parts, R, kKeyTile, s);
    clear_past(block, R, s);
  }
#endif
  // Scores of keys block <= c < kLanes of `count` rows (kKeyTile apart) set to 0.
  ATTNCORE_TARGET static void clear_past(std::int64_t block, std::int64_t count, float* s) {
    if (block >= kLanes) return;
    for (std::int64_t r = 0; r < count; ++r) {
      std::fill(s + r * kKeyTile + std::max<std::int64_t>(block, 0), s + r * kKeyTile + kLanes,
                0.0f);
    }
  }
  // score_rows (score_rows_pairs with q_pairs) for the rows the products compute; score_rows
  // prefetches `lead` keys on with lead > 0 (rows at[c] known for c < ahead).
  template <class T>
  ATTNCORE_TARGET static void score_block_rows(const T* k, const std::int64_t* at,
                                               std::int64_t block, DType dtype, std::int64_t d,
                                               const float* q,
                                               [[maybe_unused]] const float* q_pairs,
                                               std::int64_t rows, float* s, float* parts,
                                               std::int64_t lead, std::int64_t ahead) {
#if ATTNCORE_BF16_DOT
    if constexpr (sizeof(T) == 2) {
      if (q_pairs != nullptr) {
        switch (rows_computed(rows)) {
          case 2:
            return score_rows_pairs<2>(k, at, block, d, q_pairs, s, parts, lead, ahead);
          case 4:
            if constexpr (kTileRows > 4)
              return score_rows_pairs<4>(k, at, block, d, q_pairs, s, parts, lead, ahead);
            [[fallthrough]];
          default:
            return score_rows_pairs<kTileRows>(k, at, block, d, q_pairs, s, parts, lead, ahead);
        }
      }
    }
#endif
    if (rows <= 2) return score_rows<2>(k, at, block, dtype, d, q, s, parts, lead, ahead);
    if constexpr (kTileRows > 4) {
      if (rows <= 4) return score_rows<4>(k, at, block, dtype, d, q, s, parts, lead, ahead);
    }
    if constexpr (kDirectRows > kTileRows) {
      if (rows > kTileRows) {
        return score_rows<kDirectRows>(k, at, block, dtype, d, q, s, parts, lead, ahead);
      }
    }
    score_rows<kTileRows>(k, at, block, dtype, d, q, s, parts, lead, ahead);
  }
  template <class T>
  ATTNCORE_TARGET static void score_block(const T* k, std::int64_t ldk, DType dtype, std::int64_t d,
                                          std::int64_t block, const float* q, float* s) {
    if (block == kLanes) {
      score_keys<true>(k, ldk, dtype, d, block, q, s);
    } else {
      score_keys<false>(k, ldk, dtype, d, block, q, s);
    }
  }

  // fn(known) with K's dtype (T's, or for 16-bit `dtype`) as a constant: no test per load.
  template <class T, class Fn>
  ATTNCORE_TARGET static void with_known(DType dtype, const Fn& fn) {
    if constexpr (sizeof(T) == 4) {
      fn(F32{});
    } else if (dtype == DType::f16) {
      fn(F16{});
    } else {
      fn(Bf16{});
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
