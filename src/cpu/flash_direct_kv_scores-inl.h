// DirectKv's scores, for one SIMD target: S = q . K^T for decode-shaped items, K read where it
// lies (dense rows or pages) and widened in registers, a block of keys at a time
// (DirectKvBlockScores, flash_direct_kv_block_scores-inl.h); the prefetching of K that goes with
// it.
// (One row per head across several heads: DirectKvHeads, flash_direct_kv_heads-inl.h; whole
// tiles of one head read as streams: DirectKvStreams, flash_direct_kv_streams-inl.h.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/params.h"
#include "cpu/decode_plan.h"
#include "cpu/flash_direct_kv_block_scores-inl.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// The scores of DirectKv items (flash_direct_kv-inl.h) against a key tile: one row, a group's
// rows, or one row per head across several heads.
struct DirectKvScores : DirectKvBlockScores {
  // Whether a tile's rows (k_at[0 .. keys)) jump to another page every 32 keys or sooner, on
  // average: pages of 32 keys or fewer.
  static bool jumps_often(const std::int64_t* k_at, std::int64_t keys) {
    if (keys < 2) return false;
    std::int64_t jumps = 0;
    for (std::int64_t c = 1; c < keys; ++c) jumps += k_at[c] - k_at[c - 1] != k_at[1] - k_at[0];
    return jumps > 0 && jumps * 32 >= keys - 32;
  }

  // S [rows][kKeyTile] = q . K[j0 + c]^T for c < keys, 0 for keys <= c < cols, kLanes keys at
  // a time (score_block), for each of `heads` kv heads: head x's K rows lie x * k_step
  // elements after head 0's, its q and S head_floats floats after head 0's. Key j0 + c of head
  // 0 is at k + k_at[c] for c < ahead (TileRows: the tile's keys and up to kRowLead after it,
  // never past the sequence). Block by block, each block of kLanes keys for every head before
  // the next block: with the heads inside a key's row ([B, L, Hkv, D], pages) memory is read in
  // order. Streams from memory, so that the product does not wait on it: K rows `lead` keys on
  // (the next tile's too; AVX2's whole tiles of one row: none, score_tile_streams). One head's V
  // rows, one sequential stream, are not prefetched here (prefetched as their K rows were read, [B,
  // Hkv, L, D] MHA decode ran slower: bench
  // --decode, Lk=4096/16384, 1 thread, % of the probe: f32 73/71 against 80/80 without, bf16
  // 68/62 against 71/74, f16 66/60 against 70/73): P . V prefetches them (16-bit kVLead keys
  // ahead, f32 as the core's decode plan says); several heads prefetch V chunk by chunk
  // in P . V (a whole tile's V of every head is more than L2). Several rows (GQA) go through
  // score_rows (score_rows_pairs for a bf16 query over bf16 K, its rows as pairs made once per
  // tile), each K vector loaded (widened) once in registers for every row, the partial sums
  // in `widened` (the item's K tile scratch, d * kKeyTile floats: enough from D = 16 on; GQA
  // Hq=32 Hkv=8 [B, Hkv, L, D] decode, 1 thread, % of the probe, Lk=4096/16384: bf16 54/53
  // against 46/45 with the copy below); but f32 rows of one head that lie together ([B, Hkv, L,
  // D]), which run row by row through score_keys (5 interleaved passes: 66/60 against 59/55
  // that way; [B, L, Hkv, D] 54/49 -> 55/53, p16 54/45 -> 59/48 through score_rows).
  // Otherwise a block of keys not evenly spaced (a page boundary inside it), or 16-bit with
  // several rows, is first copied (widened) into `widened` ([kLanes][d rounded up to kLanes]
  // floats) and read from there by every row (the same values, so the same scores).
  template <class T>
  ATTNCORE_TARGET static void scores(const Params& p, const T* k, const std::int64_t* k_at,
                                     std::int64_t ahead, DType dtype, std::int64_t keys,
                                     std::int64_t cols, std::int64_t heads, std::int64_t k_step,
                                     std::int64_t head_floats, const float* q, std::int64_t rows,
                                     [[maybe_unused]] bool pairs, float* s, float* widened) {
    const std::int64_t d = p.head_dim;
    // One row of one head over a whole tile of rows that lie together ([B, Hkv, L, D]), on AVX2
    // or where the decode plan says (tile_streams), or a group's rows where it says so
    // (tile_rows_streams): score_tile_streams, with no prefetch.
    const int streamed = tile_streams(d, keys, heads, rows, pairs, k_at) ? 1
                         : tile_rows_streams(d, keys, heads, rows, pairs, k_at)
                             ? rows_computed(rows)
                             : 0;
    if (streamed > 0) {
      with_known<T>(dtype, [&](auto known) ATTNCORE_TARGET {
        if (streamed == 1) return score_tile_streams<1>(k, k_at, d, known, q, s, widened);
        if (streamed == 2) return score_tile_streams<2>(k, k_at, d, known, q, s, widened);
        score_tile_streams<4>(k, k_at, d, known, q, s, widened);
      });
      return;
    }
    // K rows prefetched this far ahead (AVX2's whole tiles of one row: not at all, below): one
    // head, 6 KiB of rows (12 f32 keys at D = 128, 24 16-bit), at most kRowLead (bench --decode,
    // [B, Hkv, L, D], 1 thread, % of the probe, Lk=4096/16384, 7 interleaved passes, against 16 KiB
    // and at least 32 keys: MHA f32 75/76 -> 83/82, bf16 88/86 -> 97/94, f16 80/81 -> 88/85, GQA
    // f32 63/58 -> 65/60, bf16 67/66 -> 68/69; 4, 5 and 8 KiB within 3 points of 6, 12 KiB between
    // 6 and 16). Several heads (memory read in order): as many bytes of each head's rows as the
    // core's decode plan says (group_k_ahead_bytes: 4 KiB; GQA's on Intel and Zen 4 line by line
    // through the products, group_k_spread), into L2 (bench
    // --decode, BLHD Hkv=32 Lk=4096/16384, 1 thread, GB/s: f32 8 keys 26.0-26.4, 32 keys 24.7-25.5,
    // none 25.2-26.2, 32 keys into L1 21.3-23.3; bf16 16 keys 22.4-26.1, 8 keys 21.7-22.7).
    const DecodePlan& plan = decode_plan();
    const std::int64_t lead =
        heads > 1
            ? std::clamp<std::int64_t>(
                  plan.group_k_ahead_bytes / static_cast<std::int64_t>(sizeof(T) * d), 1, kRowLead)
            : std::clamp<std::int64_t>((6144 / static_cast<std::int64_t>(sizeof(T)) + d - 1) / d, 1,
                                       kRowLead);
    // Contiguous rows ([B, Hkv, L, D]) as the core's decode plan says (decode_plan.h: into
    // L1 or L2, f32 rows also `also` keys ahead). Rows far apart ([B, L, Hkv, D]: 16 KiB at 32 f32
    // heads) share L1 sets, where the rows a block reads evict the ones prefetched: into L2 (bench
    // --decode, 1 thread: f32 [B, L, Hkv, D] 12.5 GB/s either way, bf16 8.3-10.7 into L2 against
    // 6.2-6.7 into L1).
    const bool near = heads == 1 && (ahead < 2 || k_at[1] - k_at[0] == d);
    const bool near_l1 = near && plan.near_k_into_l1;
    const std::int64_t also_keys =
        sizeof(T) == 4 && near && plan.near_k_f32_also_bytes > 0
            ? std::clamp<std::int64_t>(
                  (plan.near_k_f32_also_bytes / static_cast<std::int64_t>(sizeof(T)) + d - 1) / d,
                  1, kRowLead)
            : 0;
    const std::int64_t also = also_keys != lead ? also_keys : 0;  // (0: none)
    const bool interleaved = plan.near_k_f32_also_interleaved;
    const std::int64_t d_pad = (d + kLanes - 1) / kLanes * kLanes;
    // One row per head, several heads: key by key, K prefetched as the products run (16-bit:
    // the decode plan's heads_16bit_lead; f32 on AVX-512 as far as it says, heads_f32_k_lead;
    // else not at all) (bench --decode MHA 1 thread, % of the probe,
    // Lk=4096/16384, interleaved with head by head: f32 [B, L, Hkv, D] 65/65 -> 73/73, p16
    // 61/59 -> 68/67, p256 63/65 -> 73/72, with each key's rows of every head prefetched `lead`
    // keys on in a burst per block 61/61; bf16 pairs BLHD 63/61 -> 66/66, p16 63/56 -> 69/59,
    // p256 65/62 -> 73/66). f16 (and bf16 K with an f32 query) widened, with the prefetch, 5
    // interleaved passes: 1 thread BLHD 65/63 -> 68/65, p16 59/55 -> 65/57, p256 67/63 ->
    // 68/65; 2 threads (% of the 2-thread probe) BLHD 76/64 -> 86/78, p16 71/60 -> 89/73, p256
    // 73/64 -> 87/76. Pairs need D a multiple of 2 * kLanes and the queries as pairs, after
    // the partial sums in `widened`. AVX2, and AVX-512 where the decode plan says
    // (heads_key_groups_f32, _16bit, _pairs): score_heads_key_groups (on pairs
    // score_heads_key_groups_pairs), 4 keys at a time.
    const bool by_key = heads > 1 && rows == 1 && d % kLanes == 0 &&
                        (sizeof(T) == 4 || !pairs || d % (2 * kLanes) == 0) &&
                        heads * kLanes * kLanes + heads * d / 2 <= d * kKeyTile;
    if (by_key) {
      float* q_pairs = nullptr;
#if ATTNCORE_BF16_DOT
      if (pairs) {
        q_pairs = widened + heads * kLanes * kLanes;
        for (std::int64_t x = 0; x < heads; ++x) {
          const float* qx = q + x * head_floats;
          for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {
            const __m512bh qv = _mm512_cvtne2ps_pbh(load(qx + e0 + kLanes), load(qx + e0));
            std::memcpy(q_pairs + x * (d / 2) + e0 / 2, &qv, sizeof qv);
          }
        }
      }
#endif
      const std::int64_t k16_lead = plan.heads_16bit_lead;
      const bool k16_l1 = plan.heads_16bit_into_l1;
      for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
        const std::int64_t block = std::clamp<std::int64_t>(keys - c0, 0, kLanes);
#if ATTNCORE_BF16_DOT
        if constexpr (sizeof(T) == 2) {
          if (q_pairs != nullptr && plan.heads_key_groups_pairs) {
            score_heads_key_groups_pairs(k, k_at + c0, block, d, heads, k_step, head_floats,
                                         q_pairs, s + c0, widened, k16_lead, ahead - c0);
            continue;
          }
        }
#endif
        if (kLanes == 8 || (q_pairs == nullptr && plan.heads_key_groups(sizeof(T)))) {
          if constexpr (sizeof(T) == 4) {
            score_heads_key_groups(k, k_at + c0, block, F32{}, d, heads, k_step, head_floats, q,
                                   s + c0, widened, kLanes == 16 ? plan.heads_f32_k_lead : 0,
                                   ahead - c0);
          } else if (dtype == DType::f16) {
            score_heads_key_groups(k, k_at + c0, block, F16{}, d, heads, k_step, head_floats, q,
                                   s + c0, widened, k16_lead, ahead - c0);
          } else {
            score_heads_key_groups(k, k_at + c0, block, Bf16{}, d, heads, k_step, head_floats, q,
                                   s + c0, widened, k16_lead, ahead - c0);
          }
        } else {
          if constexpr (sizeof(T) == 2) {
            if (q_pairs == nullptr) {  // (the dtype a constant: no test per load)
              if (dtype == DType::f16) {
                score_heads_widened<DType::f16>(k, k_at + c0, block, d, heads, k_step, head_floats,
                                                q, s + c0, widened, k16_lead, ahead - c0, k16_l1);
              } else {
                score_heads_widened<DType::bf16>(k, k_at + c0, block, d, heads, k_step, head_floats,
                                                 q, s + c0, widened, k16_lead, ahead - c0, k16_l1);
              }
              continue;
            }
          }
          score_heads_by_key(k, k_at + c0, block, dtype, d, heads, k_step, head_floats, q, q_pairs,
                             s + c0, widened, sizeof(T) == 2 ? k16_lead : 0, ahead - c0, k16_l1);
        }
      }
      return;
    }
    // Several rows on bf16 pairs (GQA): every head's rows as pairs once per tile, after the
    // partial sums in `widened` ([heads][rows_computed][d / 2]; with D not a multiple of 2 *
    // kLanes, or too little scratch, row by row through score_keys_pairs).
    const std::int64_t pair_rows = rows > 1 ? rows_computed(rows) : 0;
    float* rows_pairs = nullptr;
#if ATTNCORE_BF16_DOT
    if (pairs && rows > 1 && d % (2 * kLanes) == 0 &&
        kDirectRows * kLanes * kLanes + heads * pair_rows * (d / 2) <= d * kKeyTile) {
      rows_pairs = widened + kDirectRows * kLanes * kLanes;
      for (std::int64_t x = 0; x < heads; ++x) {
        for (std::int64_t r = 0; r < pair_rows; ++r) {
          const float* qr = q + x * head_floats + r * d;
          float* to = rows_pairs + (x * pair_rows + r) * (d / 2);
          for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {
            const __m512bh qv = _mm512_cvtne2ps_pbh(load(qr + e0 + kLanes), load(qr + e0));
            std::memcpy(to + e0 / 2, &qv, sizeof qv);
          }
        }
      }
    }
#endif
    // A group's rows over several heads key by key where the decode plan says: f32 rows and
    // bf16 rows on pairs (group_by_key), and widened 16-bit rows over pages of 32 keys or fewer
    // (group_widened_by_key_small_pages), 16-bit rows in groups of up to 4; K 2 keys on into L1
    // for f32, 8 for 16-bit (score_rows_by_key: the measurements).
    const int computed = rows_computed(rows);
    if constexpr (kLanes == 16) {
      const std::int64_t width = (heads * computed + kLanes - 1) / kLanes * kLanes;
      // (16-bit rows: groups of up to 4; on pairs, the sums before the rows' pairs in `widened`)
      const bool rows_by_key =
          sizeof(T) == 4 ? plan.group_by_key
          : computed > 4 ? false
          : pairs        ? plan.group_by_key && rows_pairs != nullptr
                         : plan.group_widened_by_key_small_pages && jumps_often(k_at, keys);
      if (rows_by_key && heads > 1 && rows > 1 && d % kLanes == 0 &&
          kLanes * width <= (pairs ? kDirectRows * kLanes * kLanes : d * kKeyTile)) {
        const auto by_key = [&](auto rows_constant, auto known) ATTNCORE_TARGET {
          for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
            const std::int64_t block = std::clamp<std::int64_t>(keys - c0, 0, kLanes);
            score_rows_by_key<decltype(rows_constant)::value>(
                k, k_at + c0, block, known, d, heads, k_step, head_floats, q, rows_pairs,
                s + c0, widened, sizeof(T) == 4 ? 2 : 8, ahead - c0);
          }
        };
        with_known<T>(dtype, [&](auto known) ATTNCORE_TARGET {
          switch (computed) {
            case 2: return by_key(std::integral_constant<int, 2>{}, known);
            case 4: return by_key(std::integral_constant<int, 4>{}, known);
            default: return by_key(std::integral_constant<int, kDirectRows>{}, known);
          }
        });
        return;
      }
    }
    for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      const std::int64_t block = std::clamp<std::int64_t>(keys - c0, 0, kLanes);
      const std::int64_t ldk = block >= 2 ? even_stride(k_at + c0, block) : d;
      for (std::int64_t x = 0; x < heads; ++x) {
        const T* kx = k + x * k_step;
        // f32 rows of one head lying together, the block's evenly apart, several rows (GQA [B,
        // Hkv, L, D]): the block's K prefetches spread over its rows' score_keys calls below
        // (each row's share of the keys before it), not all before the first: Zen 3 (AVX2), 1
        // thread, Lk=16384, in-process A/B (median speed ratio of 11 rounds, two runs): 1.03,
        // 1.07 (only the 12 KiB ones spread so: 1.05; also 24 KiB ahead: 1.04; 16-bit rows of
        // one head, their prefetches spread over score_rows' groups of keys, then pairs:
        // 0.98-1.02). Zen 4 (AVX-512), Hq=32 Hkv=8, separate processes in turn, 9-11 rounds:
        // Lk=16384 1.06, 1.07; Lk=4096 1.02, 1.03.
        // AVX2, several rows over several heads (GQA [B, L, Hkv, D], pages): score_rows issues
        // the same prefetches, each group of keys (then two for 3-4 rows) its own before it (Zen 3,
        // 1 thread, Lk=16384,
        // in-process A/B, median speed ratio of 11 rounds: f32 [B, L, Hkv, D] 1.03 and 1.05, p16
        // 1.03; bf16 1.03, p16 1.01; f16 p16 1.05).
        const bool by_rows = rows > 1 && (!pairs || rows_pairs != nullptr) &&
                             (sizeof(T) == 2 || !near) &&
                             kDirectRows * kLanes * kLanes <= d * kKeyTile;
        // AVX2, and AVX-512 where the decode plan says (group_k_spread), a group's rows over
        // several heads: score_rows (score_rows_pairs) prefetches their K; on AVX-512 a group's
        // 16-bit rows over one head whose rows lie together too, `lead` (6 KiB, at most kRowLead
        // keys) ahead, not all of a block's before it (Zen 4, Hq = 32, Hkv = 8, [B, Hkv, L, D], 1
        // thread, in one process with 256 MiB read before each call, 7 rounds, median speed
        // ratio: f16 Lk = 16384 1.05, 4096 1.05; bf16 1.02, 1.01; from L2, Lk 256 -> 1024, TSC
        // ticks per key: f16 73 -> 69, bf16 60 -> 56; 8, 16, 32 or 48 keys ahead for 24:
        // 0.71-0.97 in runs without the eviction; on Intel's cores, whose plan reads groups of up
        // to 4 rows as streams, groups of more: not measured).
        const bool in_rows = (heads > 1 || (sizeof(T) == 2 && kLanes == 16 && near)) && by_rows &&
                             (kLanes == 8 || plan.group_k_spread);
        const bool spread = sizeof(T) == 4 && near && rows > 1 && ldk != 0 &&
                            (kLanes == 8 || plan.group_f32_near_spread);
        if (!spread && !in_rows) {
          prefetch_block(kx, k_at, c0, 0, kLanes, lead, also, interleaved, near_l1, ahead, d);
        }
        const float* qx = q + x * head_floats;
        float* sx = s + x * head_floats + c0;
        if (by_rows) {
          score_block_rows(kx, k_at + c0, block, dtype, d, qx,
                           rows_pairs != nullptr ? rows_pairs + x * pair_rows * (d / 2) : nullptr,
                           rows, sx, widened, in_rows ? lead : 0, ahead - c0);
          continue;
        }
#if ATTNCORE_BF16_DOT
        if constexpr (sizeof(T) == 2) {
          if (pairs) {
            for (std::int64_t r = 0; r < rows; ++r) {
              if (block == kLanes) {
                score_keys_pairs<true>(kx, k_at + c0, d, block, qx + r * d, sx + r * kKeyTile);
              } else {
                score_keys_pairs<false>(kx, k_at + c0, d, block, qx + r * d, sx + r * kKeyTile);
              }
            }
            continue;
          }
        }
#endif
        if (ldk == 0 || (sizeof(T) == 2 && rows > 1)) {
          for (std::int64_t j = 0; j < block; ++j) {
            for (std::int64_t e0 = 0; e0 < d; e0 += kLanes) {
              const int n = static_cast<int>(std::min<std::int64_t>(kLanes, d - e0));
              store(widened + j * d_pad + e0, load_part(kx + k_at[c0 + j] + e0, n, dtype));
            }
          }
          for (std::int64_t r = 0; r < rows; ++r) {
            score_block(widened, d_pad, DType::f32, d, block, qx + r * d, sx + r * kKeyTile);
          }
        } else {
          const T* first = block > 0 ? kx + k_at[c0] : kx;  // (block 0: no row is read)
          const std::int64_t share = (kLanes + rows - 1) / rows;  // keys prefetched per row
          for (std::int64_t r = 0; r < rows; ++r) {
            if (spread) {
              prefetch_block(kx, k_at, c0, std::min<std::int64_t>(r * share, kLanes),
                             std::min<std::int64_t>((r + 1) * share, kLanes), lead, also,
                             interleaved, near_l1, ahead, d);
            }
            score_block(first, ldk, dtype, d, block, qx + r * d, sx + r * kKeyTile);
          }
        }
      }
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
