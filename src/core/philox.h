// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// element-addressed dropout stream of docs/design.md section 1.5 (curand's layout, subsequence 0).
#pragma once

#include <array>
#include <cstdint>

namespace attncore::detail {

using PhiloxCounter = std::array<std::uint32_t, 4>;
using PhiloxKey = std::array<std::uint32_t, 2>;

inline PhiloxCounter philox4x32_10(PhiloxCounter ctr, PhiloxKey key) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * ctr[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * ctr[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

// The 32-bit word at position `pos` = pos_high * 2^64 + pos of the stream keyed by `seed`:
// word pos % 4 of Philox4x32-10(counter = pos / 4 as a 128-bit integer, key = (seed low,
// seed high)). Positions pass 2^64 when offset + element index does (docs/design.md section 1.5).
inline std::uint32_t philox_word(std::uint64_t seed, std::uint64_t pos,
                                 std::uint64_t pos_high = 0) {
  const std::uint64_t block_low = (pos >> 2) | (pos_high << 62), block_high = pos_high >> 2;
  const PhiloxCounter out = philox4x32_10(
      {static_cast<std::uint32_t>(block_low), static_cast<std::uint32_t>(block_low >> 32),
       static_cast<std::uint32_t>(block_high), static_cast<std::uint32_t>(block_high >> 32)},
      {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
  return out[pos & 3];
}

// curand's uniform in (0, 1]: x * 2^-32 + 2^-33, in fp32.
inline float philox_uniform(std::uint32_t x) {
  return static_cast<float>(x) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
}

// Dropout keeps element `pos` (+ pos_high * 2^64) of the stream iff its uniform is > p.
inline bool dropout_keep(std::uint64_t seed, std::uint64_t pos, float p,
                         std::uint64_t pos_high = 0) {
  return philox_uniform(philox_word(seed, pos, pos_high)) > p;
}

}  // namespace attncore::detail
