// For the white-box tests of the kernels' sums across lanes (reduce_sums_test.cpp,
// reduce_groups_test.cpp): whether this CPU runs a SIMD target, and the random vectors they sum.
#pragma once

#include <cstdint>
#include <functional>

namespace attncore::test {

// Whether this CPU has every feature of `features` (space-separated, as CpuInfo names them: a
// target's ATTNCORE_TARGET_FEATURES).
bool cpu_runs(const char* features);

// 200 rounds of `lanes` vectors of `lanes` floats (values [lanes][lanes], each a random mantissa
// in [-1, 1) times 2^-20 .. 2^20): sums(values, got, want) puts one sum per vector into got and
// want as bits, which must be equal lane by lane; and in more than 100 lanes the plain
// left-to-right sum must differ from want (the data can tell summation orders apart).
void expect_equal_lane_sums(
    int lanes, std::uint32_t seed,
    const std::function<void(const float* values, std::uint32_t* got, std::uint32_t* want)>& sums);

}  // namespace attncore::test
