// DirectKv, for one SIMD target: decode-shaped work items read K and V where they lie, in f32,
// instead of packing each tile first.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash_simd-inl.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// Decode-shaped items (one per kv group, at most kTileRows query rows) read K and V where they
// lie, in f32, instead of packing each tile first: packing is most of such an item's work.
struct DirectKv {
  // q [kTileRows][D]: the rows' queries, unscaled, in f32 (zero rows past `rows`).
  ATTNCORE_TARGET static void load_queries(const Params& p, const ForwardArgs& a, std::int64_t b,
                                           const std::int64_t* head_of,
                                           const std::int64_t* index_of, std::int64_t rows,
                                           float* q) {
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
  ATTNCORE_TARGET static void scores(const Params& p, const T* k, std::int64_t ldk, DType dtype,
                                     std::int64_t keys, std::int64_t cols, std::int64_t ahead,
                                     const float* q, std::int64_t rows, float* s) {
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
  ATTNCORE_TARGET static void accumulate(const Params& p, const T* v, std::int64_t ldv, DType dtype,
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
  ATTNCORE_TARGET static void tile_scores(const Params& p, const ForwardArgs& a, std::int64_t b,
                                          std::int64_t kv_head, std::int64_t j0, std::int64_t keys,
                                          std::int64_t cols, const float* q, std::int64_t rows,
                                          float* s) {
    const std::int64_t at = offset4(a.k, b, kv_head, j0, 0), ahead = p.seq.lk - j0;
    if (a.k.dtype == DType::f32) {
      scores(p, static_cast<const float*>(a.k.data) + at, a.k.stride[2], a.k.dtype, keys, cols,
             ahead, q, rows, s);
    } else {
      scores(p, static_cast<const std::uint16_t*>(a.k.data) + at, a.k.stride[2], a.k.dtype, keys,
             cols, ahead, q, rows, s);
    }
  }
  ATTNCORE_TARGET static void tile_accumulate(const Params& p, const ForwardArgs& a, std::int64_t b,
                                              std::int64_t kv_head, std::int64_t j0,
                                              std::int64_t keys, const float* probs,
                                              std::int64_t dv_pad, const float* alpha, float* out) {
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

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
