// White-box: the AVX2 kernels' reduce_sums (eight vectors' lane sums at once, written with
// in-lane shuffles) gives each lane reduce_sum's bits (flash_simd-inl.h): the decode scores
// rely on it to give the same bits however their partial sums are grouped.
#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)

#include <cstdint>
#include <cstring>

#include "testing/lane_sums.h"
// The target's macros, then the kernels' inline code compiled for it.
#include "cpu/target_avx2.h"
//
#include "cpu/flash_simd-inl.h"

namespace attncore::detail::avx2 {
namespace {

// Lane j of reduce_sums(v) (at_once) and reduce_sum(v[j]) (one_by_one) for v [kLanes][kLanes].
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
  if (!test::cpu_runs(ATTNCORE_TARGET_FEATURES)) {
    GTEST_SKIP() << "this CPU lacks some of: " ATTNCORE_TARGET_FEATURES;
  }
  test::expect_equal_lane_sums(kLanes, 7, both);
}

}  // namespace
}  // namespace attncore::detail::avx2

#endif
