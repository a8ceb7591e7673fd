// White-box: on the AVX-512 targets, reduce_sums taken in two steps (reduce_group over each
// group of G keys' vectors, then reduce_groups over the groups' vectors: flash_simd-inl.h) gives
// each lane reduce_sum's bits, as reduce_sums does: the decode scores of a GQA group's rows rely
// on it to give the bits of one row's scores.
#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)

#include <cstdint>
#include <cstring>

#include "testing/lane_sums.h"
// The target's macros, then the kernels' inline code compiled for it.
#include "cpu/target_avx512.h"
//
#include "cpu/flash_simd-inl.h"

namespace attncore::detail::avx512 {
namespace {

// values [kLanes keys][kLanes]: lane j of the two steps with groups of G keys (grouped), and
// reduce_sum of key j's vector (one_by_one), as bits; reduce_sums itself must give the latter.
template <int G>
ATTNCORE_TARGET void sums(const float* values, std::uint32_t* grouped, std::uint32_t* one_by_one) {
  Vec groups[kLanes / G];
  for (int j0 = 0; j0 < kLanes; j0 += G) {
    Vec v[G];
    for (int j = 0; j < G; ++j) v[j] = load(values + (j0 + j) * kLanes);
    groups[j0 / G] = reduce_group<G>(v);
  }
  float out[kLanes];
  store(out, reduce_groups<G>(groups));
  std::memcpy(grouped, out, sizeof out);
  for (int j = 0; j < kLanes; ++j) {
    const float s = reduce_sum(load(values + j * kLanes));
    std::memcpy(one_by_one + j, &s, sizeof s);
  }
  Vec all[kLanes];
  for (int j = 0; j < kLanes; ++j) all[j] = load(values + j * kLanes);
  store(out, reduce_sums(all));
  ASSERT_EQ(std::memcmp(out, one_by_one, sizeof out), 0) << "reduce_sums";
}

TEST(ReduceSums, Avx512GroupsOfKeysHaveReduceSumsBits) {
  if (!test::cpu_runs(ATTNCORE_TARGET_FEATURES)) {
    GTEST_SKIP() << "this CPU lacks some of: " ATTNCORE_TARGET_FEATURES;
  }
  test::expect_equal_lane_sums(kLanes, 12, sums<1>);
  test::expect_equal_lane_sums(kLanes, 13, sums<2>);
  test::expect_equal_lane_sums(kLanes, 15, sums<4>);
  test::expect_equal_lane_sums(kLanes, 19, sums<8>);
  test::expect_equal_lane_sums(kLanes, 27, sums<16>);
}

}  // namespace
}  // namespace attncore::detail::avx512

#endif
