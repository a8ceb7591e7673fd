// Reading and writing elements of any DType as float or double, and view addressing.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attncore/dtype.h"
#include "attncore/tensor.h"

namespace attncore::detail {

// Element offset of index (i0, i1, i2, i3) in a rank-4 view (in elements).
inline std::int64_t offset4(const TensorView& t, std::int64_t i0, std::int64_t i1, std::int64_t i2,
                            std::int64_t i3) {
  return i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2] + i3 * t.stride[3];
}

template <class T>
inline T load_element(const void* base, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f32:
      return static_cast<T>(static_cast<const float*>(base)[index]);
    case DType::f64:
      return static_cast<T>(static_cast<const double*>(base)[index]);
    case DType::bf16:
      return static_cast<T>(bf16::to_float(static_cast<const std::uint16_t*>(base)[index]));
    case DType::f16:
      return static_cast<T>(f16::to_float(static_cast<const std::uint16_t*>(base)[index]));
    case DType::b8:
      return static_cast<const std::uint8_t*>(base)[index] ? T(1) : T(0);
    case DType::i32:
      return static_cast<T>(static_cast<const std::int32_t*>(base)[index]);
  }
  return T(0);
}

// x as a float rounded to odd (toward zero, then the last bit set where that is inexact). A
// float so rounded, rounded again to bf16 or f16 to nearest even, is x rounded so at once; a
// float rounded to nearest first can land on a tie x was not on (1 + 2^-8 + 2^-40 would become
// bf16 1.0, not 1.0078125). NaN stays NaN; past the float range, FLT_MAX, which both round to
// inf.
inline float round_to_odd_float(double x) {
  float f = static_cast<float>(x);
  if (x != x || static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

// value into element `index` of dtype at base: 16-bit dtypes rounded to nearest even from the
// value itself (a double through round_to_odd_float).
template <class T>
inline void store_element(void* base, DType dtype, std::int64_t index, T value) {
  if constexpr (std::is_same_v<T, double>) {
    if (dtype == DType::bf16 || dtype == DType::f16) {
      return store_element<float>(base, dtype, index, round_to_odd_float(value));
    }
  }
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(base)[index] = static_cast<float>(value);
      return;
    case DType::f64:
      static_cast<double*>(base)[index] = static_cast<double>(value);
      return;
    case DType::bf16:
      static_cast<std::uint16_t*>(base)[index] = bf16::from_float(static_cast<float>(value));
      return;
    case DType::f16:
      static_cast<std::uint16_t*>(base)[index] = f16::from_float(static_cast<float>(value));
      return;
    case DType::b8:
      static_cast<std::uint8_t*>(base)[index] = value != T(0);
      return;
    case DType::i32:
      static_cast<std::int32_t*>(base)[index] = static_cast<std::int32_t>(value);
      return;
  }
}

// f(std::integral_constant<DType, dtype>{}): the dtype as a constant, so that a loop over a
// row's elements inside f tests it once (the loops below tested it per element, an indirect jump
// each: a GQA decode item of 512 bf16 keys spent about 15% of its time loading its queries and
// storing its output that way).
template <class F>
inline void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32:
      return f(std::integral_constant<DType, DType::f32>{});
    case DType::f64:
      return f(std::integral_constant<DType, DType::f64>{});
    case DType::bf16:
      return f(std::integral_constant<DType, DType::bf16>{});
    case DType::f16:
      return f(std::integral_constant<DType, DType::f16>{});
    case DType::b8:
      return f(std::integral_constant<DType, DType::b8>{});
    case DType::i32:
      return f(std::integral_constant<DType, DType::i32>{});
  }
}

// n elements at base + index, `stride` elements apart (contiguous by default) -> dst
// (converted to T).
template <class T>
inline void load_row(const void* base, DType dtype, std::int64_t index, std::int64_t n, T* dst,
                     std::int64_t stride = 1) {
  with_dtype(dtype, [&](auto known) {
    for (std::int64_t e = 0; e < n; ++e) dst[e] = load_element<T>(base, known, index + e * stride);
  });
}

// n values of src -> elements at base + index, `stride` elements apart (contiguous by default;
// converted to dtype).
template <class T>
inline void store_row(const T* src, std::int64_t n, void* base, DType dtype, std::int64_t index,
                      std::int64_t stride = 1) {
  with_dtype(dtype, [&](auto known) {
    for (std::int64_t e = 0; e < n; ++e) store_element<T>(base, known, index + e * stride, src[e]);
  });
}

// dst [n] = src [n] rounded to bf16 or f16 (dtype) to nearest even: the bits of
// bf16::from_float and f16::from_float, by a SIMD target's vectors (cpu/flash_simd-inl.h's
// narrow_row, reached through GemmTarget::narrow and FlashTarget::narrow).
using NarrowFn = void (*)(const float* src, DType dtype, std::int64_t n, std::uint16_t* dst);

// store_row for f32 values, a 16-bit dtype rounded by `narrow`.
inline void store_row_narrowed(NarrowFn narrow, const float* src, std::int64_t n, void* base,
                               DType dtype, std::int64_t index) {
  if (dtype == DType::bf16 || dtype == DType::f16) {
    narrow(src, dtype, n, static_cast<std::uint16_t*>(base) + index);
  } else {
    store_row(src, n, base, dtype, index);
  }
}

}  // namespace attncore::detail
