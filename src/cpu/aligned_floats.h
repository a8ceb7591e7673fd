// 64-byte aligned float storage for the flash backend's per-call workspaces, and rounding up
// to a multiple.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace attncore::detail {

// 64-byte aligned float storage, allocated once per call (never per tile).
struct AlignedFloats {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  explicit AlignedFloats(std::int64_t count) {
    const std::size_t bytes =
        (static_cast<std::size_t>(std::max<std::int64_t>(count, 1)) * sizeof(float) + 63) &
        ~std::size_t{63};
    data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data) throw std::bad_alloc();
  }
  float* get() const { return data.get(); }
};

inline std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

}  // namespace attncore::detail
