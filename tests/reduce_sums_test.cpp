// White-box: the AVX2 kernels' reduce_sums (eight vectors' lane sums at once, written with
// in-lane shuffles) gives each lane reduce_sum's bits (flash_simd-inl.h): the decode scores
// rely on it to give the same bits however their partial sums are grouped.
#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#include "attncore/info.h"
#include "cpu/target_avx2.h"
#include "cpu/flash_simd-inl.h"

namespace attncore::detail::avx2 {
namespace {

// Whether this CPU runs the avx2 target (the features it is compiled for).
bool runs_avx2() {
  const CpuInfo cpu = cpu_info();
  std::istringstream features(ATTNCORE_TARGET_FEATURES);
  for (std::string f; features >> f;) {
    if (!cpu.has(f)) return false;
  }
  return true;
}

// Lane j of reduce_sums(v) and reduce_sum(v[j]) for v [kLanes][kLanes], as bits.
ATTNCORE_TARGET void both(const float* values, std::uint32_t* at_once, std::uint32_t* one_by_one) {
  Vec v[kLanes];
  for (int j = 0; j < kLanes; ++j) v[j] = load(values + j * kLanes);
  for (int j = 0; j < kLanes; ++j) {
    const float s = reduce_sum(v[j]);
    std::memcpy(one_by_one + j, &s, sizeof s);
  }
  float sums[kLanes];
  store(sums, reduce_sums(v));
  std::memcpy(at_once, sums, sizeof sums);
}

TEST(ReduceSums, Avx2LanesHaveReduceSumsBits) {
  if (!runs_avx2()) GTEST_SKIP() << "this CPU lacks some of: " ATTNCORE_TARGET_FEATURES;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  int order_sensitive = 0;  // lanes whose sum in plain order differs: the data can tell orders
  for (int round = 0; round < 200; ++round) {
    float values[kLanes * kLanes];
    for (float& x : values) x = std::ldexp(mantissa(rng), exponent(rng));
    std::uint32_t at_once[kLanes], one_by_one[kLanes];
    both(values, at_once, one_by_one);
    for (int j = 0; j < kLanes; ++j) {
      ASSERT_EQ(at_once[j], one_by_one[j]) << "round " << round << ", lane " << j;
      float plain = 0.0f;
      for (int i = 0; i < kLanes; ++i) plain += values[j * kLanes + i];
      std::uint32_t plain_bits;
      std::memcpy(&plain_bits, &plain, sizeof plain);
      order_sensitive += plain_bits != one_by_one[j];
    }
  }
  EXPECT_GT(order_sensitive, 100);
}

}  // namespace
}  // namespace attncore::detail::avx2

#endif
