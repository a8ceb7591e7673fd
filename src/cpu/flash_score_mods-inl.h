// The score modifiers of docs/design.md section 1.2 (softcap, ALiBi, additive and boolean masks) on
// one row of a score tile, for one SIMD target: used by the forward tile loop and the backward.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/convert.h"
#include "core/params.h"
#include "cpu/flash_simd-inl.h"
#include "policy/score_mod.h"

namespace attncore::detail::ATTNCORE_TARGET_NS {

// tanh(y): for |y| < 0.625 the odd polynomial y + y^3 P(y^2) (Cephes' tanhf coefficients,
// relative error 1.3e-7 there), elsewhere 1 - 2 / (e^(2y) + 1), which saturates to +-1 and keeps
// NaN. That formula alone loses tanh's digits to cancellation as y -> 0, where the softcap of
// large caps works (s / cap = 1e-8 for s = 1 at cap 1e8 gave tanh 0, an error of 1 in the score).
ATTNCORE_TARGET inline Vec tanhv(Vec y) {
  const Vec z = y * y;
  Vec poly = splat(-5.70498872745e-3f);
  poly = poly * z + 2.06390887954e-2f;
  poly = poly * z - 5.37397155531e-2f;
  poly = poly * z + 1.33314422036e-1f;
  poly = poly * z - 3.33332819422e-1f;
  const Vec small = poly * z * y + y;
  const Vec large = 1.0f - 2.0f / (exp2v(y * (2.0f * kLog2e)) + 1.0f);
  return z < 0.390625f ? small : large;  // 0.390625 = 0.625^2; NaN and inf take `large`
}

// Softcap (policy/score_mod.h) on columns [0, cols) of one row of a tile: s becomes the capped
// score; dcap, unless null, receives its derivative.
// A cap past f32's range (the call's cap is a double) leaves them unchanged: tanh(s / cap) cap
// rounds to s for every f32 score that is not itself near f32's limit.
ATTNCORE_TARGET inline void apply_softcap(float cap, std::int64_t cols, float* s, float* dcap) {
  if (cap == INFINITY) return;
  const float inv_cap = 1.0f / cap;
  const auto tanh = [](Vec& y) ATTNCORE_TARGET { y = tanhv(y); };
  for (std::int64_t c = 0; c < cols; c += kLanes) {
    Vec x = load(s + c);
    softcap(x, cap, inv_cap, tanh);
    store(s + c, x);
    if (dcap != nullptr) {
      Vec derivative;
      softcap_derivative(x, inv_cap, derivative);
      store(dcap + c, derivative);
    }
  }
}

// The score modifiers of docs/design.md section 1.2 on one row of a tile (keys j0 .. j0 + keys).
ATTNCORE_TARGET inline void apply_score_mods(const Params& p, std::int64_t b, std::int64_t h,
                                             std::int64_t i, std::int64_t j0, std::int64_t keys,
                                             float* s) {
  if (p.softcap != 0.0) apply_softcap(static_cast<float>(p.softcap), keys, s, nullptr);
  if (p.alibi != nullptr) {
    const float slope = p.alibi[b * p.alibi_stride_b + h * p.alibi_stride_h];
    for (std::int64_t c = 0; c < keys; ++c) {
      alibi(s[c], slope, static_cast<float>(alibi_distance(i, j0 + c, p.seq.lq, p.seq.lk)));
    }
  }
  if (p.mask_kind != MaskKind::none) {
    const std::int64_t base = offset4(p.mask, b, h, i, j0);
    const std::int64_t stride = p.mask.stride[3];
    if (p.mask_kind == MaskKind::additive) {
      if (p.mask.dtype == DType::f32 && stride == 1) {
        const float* m = static_cast<const float*>(p.mask.data) + base;
        for (std::int64_t c = 0; c < keys; ++c) add_bias(s[c], m[c]);
      } else {
        for (std::int64_t c = 0; c < keys; ++c) {
          add_bias(s[c], load_element<float>(p.mask.data, p.mask.dtype, base + c * stride));
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

}  // namespace attncore::detail::ATTNCORE_TARGET_NS
