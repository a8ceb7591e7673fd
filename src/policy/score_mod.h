// The score modifiers of docs/design.md section 1.2, applied in this order after s = scale * q.k:
// softcap, ALiBi, additive bias. Each has its value here; backward multiplies dS by the
// softcap derivative (ALiBi and the bias pass dS through unchanged).
#pragma once

#include <cmath>
#include <cstdint>

namespace attncore::detail {

// s -> cap * tanh(s / cap); cap == 0 means off.
template <class T>
inline T softcap_apply(T s, T cap) {
  return cap == T(0) ? s : cap * std::tanh(s / cap);
}

// d(softcap(s))/ds written in terms of the capped value c = cap * tanh(s / cap).
template <class T>
inline T softcap_grad_from_capped(T capped, T cap) {
  if (cap == T(0)) return T(1);
  const T t = capped / cap;
  return T(1) - t * t;
}

// ALiBi's term for query row i and key column j: -slope * |i + Lk - Lq - j|.
template <class T>
inline T alibi_bias(T slope, std::int64_t i, std::int64_t j, std::int64_t seqlen_q,
                    std::int64_t seqlen_k) {
  const std::int64_t distance = i + seqlen_k - seqlen_q - j;
  return -slope * static_cast<T>(distance < 0 ? -distance : distance);
}

}  // namespace attncore::detail
