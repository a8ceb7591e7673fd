#include "fuzz_input.h"

#include <algorithm>
#include <cstring>

#include "testing/tensors.h"

namespace attncore::fuzz {

std::vector<std::uint8_t> Array::snapshot() const {
  std::vector<std::uint8_t> s(bytes());
  std::memcpy(s.data(), storage.data(), s.size());
  return s;
}

bool Array::same_as(const std::vector<std::uint8_t>& snap) const {
  return snap.size() == bytes() && std::memcmp(snap.data(), storage.data(), snap.size()) == 0;
}

Array make_array(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                 std::uint8_t fill) {
  const int rank = static_cast<int>(shape.size());
  Array a;
  a.view.dtype = dtype;
  a.view.rank = rank;
  for (int d = 0; d < rank; ++d) a.view.shape[static_cast<std::size_t>(d)] = shape[d];
  std::int64_t extent = 1;  // elements the dims inner to d span
  auto& stride = a.view.stride;
  if (layout == Layout::transposed && rank == 4) {
    // Memory [d0, d2, d1, d3], seen as [d0, d1, d2, d3].
    stride = {shape[2] * shape[1] * shape[3], shape[3], shape[1] * shape[3], 1};
    extent = std::max<std::int64_t>(shape[0] * stride[0], 1);
  } else {
    for (int d = rank - 1; d >= 0; --d) {
      std::int64_t s = extent;
      if (d == rank - 1 && layout == Layout::bad_last) s = 2;
      if (d == rank - 2 && layout == Layout::padded) s = extent + 3;
      if (d == rank - 2 && layout == Layout::overlapping) s = 1;
      if (d == 0 && rank > 1 && layout == Layout::broadcast) s = 0;
      stride[static_cast<std::size_t>(d)] = s;
      if (shape[d] > 0) extent = (shape[d] - 1) * s + extent;
    }
  }
  const std::size_t bytes = static_cast<std::size_t>(extent) * size_of(dtype);
  a.storage.resize(std::max<std::size_t>((bytes + 7) / 8, 1));
  std::memset(a.storage.data(), fill, a.bytes());
  a.view.data = a.storage.data();
  return a;
}

Array make_input(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                 const Reader& reader, std::size_t salt, double magnitude) {
  Array a = make_array(dtype, shape, layout);
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  std::vector<double> values(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = reader.value(i * 7 + salt, magnitude);
  if (dtype == DType::b8) {
    for (double& x : values) x = x >= 0 ? 1 : 0;
  }
  test::write_view(a.view, values);
  return a;
}

}  // namespace attncore::fuzz
