// The bytes the decode benchmarks fill a KV cache's memory with (attncore bench --decode and
// bench/decode_plans.cpp): 16-bit halves that are moderate normal numbers read as f16 (1 to 2),
// as bf16 (2^-7 to 1) and, in pairs, as f32 (2^-7 to 1), so that every dtype's view of the bytes
// is finite; the same fixed sequence every run.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attncore_tools {

inline void fill_cache_halves(void* data, std::size_t bytes) {
  auto* halves = static_cast<std::uint16_t*>(data);
  std::uint32_t state = 12345;
  for (std::size_t i = 0; i < bytes / 2; ++i) {
    state = state * 1664525u + 1013904223u;
    halves[i] = static_cast<std::uint16_t>(0x3C00u | ((state >> 8) & 0x83FFu));
  }
}

}  // namespace attncore_tools
