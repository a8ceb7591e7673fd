// White-box: on the AVX-512 targets, reduce_sums taken in two steps (reduce_group over each
// group of G keys' vectors, then reduce_groups over the groups' vectors: flash_simd-inl.h) gives
// each lane reduce_sum's bits, as reduce_sums does: the decode scores of a GQA group's rows rely
// on it to give the bits of one row's scores.
#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#include "attncore/info.h"
// The target's macros, then the kernels' inline code compiled for it.
#include "cpu/target_avx512.h"
//
#include "cpu/flash_simd-inl.h"

namespace attncore::detail::avx512 {
namespace {

bool runs_avx512() {
  const CpuInfo cpu = cpu_info();
  std::istringstream features(ATTNCORE_TARGET_FEATURES);
  for (std::string f; features >> f;) {
    if (!cpu.has(f)) return false;
  }
  return true;
}

// values [kLanes keys][kLanes]: lane j of the two steps with groups of G keys, and of
// reduce_sums, and reduce_sum of key j's vector, as bits.
template <int G>
ATTNCORE_TARGET void sums(const float* values, std::uint32_t* grouped, std::uint32_t* at_once,
                          std::uint32_t* one_by_one) {
  Vec groups[kLanes / G];
  for (int j0 = 0; j0 < kLanes; j0 += G) {
    Vec v[G];
    for (int j = 0; j < G; ++j) v[j] = load(values + (j0 + j) * kLanes);
    groups[j0 / G] = reduce_group<G>(v);
  }
  float out[kLanes];
  store(out, reduce_groups<G>(groups));
  std::memcpy(grouped, out, sizeof out);
  Vec all[kLanes];
  for (int j = 0; j < kLanes; ++j) all[j] = load(values + j * kLanes);
  store(out, reduce_sums(all));
  std::memcpy(at_once, out, sizeof out);
  for (int j = 0; j < kLanes; ++j) {
    const float s = reduce_sum(load(values + j * kLanes));
    std::memcpy(one_by_one + j, &s, sizeof s);
  }
}

template <int G>
void check_groups_of() {
  std::mt19937 rng(11 + G);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  int order_sensitive = 0;  // lanes whose plain-order sum differs: the data can tell orders
  for (int round = 0; round < 200; ++round) {
    float values[kLanes * kLanes];
    for (float& x : values) x = std::ldexp(mantissa(rng), exponent(rng));
    std::uint32_t grouped[kLanes], at_once[kLanes], one_by_one[kLanes];
    sums<G>(values, grouped, at_once, one_by_one);
    for (int j = 0; j < kLanes; ++j) {
      ASSERT_EQ(grouped[j], one_by_one[j])
          << "groups of " << G << ", round " << round << ", lane " << j;
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

TEST(ReduceSums, Avx512GroupsOfKeysHaveReduceSumsBits) {
  if (!runs_avx512()) GTEST_SKIP() << "this CPU lacks some of: " ATTNCORE_TARGET_FEATURES;
  check_groups_of<1>();
  check_groups_of<2>();
  check_groups_of<4>();
  check_groups_of<8>();
  check_groups_of<16>();
}

}  // namespace
}  // namespace attncore::detail::avx512

#endif
