// Moving test data between std::vector<double> (the oracle's side) and attncore tensors and
// views of any dtype, rank and strides, plus the memory layouts the tests run through.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attncore/dtype.h"
#include "attncore/tensor.h"
#include "testing/oracle.h"

namespace attncore::test {

// x rounded to the precision of `dtype` (through float for the 16-bit types; b8: 0 or 1).
double round_to(double x, DType dtype);
// The oracle Rounder for `dtype`: nullptr for f64, else rounding to the type.
Rounder rounder_for(DType dtype);
std::vector<double> rounded(std::vector<double> x, DType dtype);

// The elements of `view` in row-major order of its shape, whatever its strides.
std::vector<double> read_view(const TensorView& view);
// Writes `values` (row-major over view.shape) into the view's elements, converting to its dtype.
void write_view(const TensorView& view, const std::vector<double>& values);
// Index i of dim `dim` of `view`, kept as a dim of size 1 (batch row b of [B, H, L, D] as
// [1, H, L, D]).
TensorView index_of_dim(const TensorView& view, int dim, std::int64_t i);

// A contiguous tensor of `shape` holding `values` converted to `dtype`.
Tensor make_tensor(DType dtype, const std::vector<std::int64_t>& shape,
                   const std::vector<double>& values);

// `dense` [B, capacity, row] (a cache's slots, each `row` values: [B, L, Hkv, D]) as a paged pool
// [num_pages, page_size, row]: sequence b's page i is pool page num_pages - 1 - (b * per_seq + i)
// (the pages in reverse), and page 0 a spare one of NaN; slots past capacity in a last page NaN.
struct PagedPool {
  std::vector<double> values;
  Tensor block_table;  // i32 [B, per_seq]
  std::int64_t num_pages;
};
PagedPool paged_values(const std::vector<double>& dense, std::int64_t batch, std::int64_t capacity,
                       std::int64_t row, std::int64_t page_size);

// How a [B, H, L, D] operand sits in memory.
enum class Layout {
  bhsd,    // contiguous [B, H, L, D] (torch)
  bshd,    // contiguous [B, L, H, D] seen through transposed(1, 2) (flash-attn)
  padded,  // [B, H, L, D] whose rows are `kPad` elements longer than D (odd row stride)
};
inline constexpr std::int64_t kPad = 3;
std::string name_of_layout(Layout layout);

// An owned buffer and the strided view the library is given. Padding elements hold NaN (0xff
// bytes for bool), so a kernel that reads or writes past a row shows up.
struct Buffer {
  Tensor storage;
  TensorView view;
};

// A buffer of `shape` (rank 1 to 4; bshd needs rank 4) in `layout`, elements zero.
Buffer make_buffer(DType dtype, const std::vector<std::int64_t>& shape, Layout layout);
// The same holding `values` (row-major over `shape`).
Buffer make_buffer(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                   const std::vector<double>& values);
// Whether every padding element of a padded buffer still holds its NaN filler.
bool padding_intact(const Buffer& buffer);

template <std::size_t N>
std::vector<std::int64_t> to_shape(const std::array<std::int64_t, N>& a) {
  return std::vector<std::int64_t>(a.begin(), a.end());
}

// max |x| over finite elements (0 when empty).
double max_abs(const std::vector<double>& x);

// Whether got and want hold the same bits element by element (NaN where want has NaN); the
// message names `what` and the first element that differs.
::testing::AssertionResult same_bits(const std::vector<double>& got,
                                     const std::vector<double>& want, const std::string& what);

// The message of the attncore::Error f throws; "" when it throws none.
std::string error_message(const std::function<void()>& f);

// The message of the InvalidArgument f throws; "" when it throws none (another exception
// propagates).
std::string invalid_argument_message(const std::function<void()>& f);

}  // namespace attncore::test
