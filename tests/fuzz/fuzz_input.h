// Decoding a fuzzer's bytes into arrays and views: a reader that never fails (past the end it
// returns zeros) and owned strided arrays in the layouts a caller may pass, good and bad.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "attncore/tensor.h"

namespace attncore::fuzz {

// Reads choices from the input's bytes, in order; zeros once they are used up.
class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return at_ < size_ ? data_[at_++] : 0; }
  // An integer in [lo, hi].
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    const std::uint32_t r = static_cast<std::uint32_t>(byte()) | (std::uint32_t{byte()} << 8);
    return lo + static_cast<std::int64_t>(r % static_cast<std::uint32_t>(hi - lo + 1));
  }
  // True with probability about n / 256.
  bool chance(int n) { return byte() < n; }
  // The element values: the input's bytes from here on, cycled, as multiples of 1/128 in
  // [-1, 1) (exact in every dtype; the range the tolerances of docs/design.md section 6 are
  // set for), times `magnitude`.
  double value(std::size_t i, double magnitude) const {
    const std::size_t rest = size_ > at_ ? size_ - at_ : 0;
    const int b = rest ? data_[at_ + i % rest] : static_cast<int>((i * 37) % 256);
    return (b - 128) / 128.0 * magnitude;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

// How an array sits in memory. The good ones: contiguous, [B, L, H, D] seen transposed (rank 4),
// rows padded to an odd stride, a broadcast (stride 0) leading dim. The ones that are refused
// for outputs (and accepted for inputs): overlapping rows (row stride 1). Refused everywhere: a
// last stride of 2.
enum class Layout : std::uint8_t {
  contiguous,
  transposed,
  padded,
  broadcast,
  overlapping,
  bad_last
};
inline constexpr int kLayouts = 6;

// An owned array and the view the library is given. The storage covers every element the view
// can reach and nothing else: what a call writes outside the view's elements ASan sees.
struct Array {
  std::vector<double> storage;  // 8-byte aligned backing store
  TensorView view;
  std::size_t bytes() const { return storage.size() * sizeof(double); }
  std::vector<std::uint8_t> snapshot() const;
  bool same_as(const std::vector<std::uint8_t>& snap) const;
};

// An array of `shape` (rank 1 to 4) in `layout`; its storage bytes all `fill`. A layout that
// does not apply to the shape (transposed for rank < 4) falls back to contiguous.
Array make_array(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                 std::uint8_t fill = 0);
// The same, its elements set to the reader's values (read back through the view, so that
// broadcast and overlapping views hold what the library will read).
Array make_input(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                 const Reader& reader, std::size_t salt, double magnitude);

}  // namespace attncore::fuzz
