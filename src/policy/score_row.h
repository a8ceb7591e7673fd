// One row of attention, unfused: the final scores of query row i from its raw dot products,
// the dense softmax with its LSE, and dropout. The reference (T = double) and math (T = float
// for f32/bf16/f16, double for f64) backends both use these, so they agree by construction on
// what every option means.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/convert.h"
#include "core/philox.h"
#include "core/params.h"
#include "policy/mask.h"
#include "policy/score_mod.h"

namespace attncore::detail {

// s[j], j in [0, Lk): on entry <q_i, k_j>; on return the score of docs/design.md section 1
// (scale, softcap, ALiBi, additive mask) or -inf where a mask hides key j; the scaled score of
// a finite q.k, and its sum with a finite bias, held within T's range (policy/score_mod.h).
// When `dcap` is not null it receives d(score)/d(scale * q.k), the softcap derivative (0
// where masked).
template <class T>
void finish_scores(const Params& p, const CausalWindowMask& causal_window, std::int64_t b,
                   std::int64_t h, std::int64_t i, T* s, T* dcap) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const KeyRange visible = causal_window.row(i);
  const T scale = static_cast<T>(p.scale);
  for (std::int64_t j = 0; j < std::min(visible.begin, p.seq.lk); ++j) s[j] = kNegInf;
  for (std::int64_t j = visible.end; j < p.seq.lk; ++j) s[j] = kNegInf;
  if (dcap) {
    for (std::int64_t j = 0; j < p.seq.lk; ++j) dcap[j] = T(0);
  }
  if (p.softcap == 0.0 && !p.alibi && p.mask_kind == MaskKind::none) {
    for (std::int64_t j = visible.begin; j < visible.end; ++j) {  // the common case
      s[j] = held_product(s[j], scale);
    }
    if (dcap) {
      for (std::int64_t j = visible.begin; j < visible.end; ++j) dcap[j] = T(1);
    }
    return;
  }
  const T cap = static_cast<T>(p.softcap);
  const T inv_cap = cap == T(0) ? T(0) : T(1) / cap;
  const T slope =
      p.alibi ? static_cast<T>(p.alibi[b * p.alibi_stride_b + h * p.alibi_stride_h]) : T(0);
  const std::int64_t mask_row = p.mask_kind == MaskKind::none ? 0 : offset4(p.mask, b, h, i, 0);
  for (std::int64_t j = visible.begin; j < visible.end; ++j) {
    T x = held_product(s[j], scale);
    if (cap != T(0) && cap != std::numeric_limits<T>::infinity()) {  // see flash's apply_softcap
      softcap(x, cap, inv_cap, [](T& y) { y = std::tanh(y); });
      if (dcap) softcap_derivative(x, inv_cap, dcap[j]);
    } else if (dcap) {
      dcap[j] = T(1);
    }
    if (p.alibi) alibi(x, slope, static_cast<T>(alibi_distance(i, j, p.seq.lq, p.seq.lk)));
    if (p.mask_kind != MaskKind::none) {
      const T m = load_element<T>(p.mask.data, p.mask.dtype, mask_row + j * p.mask.stride[3]);
      if (p.mask_kind == MaskKind::additive) {
        add_bias(x, m);
      } else if (m == T(0)) {
        x = kNegInf;
      }
    }
    s[j] = x;
  }
}

// In place: s[j] -> softmax_j(s) over n keys; returns the row's LSE = log(sum_j exp(s_j)).
// A row with no finite score gives P = 0 and LSE = -inf; NaN scores give NaN.
template <class T>
T softmax_row(T* s, std::int64_t n) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  T row_max = kNegInf;
  bool has_nan = false;
  for (std::int64_t j = 0; j < n; ++j) {
    has_nan |= std::isnan(s[j]);
    if (s[j] > row_max) row_max = s[j];
  }
  if (row_max == kNegInf && !has_nan) {
    for (std::int64_t j = 0; j < n; ++j) s[j] = T(0);
    return kNegInf;
  }
  if (has_nan) row_max = std::numeric_limits<T>::quiet_NaN();
  T row_sum = T(0);
  for (std::int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - row_max);
    row_sum += s[j];
  }
  const T inv = T(1) / row_sum;
  for (std::int64_t j = 0; j < n; ++j) s[j] *= inv;
  return row_max + std::log(row_sum);
}

// The dropout factor of element (b, h, i, j): 1/(1-p) if kept, else 0 (1 without dropout).
// Addressed as in a [B, Hq, dropout.rows, dropout.cols] batch (docs/design.md section 1.5).
class DropoutRow {
 public:
  DropoutRow(const Params& p, std::int64_t b, std::int64_t h, std::int64_t i)
      : seed_(p.dropout.seed),
        p_(static_cast<float>(p.dropout.p)),
        keep_scale_(1.0 / (1.0 - p.dropout.p)),
        base_(p.dropout.offset +
              ((static_cast<std::uint64_t>(b) * static_cast<std::uint64_t>(p.heads_q) +
                static_cast<std::uint64_t>(h)) *
                   static_cast<std::uint64_t>(p.dropout.rows) +
               static_cast<std::uint64_t>(i)) *
                  static_cast<std::uint64_t>(p.dropout.cols)),
        base_high_(base_ < p.dropout.offset ? 1u : 0u),  // offset + index passed 2^64
        active_(p.dropout.p > 0.0) {}

  bool active() const { return active_; }

  template <class T>
  T factor(std::int64_t j) const {
    if (!active_) return T(1);
    const std::uint64_t pos = base_ + static_cast<std::uint64_t>(j);
    return dropout_keep(seed_, pos, p_, base_high_ + (pos < base_ ? 1u : 0u))
               ? static_cast<T>(keep_scale_)
               : T(0);
  }

 private:
  std::uint64_t seed_;
  float p_;
  double keep_scale_;
  std::uint64_t base_;       // the row's first position, modulo 2^64 ...
  std::uint64_t base_high_;  // ... and its bits above 2^64 (the element index is < 2^63)
  bool active_;
};

}  // namespace attncore::detail
