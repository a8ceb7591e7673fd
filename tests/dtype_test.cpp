// bf16 and f16 storage types (include/attncore/dtype.h): decoding every bit pattern, round
// trips, round-to-nearest-even, overflow, subnormals, infinities and NaN, against expectations
// computed here from the IEEE definitions.
#include "attncore/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "testing/random.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr: the DAZ test
#endif

namespace attncore {
namespace {

float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The value of a binary16 pattern from the IEEE definition (exponent bias 15, 10-bit fraction).
double f16_value(std::uint16_t h) {
  const double sign = (h & 0x8000u) != 0 ? -1.0 : 1.0;
  const int exp = (h >> 10) & 0x1f;
  const int frac = h & 0x3ff;
  if (exp == 0x1f)
    return frac == 0 ? sign * std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(frac, -24);
  return sign * std::ldexp(1024 + frac, exp - 25);
}

// The value of a bfloat16 pattern (exponent bias 127, 7-bit fraction).
double bf16_value(std::uint16_t b) {
  const double sign = (b & 0x8000u) != 0 ? -1.0 : 1.0;
  const int exp = (b >> 7) & 0xff;
  const int frac = b & 0x7f;
  if (exp == 0xff)
    return frac == 0 ? sign * std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(frac, -133);
  return sign * std::ldexp(128 + frac, exp - 134);
}

// Nearest pattern to |x| among the non-negative finite patterns 0..max_finite of a format, with
// ties to the even pattern and the infinity pattern standing for `overflow_value` (the next
// power of two, as IEEE rounding treats it). Returns the magnitude bits.
std::uint16_t nearest_even(double ax, const std::vector<double>& table, double overflow_value) {
  // table[b] = value of pattern b for b in [0, max_finite]; table.size() - 1 + 1 is the inf
  // pattern.
  const auto inf_bits = static_cast<std::uint16_t>(table.size());
  if (ax >= overflow_value) return inf_bits;
  const auto it = std::upper_bound(table.begin(), table.end(), ax);  // first value > ax
  const auto hi = static_cast<std::size_t>(it - table.begin());      // >= 1 since table[0] = 0
  const std::size_t lo = hi - 1;
  if (table[lo] == ax) return static_cast<std::uint16_t>(lo);
  const double hi_value = hi == table.size() ? overflow_value : table[hi];
  const double d_lo = ax - table[lo];
  const double d_hi = hi_value - ax;
  if (d_lo < d_hi) return static_cast<std::uint16_t>(lo);
  if (d_hi < d_lo) return static_cast<std::uint16_t>(hi);
  return static_cast<std::uint16_t>((lo % 2 == 0) ? lo : hi);
}

std::vector<double> f16_table() {  // patterns 0x0000..0x7bff
  std::vector<double> t;
  for (std::uint32_t b = 0; b <= 0x7bffu; ++b)
    t.push_back(f16_value(static_cast<std::uint16_t>(b)));
  return t;
}

std::vector<double> bf16_table() {  // patterns 0x0000..0x7f7f
  std::vector<double> t;
  for (std::uint32_t b = 0; b <= 0x7f7fu; ++b)
    t.push_back(bf16_value(static_cast<std::uint16_t>(b)));
  return t;
}

// Floats worth rounding: random bit patterns over the whole range, plus every midpoint and its
// neighbours for a stretch of 16-bit patterns around the subnormal and overflow boundaries.
std::vector<float> probe_floats() {
  std::vector<float> xs;
  test::Random rng(2024);
  for (int n = 0; n < 400000; ++n) {
    const float f = float_from_bits(static_cast<std::uint32_t>(rng.next_u64()));
    if (!std::isnan(f)) xs.push_back(f);
  }
  // f32 values near f16 rounding boundaries (all of the f16 range, scaled by a few factors).
  for (std::uint32_t b = 0; b < 0x7c00u; b += 7) {
    const double lo = f16_value(static_cast<std::uint16_t>(b));
    const double hi = f16_value(static_cast<std::uint16_t>(b + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);  // exact in f32
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, 1e30f));
    xs.push_back(-mid);
  }
  for (std::uint32_t b = 0; b < 0x7f80u; b += 5) {
    const double lo = bf16_value(static_cast<std::uint16_t>(b));
    const double hi =
        b + 1 == 0x7f80u ? std::ldexp(1.0, 128) : bf16_value(static_cast<std::uint16_t>(b + 1));
    const double mid = (lo + hi) / 2;
    if (mid > std::numeric_limits<float>::max()) continue;
    const auto m = static_cast<float>(mid);  // exact in f32
    xs.push_back(m);
    xs.push_back(std::nextafter(m, 0.0f));
    xs.push_back(std::nextafter(m, std::numeric_limits<float>::infinity()));
    xs.push_back(-m);
  }
  return xs;
}

TEST(Bf16, DecodesEveryPatternLikeIeee) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double want = bf16_value(bits);
    const float got = bf16::to_float(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << b;
      EXPECT_EQ(std::signbit(got), (b & 0x8000u) != 0) << std::hex << b;
    }
  }
}

TEST(Bf16, EveryPatternRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = bf16::to_float(bits);
    const std::uint16_t back = bf16::from_float(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16::to_float(back))) << std::hex << b;  // NaN stays NaN
      EXPECT_EQ(back & 0x8000u, bits & 0x8000u) << std::hex << b;
    } else {
      EXPECT_EQ(back, bits) << std::hex << b;
    }
  }
}

TEST(Bf16, RoundsToNearestEven) {
  const std::vector<double> table = bf16_table();
  const double overflow = std::ldexp(1.0, 128);
  for (float f : probe_floats()) {
    const std::uint16_t want = static_cast<std::uint16_t>(
        nearest_even(std::fabs(static_cast<double>(f)), table, overflow) |
        (std::signbit(f) ? 0x8000u : 0u));
    ASSERT_EQ(bf16::from_float(f), want) << "f = " << f << " (0x" << std::hex << bits_of(f) << ")";
  }
}

TEST(Bf16, ExactCases) {
  EXPECT_EQ(bf16::from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16::from_float(-0.0f), 0x8000);
  EXPECT_EQ(bf16::from_float(1.0f), 0x3f80);
  EXPECT_EQ(bf16::from_float(-2.0f), 0xc000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even pattern 0x3f80.
  EXPECT_EQ(bf16::from_float(1.00390625f), 0x3f80);
  // 1 + 3*2^-8 is halfway between 0x3f81 and 0x3f82: ties to even 0x3f82.
  EXPECT_EQ(bf16::from_float(1.01171875f), 0x3f82);
  // Just above the halfway point rounds up.
  EXPECT_EQ(bf16::from_float(std::nextafter(1.00390625f, 2.0f)), 0x3f81);
  EXPECT_EQ(bf16::from_float(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bf16::from_float(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest float rounds past the largest bf16 (0x7f7f) to infinity.
  EXPECT_EQ(bf16::from_float(std::numeric_limits<float>::max()), 0x7f80);
  // Subnormal floats keep their top bits; the smallest subnormal float rounds to zero.
  EXPECT_EQ(bf16::from_float(float_from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(bf16::from_float(float_from_bits(0x00000001u)), 0x0000);
  EXPECT_EQ(bf16::from_float(float_from_bits(0x00018000u)), 0x0002);  // tie: to even
  const std::uint16_t nan = bf16::from_float(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7f80u, 0x7f80u);
  EXPECT_NE(nan & 0x007fu, 0u);
  // A NaN whose payload lives only in the low 16 bits must not truncate to infinity.
  const std::uint16_t low_nan = bf16::from_float(float_from_bits(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16::to_float(low_nan)));
  EXPECT_EQ(static_cast<float>(bf16(3.0f)), 3.0f);
}

TEST(F16, DecodesEveryPatternLikeIeee) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double want = f16_value(bits);
    const float got = f16::to_float(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << b;
      EXPECT_EQ(std::signbit(got), (b & 0x8000u) != 0) << std::hex << b;
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
// A process may run with denormals-are-zero (and flush-to-zero) set: decoding a subnormal half
// must not depend on it (the SIMD targets' F16C conversion ignores it; DESIGN.md section 8:
// the caller's floating-point state is theirs).
TEST(F16, DecodesSubnormalsUnderDenormalsAreZero) {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // DAZ and FTZ
  std::vector<float> got;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    if ((b & 0x7c00u) == 0) got.push_back(f16::to_float(static_cast<std::uint16_t>(b)));
  }
  _mm_setcsr(saved);
  std::size_t i = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    if ((b & 0x7c00u) != 0) continue;
    const float g = got[i++];
    EXPECT_EQ(static_cast<double>(g), f16_value(static_cast<std::uint16_t>(b))) << std::hex << b;
    EXPECT_EQ(std::signbit(g), (b & 0x8000u) != 0) << std::hex << b;
  }
}
#endif

TEST(F16, EveryPatternRoundTrips) {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = f16::to_float(bits);
    const std::uint16_t back = f16::from_float(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16::to_float(back))) << std::hex << b;
      EXPECT_EQ(back & 0x8000u, bits & 0x8000u) << std::hex << b;
    } else {
      EXPECT_EQ(back, bits) << std::hex << b;
    }
  }
}

TEST(F16, RoundsToNearestEven) {
  const std::vector<double> table = f16_table();
  const double overflow = 65536.0;  // the infinity pattern stands for 2^16 when rounding
  for (float f : probe_floats()) {
    const std::uint16_t want = static_cast<std::uint16_t>(
        nearest_even(std::fabs(static_cast<double>(f)), table, overflow) |
        (std::signbit(f) ? 0x8000u : 0u));
    ASSERT_EQ(f16::from_float(f), want) << "f = " << f << " (0x" << std::hex << bits_of(f) << ")";
  }
}

TEST(F16, ExactCases) {
  EXPECT_EQ(f16::from_float(0.0f), 0x0000);
  EXPECT_EQ(f16::from_float(-0.0f), 0x8000);
  EXPECT_EQ(f16::from_float(1.0f), 0x3c00);
  EXPECT_EQ(f16::from_float(-2.0f), 0xc000);
  EXPECT_EQ(f16::from_float(0.5f), 0x3800);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even 0x3c00; 1 + 3*2^-11 to 0x3c02.
  EXPECT_EQ(f16::from_float(1.00048828125f), 0x3c00);
  EXPECT_EQ(f16::from_float(1.00146484375f), 0x3c02);
  // Largest finite half, the overflow threshold 65520 (halfway to 2^16: ties away to inf).
  EXPECT_EQ(f16::from_float(65504.0f), 0x7bff);
  EXPECT_EQ(f16::from_float(65519.99f), 0x7bff);
  EXPECT_EQ(f16::from_float(65520.0f), 0x7c00);
  EXPECT_EQ(f16::from_float(1e6f), 0x7c00);
  EXPECT_EQ(f16::from_float(-1e6f), 0xfc00);
  EXPECT_EQ(f16::from_float(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f16::from_float(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Smallest normal 2^-14, largest subnormal 1023 * 2^-24, smallest subnormal 2^-24.
  EXPECT_EQ(f16::from_float(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(f16::from_float(1023.0f * std::ldexp(1.0f, -24)), 0x03ff);
  EXPECT_EQ(f16::from_float(std::ldexp(1.0f, -24)), 0x0001);
  // 2^-25 is halfway between 0 and 2^-24: ties to even zero; a bit more rounds up.
  EXPECT_EQ(f16::from_float(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(f16::from_float(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(f16::from_float(1.5f * std::ldexp(1.0f, -25)), 0x0001);
  // 1.5 * 2^-24 is halfway between subnormals 1 and 2: ties to even 2.
  EXPECT_EQ(f16::from_float(1.5f * std::ldexp(1.0f, -24)), 0x0002);
  // 2.5 * 2^-24 ties to even 2.
  EXPECT_EQ(f16::from_float(2.5f * std::ldexp(1.0f, -24)), 0x0002);
  // Halfway between the largest subnormal and the smallest normal rounds up to the normal.
  EXPECT_EQ(f16::from_float(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  EXPECT_EQ(f16::from_float(std::ldexp(1.0f, -30)), 0x0000);
  const std::uint16_t nan = f16::from_float(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00u, 0x7c00u);
  EXPECT_NE(nan & 0x03ffu, 0u);
  EXPECT_TRUE(std::isnan(f16::to_float(f16::from_float(float_from_bits(0x7f800001u)))));
  EXPECT_EQ(static_cast<float>(f16(0.25f)), 0.25f);
  EXPECT_EQ(f16::to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16::to_float(0x7bff), 65504.0f);
}

// Doubles stored to bf16 and f16 (detail::store_element, src/core/convert.h) round once, to the
// nearest even: the midpoint of each pair of neighbours (for every third pattern), nudged by
// 2^-30 of itself either way (through a float rounded to nearest, such a value lands on the
// midpoint and goes the even way), double subnormals and values past the float range.
TEST(DType, DoublesRoundOnceTo16Bits) {
  struct Format {
    DType dtype;
    std::vector<double> table;
    double overflow;
  };
  for (const Format& f : {Format{DType::bf16, bf16_table(), std::ldexp(1.0, 128)},
                          Format{DType::f16, f16_table(), 65536.0}}) {
    std::vector<double> xs = {0.0,
                              -0.0,
                              5e-324,
                              1e-310,
                              1e-40,
                              3e38,
                              3.4e38,
                              3.5e38,
                              1e300,
                              65519.9,
                              65520.0,
                              65520.1,
                              0x1p-25,
                              0x1p-25 + 0x1p-70,
                              0x1p-134 + 0x1p-170,
                              std::numeric_limits<double>::infinity()};
    for (std::size_t b = 0; b + 1 < f.table.size(); b += 3) {
      const double mid = (f.table[b] + f.table[b + 1]) / 2;  // exact in double
      for (double x : {mid, mid * (1 + 0x1p-30), mid * (1 - 0x1p-30)}) xs.push_back(x);
    }
    for (const double magnitude : std::vector<double>(xs)) xs.push_back(-magnitude);
    // (Stored into room for any dtype: the compiler sees every branch of store_element.)
    auto stored = [&](double x) {
      std::uint64_t slot = 0;
      detail::store_element<double>(&slot, f.dtype, 0, x);
      std::uint16_t bits;
      std::memcpy(&bits, &slot, 2);
      return bits;
    };
    for (const double x : xs) {
      const std::uint16_t got = stored(x);
      const auto want = static_cast<std::uint16_t>(nearest_even(std::fabs(x), f.table, f.overflow) |
                                                   (std::signbit(x) ? 0x8000u : 0u));
      ASSERT_EQ(got, want) << name_of(f.dtype) << " x = " << x << " (" << std::hexfloat << x << ")";
    }
    const std::uint16_t nan = stored(std::numeric_limits<double>::quiet_NaN());
    EXPECT_TRUE(std::isnan(f.dtype == DType::bf16 ? bf16::to_float(nan) : f16::to_float(nan)));
  }
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(size_of(DType::f32), 4u);
  EXPECT_EQ(size_of(DType::f64), 8u);
  EXPECT_EQ(size_of(DType::bf16), 2u);
  EXPECT_EQ(size_of(DType::f16), 2u);
  EXPECT_EQ(size_of(DType::b8), 1u);
  EXPECT_EQ(sizeof(bf16), 2u);
  EXPECT_EQ(sizeof(f16), 2u);
  EXPECT_EQ(name_of(DType::bf16), "bf16");
  EXPECT_EQ(name_of(DType::b8), "bool");
  EXPECT_FALSE(is_floating(DType::b8));
  EXPECT_TRUE(is_floating(DType::f16));
}

}  // namespace
}  // namespace attncore
