// Keys a row cannot see (docs/design.md section 1.11, policy/kv_access.h) for one SIMD target.
// The products multiply whole tiles: a key hidden from a row has weight exactly 0 there, and
// 0 * inf or 0 * NaN in its K or V row would still reach the row. Such keys are rare, and only
// tiles some row does not see entirely can hold them, so the kernels look for them there and
// only then take the careful path: the key's row zeroed in a copy of the tile for the product,
// and added back to the rows that see it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "core/sequence.h"
#include "cpu/flash_simd-inl.h"
#include "policy/kv_access.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// Whether elements [at, at + n) of a view's data (f32, bf16 or f16) are all finite: x * 0 is 0
// for finite x and NaN for inf and NaN.
ATTNCORE_TARGET inline bool row_is_finite(const TensorView& t, std::int64_t at, std::int64_t n) {
  Vec acc = Vec{};
  for (std::int64_t e0 = 0; e0 < n; e0 += kLanes) {
    const int m = static_cast<int>(std::min<std::int64_t>(kLanes, n - e0));
    const Vec x = t.dtype == DType::f32
                      ? load_part(static_cast<const float*>(t.data) + at + e0, m)
                      : load_part(static_cast<const std::uint16_t*>(t.data) + at + e0, m, t.dtype);
    acc += x * 0.0f;
  }
  return reduce_sum(acc) == 0.0f;
}

// The keys j0 + c (c < keys) whose row of t (K or V of (b, kv_head)) holds inf or NaN, into
// bad[]; returns their count.
ATTNCORE_TARGET inline std::int64_t nonfinite_keys(const TensorView& t, std::int64_t b,
                                                   std::int64_t kv_head, std::int64_t j0,
                                                   std::int64_t keys, std::int64_t width,
                                                   std::int64_t* bad) {
  std::int64_t count = 0;
  for (std::int64_t c = 0; c < keys; ++c) {
    if (!row_is_finite(t, offset4(t, b, kv_head, j0 + c, 0), width)) bad[count++] = c;
  }
  return count;
}

// out[r][e] += weight[r * kKeyTile + c] * t[key j0 + c][e] (e < width) for each bad key c and
// each row r < rows that sees it: the products' share of the keys left out of them.
ATTNCORE_TARGET __attribute__((noinline)) inline void add_bad_keys(
    const Params& p, const CausalWindowMask& band, const TensorView& t, std::int64_t b,
    std::int64_t kv_head, std::int64_t j0, const std::int64_t* bad, std::int64_t bad_count,
    const std::int64_t* head_of, const std::int64_t* index_of, std::int64_t rows,
    const float* weight, std::int64_t width, float* out, std::int64_t ld_out) {
  for (std::int64_t n = 0; n < bad_count; ++n) {
    const std::int64_t c = bad[n], at = kv_offset(p, t, b, kv_head, j0 + c);
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!row_sees_key(p, band, b, head_of[r], index_of[r], j0 + c)) continue;
      const float w = weight[r * kKeyTile + c];
      for (std::int64_t e = 0; e < width; ++e) {
        out[r * ld_out + e] += w * load_element<float>(t.data, t.dtype, at + e);
      }
    }
  }
}

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
