// The online softmax state (policy/softmax_state.h): tile-by-tile updates give the dense
// softmax's LSE and weights, states of disjoint key sets merge to the state of all keys, and
// finished (out, LSE) pairs merge as docs/design.md section 1.12 says.
#include "policy/softmax_state.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "testing/random.h"

namespace attncore::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr double kInf = std::numeric_limits<double>::infinity();
float exp2_scalar(float x) { return std::exp2(x); }

// Runs scores s (natural units) and values v [n][dv] through the state in tiles of `tile`;
// returns acc and the state.
SoftmaxState run(const std::vector<float>& s, const std::vector<float>& v, int dv, int tile,
                 std::vector<float>& acc) {
  SoftmaxState st;
  acc.assign(static_cast<std::size_t>(dv), 0.0f);
  for (std::size_t j0 = 0; j0 < s.size(); j0 += static_cast<std::size_t>(tile)) {
    const std::size_t end = std::min(s.size(), j0 + static_cast<std::size_t>(tile));
    float tile_max = -INFINITY;
    for (std::size_t j = j0; j < end; ++j) tile_max = std::fmax(tile_max, s[j] * kLog2e);
    const float new_max = st.next_max(tile_max);
    if (new_max == -INFINITY) continue;
    const float alpha = st.alpha(new_max, exp2_scalar);
    for (float& a : acc) a *= alpha;
    float tile_sum = 0;
    for (std::size_t j = j0; j < end; ++j) {
      const float p = std::exp2(std::fma(s[j], kLog2e, -new_max));
      tile_sum += p;
      for (int e = 0; e < dv; ++e) acc[static_cast<std::size_t>(e)] += p * v[j * dv + e];
    }
    st.update(new_max, alpha, tile_sum);
  }
  return st;
}

TEST(SoftmaxState, TilesGiveTheDenseSoftmax) {
  attncore::test::Random rng(3);
  for (int n : {1, 7, 128, 300}) {
    std::vector<float> s(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n) * 4);
    for (float& x : s) x = static_cast<float>(rng.uniform(-8, 8));
    for (float& x : v) x = static_cast<float>(rng.uniform(-1, 1));
    double m = -INFINITY, sum = 0;
    for (float x : s) m = std::fmax(m, x);
    for (float x : s) sum += std::exp(x - m);
    std::vector<float> acc;
    const SoftmaxState st = run(s, v, 4, 32, acc);
    EXPECT_NEAR(st.lse(), m + std::log(sum), 1e-5 * (1 + std::fabs(m)));
    for (int e = 0; e < 4; ++e) {
      double want = 0;
      for (int j = 0; j < n; ++j) want += std::exp(s[j] - m) / sum * v[j * 4 + e];
      EXPECT_NEAR(acc[e] * st.out_factor(), want, 1e-5);
    }
  }
}

TEST(SoftmaxState, MergeOutputs) {
  // Two halves of one row's keys, finished separately, merge to the whole.
  const double s[] = {0.3, -1.2, 2.0, 0.7, -0.4};
  const double v[] = {1.0, -2.0, 0.5, 3.0, -1.0};
  auto finish = [&](int begin, int end, double* out) {
    double m = -INFINITY, sum = 0, acc = 0;
    for (int j = begin; j < end; ++j) m = std::fmax(m, s[j]);
    for (int j = begin; j < end; ++j) {
      sum += std::exp(s[j] - m);
      acc += std::exp(s[j] - m) * v[j];
    }
    *out = sum == 0 ? 0 : acc / sum;
    return sum == 0 ? -INFINITY : m + std::log(sum);
  };
  double whole = 0, a = 0, b = 0, merged = 0;
  const double lse = finish(0, 5, &whole);
  const double lse_a = finish(0, 2, &a), lse_b = finish(2, 5, &b);
  EXPECT_NEAR(merge_outputs(&a, lse_a, &b, lse_b, 1, &merged), lse, 1e-12);
  EXPECT_NEAR(merged, whole, 1e-12);
  // A side with LSE -inf contributes nothing, even NaN in its output.
  const double nan = std::nan("");
  EXPECT_EQ(merge_outputs(&a, lse_a, &nan, -kInf, 1, &merged), lse_a);
  EXPECT_EQ(merged, a);
  EXPECT_EQ(merge_outputs(&nan, -kInf, &nan, -kInf, 1, &merged), -kInf);
  EXPECT_EQ(merged, 0.0);
}

TEST(SoftmaxState, MergeOutputsWithLargeLse) {
  // Equal sides weigh 1/2 each however large their LSE: rounding the merged LSE (to f32 at 1e7
  // its ulp is 1, which swallows log 2) must not change the weights.
  for (const float l : {0.0f, 1e3f, 1e5f, 1e7f, 2e7f, 3e38f, -3e38f}) {
    const float a = 1.0f, b = 3.0f;
    float merged = 0;
    const float lse = merge_outputs(&a, l, &b, l, 1, &merged);
    EXPECT_EQ(merged, 2.0f) << l;
    EXPECT_NEAR(lse, static_cast<double>(l) + std::log(2.0), std::fabs(l) * 1e-7 + 1e-6) << l;
  }
  // Several parts at once (split-KV's): three equal parts weigh 1/3 each. Merged two at a time
  // through the rounded LSE (1e7 + log 2 rounds to 1e7) the third would weigh 1/2: 3.75.
  const float outs3[3] = {1.0f, 2.0f, 6.0f}, lses3[3] = {1e7f, 1e7f, 1e7f};
  const float* parts[3] = {&outs3[0], &outs3[1], &outs3[2]};
  float merged3 = 0;
  merge_outputs(parts, lses3, 3, 1, &merged3);
  EXPECT_NEAR(merged3, 3.0f, 1e-6f);
  // A part with LSE -inf takes no part, NaN in its output included.
  const float with_none[3] = {1.0f, std::nanf(""), 3.0f}, lses_none[3] = {5.0f, -INFINITY, 5.0f};
  const float* parts_none[3] = {&with_none[0], &with_none[1], &with_none[2]};
  EXPECT_NEAR(merge_outputs(parts_none, lses_none, 3, 1, &merged3), 5.0f + std::log(2.0f), 1e-6f);
  EXPECT_EQ(merged3, 2.0f);
  // A NaN LSE makes the result NaN; so does +inf (its weight is inf / inf).
  for (const float bad : {std::nanf(""), static_cast<float>(INFINITY)}) {
    const float lses_bad[3] = {5.0f, bad, 5.0f};
    EXPECT_TRUE(std::isnan(merge_outputs(parts, lses_bad, 3, 1, &merged3))) << bad;
    EXPECT_TRUE(std::isnan(merged3)) << bad;
  }
  // Unequal sides: weights e / (e_a + e_b) relative to the larger LSE.
  const double a = 1.0, b = 3.0;
  double merged = 0;
  merge_outputs(&a, 1e9 + 1.0, &b, 1e9, 1, &merged);
  const double wa = 1.0 / (1.0 + std::exp(-1.0));
  EXPECT_NEAR(merged, wa * a + (1 - wa) * b, 1e-12);
}

}  // namespace
}  // namespace attncore::detail
