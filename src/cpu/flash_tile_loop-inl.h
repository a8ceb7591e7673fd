// The flash forward kernel for one SIMD target (the macros are described in
// flash_layout-inl.h): the tile loop of one work item, and the exported entry points run_block
// and pack_tiles.
//
// Per work item (rows [row0, row0 + rows) of one query head):
//   q = Q rows * scale;  O = 0;  m = -inf;  l = 0
//   for each key tile intersecting the rows' causal / window band:
//     S = q . K_tile^T                       (micro-kernel 1; keys in vector lanes)
//     S = score mods (softcap, ALiBi, mask)   (only when the call has them)
//     S = -inf outside each row's band        (only on tiles the band cuts: "partial" tiles)
//     online softmax (policy/softmax_state.h): m' = max(m, rowmax S); P = exp(S - m');
//                     alpha = exp(m - m'); l = alpha l + rowsum P;  P *= dropout factor
//     O = alpha O + P . V_tile                (micro-kernel 2; Dv in vector lanes)
//   out = O / l (0 where l = 0);  lse = m + log l (-inf where l = 0)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "core/sequence.h"
#include "cpu/flash.h"
#include "cpu/flash_direct_kv-inl.h"
#include "cpu/flash_dot_bf16-inl.h"
#include "cpu/flash_dot_f32-inl.h"
#include "cpu/flash_hidden_keys-inl.h"
#include "cpu/flash_layout-inl.h"
#include "cpu/flash_score_mods-inl.h"
#include "cpu/flash_simd-inl.h"
#include "policy/mask.h"
#include "policy/score_row.h"
#include "policy/softmax_state.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// The keys c < keys flagged in `hidden` whose V row holds inf or NaN, into bad[] (returns
// their count), looked for in the tile the product reads (in cache), or in place (direct). For
// a packed tile, their rows are zeroed in w.v_tile (the panel's tile copied there, or the tile
// packed there) and *v_tile set to it. Out of line: kept apart from the tile loop's hot code.
template <class Dot>
ATTNCORE_TARGET __attribute__((noinline)) std::int64_t leave_out_hidden_keys(
    const Params& p, const ForwardArgs& a, std::int64_t b, std::int64_t kv_head, std::int64_t j0,
    std::int64_t keys, const IVec* hidden, bool direct, std::int64_t dv_pad, const FlashScratch& w,
    const float** v_tile, std::int64_t* bad) {
  std::int64_t count = 0;
  for (std::int64_t c = 0; c < keys; ++c) {
    if (hidden[c / kLanes][c % kLanes] == 0) continue;
    const bool finite =
        direct ? row_is_finite(a.v, kv_offset(p, a.v, b, kv_head, j0 + c), p.head_dim_v)
               : Dot::key_finite(*v_tile, c, dv_pad);
    if (!finite) bad[count++] = c;
  }
  if (count > 0 && !direct) {
    if (*v_tile != w.v_tile) std::copy_n(*v_tile, Dot::v_tile_floats(dv_pad), w.v_tile);
    *v_tile = w.v_tile;
    for (std::int64_t n = 0; n < count; ++n) Dot::zero_key(w.v_tile, bad[n], dv_pad);
  }
  return count;
}

// A DirectKv item's scratch for its kv head x (FlashScratch::heads, w.head_floats apart): q, S,
// O, the softmax states and alpha of its `rows` computed rows (direct_head_floats); the widened
// block (k_tile) and the rest are shared.
ATTNCORE_TARGET inline FlashScratch head_scratch(const FlashScratch& w, std::int64_t x,
                                                 std::int64_t rows, std::int64_t d,
                                                 std::int64_t dv_pad) {
  FlashScratch h = w;
  h.q = w.heads + x * w.head_floats;
  h.scores = h.q + rows * d + kDirectSkew;
  h.out = h.scores + rows * kKeyTile + kDirectSkew;
  h.softmax = reinterpret_cast<SoftmaxState*>(h.out + rows * dv_pad);
  h.alpha = h.out + rows * (dv_pad + 2);
  return h;
}

// One work item: see the top of this file. A DirectKv item of several kv heads runs each tile
// for every head in turn, each head's steps exactly those of an item of its own (the same
// bits): the scores block by block across the heads, each head's softmax, then P . V in
// chunks of DirectKv::head_chunk keys across the heads (the chunks sum in key order as one
// pass does).
template <class Dot>
ATTNCORE_TARGET void run_block_with(const Params& p, const ForwardArgs& a, const FlashPanel& panel,
                                    const FlashItem& item, const FlashScratch& scratch) {
  const std::int64_t d = p.head_dim, dv_pad = panel.dv_pad, lk = p.seq.lk, b = item.b;
  const std::int64_t rows = item.rows;
  const std::int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const CausalWindowMask band(p);
  const bool has_mods = p.softcap != 0.0 || p.alibi != nullptr || p.mask_kind != MaskKind::none;
  const bool bool_mask = p.mask_kind == MaskKind::boolean;

  // Each row's head (of the item's first kv head; kv head x adds x * group) and query index,
  // and the keys the rows see (which tiles to visit, and which of them are full: seen
  // entirely by every row, so that no mask code runs), the same for every kv head.
  std::int64_t head_of[kBlockRows], index_of[kBlockRows];
  RowSetKeys seen;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t n = item.first + r;
    head_of[r] = item.kv_head * p.group + n / p.seq.lq;
    index_of[r] = n % p.seq.lq;
    seen.add(band.row(index_of[r]));
  }

  // A group's only item of at most kDirectRows rows (decode) reads K and V in place;
  // flash.cpp gives every such problem no panel, whatever the thread count
  // (flash_reads_kv_in_place: the same rule).
  const bool direct = Dot::kDirectDecode && panel.k_tiles == nullptr && rows <= kDirectRows;
  const std::int64_t heads = direct ? item.heads : 1;
  // The rows the products compute: whole micro-tiles, or in place the few DirectKv computes.
  const std::int64_t live_rows = direct ? DirectKv::rows_computed(rows) : padded_rows;
  // In place, each kv head's scratch sized for the rows computed.
  FlashScratch w = scratch;
  if (direct) w.head_floats = direct_head_floats(live_rows, kKeyTile, d, dv_pad);
  // Scratch of kv head x (item.kv_head + x), and its rows' heads.
  auto scratch_of = [&](std::int64_t x) ATTNCORE_TARGET {
    return direct ? head_scratch(w, x, live_rows, d, dv_pad) : w;
  };
  auto heads_of = [&](std::int64_t x, std::int64_t* of) ATTNCORE_TARGET {
    for (std::int64_t r = 0; r < rows; ++r) of[r] = head_of[r] + x * p.group;
  };
  for (std::int64_t x = 0; x < heads; ++x) {
    const FlashScratch wx = scratch_of(x);
    std::int64_t hx[kBlockRows];
    heads_of(x, hx);
    if (direct) {
      DirectKv::load_queries(p, a, b, hx, index_of, rows, wx.q);
    } else {
      Dot::load_queries(p, a, b, hx, index_of, rows, padded_rows, wx.q);
    }
    // (In place, the rows the products compute: a decode item of 32 heads spent 3 of its 20
    // us zeroing whole micro-tiles of rows, kTileRows of them for one row.)
    for (std::int64_t e = 0; e < live_rows * dv_pad; ++e) wx.out[e] = 0.0f;
    for (std::int64_t r = 0; r < live_rows; ++r) {
      wx.softmax[r] = SoftmaxState{};
      wx.alpha[r] = 1.0f;
    }
  }
  // S is in units of q.k times score_scale: scale is in the queries already, or applied here.
  const float score_scale = Dot::kScaledQueries && !direct ? 1.0f : static_cast<float>(p.scale);
  // S is scaled before the masks when score mods need the score, or when the scale rounds to 0 in
  // f32 (scale < 2^-150): the masks' -inf times 0 would be NaN (every score is then 0 and the
  // row's weights uniform, as they are to f32 precision).
  const bool scale_first = has_mods || score_scale == 0.0f;
  const auto exp2 = [](auto x) ATTNCORE_TARGET { return exp2v(splat(x))[0]; };

  // The tiles holding keys some row sees, within the item's own key range (a split-KV item's).
  const KeyRange span = seen.span();
  const std::int64_t first_key = std::max(span.begin, item.key_begin);
  const std::int64_t end_key = std::min(span.end, item.key_end);
  // AVX2 (and AVX-512 where the decode plan says: one_row_streams, one_row_paired), one row of
  // one kv head read in place: each tile's P . V (no key left out) waits for the next tile's
  // scores and runs with them (DirectKv::tile_scores), so that K and V are read as concurrent
  // streams, each tile's V rows in one of two buffers (its P stays in S, which
  // score_tile_streams writes after its last group, score_tile_paired key by key after reading
  // that key's P). MHA [B, Hkv, L, D], Zen 3, 1 thread, % of the probe, Lk=16384, three runs of 3
  // interleaved passes (scratch harness, huge pages) against P . V after each tile's scores: f32
  // 85/82/81 -> 99/86/93, bf16 75/73/68 -> 81/76/81, f16 78/80/71 -> 89/78/75 (the scores' 4 keys
  // adjacent instead of 32 apart: f32 60/61/61, 16-bit within noise of the base; P . V in two
  // halves of the row per 4 keys, as accumulate<T, 1> runs: f32 70-75, 16-bit 76-80). Not kept, 3
  // runs of 3 passes each: items of several kv heads ([B, L, Hkv, D], pages) with each head's 4
  // keys of V after its 4 scored keys (f32 BLHD 91-101 -> 78-93, 16-bit within noise or lower) or
  // every head's after each group of 4 keys (within noise); GQA rows with each 8-key block's P . V
  // after it is scored (f32 46-59 -> 44-55, 16-bit within noise), also without the GQA product's V
  // prefetches. (Where the next tile is not scored by score_tile_streams or score_tile_paired, as
  // over [B, L, Hkv, D] or the last tile, the product runs before its scores: the same work,
  // later.)
  // A group's 2 to 4 rows likewise where the decode plan says (rows_overlap; their scores by
  // score_tile_streams<R>, RowsProduct between them).
  const DecodePlan& plan = decode_plan();
  const bool overlap_rows = rows == 1 ? kLanes == 8 || plan.one_row_streams || plan.one_row_paired
                                      : DirectKv::rows_computed(rows) <= 4 && plan.rows_overlap;
  const bool overlap = direct && overlap_rows && heads == 1 && p.head_dim % kLanes == 0 &&
                       p.head_dim_v % kLanes == 0 && a.k.dtype == a.v.dtype;
  // One row per head over several heads likewise where the decode plan says (heads_overlap;
  // their scores by score_heads_key_groups, each head's RowsProduct between them), and a GQA
  // group's 16-bit rows over several heads.
  const bool overlap_heads = direct && heads > 1 && !bool_mask &&
                             DirectKv::heads_key_groups_overlap(p.head_dim, heads, rows,
                                                                DirectKv::on_pairs(a), a.k.dtype) &&
                             p.head_dim_v % kLanes == 0 && a.k.dtype == a.v.dtype;
  TileRows tile_rows[3];
  PendingProduct pending;
  const std::int64_t tile_begin = first_key / kKeyTile;
  const std::int64_t tile_end =
      end_key > first_key ? (end_key + kKeyTile - 1) / kKeyTile : tile_begin;
  for (std::int64_t t = tile_begin; t < tile_end; ++t) {
    if (t > tile_begin && w.launch != nullptr) w.launch->check_cancel();
    const std::int64_t j0 = t * kKeyTile;
    const std::int64_t keys = std::min<std::int64_t>(kKeyTile, lk - j0);
    const std::int64_t cols = tile_cols(keys);  // S, P and the products: columns [0, cols)
    // The last tile's keys past Lk are padding: such a tile is never full.
    const bool full = keys == kKeyTile && seen.classify(j0, j0 + kKeyTile) == TileKind::full;
    // The panel's tile, or (panel without tiles: a single item of its group) this tile packed
    // now into scratch, where it stays in L1/L2 for its one use.
    const float* k_tile = w.k_tile;
    const float* v_tile = w.v_tile;
    // In place: the tile's rows of the first kv head, pages resolved once (V in turns with
    // `overlap`).
    TileRows& k_rows = tile_rows[2];
    TileRows& v_rows = tile_rows[overlap || overlap_heads ? t & 1 : 0];
    if (direct) {
      resolve_rows(p, a.k, b, item.kv_head, j0, k_rows);
      resolve_rows(p, a.v, b, item.kv_head, j0, v_rows);
      const FlashScratch w0 = scratch_of(0);
      DirectKv::tile_scores(p, a, k_rows, heads, w.head_floats, keys, cols, w0.q, rows,
                            w0.scores, w.k_tile, pending, dv_pad, w0.out);
    } else if (panel.k_tiles != nullptr) {
      k_tile = panel.k_tiles + t * d * kKeyTile;
      v_tile = panel.v_rows + j0 * dv_pad;
    } else {
      Dot::pack_tile(p, a, b, item.kv_head, t, w.k_tile, w.v_tile, dv_pad);
    }
    if (!direct) Dot::scores(p, w.q, k_tile, padded_rows, cols, w.scores);
    // Tiles some row does not see entirely: lanes of `hidden` set for keys hidden from a row
    // (score -inf after the masks: outside its band, false in a bool mask, or -inf otherwise).
    const bool cut = !full || bool_mask;
    // P . V runs over the tile's keys up to the last one some row sees, in whole micro-tiles
    // (the keys after it, past every row's band on a causal diagonal, have P = 0 everywhere).
    const std::int64_t pv_cols = std::min(cols, tile_cols(span.end - j0));
    const std::int64_t pv_keys = std::min(keys, pv_cols);
    for (std::int64_t x = 0; x < heads; ++x) {
      const FlashScratch wx = scratch_of(x);
      const std::int64_t kv_head = item.kv_head + x;
      std::int64_t hx[kBlockRows];
      heads_of(x, hx);
      IVec hidden[kKeyTile / kLanes];
      if (cut) std::fill_n(hidden, cols / kLanes, IVec{});
      for (std::int64_t r = 0; r < live_rows; ++r) {
        float* s = wx.scores + r * kKeyTile;
        if (r >= rows) {  // padding rows take no part
          for (std::int64_t c = 0; c < cols; ++c) s[c] = 0.0f;
          continue;
        }
        const std::int64_t h = hx[r], i = index_of[r];
        float row_scale = score_scale;  // S * row_scale is the score of docs/design.md section 1.2
        if (scale_first) {
          if (row_scale != 1.0f) {
            for (std::int64_t c = 0; c < cols; c += kLanes)
              store(s + c, held_product(load(s + c), row_scale));
            row_scale = 1.0f;
          }
          if (has_mods) apply_score_mods(p, b, h, i, j0, keys, s);
        }
        if (!full) {
          const KeyRange visible = band.row(i);
          const std::int64_t lo = std::max<std::int64_t>(visible.begin - j0, 0);
          const std::int64_t hi = std::min<std::int64_t>(visible.end - j0, keys);
          for (std::int64_t c = 0; c < cols; ++c) {
            if (c < lo || c >= hi) s[c] = -INFINITY;
          }
        }
        if (cut) {
          for (std::int64_t c = 0; c < cols; c += kLanes) {
            hidden[c / kLanes] |= load(s + c) == -INFINITY;
          }
        }
        // Online softmax (policy/softmax_state.h). Scores enter in log2 units (score * log2 e):
        // the max rounded once, P = 2^(S * factor - max) from each score's unrounded product,
        // and the rescale alpha = 2^(old max - new max), exactly 1 while the max stays.
        float factor = row_scale * kLog2e;
        Vec vmx = load(s);
        for (std::int64_t c = kLanes; c < cols; c += kLanes) vmx = vmax(load(s + c), vmx);
        SoftmaxState& state = wx.softmax[r];
        const float new_max = state.next_max(held_product(reduce_max(vmx), factor));
        if (new_max == -INFINITY) {  // nothing visible yet: P = 0, nothing to rescale
          for (std::int64_t c = 0; c < cols; ++c) s[c] = 0.0f;
          wx.alpha[r] = 1.0f;
          continue;
        }
        // P's argument S * factor - max takes the product unrounded (fmsub_exact): every P of
        // the row is relative to the current rounded max (alpha re-bases earlier tiles on a new
        // one, exactly), so the rounding residual r of the max's own product (|r| <= ulp(max) /
        // 2) is one factor 2^r of every P, the sum and the accumulator, which the output's
        // 1 / sum and the LSE cancel exactly. Below |max| = 2^28 that factor is at most 2^8
        // (scaled scores up to ~1.9e8); past it (scales near f32's limit) 2^r of the row's
        // largest score was 0 or 2^127 at scale 1e30: such rows are rounded to log2 units
        // first, so that the largest score gives exactly 2^0, and each score's own rounding (up
        // to ulp(max) / 2 in its exponent) stays in its P. (Rounding from 2^22 on, as before,
        // put that error into rows of scores past ~2.9e6: scores 1e7 - j, j = 0..7, gave 0.623
        // for 0.579.)
        // (Scores past +-FLT_MAX / factor held at +-FLT_MAX there, held_product: such scores of one
        // row share it equally, where f32 softmax gives it to the largest of them alone.)
        if (!(std::fabs(new_max) < 0x1p28f)) {
          for (std::int64_t c = 0; c < cols; c += kLanes)
            store(s + c, held_product(load(s + c), factor));
          factor = 1.0f;
        }
        const float alpha = state.alpha(new_max, exp2);
        Vec vsum = splat(0.0f);
        for (std::int64_t c = 0; c < cols; c += kLanes) {
          const Vec prob = exp2v(fmsub_exact(load(s + c), factor, new_max));
          vsum += prob;
          store(s + c, prob);
        }
        state.update(new_max, alpha, reduce_sum(vsum));
        wx.alpha[r] = alpha;
        if (p.dropout.p > 0.0) {  // after the sum: the normaliser is the pre-dropout sum
          const DropoutRow dropout(p, b, h, i);
          for (std::int64_t c = 0; c < keys; ++c) s[c] *= dropout.factor<float>(j0 + c);
        }
      }
      if (direct && !cut && overlap) {  // P . V with the next tile's scores, or after the loop
        pending = PendingProduct{&v_rows, pv_keys, rows, wx.scores, wx.alpha};
        continue;
      }
      if (direct && !cut) continue;  // P . V below, chunk by chunk across the heads
      // Keys among them hidden from some row whose V holds inf or NaN
      // (flash_hidden_keys-inl.h): left out of the product (zeroed in a copy of the tile, or
      // skipped in place) and added to the rows that see them.
      std::int64_t bad[kKeyTile], bad_count = 0;
      if (cut) {
        bad_count = leave_out_hidden_keys<Dot>(p, a, b, kv_head, j0, pv_keys, hidden, direct,
                                               dv_pad, wx, &v_tile, bad);
      }
      if (direct) {
        // In place: the runs of keys between the ones left out, one after the other (the same
        // sums in the same order as one pass), the accumulator rescaled by the first call only.
        float ones[kDirectRows];
        if (bad_count > 0) std::fill_n(ones, kDirectRows, 1.0f);
        std::int64_t begin = 0;
        bool rescaled = false;
        for (std::int64_t n = 0; n <= bad_count; ++n) {
          const std::int64_t end = n < bad_count ? bad[n] : pv_keys;
          if (end > begin || (n == bad_count && !rescaled)) {
            DirectKv::tile_accumulate(p, a, v_rows, x * a.v.stride[1], begin, end - begin, 0, rows,
                                      wx.scores + begin, dv_pad, rescaled ? ones : wx.alpha,
                                      wx.out);
            rescaled = true;
          }
          begin = end + 1;
        }
      } else {
        Dot::accumulate(wx.scores, v_tile, dv_pad, padded_rows, pv_cols, wx.alpha, wx.probs16,
                        wx.out);
      }
      if (bad_count > 0) {
        add_bad_keys(p, band, a.v, b, kv_head, j0, bad, bad_count, hx, index_of, rows, wx.scores,
                     p.head_dim_v, wx.out, dv_pad);
      }
    }
    if (direct && !cut && overlap_heads) {  // P . V with the next tile's scores, or after the loop
      const FlashScratch w0 = scratch_of(0);
      pending = PendingProduct{&v_rows, pv_keys, rows, w0.scores, w0.alpha, heads, w.head_floats};
    } else if (direct && !cut && !overlap) {
      // In place, no key left out: P . V in chunks of keys across the heads.
      const FlashScratch w0 = scratch_of(0);
      DirectKv::tile_accumulate_chunks(p, a, v_rows, pv_keys, heads, rows, w0.scores, dv_pad,
                                       w0.alpha, w0.out, w.head_floats);
    }
  }

  if (pending.v_rows != nullptr) {  // the last tile's P . V
    DirectKv::run_pending(p, a, pending, dv_pad, scratch_of(0).out);
  }

  // out = O / l, lse = m ln 2 + log l; rows with no visible key: exactly 0 (even where V holds
  // inf or NaN, which 0-weighted keys still bring into O) and -inf.
  for (std::int64_t x = 0; x < heads; ++x) {
    const FlashScratch wx = scratch_of(x);
    std::int64_t hx[kBlockRows];
    heads_of(x, hx);
    for (std::int64_t r = 0; r < rows; ++r) {
      const SoftmaxState& state = wx.softmax[r];
      const float out_factor = state.out_factor();
      float* o = wx.out + r * dv_pad;
      if (out_factor == 0.0f) {
        for (std::int64_t e = 0; e < p.head_dim_v; ++e) o[e] = 0.0f;
      } else {
        for (std::int64_t e = 0; e < p.head_dim_v; ++e) o[e] *= out_factor;
      }
      const std::int64_t h = hx[r], i = index_of[r];
      store_row_narrowed(narrow_row, o, p.head_dim_v, a.out.data, a.out.dtype,
                         offset4(a.out, b, h, i, 0));
      if (a.lse.data != nullptr) {
        store_element(a.lse.data, a.lse.dtype,  // (rounded once to the LSE's dtype)
                      b * a.lse.stride[0] + h * a.lse.stride[1] + i * a.lse.stride[2], state.lse());
      }
    }
  }
}

// The exported entry points: native bf16 dot products for bf16 inputs where this target has
// them, f32 for everything else (p.dtype is the query's: an f32 query over a bf16 cache takes
// f32 products, its K/V widened exactly as F32Dot packs them or DirectKv loads them).
ATTNCORE_TARGET void run_block(const Params& p, const ForwardArgs& a, const FlashPanel& panel,
                               const FlashItem& item, const FlashScratch& w) {
#if ATTNCORE_BF16_DOT
  // Decode items read bf16 K/V in place in f32 like every dtype (flash_reads_kv_in_place): each
  // K/V element is used once per row, too few times to pay for packing it into bf16 pairs.
  const bool direct = panel.k_tiles == nullptr && item.rows <= kDirectRows;
  if (p.dtype == DType::bf16 && !direct) return run_block_with<Bf16Dot>(p, a, panel, item, w);
#endif
  run_block_with<F32Dot>(p, a, panel, item, w);
}

// Packs tiles [t_begin, t_end) into a panel: K [tiles][D][kKeyTile] floats' worth, then V
// [tiles * kKeyTile][dv_pad] floats' worth.
ATTNCORE_TARGET void pack_tiles(const Params& p, const ForwardArgs& a, std::int64_t b,
                                std::int64_t kv_head, std::int64_t t_begin, std::int64_t t_end,
                                float* k_tiles, float* v_rows, std::int64_t dv_pad) {
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

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
