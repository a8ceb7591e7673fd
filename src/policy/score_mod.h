// The score modifiers of docs/design.md section 1.2, applied in this order after s = scale * q.k:
// softcap, ALiBi, additive bias. Each is defined here once: softcap for any arithmetic type T
// with the usual operators, double or float scalars (the math backend, policy/score_row.h) and
// the flash kernels' vectors (src/cpu/flash_*-inl.h), which pass their own tanh; ALiBi and the
// bias for scalars, holding a sum that overflows (held). Backward multiplies dS by the softcap
// derivative (ALiBi and the bias pass dS through unchanged).
//
// They work in place on references: the flash kernels call them from functions compiled for
// their SIMD target, and a vector passed or returned by value between such a function and one
// without the target's ISA (as these are) changes the call ABI, which clang refuses. Always
// inlined, they take the caller's ISA and leave no baseline copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#define ATTNCORE_POLICY_INLINE inline __attribute__((always_inline))

namespace attncore::detail {

// Softcap: s -> cap * tanh(s / cap), with s / cap computed as s * inv_cap (inv_cap = 1 / cap,
// rounded once by the caller); tanh(y) replaces y by its tanh. cap == 0 means off: callers test
// it once per call. C is the scalar type of T (float for float and vectors, double for double).
template <class T, class C, class Tanh>
ATTNCORE_POLICY_INLINE void softcap(T& s, C cap, C inv_cap, Tanh&& tanh) {
  T y = s * inv_cap;
  tanh(y);
  s = cap * y;
}

// The softcap derivative d(softcap(s))/ds = 1 - tanh(s / cap)^2, from the capped value
// c = softcap(s) (so that backward keeps only c), into `derivative`.
template <class T, class C>
ATTNCORE_POLICY_INLINE void softcap_derivative(const T& capped, C inv_cap, T& derivative) {
  const T t = capped * inv_cap;
  derivative = C(1) - t * t;
}

// ALiBi: the key's distance from query row i's diagonal, |i + Lk - Lq - j|, as an integer
// (callers convert it to their type once).
inline std::int64_t alibi_distance(std::int64_t i, std::int64_t j, std::int64_t seqlen_q,
                                   std::int64_t seqlen_k) {
  const std::int64_t distance = i + seqlen_k - seqlen_q - j;
  return distance < 0 ? -distance : distance;
}

// y, a score of finite terms, held within T's range where their product or sum overflowed:
// +-max instead of an infinity, which a -inf mask would meet as NaN and its row's softmax as
// inf - inf (scale 1e38 times q.k of 10 in f32). Such scores of one row share its weight
// equally (README, "Known limits"). Scalars (float, double).
template <class T>
ATTNCORE_POLICY_INLINE T held(T y) {
  return std::isinf(y) ? std::copysign(std::numeric_limits<T>::max(), y) : y;
}

// x * factor (a scale times q.k), held where x was finite.
template <class T>
ATTNCORE_POLICY_INLINE T held_product(T x, T factor) {
  const T y = x * factor;
  return std::isfinite(x) ? held(y) : y;
}

// The additive bias's term: s += bias, held where both were finite (a -inf bias masks the key).
template <class T>
ATTNCORE_POLICY_INLINE void add_bias(T& s, T bias) {
  const bool finite = std::isfinite(s) && std::isfinite(bias);
  s += bias;
  if (finite) s = held(s);
}

// ALiBi's term: s += -slope * distance (distance from alibi_distance, converted to T), held
// where s was finite (validation bounds the slopes so that the term itself is finite).
// Scalars.
template <class T, class C>
ATTNCORE_POLICY_INLINE void alibi(T& s, C slope, const T& distance) {
  const bool finite = std::isfinite(s);
  s += -slope * distance;
  if (finite) s = held(s);
}

}  // namespace attncore::detail

#undef ATTNCORE_POLICY_INLINE
