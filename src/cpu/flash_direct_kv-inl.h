// DirectKv, for one SIMD target: decode-shaped work items read K and V where they lie, in f32,
// instead of packing each tile first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash_direct_kv_products-inl.h"
#include "cpu/flash_direct_kv_scores-inl.h"
#include "cpu/flash_simd-inl.h"
#include "cpu/flash_tile_rows-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// A tile's P . V for one row, or a group's rows, left to run with the next tile's scores
// (DirectKv::tile_scores): its V rows, keys, rows, P ([rows][kKeyTile]) and each row's alpha
// (the rows' scratch, which holds them until the next tile's softmax).
struct PendingProduct {
  const TileRows* v_rows = nullptr;  // none pending
  std::int64_t keys;
  std::int64_t rows;
  const float* probs;
  const float* alpha;
  // Several heads ([B, L, Hkv, D], pages; one row each, or a GQA group's rows): each head's P,
  // alpha and out head_floats floats after the one before (DirectKv::heads_with_product).
  std::int64_t heads = 1;
  std::int64_t head_floats = 0;
};

// Decode-shaped items (one per kv group, at most kDirectRows query rows) read K and V where they
// lie, in f32, instead of packing each tile first: packing is most of such an item's work. The
// scores are DirectKvScores' (flash_direct_kv_scores-inl.h), P . V DirectKvProducts'
// (flash_direct_kv_products-inl.h); here each tile's steps, and the products left to run with
// the next tile's scores.
struct DirectKv : DirectKvProducts {
  // q [rows_computed(rows)][D]: the rows' queries, unscaled, in f32 (zero rows past `rows`:
  // the products compute those rows too; the rows after them are never read). 16-bit rows are
  // widened by vectors, not element by element (Zen 4, 1 thread, separate processes in turn, 9
  // rounds, median speed ratio: f16 Hq = 32, Hkv = 8, Lk = 64 1.27, Lk = 1024 1.02-1.03; Hkv =
  // 32, Lk = 256 1.03; bf16 Hkv = 32, Lk = 256 1.00).
  ATTNCORE_TARGET static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                                           const std::int64_t* head_of,
                                           const std::int64_t* index_of, std::int64_t rows,
                                           float* q) {
    const std::int64_t d = p.head_dim;
    const bool sixteen_bit = a.q.dtype == DType::bf16 || a.q.dtype == DType::f16;
    for (std::int64_t r = 0; r < rows_computed(rows); ++r) {
      if (r < rows) {
        const std::int64_t at = offset4(a.q, b, head_of[r], index_of[r], 0);
        if (sixteen_bit) {
          widen_row(static_cast<const std::uint16_t*>(a.q.data) + at, a.q.dtype, d, q + r * d);
        } else {
          load_row(a.q.data, a.q.dtype, at, d, q + r * d);
        }
      } else {
        std::fill_n(q + r * d, d, 0.0f);
      }
    }
  }
  // A pending product run on its own, as a tile's P . V runs where none is left pending
  // (tile_accumulate_chunks). For several heads (an item's last tile, on the Intel Xeon) against
  // each head's whole tile in turn, bench --decode, separate processes in turn, 4 rounds, median
  // ratio, MHA [B, L, Hkv, D] and pages at Lk = 4096: f32 1.05, bf16 1.02 (p256 1.015), f16 p16
  // 1.01; at Lk = 16384 1.00-1.01.
  ATTNCORE_TARGET static void run_pending(const Params& p, const ForwardArgs& a,
                                          const PendingProduct& run, std::int64_t dv_pad,
                                          float* out) {
    tile_accumulate_chunks(p, a, *run.v_rows, run.keys, run.heads, run.rows, run.probs, dv_pad,
                           run.alpha, out, run.head_floats);
  }

  // out [n] *= alpha: a pending product's rows, scaled before their keys are added (as
  // accumulate scales them).
  ATTNCORE_TARGET static void rescale(float* out, std::int64_t n, float alpha) {
    const Vec scale = splat(alpha);
    for (std::int64_t e = 0; e < n; e += kLanes) store(out + e, load(out + e) * scale);
  }

  // f(k, v, known) with K and V (one dtype) as typed pointers and the dtype as a constant (F32,
  // F16, Bf16): the products run between the scores.
  template <class F>
  ATTNCORE_TARGET static void with_kv(const ForwardArgs& a, F&& f) {
    if (a.k.dtype == DType::f32) {
      f(static_cast<const float*>(a.k.data), static_cast<const float*>(a.v.data), F32{});
    } else if (a.k.dtype == DType::f16) {
      f(static_cast<const std::uint16_t*>(a.k.data), static_cast<const std::uint16_t*>(a.v.data),
        F16{});
    } else {
      f(static_cast<const std::uint16_t*>(a.k.data), static_cast<const std::uint16_t*>(a.v.data),
        Bf16{});
    }
  }

  // A tile's scores by score_tile_streams (tile_streams), or a group's by
  // score_tile_streams<R> (tile_rows_streams), with the pending product of the tile before it
  // (RowsProduct; out scaled by each row's alpha first, as accumulate scales it).
  ATTNCORE_TARGET static void streams_with_product(const Params& p, const ForwardArgs& a,
                                                   const TileRows& k_rows,
                                                   const PendingProduct& run, const float* q,
                                                   std::int64_t rows, float* s, float* widened,
                                                   std::int64_t dv_pad, float* out) {
    const int computed = rows_computed(rows);
    for (int r = 0; r < computed; ++r) rescale(out + r * dv_pad, dv_pad, run.alpha[r]);
    with_kv(a, [&](auto k, auto v, auto known) ATTNCORE_TARGET {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(v)>>;
      using Known = decltype(known);
      const std::int64_t dv = p.head_dim_v, ahead = run.v_rows->count, d = p.head_dim;
      const std::int64_t* at = run.v_rows->at;
      if (computed == 1) {
        const RowsProduct<T, Known, 1> product{v, at, run.keys, run.probs, out, dv, dv_pad, ahead};
        return score_tile_streams<1>(k, k_rows.at, d, known, q, s, widened, product);
      }
      if (computed == 2) {
        const RowsProduct<T, Known, 2> product{v, at, run.keys, run.probs, out, dv, dv_pad, ahead};
        return score_tile_streams<2>(k, k_rows.at, d, known, q, s, widened, product);
      }
      const RowsProduct<T, Known, 4> product{v, at, run.keys, run.probs, out, dv, dv_pad, ahead};
      score_tile_streams<4>(k, k_rows.at, d, known, q, s, widened, product);
    });
  }

  // A tile's scores by score_tile_paired (tile_paired), with the pending product of the tile
  // before it (out scaled by its alpha first, as accumulate scales it); on bf16 pairs the query
  // made pairs first, in `widened`.
  // (Built for AVX-512 only: tile_paired is false elsewhere.)
  ATTNCORE_TARGET static void paired_with_product(
      [[maybe_unused]] const Params& p, [[maybe_unused]] const ForwardArgs& a,
      [[maybe_unused]] const TileRows& k_rows, [[maybe_unused]] const PendingProduct& run,
      [[maybe_unused]] const float* q, [[maybe_unused]] bool pairs, [[maybe_unused]] float* s,
      [[maybe_unused]] float* widened, [[maybe_unused]] std::int64_t dv_pad,
      [[maybe_unused]] float* out) {
    if constexpr (kLanes == 16) {
      const std::int64_t d = p.head_dim;
      rescale(out, dv_pad, run.alpha[0]);
#if ATTNCORE_BF16_DOT
      if (pairs) {
        for (std::int64_t e0 = 0; e0 < d; e0 += 2 * kLanes) {
          const __m512bh qv = _mm512_cvtne2ps_pbh(load(q + e0 + kLanes), load(q + e0));
          std::memcpy(widened + e0 / 2, &qv, sizeof qv);
        }
        return score_tile_paired<true>(static_cast<const std::uint16_t*>(a.k.data), k_rows.at,
                                       k_rows.count, d, Bf16{}, q, widened, s,
                                       static_cast<const std::uint16_t*>(a.v.data),
                                       run.v_rows->at, run.v_rows->count, run.keys, run.probs,
                                       out);
      }
#endif
      with_kv(a, [&](auto k, auto v, auto known) ATTNCORE_TARGET {
        score_tile_paired<false>(k, k_rows.at, k_rows.count, d, known, q, nullptr, s, v,
                                 run.v_rows->at, run.v_rows->count, run.keys, run.probs, out);
      });
    }
  }

  // A tile's scores over several heads by score_heads_key_groups (heads_key_groups_overlap),
  // each head's P . V of the previous tile run after its scores of each group of keys
  // (RowsProduct over that head's row; out scaled by each head's alpha first, as
  // accumulate_heads scales it). 16-bit K rows prefetched heads_overlap_lead keys ahead (each
  // line as the products read the same line of their key's row), and V rows as many keys
  // ahead, into L2; f32 rows neither.
  // On the Intel Xeon (the core whose plan overlaps: decode_plan.cpp), MHA Hq = Hkv = 32, Lk =
  // 16384, 1 thread, K/V on huge pages, in-process A/B (the calls in turn, 1 GiB read before each),
  // median speed ratio of 5 rounds, against K 16 keys ahead (heads_16bit_lead, as scores leads it)
  // and V not prefetched: bf16 [B, L, Hkv, D] 1.05 and 1.05, p16 1.06; f16 1.05, p16 1.06 (K 4
  // keys, V 2-4: 1.04-1.05; K 1-3, V 1-3 within 1% of 2 and 2; V alone 0.99-1.00, K 4 keys alone
  // 1.01-1.02). f32, which prefetches neither: V 2 or 4 keys ahead 0.99, K and V 4 keys 0.98. bench
  // --decode against the commit before, separate processes in turn, 3 rounds, median ratio, Lk =
  // 4096/16384: bf16 BLHD 1.06/1.06, f16 p16 1.05/1.06, f32 BLHD and p16 1.00-1.01 (with f32's V
  // rows passed as known but not prefetched, f32 read 0.97: its products then tested the lead per
  // key). (A plain read with the FMAs of such a kernel after each 256-byte row reached 16-17 GB/s
  // with each line of both prefetched 4 keys ahead into L2, 14 with K's alone: the core keeps too
  // few misses in flight for the loads the products wait on.)
  // The lead: 2 keys where a key's rows of the item's heads take 8 KiB or more (as 32 16-bit heads
  // of D = 128), else 3. Fewer heads (a small model's, or a tensor-parallel shard's), the same
  // in-process A/B, Hq = Hkv, against 2 keys: Hkv = 8, Lk = 16384, bf16 [B, L, Hkv, D] 1.21 (71 ->
  // 86% of the probe) and 1.21, f16 p16 1.28 (65 -> 84%), 4 keys 1.12-1.17; Hkv = 4, Lk = 32768,
  // bf16 1.03 (4 keys 1.02, 8 keys 0.89); Hkv = 16, Lk = 8192, 3 or 4 keys 1.00; Hkv = 32, Lk =
  // 4096, 3 keys: bf16 0.99, f16 p16 1.00.
  ATTNCORE_TARGET static std::int64_t heads_overlap_lead(std::int64_t heads, std::int64_t d,
                                                         std::int64_t element_bytes) {
    return heads * d * element_bytes >= 8192 ? 2 : 3;
  }
  // A GQA group's rows (2 or 4 computed) likewise, 16-bit only (heads_key_groups_overlap): each
  // head's R rows scored per group of keys (score_heads_key_groups<R>), then its rows' P . V of
  // the same keys of the tile before (RowsProduct<R>): the same bits as scores, then P . V in
  // chunks. Hq = 32, Hkv = 8 (the lead 3 keys: 2, 4 and 6 ran at 0.81-0.93 of one pass, 5 and 7
  // within 1% of 3), Lk = 16384, against that one pass, in-process A/B, median of 5-9 rounds:
  // bf16 [B, L, Hkv, D] 1.05, p256 1.03, f16 p16 1.03 (Lk = 4096, [B, L, Hkv, D]: 1.01); f32
  // 0.96-0.98 (kept out). bench --decode against the commit before, 3 rounds, Lk = 4096/16384:
  // bf16 [B, L, Hkv, D] 1.04/1.05, p256 1.00/1.07, f16 [B, L, Hkv, D] 1.06/1.08, p16 1.07/1.04.
  ATTNCORE_TARGET static void heads_with_product(const Params& p, const ForwardArgs& a,
                                                 const TileRows& k_rows, const PendingProduct& run,
                                                 std::int64_t keys, std::int64_t cols,
                                                 const float* q, float* s, float* parts,
                                                 std::int64_t dv_pad, float* out) {
    const std::int64_t hf = run.head_floats, heads = run.heads, dv = p.head_dim_v;
    const int computed = rows_computed(run.rows);
    for (std::int64_t x = 0; x < heads; ++x) {
      for (int r = 0; r < computed; ++r) {
        rescale(out + x * hf + r * dv_pad, dv, run.alpha[x * hf + r]);
      }
    }
    with_kv(a, [&](auto k, auto v, auto known) ATTNCORE_TARGET {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(v)>>;
      const std::int64_t lead =
          sizeof(T) == 2 ? heads_overlap_lead(heads, p.head_dim, sizeof(T)) : 0;
      const std::int64_t v_step = a.v.stride[1], ahead = lead > 0 ? run.v_rows->count : 0;
      const std::int64_t* at = run.v_rows->at;
      auto with_rows = [&](auto rows_constant) ATTNCORE_TARGET {
        constexpr int R = decltype(rows_constant)::value;
        for (std::int64_t c0 = 0; c0 < cols; c0 += kLanes) {
          const std::int64_t block = std::clamp<std::int64_t>(keys - c0, 0, kLanes);
          // Head x's V rows x * v_step elements after the first head's.
          const auto between = [&](std::int64_t x, std::int64_t j, std::int64_t n) ATTNCORE_TARGET {
            const RowsProduct<T, decltype(known), R, 2> product{
                v + x * v_step, at,    run.keys, run.probs + x * hf, out + x * hf, dv,
                dv_pad,         ahead, lead};
            product(c0 + j, n);
          };
          score_heads_key_groups<R>(k, k_rows.at + c0, block, known, p.head_dim, heads,
                                    a.k.stride[1], hf, q, s + c0, parts, lead, k_rows.count - c0,
                                    between);
        }
      };
      if (computed == 1) return with_rows(std::integral_constant<int, 1>{});
      if constexpr (sizeof(T) == 2) {  // (f32 groups never overlap: heads_key_groups_overlap)
        if (computed == 2) return with_rows(std::integral_constant<int, 2>{});
        with_rows(std::integral_constant<int, 4>{});
      }
    });
  }

  // Whether a bf16 query's scores against bf16 K run on native bf16 dots (an f32 query keeps
  // the f32 path: its bits are those of the same call over an f32 cache).
  ATTNCORE_TARGET static bool on_pairs(const ForwardArgs& a) {
    return ATTNCORE_BF16_DOT && a.k.dtype == DType::bf16 && a.q.dtype == DType::bf16;
  }

  // The scores of a key tile of K rows resolved (TileRows) of the item's first kv head, in the
  // input's dtype, for `heads` heads (DirectKvScores::scores).
  // A pending product (PendingProduct) runs with the scores where score_tile_paired,
  // score_tile_streams or score_heads_key_groups scores the tile, else before them; either way
  // it is no longer pending.
  ATTNCORE_TARGET static void tile_scores(const Params& p, const ForwardArgs& a,
                                          const TileRows& k_rows, std::int64_t heads,
                                          std::int64_t head_floats, std::int64_t keys,
                                          std::int64_t cols, const float* q, std::int64_t rows,
                                          float* s, float* widened, PendingProduct& pending,
                                          std::int64_t dv_pad, float* out) {
    const std::int64_t k_step = a.k.stride[1];
    const bool pairs = on_pairs(a);
    if (pending.v_rows != nullptr) {
      const PendingProduct run = pending;
      pending.v_rows = nullptr;
      if (run.heads > 1 && cols >= run.keys &&
          heads_key_groups_overlap(p.head_dim, heads, rows, pairs, a.k.dtype)) {
        return heads_with_product(p, a, k_rows, run, keys, cols, q, s, widened, dv_pad, out);
      }
      if (tile_paired(p.head_dim, p.head_dim_v, keys, heads, rows, pairs, k_rows.at)) {
        return paired_with_product(p, a, k_rows, run, q, pairs, s, widened, dv_pad, out);
      }
      if (tile_streams(p.head_dim, keys, heads, rows, pairs, k_rows.at) ||
          tile_rows_streams(p.head_dim, keys, heads, rows, pairs, k_rows.at)) {
        return streams_with_product(p, a, k_rows, run, q, rows, s, widened, dv_pad, out);
      }
      run_pending(p, a, run, dv_pad, out);
    }
    if (a.k.dtype == DType::f32) {
      scores(p, static_cast<const float*>(a.k.data), k_rows.at, k_rows.count, a.k.dtype, keys, cols,
             heads, k_step, head_floats, q, rows, false, s, widened);
    } else {
      scores(p, static_cast<const std::uint16_t*>(a.k.data), k_rows.at, k_rows.count, a.k.dtype,
             keys, cols, heads, k_step, head_floats, q, rows, pairs, s, widened);
    }
  }
};

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
