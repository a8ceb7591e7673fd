#include "testing/lane_sums.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attncore/info.h"

namespace attncore::test {

bool cpu_runs(const char* features) {
  const CpuInfo cpu = cpu_info();
  std::istringstream names(features);
  for (std::string f; names >> f;) {
    if (!cpu.has(f)) return false;
  }
  return true;
}

void expect_equal_lane_sums(
    int lanes, std::uint32_t seed,
    const std::function<void(const float* values, std::uint32_t* got, std::uint32_t* want)>& sums) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  const std::size_t n = static_cast<std::size_t>(lanes);
  std::vector<float> values(n * n);
  std::vector<std::uint32_t> got(n), want(n);
  int order_sensitive = 0;
  for (int round = 0; round < 200; ++round) {
    for (float& x : values) x = std::ldexp(mantissa(rng), exponent(rng));
    sums(values.data(), got.data(), want.data());
    for (std::size_t j = 0; j < n; ++j) {
      ASSERT_EQ(got[j], want[j]) << "round " << round << ", lane " << j;
      float plain = 0.0f;
      for (std::size_t i = 0; i < n; ++i) plain += values[j * n + i];
      std::uint32_t plain_bits;
      std::memcpy(&plain_bits, &plain, sizeof plain);
      order_sensitive += plain_bits != want[j];
    }
  }
  EXPECT_GT(order_sensitive, 100);
}

}  // namespace attncore::test
