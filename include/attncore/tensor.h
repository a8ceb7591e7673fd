// TensorView (non-owning, strided, sizes and strides in elements) and Tensor (owning, 64-byte
// aligned, contiguous).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "attncore/dtype.h"
#include "attncore/export.h"

namespace attncore {

inline constexpr int kMaxRank = 4;

// A strided window onto memory the caller owns. Shape and strides count elements, never bytes,
// so a [B, L, H, D] (flash) buffer is passed as a [B, H, L, D] view with permuted strides and
// no copy. Strides may be 0 (broadcast) but never negative.
struct ATTNCORE_API TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  // Row-major contiguous view of `shape`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape);
  // View with explicit strides (in elements); `shape` and `strides` must have the same length.
  static TensorView strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> strides);

  // Dim d's size and stride, for 0 <= d < rank (unchecked).
  std::int64_t size(int d) const { return shape[static_cast<std::size_t>(d)]; }
  std::int64_t stride_of(int d) const { return stride[static_cast<std::size_t>(d)]; }
  // Number of elements, or -1 when it does not fit in int64 (or rank is outside 0..kMaxRank).
  std::int64_t numel() const;
  // The same memory with dimensions d0 and d1 swapped (e.g. [B, L, H, D] <-> [B, H, L, D]).
  TensorView transposed(int d0, int d1) const;
  // "[2, 8, 1024, 128]" ("[rank=9]" for a rank outside 0..kMaxRank)
  std::string shape_string() const;
};

// Owning, zero-initialised, 64-byte aligned, row-major contiguous storage. On Linux, from 32 MiB
// on, a mapping of its own, 2 MiB aligned, for which the OS is asked for huge pages (transparent
// huge pages; a hint): a KV cache held in one streams with fewer TLB misses.
class ATTNCORE_API Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::initializer_list<std::int64_t> shape);
  // Moved from, a Tensor is undefined (no view of the storage it gave away).
  Tensor(Tensor&& other) noexcept
      : storage_(std::move(other.storage_)), view_(std::exchange(other.view_, TensorView{})) {}
  Tensor& operator=(Tensor&& other) noexcept {
    storage_ = std::move(other.storage_);
    view_ = std::exchange(other.view_, TensorView{});
    return *this;
  }
  Tensor(DType dtype, const std::int64_t* shape, int rank);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable as a view
  void* data() const { return view_.data; }
  DType dtype() const { return view_.dtype; }
  int rank() const { return view_.rank; }
  std::int64_t size(int d) const { return view_.size(d); }
  std::int64_t numel() const { return view_.numel(); }
  bool defined() const { return view_.rank > 0; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(view_.data);
  }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> storage_;
  TensorView view_;
};

}  // namespace attncore
