// The online softmax of one query row, the one place its running max and sum are kept
// (docs/design.md section 1.4, 1.6 and 1.12): the flash tile loop updates it tile by tile; the
// merge of finished (out, LSE) pairs below serves split-KV decode and the public merge.
//
// Scores enter in log2 units (score * log2 e): the running max is such a product, rounded once
// by the caller, and the caller forms each probability 2^(s - max) from its score's unrounded
// product less that max, so that every probability of the row carries the max's one rounding as
// a common factor, which the sum and the LSE cancel; the rescale 2^(old max - new max) takes the
// same rounded maxes. The LSE leaves in natural log. The accumulator acc = sum_j 2^(s_j - max)
// v_j is the caller's (a row of Dv floats it rescales by the factor update() is given).
#pragma once

#include <cmath>
#include <cstdint>

namespace attncore::detail {

struct SoftmaxState {
  float max = -INFINITY;  // running max of the scores seen, log2 units (-inf: none visible)
  float sum = 0.0f;       // sum of 2^(s - max) over the scores seen

  // The max after a tile whose largest score is `tile_max`. NaN scores make the row NaN (never
  // "nothing visible"). -inf: still nothing visible (the tile's probabilities are all 0).
  float next_max(float tile_max) const {
    return tile_max > max || std::isnan(tile_max) ? tile_max : max;
  }

  // alpha, the factor the sum and the accumulator are rescaled by when the max moves to
  // `new_max` (from next_max, not -inf): 0 when nothing was visible before, exactly 1 while the
  // max stays, else 2^(old max - new max) by `exp2` (the caller's vector exp2 on one lane).
  template <class Exp2>
  float alpha(float new_max, Exp2&& exp2) const {
    return max == -INFINITY ? 0.0f : max == new_max ? 1.0f : exp2(max - new_max);
  }

  // Moves the state to `new_max` and adds a tile's probabilities (computed against new_max) in
  // one step: sum = sum * alpha + tile_sum, alpha from alpha(new_max).
  void update(float new_max, float alpha, float tile_sum) {
    sum = sum * alpha + tile_sum;
    max = new_max;
  }

  // The factor the accumulator is multiplied by to give the output: 1 / sum, or 0 for a row
  // with no visible key, whose output the caller writes as exactly 0 rather than multiplying
  // (0-weighted keys may have brought inf or NaN from V into the accumulator).
  float out_factor() const { return sum == 0.0f ? 0.0f : 1.0f / sum; }

  // The row's LSE in natural log, max ln 2 + ln sum (-inf for a row with no visible key), in
  // double: all that max and sum say (an f32 LSE of 1e5 is good to ulp 0.0078 only), for parts
  // merged later (split-KV weighs each by exp(LSE - max LSE)) and f64 outputs; an f32 output
  // rounds it once (so that a sequence merged from one part has the bits of its unsplit call).
  double lse() const {
    constexpr double kLn2 = 0.6931471805599453;
    return sum == 0.0f ? -INFINITY : static_cast<double>(max) * kLn2 + std::log(double{sum});
  }
};

// Merges `parts` finished results over disjoint key sets (docs/design.md section 1.12): part s
// has output outs[s][0, n) (T) and LSE lses[s] (L: T, or double for f32 parts whose LSEs carry
// more than f32 holds); LSE = log(sum_s exp(lses[s])) computed stably, out =
// sum_s exp(lses[s] - LSE) outs[s]; a part with LSE -inf contributes nothing (even NaN in its
// output), all -inf give 0 and -inf; a NaN or +inf LSE makes the result NaN. The weights are e_s /
// sum(e) with e_s = exp(lses[s] - max LSE), not exp(lses[s] - LSE) through the rounded LSE: where
// the LSE is large (1e5 and more in f32) its rounding would lose log(sum(e)), and weights meant
// to sum to 1 would not. All parts at once, so that split-KV's parts are not weighed by LSEs
// rounded along the way. Writes out[0, n) (no part's output may be `out`) and returns the
// merged LSE. T, L: float or double.
template <class T, class L>
L merge_outputs(const T* const* outs, const L* lses, int parts, std::int64_t n, T* out) {
  L hi = -INFINITY;
  for (int s = 0; s < parts; ++s) {
    if (lses[s] > hi || std::isnan(lses[s])) hi = lses[s];
    if (std::isnan(hi)) break;
  }
  if (hi == -INFINITY) {
    for (std::int64_t e = 0; e < n; ++e) out[e] = T(0);
    return hi;
  }
  L sum = 0;
  for (int s = 0; s < parts; ++s) {
    if (lses[s] != -INFINITY) sum += std::exp(lses[s] - hi);
  }
  bool first = true;
  for (int s = 0; s < parts; ++s) {
    if (lses[s] == -INFINITY) continue;
    const T w = static_cast<T>(std::exp(lses[s] - hi) / sum);
    const T* o = outs[s];
    for (std::int64_t e = 0; e < n; ++e) out[e] = first ? w * o[e] : out[e] + w * o[e];
    first = false;
  }
  return hi + std::log(sum);
}

// The same for two results (the public merge's).
template <class T>
T merge_outputs(const T* out_a, T lse_a, const T* out_b, T lse_b, std::int64_t n, T* out) {
  const T* const outs[2] = {out_a, out_b};
  const T lses[2] = {lse_a, lse_b};
  return merge_outputs(outs, lses, 2, n, out);
}

}  // namespace attncore::detail
