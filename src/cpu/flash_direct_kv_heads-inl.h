// DirectKv's scores of one row per head across several kv heads, for one SIMD target: MHA
// decode where a key's row holds every head ([B, L, Hkv, D], pages), K read in address order,
// key by key (AVX2 and Intel's cores: a few keys at a time, also for a GQA group's rows per
// head) (flash_direct_kv_scores-inl.h holds the rest of the scores); and their P . V key by key
// (accumulate_by_key); and a GQA group's rows' scores key by key (score_rows_by_key).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/params.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// A dtype as a constant, for load_part's `known` argument: no test per load.
using F32 = std::integral_constant<DType, DType::f32>;
using F16 = std::integral_constant<DType, DType::f16>;
using Bf16 = std::integral_constant<DType, DType::bf16>;

// Nothing to run between the groups of keys of score_tile_streams or score_heads_key_groups.
struct NoWork {
  template <class... Args>
  ATTNCORE_TARGET void operator()(Args...) const {}
};

// The scores of one row per head: a base of DirectKvScores (flash_direct_kv_scores-inl.h).
struct DirectKvHeads {
  // The scores of `count` rows from their partial sums: parts [count][kLanes keys][kLanes]
  // lanes into s[x * stride .. + kLanes) for row x, each key's lanes summed by reduce_sums.
  ATTNCORE_TARGET static void sum_parts(const float* parts, std::int64_t count, std::int64_t stride,
                                        float* s) {
    for (std::int64_t x = 0; x < count; ++x) {
      Vec t[kLanes];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) t[j] = load(parts + (x * kLanes + j) * kLanes);
      store(s + x * stride, reduce_sums(t));
    }
  }

  // The rows of a group of G keys of a block (from key j0; keys past `block` read key 0's row,
  // none where the block has no key) and the rows `lead` keys on (null past `ahead`, the rows
  // resolved, or with no lead), for the key groups below.
  template <int G, class T>
  ATTNCORE_TARGET __attribute__((always_inline)) static inline void group_rows(
      const T* k, const std::int64_t* at, int j0, std::int64_t block, std::int64_t lead,
      std::int64_t ahead, const T* (&row)[G], const T* (&next)[G]) {
#pragma GCC unroll 8
    for (int j = 0; j < G; ++j) {
      row[j] = j0 + j < block ? k + at[j0 + j] : block > 0 ? k + at[0] : nullptr;
      next[j] = lead > 0 && j0 + j + lead < ahead ? k + at[j0 + j + lead] : nullptr;
    }
  }

  // The same from sums formed a group of G keys at a time (G divides kLanes): put_group keeps one
  // row's lane sums of keys j0 .. j0 + G - 1 (j0 a multiple of G) in that row's parts
  // (kLanes * kLanes floats), as reduce_group's one vector at slot j0 / G (AVX2: each key's
  // lane sums at slot j0 + j, as they are), and sum_groups forms `count` rows' scores from them:
  // reduce_sums' bits either way. A GQA group of 4 rows (4 keys a group) stores and loads a
  // quarter of the vectors it did through all of reduce_sums at the end. Zen 4 (AVX-512), GQA
  // Hq=32 Hkv=8 decode, Lk=16384, 1 thread, separate processes in turn, median speed ratio of 9
  // rounds against that: bf16 [B, Hkv, L, D] 1.10, [B, L, Hkv, D] 1.05, p16 1.03; f16 1.05,
  // 1.05, 1.04; f32 [B, L, Hkv, D] 1.03, p16 1.02 (f32 [B, Hkv, L, D] scores row by row:
  // unchanged); from L2 (Hq=4 Hkv=1, Lk 256 -> 1024) bf16 62 -> 57 TSC ticks per key.
  template <int G>
  ATTNCORE_TARGET __attribute__((always_inline)) static inline void put_group(const Vec* sums,
                                                                              int j0,
                                                                              float* row_parts) {
    if constexpr (kLanes == 8) {
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) store(row_parts + (j0 + j) * kLanes, sums[j]);
    } else {
      Vec t[G];
#pragma GCC unroll 16
      for (int j = 0; j < G; ++j) t[j] = sums[j];
      store(row_parts + (j0 / G) * kLanes, reduce_group<G>(t));
    }
  }
  template <int G>
  ATTNCORE_TARGET static void sum_groups(const float* parts, std::int64_t count,
                                         std::int64_t stride, float* s) {
    if constexpr (kLanes == 8) {
      sum_parts(parts, count, stride, s);
    } else {
      for (std::int64_t x = 0; x < count; ++x) {
        Vec t[kLanes / G];
#pragma GCC unroll 16
        for (int i = 0; i < kLanes / G; ++i) t[i] = load(parts + (x * kLanes + i) * kLanes);
        store(s + x * stride, reduce_groups<G>(t));
      }
    }
  }

  // One row per head (MHA) against a block of keys c < block (0 past it) of `heads` heads, key
  // after key, each key's row of every head in turn: memory read in address order, which the
  // hardware prefetcher streams ([B, L, Hkv, D] and pages: a key's heads lie together). Head
  // x's q and S lie x * head_floats floats on, its K row x * k_step elements after head 0's at
  // k + at[j]; D a multiple of kLanes. Each score is the one score_keys (score_keys_pairs with
  // `q_pairs`: the heads' queries as bf16 pairs, d / 2 each) gives it: the same lane sums, then
  // reduce_sums over `parts` (heads * kLanes * kLanes floats) for f32, each sum reduce_sum'd
  // as it is formed for bf16 pairs (the same bits; widened 16-bit K: score_heads_widened;
  // bench --decode MHA bf16, 1 thread, % of the probe, Lk=4096/16384, interleaved: [B, L, Hkv,
  // D] 69/66 -> 77/68, p256 72/65 -> 78/69; f32 ran 3 points slower that way). With `lead` > 0
  // (bf16 pairs), each line read prefetches the same line of the key `lead` keys on (at[j +
  // lead] for j + lead < ahead), into L2: one prefetch per line, spread through the products,
  // which also runs ahead across page boundaries.
  template <class T>
  ATTNCORE_TARGET static void score_heads_by_key(const T* k, const std::int64_t* at,
                                                 std::int64_t block, DType dtype, std::int64_t d,
                                                 std::int64_t heads, std::int64_t k_step,
                                                 std::int64_t head_floats, const float* q,
                                                 [[maybe_unused]] const float* q_pairs, float* s,
                                                 float* parts, std::int64_t lead,
                                                 std::int64_t ahead,
                                                 [[maybe_unused]] bool into_l1) {
    for (std::int64_t j = 0; j < kLanes; ++j) {
      const T* row = k + (j < block ? at[j] : 0);
      [[maybe_unused]] const T* next = lead > 0 && j + lead < ahead ? k + at[j + lead] : nullptr;
      for (std::int64_t x = 0; x < heads; ++x) {
        Vec acc = {};
        if (j < block) {
          const T* kx = row + x * k_step;
#if ATTNCORE_BF16_DOT
          if (sizeof(T) == 2 && q_pairs != nullptr) {
            const float* qx = q_pairs + x * (d / 2);
            __m512 sum = acc;
            for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {
              if (next != nullptr) prefetch_line(next + x * k_step + e0, into_l1);
              const __m512i qv = _mm512_loadu_si512(qx + e0 / 2);
              const __m512i kv = _mm512_loadu_si512(kx + e0);
              sum = _mm512_dpbf16_ps(sum, reinterpret_cast<const __m512bh&>(qv),
                                     reinterpret_cast<const __m512bh&>(kv));
            }
            acc = sum;
          } else
#endif
          {
            const float* qx = q + x * head_floats;
            for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
              acc = fmadd(load(qx + e0), load_part(kx + e0, kLanes, dtype), acc);
            }
          }
        }
        if constexpr (sizeof(T) == 2) {
          s[x * head_floats + j] = reduce_sum(acc);
        } else {
          store(parts + (x * kLanes + j) * kLanes, acc);
        }
      }
    }
    if constexpr (sizeof(T) == 4) sum_parts(parts, heads, head_floats, s);
  }

  // score_heads_by_key on AVX2 (any dtype, `known` a constant): kKeys keys of the block at once,
  // one head after another, each step of a head's row multiplied with kKeys keys' rows (one query
  // load, kKeys multiply-add chains: one key's chain alone left each step waiting on its latency),
  // so that K is read as kKeys streams in address order; each (key, head) lane sum formed as
  // score_keys forms it, into `parts` ([heads][kLanes keys][kLanes]; AVX-512: a vector per group
  // of keys, put_group) and summed by sum_groups (the same bits). With `lead` > 0, each line read
  // prefetches the same line of the key `lead` keys on, into L2 (16-bit: the decode plan's
  // heads_16bit_lead; f32: none on AVX2, on AVX-512 the plan's heads_f32_k_lead). Zen 3, 1
  // thread, % of the probe,
  // Lk=16384, two runs of 3 interleaved passes against score_heads_by_key (f32) and
  // score_heads_widened (16-bit): BLHD f32 69/71 -> 81/77, bf16 50/49 -> 55/57, f16 50/44
  // -> 56/57, p16 f32 70/55 -> 67/78, bf16 47/46 -> 48/46 (8 keys at once within the noise of
  // 4, 2 lower for f32: 62-64 against 68-72); kLanes heads' chains interleaved instead, each
  // step of the rows for every head in turn (K no longer read in address order): lower, f32
  // BLHD 56/64 -> 47/49, p16 61/61 -> 48/43.
  // R rows per head (a GQA group's, rows d apart from q + x * head_floats; S row r of head x at
  // x * head_floats + r * kKeyTile): each K vector loaded (widened) once for the R rows, their
  // (row, key) lane sums in registers, `parts` [heads][R][kLanes keys][kLanes] (put_group); each
  // score the
  // one score_rows gives it (the same bits). `between(x, j0, kKeys)` runs after head x's scores
  // of keys j0 .. j0 + kKeys - 1 (DirectKv::heads_with_product: that head's P . V of the tile
  // before).
  template <int R = 1, class T, class Known, class Between = NoWork>
  ATTNCORE_TARGET static void score_heads_key_groups(
      const T* k, const std::int64_t* at, std::int64_t block, Known known, std::int64_t d,
      std::int64_t heads, std::int64_t k_step, std::int64_t head_floats, const float* q, float* s,
      float* parts, std::int64_t lead, std::int64_t ahead, const Between& between = {}) {
    constexpr int kKeys = kLanes < 4 ? kLanes : 4;
    static_assert(kLanes % kKeys == 0, "whole groups of keys in a block");
    for (int j0 = 0; j0 < kLanes; j0 += kKeys) {
      const T* row[kKeys];
      const T* next[kKeys];
      group_rows(k, at, j0, block, lead, ahead, row, next);
      const bool any = j0 < block;  // (a group wholly past the block: scores 0, nothing read)
      for (std::int64_t x = 0; x < heads; ++x) {
        Vec acc[R][kKeys];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
          for (int j = 0; j < kKeys; ++j) acc[r][j] = Vec{};
        }
        const float* qx = q + x * head_floats;
        const std::int64_t off = x * k_step;
        for (std::int64_t e0 = 0; any && e0 < d; e0 += kLanes) {
          if (lead > 0 && (e0 * sizeof(T)) % 64 == 0) {
#pragma GCC unroll 8
            for (int j = 0; j < kKeys; ++j) {
              if (next[j] != nullptr) __builtin_prefetch(next[j] + off + e0, 0, 2);
            }
          }
          Vec qv[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) qv[r] = load(qx + r * d + e0);
#pragma GCC unroll 8
          for (int j = 0; j < kKeys; ++j) {
            const Vec kv = load_part(row[j] + off + e0, kLanes, known);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r][j] = fmadd(qv[r], kv, acc[r][j]);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          Vec sums[kKeys];
#pragma GCC unroll 8
          for (int j = 0; j < kKeys; ++j) sums[j] = j0 + j < block ? acc[r][j] : Vec{};
          put_group<kKeys>(sums, j0, parts + (x * R + r) * kLanes * kLanes);
        }
        between(x, j0, kKeys);
      }
    }
    for (std::int64_t x = 0; x < heads; ++x) {
      sum_groups<kKeys>(parts + x * R * kLanes * kLanes, R, kKeyTile, s + x * head_floats);
    }
  }

#if ATTNCORE_BF16_DOT
  // score_heads_key_groups (one row per head) on bf16 pairs: q_pairs [heads][d / 2], D a
  // multiple of 2 * kLanes; each (head, key) lane sum formed as score_keys_pairs forms it, so
  // each score the one score_heads_by_key gives it (the same bits).
  ATTNCORE_TARGET static void score_heads_key_groups_pairs(
      const std::uint16_t* k, const std::int64_t* at, std::int64_t block, std::int64_t d,
      std::int64_t heads, std::int64_t k_step, std::int64_t head_floats, const float* q_pairs,
      float* s, float* parts, std::int64_t lead, std::int64_t ahead) {
    constexpr int kKeys = 4;
    for (int j0 = 0; j0 < kLanes; j0 += kKeys) {
      const std::uint16_t* row[kKeys];
      const std::uint16_t* next[kKeys];
      group_rows(k, at, j0, block, lead, ahead, row, next);
      const bool any = j0 < block;  // (a group wholly past the block: scores 0, nothing read)
      for (std::int64_t x = 0; x < heads; ++x) {
        __m512 acc[kKeys];
#pragma GCC unroll 8
        for (int j = 0; j < kKeys; ++j) acc[j] = _mm512_setzero_ps();
        const float* qx = q_pairs + x * (d / 2);
        const std::int64_t off = x * k_step;
        for (std::int64_t e0 = 0; any && e0 < d; e0 += 2 * kLanes) {  // (one line of each row)
#pragma GCC unroll 8
          for (int j = 0; j < kKeys; ++j) {
            if (next[j] != nullptr) __builtin_prefetch(next[j] + off + e0, 0, 2);
          }
          const __m512i qv = _mm512_loadu_si512(qx + e0 / 2);
#pragma GCC unroll 8
          for (int j = 0; j < kKeys; ++j) {
            const __m512i kv = _mm512_loadu_si512(row[j] + off + e0);
            acc[j] = _mm512_dpbf16_ps(acc[j], reinterpret_cast<const __m512bh&>(qv),
                                      reinterpret_cast<const __m512bh&>(kv));
          }
        }
        Vec sums[kKeys];
#pragma GCC unroll 8
        for (int j = 0; j < kKeys; ++j) sums[j] = j0 + j < block ? Vec(acc[j]) : Vec{};
        put_group<kKeys>(sums, j0, parts + x * kLanes * kLanes);
      }
    }
    for (std::int64_t x = 0; x < heads; ++x) {
      sum_groups<kKeys>(parts + x * kLanes * kLanes, 1, kKeyTile, s + x * head_floats);
    }
  }
#endif

  // score_heads_by_key for 16-bit K widened in registers (f16, or bf16 under an f32 query): the
  // lane sums of kLanes heads at a time kept in registers and summed across lanes together,
  // reduce_sums giving head x0 + x's score in lane x (the bits of reduce_sum'ing each), into
  // `by_key` [kLanes keys][heads rounded up to kLanes], then copied to each head's S (bench
  // --decode MHA f16, % of the probe, Lk=4096/16384, interleaved against one reduce_sum per
  // score, 7 passes on 1 thread: BLHD 60/66 -> 65/71, p16 67/60 -> 70/62, p256 70/67 -> 78/71;
  // 5 on 2 threads: BLHD 81/78 -> 88/76, p16 84/77 -> 88/75, p256 92/80 -> 97/79. bf16 pairs
  // ran 12-18 points slower that way, f32 1-2). The products of kChains heads at a time run
  // interleaved, one multiply-add chain each (their rows lie together: K still read in address
  // order), where each head's chain alone left the core waiting on its latency: Zen 5, f16 [B,
  // L, Hkv, D], Hkv = 32, 1 thread, in one process against each head in turn: from L2 (Lk = 48)
  // 1.18, from memory (Lk = 16384) 1.03.
  static constexpr int kChains = 4;
  template <DType kDtype, class T>
  ATTNCORE_TARGET static void score_heads_widened(const T* k, const std::int64_t* at,
                                                  std::int64_t block, std::int64_t d,
                                                  std::int64_t heads, std::int64_t k_step,
                                                  std::int64_t head_floats, const float* q,
                                                  float* s, float* by_key, std::int64_t lead,
                                                  std::int64_t ahead, bool into_l1) {
    const std::int64_t heads_pad = (heads + kLanes - 1) / kLanes * kLanes;
    for (std::int64_t j = 0; j < kLanes; ++j) {
      const T* row = k + (j < block ? at[j] : 0);
      const T* next = lead > 0 && j + lead < ahead ? k + at[j + lead] : nullptr;
      for (std::int64_t x0 = 0; x0 < heads; x0 += kLanes) {
        const std::int64_t n = j < block ? std::min<std::int64_t>(kLanes, heads - x0) : 0;
        Vec acc[kLanes];
#pragma GCC unroll 16
        for (int x = 0; x < kLanes; ++x) acc[x] = Vec{};
#pragma GCC unroll 4
        for (int xg = 0; xg < kLanes; xg += kChains) {
          if (xg >= n) continue;
          // (a group past the last head repeats it, its sums left out: no test per step)
          std::int64_t off[kChains];
#pragma GCC unroll 4
          for (int h = 0; h < kChains; ++h) off[h] = x0 + std::min<std::int64_t>(xg + h, n - 1);
          Vec sum[kChains] = {};
          for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
            if (next != nullptr && (e0 * sizeof(T)) % 64 == 0) {
#pragma GCC unroll 4
              for (int h = 0; h < kChains; ++h) {
                prefetch_line(next + off[h] * k_step + e0, into_l1);
              }
            }
#pragma GCC unroll 4
            for (int h = 0; h < kChains; ++h) {
              sum[h] = fmadd(load(q + off[h] * head_floats + e0),
                             load_part(row + off[h] * k_step + e0, kLanes, kDtype), sum[h]);
            }
          }
#pragma GCC unroll 4
          for (int h = 0; h < kChains; ++h) acc[xg + h] = xg + h < n ? sum[h] : Vec{};
        }
        Vec t[kLanes];
#pragma GCC unroll 16
        for (int x = 0; x < kLanes; ++x) t[x] = acc[x];
        store(by_key + j * heads_pad + x0, reduce_sums(t));
      }
    }
    for (std::int64_t x = 0; x < heads; ++x) {
      for (int j = 0; j < kLanes; ++j) s[x * head_floats + j] = by_key[j * heads_pad + x];
    }
  }

  // A GQA group's R query rows per head over several heads ([B, L, Hkv, D], pages) against a
  // block of keys c < block, key by key, each key's row of every head in turn: K read in address
  // order as one stream, each K vector loaded once for the head's R rows (rows d apart from q +
  // x * head_floats), the products of 8 / R heads at a time interleaved (8 multiply-add chains),
  // the lane sums of kLanes / R heads' rows summed across lanes together by reduce_sums (each
  // score the one score_rows gives it: the same bits), into `by_key` [kLanes keys][heads
  // rounded up to kLanes / R][R], then copied to each head's S (row r of head x at x *
  // head_floats + r * kKeyTile; 0 past `block`). Each line read prefetches the same line of the
  // key `lead` keys on into L1 (at[j + lead] for j + lead < ahead). R divides kLanes. Zen 5,
  // f32, Hq = 32, Hkv = 8, Lk = 16384, 1 thread, in one process against score_rows head by head
  // (K 4 KiB of each head ahead), 7-9 rounds, K 2 keys on: [B, L, Hkv, D] 1.20-1.21 (1 key on
  // 1.14, 3 keys 1.14, 4 keys 1.13, 6-8 keys 1.12-1.13, none 0.78), p16 1.25, p256 1.20-1.21,
  // from L3 (Lk = 2048) 1.06, 2 threads 1.07; groups of 8 rows (Hkv = 4) 1.06, of 2 (Hq = 16)
  // 1.22. f16 so: 0.94-0.95 over `[B, L, Hkv, D]` and pages of 256 (the widening makes it bound
  // by its instructions), taken over pages of 32 keys or fewer, K 8 keys on: p16 1.12-1.14 (4
  // keys 1.08-1.16, 16 keys 1.12), 2 threads 1.10, p32 1.05, p64 1.00; groups of 2 rows (Hq =
  // 16) p16 1.08. bf16 on pair dot products, K 8 keys on: [B, L, Hkv, D] 1.05, p16 1.16-1.19, p32
  // 1.17, p64 1.11, p256 1.07-1.09, from L3 0.99; groups of 2 rows 1.12. 16-bit groups of 8 rows
  // (Hkv = 4) so: f16 p16 0.92, bf16 p16 0.97, [B, L, Hkv, D] 0.90 (not taken).
  // With `q_pairs` (bf16 K, a bf16 query: AVX512-BF16), the rows' queries as bf16 pairs
  // ([heads][R][d / 2]), each lane sum formed on pair dot products as score_rows_pairs forms it.
  template <int R, class T, class Known>
  ATTNCORE_TARGET static void score_rows_by_key(const T* k, const std::int64_t* at,
                                                std::int64_t block, Known known, std::int64_t d,
                                                std::int64_t heads, std::int64_t k_step,
                                                std::int64_t head_floats, const float* q,
                                                [[maybe_unused]] const float* q_pairs, float* s,
                                                float* by_key, std::int64_t lead,
                                                std::int64_t ahead) {
    static_assert(kLanes % R == 0, "whole heads in a vector of sums");
    constexpr int kHeads = kLanes / R;                  // heads per reduce_sums
    constexpr int kAtOnce = R >= 8 ? 1 : 8 / R;  // heads whose chains interleave
    const std::int64_t width = (heads + kHeads - 1) / kHeads * kHeads * R;
    for (std::int64_t j = 0; j < block; ++j) {
      const T* row = k + at[j];
      const T* next = lead > 0 && j + lead < ahead ? k + at[j + lead] : nullptr;
      for (std::int64_t x0 = 0; x0 < heads; x0 += kHeads) {
        Vec acc[kLanes];
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) acc[i] = Vec{};
#pragma GCC unroll 8
        for (int xg = 0; xg < kHeads; xg += kAtOnce) {
          if (x0 + xg >= heads) break;
          // (heads past the last repeat it, their sums left out: no test per step)
          std::int64_t x[kAtOnce];
#pragma GCC unroll 8
          for (int h = 0; h < kAtOnce; ++h) x[h] = std::min<std::int64_t>(x0 + xg + h, heads - 1);
          Vec sum[kAtOnce][R] = {};
#if ATTNCORE_BF16_DOT
          if (sizeof(T) == 2 && q_pairs != nullptr) {
            for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {  // (one line of each row)
#pragma GCC unroll 8
              for (int h = 0; h < kAtOnce; ++h) {
                if (next != nullptr) prefetch_line(next + x[h] * k_step + e0, true);
                const __m512i kv = _mm512_loadu_si512(row + x[h] * k_step + e0);
                const float* qx = q_pairs + (x[h] * R) * (d / 2) + e0 / 2;
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r) {
                  const __m512i qv = _mm512_loadu_si512(qx + r * (d / 2));
                  sum[h][r] = Vec(_mm512_dpbf16_ps(sum[h][r], reinterpret_cast<const __m512bh&>(qv),
                                                   reinterpret_cast<const __m512bh&>(kv)));
                }
              }
            }
          } else
#endif
          {
            for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
              if (next != nullptr && (e0 * sizeof(T)) % 64 == 0) {
#pragma GCC unroll 8
                for (int h = 0; h < kAtOnce; ++h) prefetch_line(next + x[h] * k_step + e0, true);
              }
#pragma GCC unroll 8
              for (int h = 0; h < kAtOnce; ++h) {
                const Vec kv = load_part(row + x[h] * k_step + e0, kLanes, known);
                const float* qx = q + x[h] * head_floats + e0;
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r) sum[h][r] = fmadd(load(qx + r * d), kv, sum[h][r]);
              }
            }
          }
#pragma GCC unroll 8
          for (int h = 0; h < kAtOnce; ++h) {
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              acc[(xg + h) * R + r] = x0 + xg + h < heads ? sum[h][r] : Vec{};
            }
          }
        }
        store(by_key + j * width + x0 * R, reduce_sums(acc));
      }
    }
    for (std::int64_t x = 0; x < heads; ++x) {
      for (int r = 0; r < R; ++r) {
        float* sx = s + x * head_floats + r * kKeyTile;
        for (std::int64_t j = 0; j < kLanes; ++j) {
          sx[j] = j < block ? by_key[j * width + x * R + r] : 0.0f;
        }
      }
    }
  }

  // P . V of one row per head for every head of a multi-head item (MHA [B, L, Hkv, D], pages), over
  // a tile's keys [0, keys), key after key, each key's row of every head in turn: V read in address
  // order as one stream, which the hardware prefetcher streams, every head's output (out + x *
  // head_floats, dv floats, dv a multiple of kLanes) in L1 instead of registers. Head x's out = its
  // alpha (alpha + x * head_floats; with alpha null, 1) times out plus its P (probs + x *
  // head_floats) times its V rows (v + v_at[c] + x * v_step), each element's products in key order,
  // as accumulate<T, 1> forms them (the same bits). Where the rows jump (a page boundary), the row
  // kJumpLead keys on, whole, into L2; with `lead` > 0 (16-bit V: the decode plan's
  // heads_16bit_lead), each head's row `lead` keys on too, line by line as its products run, into
  // L1 or L2 (into_l1); never a row at or past `ahead`, the rows resolved. Zen 5, Hq = Hkv = 32, 1
  // thread, in one process against chunks of keys head by head with each head's next chunk
  // prefetched (tile_accumulate), with 16-bit K 4 keys on: f16 [B, L, Hkv, D] 1.21, p16 1.11, p256
  // 1.22-1.24, from L3 (Lk = 512) 1.49; bf16 1.16-1.19, p16 1.11 (with the jump's prefetch 1.13;
  // without either, V prefetched nowhere: 0.84), p256 1.19; f32 (its scores' key groups not run
  // with P . V, heads_overlap) 1.21, p16 1.13, p256 1.13. Then 16-bit rows also 1 key on into L1,
  // line by line (7 rounds): bf16 [B, L, Hkv, D] 1.04, p16 1.09, p256 1.07; f16 1.03, p16
  // 1.07-1.09, p256 1.04, from L3 1.05 (2 keys 0.99-1.08; f32 rows so 0.92, 2 keys 0.87).
  static constexpr std::int64_t kJumpLead = 2;
  template <class T, class Known>
  ATTNCORE_TARGET static void accumulate_by_key(const T* v, const std::int64_t* v_at,
                                               std::int64_t keys, std::int64_t ahead,
                                               std::int64_t heads, std::int64_t v_step,
                                               std::int64_t dv, const float* probs, float* out,
                                               const float* alpha, std::int64_t head_floats,
                                               std::int64_t lead, bool into_l1) {
    for (std::int64_t x = 0; alpha != nullptr && x < heads; ++x) {
      float* ox = out + x * head_floats;
      const Vec scale = splat(alpha[x * head_floats]);
      for (std::int64_t e0 = 0; e0 < dv; e0 += kLanes) store(ox + e0, load(ox + e0) * scale);
    }
    const std::int64_t step = keys > 1 ? v_at[1] - v_at[0] : 0;
    // (Dv = 128 a constant, its loop unrolled: from L3 1.11, from memory 1.00-1.03; the
    // widened scores' so, 0.77 and 0.94)
    const auto by_key = [&](auto vectors) ATTNCORE_TARGET {
      const std::int64_t n = vectors() > 0 ? vectors() * kLanes : dv;
      for (std::int64_t c = 0; c < keys; ++c) {
        const std::int64_t far = c + kJumpLead;
        if (far < ahead && v_at[far] - v_at[far - 1] != step) {
          prefetch_lines<2>(v + v_at[far], (heads - 1) * v_step + dv);
        }
        const T* row = v + v_at[c];
        const T* next = lead > 0 && c + lead < ahead ? v + v_at[c + lead] : nullptr;
        for (std::int64_t x = 0; x < heads; ++x) {
          const Vec weight = splat(probs[x * head_floats + c]);
          float* ox = out + x * head_floats;
          const T* vx = row + x * v_step;
          for (std::int64_t e0 = 0; next != nullptr && e0 < n; e0 += 64 / sizeof(T)) {
            prefetch_line(next + x * v_step + e0, into_l1);
          }
#pragma GCC unroll 8
          for (std::int64_t e0 = 0; e0 < n; e0 += kLanes) {
            store(ox + e0, fmadd(weight, load_part(vx + e0, kLanes, Known{}), load(ox + e0)));
          }
        }
      }
    };
    if (dv == 8 * kLanes) {
      by_key(std::integral_constant<int, 8>{});
    } else {
      by_key(std::integral_constant<int, 0>{});
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
