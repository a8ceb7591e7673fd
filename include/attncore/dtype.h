// Element types of attncore tensors and the 16-bit float storage types.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace attncore {

enum class DType : std::uint8_t {
  f32,   // IEEE binary32
  f64,   // IEEE binary64 (reference backend and math backend)
  bf16,  // bfloat16: the high half of a binary32
  f16,   // IEEE binary16
  b8,    // bool, one byte, 0 = false; only for boolean attention masks
  i32,   // int32 index arrays (cu_seqlens, seqused_k, page tables); never a value type
};

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::b8:
      return 1;
    case DType::i32:
      return 4;
  }
  return 0;
}

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::b8:
      return "bool";
    case DType::i32:
      return "i32";
  }
  return "?";
}

constexpr bool is_floating(DType t) { return t != DType::b8 && t != DType::i32; }

// bfloat16 storage: conversion from float rounds to nearest even; NaN stays NaN.
struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  explicit bf16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  static float to_float(std::uint16_t b) {
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static std::uint16_t from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
      return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
  }
};

// IEEE binary16 storage: conversion from float rounds to nearest even, overflow gives inf.
struct f16 {
  std::uint16_t bits = 0;

  f16() = default;
  explicit f16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }

  // Branch-free (so that loops of it vectorise): the 15 magnitude bits moved into a float's
  // exponent and mantissa and scaled by 2^112 give every normal half exactly; a subnormal half
  // (exponent 0) is its 10 bits times 2^-24, converted from the integer, so that a caller's
  // denormals-are-zero mode (which would read the float subnormal the shift makes as 0) changes
  // nothing, as it changes nothing in F16C's conversion; exponent 31 (inf, NaN) is rebuilt
  // with the float's all-ones exponent.
  static float to_float(std::uint16_t h) {
    const std::uint32_t magnitude = static_cast<std::uint32_t>(h & 0x7fffu) << 13;
    float f;
    std::memcpy(&f, &magnitude, 4);
    f *= 0x1p112f;
    if ((h & 0x7c00u) == 0) f = static_cast<float>(h & 0x3ffu) * 0x1p-24f;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((h & 0x7c00u) == 0x7c00u) u = 0x7f800000u | magnitude;  // inf or NaN, payload kept
    u |= static_cast<std::uint32_t>(h & 0x8000u) << 16;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static std::uint16_t from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
    if (abs >= 0x477ff000u)
      return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
    if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
      if (abs < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
      const std::uint32_t exp = abs >> 23;
      const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      const std::uint32_t shift = 126u - exp;  // 14..24
      std::uint32_t h = mant >> shift;
      const std::uint32_t rem = mant & ((1u << shift) - 1u);
      const std::uint32_t half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (h & 1u))) ++h;
      return static_cast<std::uint16_t>(sign | h);
    }
    std::uint32_t h = ((abs >> 13) - (112u << 10));  // rebias 127 -> 15
    const std::uint32_t rem = abs & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
};

}  // namespace attncore
