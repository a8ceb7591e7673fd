// Seeded test data: splitmix64, so every platform and standard library draws the same numbers.
#pragma once

#include <cstdint>
#include <vector>

namespace attncore::test {

class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_u64() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n).
  std::int64_t below(std::int64_t n) {
    return static_cast<std::int64_t>(next_u64() % static_cast<std::uint64_t>(n));
  }
  bool coin(double p_true) { return uniform() < p_true; }

 private:
  std::uint64_t state_;
};

// n values uniform in [lo, hi).
inline std::vector<double> random_vector(std::int64_t n, std::uint64_t seed, double lo = -1.0,
                                         double hi = 1.0) {
  Random rng(seed);
  std::vector<double> x(static_cast<std::size_t>(n));
  for (double& e : x) e = rng.uniform(lo, hi);
  return x;
}

}  // namespace attncore::test
