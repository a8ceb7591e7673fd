// Philox4x32-10 (src/core/philox.h) against Random123's published known-answer vectors
// (kat_vectors), and the dropout word stream against the oracle's own implementation.
#include "core/philox.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "testing/oracle.h"
#include "testing/random.h"

namespace attncore {
namespace {

struct KnownAnswer {
  std::array<std::uint32_t, 4> counter;
  std::array<std::uint32_t, 2> key;
  std::array<std::uint32_t, 4> expected;
};

// Random123 tests/kat_vectors, the three "philox4x32 10" lines.
const KnownAnswer kKnownAnswers[] = {
    {{0x00000000u, 0x00000000u, 0x00000000u, 0x00000000u},
     {0x00000000u, 0x00000000u},
     {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
     {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
     {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

TEST(Philox, LibraryMatchesRandom123KnownAnswers) {
  for (const KnownAnswer& kat : kKnownAnswers) {
    EXPECT_EQ(detail::philox4x32_10(kat.counter, kat.key), kat.expected);
  }
}

TEST(Philox, OracleMatchesRandom123KnownAnswers) {
  for (const KnownAnswer& kat : kKnownAnswers) {
    EXPECT_EQ(test::oracle_philox4x32_10(kat.counter, kat.key), kat.expected);
  }
}

TEST(Philox, LibraryMatchesOracleOnRandomBlocks) {
  test::Random rng(99);
  for (int n = 0; n < 2000; ++n) {
    const std::uint64_t a = rng.next_u64(), b = rng.next_u64(), c = rng.next_u64();
    const std::array<std::uint32_t, 4> ctr = {
        static_cast<std::uint32_t>(a), static_cast<std::uint32_t>(a >> 32),
        static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32)};
    const std::array<std::uint32_t, 2> key = {static_cast<std::uint32_t>(c),
                                              static_cast<std::uint32_t>(c >> 32)};
    ASSERT_EQ(detail::philox4x32_10(ctr, key), test::oracle_philox4x32_10(ctr, key)) << n;
  }
}

TEST(Philox, WordStreamMatchesOracle) {
  const std::uint64_t seeds[] = {0, 1, 0xdeadbeefull, 0x123456789abcdef0ull, ~0ull};
  std::vector<std::uint64_t> positions;
  for (std::uint64_t p = 0; p < 64; ++p) positions.push_back(p);
  for (std::uint64_t base :
       {(1ull << 32) * 4 - 8, (1ull << 34) - 3, (1ull << 40) + 1, (1ull << 62) + 5, ~0ull - 7}) {
    for (std::uint64_t i = 0; i < 8; ++i) positions.push_back(base + i);
  }
  for (std::uint64_t seed : seeds) {
    for (std::uint64_t pos : positions) {
      ASSERT_EQ(detail::philox_word(seed, pos), test::oracle_philox_word(seed, pos))
          << "seed " << seed << " pos " << pos;
    }
  }
}

TEST(Philox, WordsAreTheFourWordsOfTheirBlock) {
  // pos = 4 * block + w is word w of Philox(counter = block as 128 bits, key = (lo, hi)).
  const std::uint64_t seed = 0x0000000500000003ull;  // key (3, 5)
  for (std::uint64_t block : {0ull, 1ull, 0xffffffffull, 0x100000000ull, 0x3fffffffffffffffull}) {
    const std::array<std::uint32_t, 4> expected = test::oracle_philox4x32_10(
        {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), 0u, 0u},
        {3u, 5u});
    for (std::uint64_t w = 0; w < 4; ++w) {
      EXPECT_EQ(detail::philox_word(seed, 4 * block + w), expected[w]) << block << " " << w;
    }
  }
}

TEST(Philox, UniformIsCurandsMapping) {
  // u = x * 2^-32 + 2^-33 in fp32, in (0, 1].
  EXPECT_EQ(detail::philox_uniform(0u), std::ldexp(1.0f, -33));
  EXPECT_EQ(detail::philox_uniform(0xffffffffu), 1.0f);
  EXPECT_EQ(detail::philox_uniform(0x80000000u), 0.5f);
  test::Random rng(7);
  for (int n = 0; n < 100000; ++n) {
    const auto x = static_cast<std::uint32_t>(rng.next_u64());
    const float u = detail::philox_uniform(x);
    ASSERT_EQ(u, test::oracle_uniform(x)) << x;
    ASSERT_GT(u, 0.0f);
    ASSERT_LE(u, 1.0f);
  }
}

TEST(Philox, DropoutKeepMatchesOracle) {
  for (float p : {0.0f, 0.1f, 0.25f, 0.5f, 0.9f}) {
    std::int64_t kept = 0;
    for (std::uint64_t pos = 0; pos < 20000; ++pos) {
      const bool keep = detail::dropout_keep(77, pos + 1000, p);
      ASSERT_EQ(keep, test::oracle_keep(77, pos + 1000, p)) << p << " " << pos;
      kept += keep;
    }
    if (p == 0.0f) {
      EXPECT_EQ(kept, 20000);
    }
  }
}

}  // namespace
}  // namespace attncore
