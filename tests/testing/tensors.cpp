// Conversions between std::vector<double> and attncore tensors / strided views; test layouts.
#include "testing/tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "attncore/error.h"

namespace attncore::test {
namespace {

double load(const void* base, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(base)[offset];
    case DType::f64:
      return static_cast<const double*>(base)[offset];
    case DType::bf16:
      return bf16::to_float(static_cast<const bf16*>(base)[offset].bits);
    case DType::f16:
      return f16::to_float(static_cast<const f16*>(base)[offset].bits);
    case DType::b8:
      return static_cast<const std::uint8_t*>(base)[offset] != 0 ? 1.0 : 0.0;
    case DType::i32:
      return static_cast<const std::int32_t*>(base)[offset];
  }
  return 0.0;
}

void store(void* base, DType dtype, std::int64_t offset, double x) {
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(base)[offset] = static_cast<float>(x);
      return;
    case DType::f64:
      static_cast<double*>(base)[offset] = x;
      return;
    case DType::bf16:
      static_cast<bf16*>(base)[offset] = bf16(static_cast<float>(x));
      return;
    case DType::f16:
      static_cast<f16*>(base)[offset] = f16(static_cast<float>(x));
      return;
    case DType::b8:
      static_cast<std::uint8_t*>(base)[offset] = x != 0.0 ? 1 : 0;
      return;
    case DType::i32:
      static_cast<std::int32_t*>(base)[offset] = static_cast<std::int32_t>(x);
      return;
  }
}

// Calls fn(linear_index, element_offset) for every element of the view in row-major order.
template <class Fn>
void for_each_element(const TensorView& view, Fn fn) {
  std::int64_t n = 1;
  for (int d = 0; d < view.rank; ++d) n *= view.size(d);
  if (n == 0) return;
  std::array<std::int64_t, kMaxRank> index{};
  for (std::int64_t linear = 0; linear < n; ++linear) {
    std::int64_t offset = 0;
    for (int d = 0; d < view.rank; ++d)
      offset += index[static_cast<std::size_t>(d)] * view.stride_of(d);
    fn(linear, offset);
    for (int d = view.rank - 1; d >= 0; --d) {
      if (++index[static_cast<std::size_t>(d)] < view.size(d)) break;
      index[static_cast<std::size_t>(d)] = 0;
    }
  }
}

}  // namespace

double round_to(double x, DType dtype) {
  switch (dtype) {
    case DType::f32:
      return static_cast<float>(x);
    case DType::f64:
      return x;
    case DType::bf16:
      return static_cast<float>(bf16(static_cast<float>(x)));
    case DType::f16:
      return static_cast<float>(f16(static_cast<float>(x)));
    case DType::b8:
      return x != 0.0 ? 1.0 : 0.0;
    case DType::i32:
      return std::nearbyint(x);
  }
  return x;
}

Rounder rounder_for(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return [](double x) { return round_to(x, DType::f32); };
    case DType::bf16:
      return [](double x) { return round_to(x, DType::bf16); };
    case DType::f16:
      return [](double x) { return round_to(x, DType::f16); };
    default:
      return nullptr;
  }
}

std::vector<double> rounded(std::vector<double> x, DType dtype) {
  for (double& e : x) e = round_to(e, dtype);
  return x;
}

TensorView index_of_dim(const TensorView& view, int dim, std::int64_t i) {
  TensorView s = view;
  s.data = static_cast<char*>(view.data) +
           i * view.stride_of(dim) * static_cast<std::int64_t>(size_of(view.dtype));
  s.shape[static_cast<std::size_t>(dim)] = 1;
  return s;
}

std::vector<double> read_view(const TensorView& view) {
  std::int64_t n = 1;
  for (int d = 0; d < view.rank; ++d) n *= view.size(d);
  std::vector<double> out(static_cast<std::size_t>(n));
  for_each_element(view, [&](std::int64_t linear, std::int64_t offset) {
    out[static_cast<std::size_t>(linear)] = load(view.data, view.dtype, offset);
  });
  return out;
}

void write_view(const TensorView& view, const std::vector<double>& values) {
  for_each_element(view, [&](std::int64_t linear, std::int64_t offset) {
    store(view.data, view.dtype, offset, values.at(static_cast<std::size_t>(linear)));
  });
}

Tensor make_tensor(DType dtype, const std::vector<std::int64_t>& shape,
                   const std::vector<double>& values) {
  Tensor t(dtype, shape.data(), static_cast<int>(shape.size()));
  write_view(t.view(), values);
  return t;
}

std::string name_of_layout(Layout layout) {
  switch (layout) {
    case Layout::bhsd:
      return "bhsd";
    case Layout::bshd:
      return "bshd";
    case Layout::padded:
      return "padded";
  }
  return "?";
}

Buffer make_buffer(DType dtype, const std::vector<std::int64_t>& shape, Layout layout) {
  const int rank = static_cast<int>(shape.size());
  if (rank < 1 || rank > kMaxRank) throw std::logic_error("make_buffer: rank 1..4");
  Buffer b;
  switch (layout) {
    case Layout::bhsd: {
      b.storage = Tensor(dtype, shape.data(), rank);
      b.view = b.storage.view();
      break;
    }
    case Layout::bshd: {
      if (rank != 4) throw std::logic_error("make_buffer: bshd needs rank 4");
      const std::vector<std::int64_t> bshd = {shape[0], shape[2], shape[1],
                                              shape[3]};  // [B, L, H, D]
      b.storage = Tensor(dtype, bshd.data(), 4);
      b.view = b.storage.view().transposed(1, 2);  // [B, H, L, D]
      break;
    }
    case Layout::padded: {
      std::vector<std::int64_t> padded = shape;  // [..., last + kPad]
      padded.back() += kPad;
      b.storage = Tensor(dtype, padded.data(), rank);
      // Fill everything (padding included) with NaN, then the view's elements with zero.
      const std::int64_t total = b.storage.numel();
      if (dtype == DType::b8) {
        if (total > 0) std::memset(b.storage.data(), 0xff, static_cast<std::size_t>(total));
      } else {
        write_view(b.storage.view(), std::vector<double>(static_cast<std::size_t>(total),
                                                         std::numeric_limits<double>::quiet_NaN()));
      }
      b.view = b.storage.view();
      b.view.shape[static_cast<std::size_t>(rank - 1)] = shape.back();
      std::int64_t n = 1;
      for (std::int64_t s : shape) n *= s;
      write_view(b.view, std::vector<double>(static_cast<std::size_t>(n), 0.0));
      break;
    }
  }
  return b;
}

Buffer make_buffer(DType dtype, const std::vector<std::int64_t>& shape, Layout layout,
                   const std::vector<double>& values) {
  Buffer b = make_buffer(dtype, shape, layout);
  write_view(b.view, values);
  return b;
}

bool padding_intact(const Buffer& buffer) {
  const TensorView& storage = buffer.storage.view();
  const int last = storage.rank - 1;
  if (storage.rank == 0 || storage.size(last) == buffer.view.size(last)) return true;
  const std::int64_t width = buffer.view.size(last);
  bool intact = true;
  for_each_element(storage, [&](std::int64_t linear, std::int64_t offset) {
    if (linear % storage.size(last) < width) return;
    if (storage.dtype == DType::b8) {
      intact = intact && static_cast<const std::uint8_t*>(storage.data)[offset] == 0xff;
    } else {
      intact = intact && std::isnan(load(storage.data, storage.dtype, offset));
    }
  });
  return intact;
}

double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double e : x) {
    if (std::isfinite(e) && std::fabs(e) > m) m = std::fabs(e);
  }
  return m;
}

::testing::AssertionResult same_bits(const std::vector<double>& got,
                                     const std::vector<double>& want, const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (std::size_t e = 0; e < got.size(); ++e) {
    if (!(std::isnan(got[e]) && std::isnan(want[e])) &&
        std::memcmp(&got[e], &want[e], sizeof(double)) != 0) {
      return ::testing::AssertionFailure()
             << what << ": element " << e << " is " << got[e] << ", expected " << want[e];
    }
  }
  return ::testing::AssertionSuccess();
}

namespace {

// The message of the E that f throws; "" when it throws none (other exceptions propagate).
template <class E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

}  // namespace

std::string error_message(const std::function<void()>& f) { return message_of<Error>(f); }

std::string invalid_argument_message(const std::function<void()>& f) {
  return message_of<InvalidArgument>(f);
}

PagedPool paged_values(const std::vector<double>& dense, std::int64_t batch, std::int64_t capacity,
                       std::int64_t row, std::int64_t page_size) {
  const std::int64_t per_seq = (capacity + page_size - 1) / page_size;
  const std::int64_t num_pages = batch * per_seq + 1;
  std::vector<double> pool(static_cast<std::size_t>(num_pages * page_size * row),
                           std::numeric_limits<double>::quiet_NaN());
  std::vector<double> table;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < per_seq; ++i) {
      const std::int64_t page = num_pages - 1 - (b * per_seq + i);
      table.push_back(static_cast<double>(page));
      for (std::int64_t r = 0; r < page_size && i * page_size + r < capacity; ++r) {
        std::copy_n(dense.begin() + (b * capacity + i * page_size + r) * row, row,
                    pool.begin() + (page * page_size + r) * row);
      }
    }
  }
  return {pool, make_tensor(DType::i32, {batch, per_seq}, table), num_pages};
}

}  // namespace attncore::test
