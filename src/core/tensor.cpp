// TensorView helpers, Tensor storage, and the names of the public enums.
#include "attncore/tensor.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "attncore/error.h"
#include "attncore/info.h"
#include "attncore/options.h"
#include "core/cpu_info.h"
#include "core/large_memory.h"

namespace attncore {

namespace {

TensorView make_view(void* data, DType dtype, const std::int64_t* shape,
                     const std::int64_t* strides, std::size_t rank) {
  if (rank > static_cast<std::size_t>(kMaxRank)) {
    throw InvalidArgument("TensorView: rank is too large (rank=" + std::to_string(rank) +
                          ", expected <= " + std::to_string(kMaxRank) + ")");
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.rank = static_cast<int>(rank);
  std::int64_t running = 1;
  for (std::size_t d = rank; d-- > 0;) {
    view.shape[d] = shape[d];
    if (strides != nullptr) {
      view.stride[d] = strides[d];
    } else {
      view.stride[d] = running;
      // Saturate instead of overflowing; validation rejects such shapes by numel().
      if (shape[d] > 0 && running > INT64_MAX / shape[d]) {
        running = INT64_MAX;
      } else {
        running *= shape[d] > 0 ? shape[d] : 1;
      }
    }
  }
  return view;
}

}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype,
                                  std::initializer_list<std::int64_t> shape) {
  return make_view(data, dtype, shape.begin(), nullptr, shape.size());
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> strides) {
  if (shape.size() != strides.size()) {
    throw InvalidArgument(
        "TensorView: strides do not match the shape (rank=" + std::to_string(shape.size()) +
        ", expected " + std::to_string(shape.size()) + " strides, got " +
        std::to_string(strides.size()) + ")");
  }
  return make_view(data, dtype, shape.begin(), strides.begin(), shape.size());
}

std::int64_t TensorView::numel() const {
  // -1 for a negative size or a product past int64 (0 wins over both where a size is 0, in
  // dim order against a negative one). Overflow is tested by the multiply itself: the calls'
  // overlap checks ask every view's numel, and a division per dim cost ~0.7 us of a small
  // Python append (perf).
  if (rank < 0 || rank > kMaxRank) return -1;  // (no such view: shape holds kMaxRank sizes)
  std::int64_t n = 1;
  bool overflow = false;
  for (int d = 0; d < rank; ++d) {
    const std::int64_t s = shape[static_cast<std::size_t>(d)];
    if (s < 0) return -1;
    if (s == 0) return 0;
    overflow = __builtin_mul_overflow(n, s, &n) || overflow;
  }
  return overflow ? -1 : n;
}

TensorView TensorView::transposed(int d0, int d1) const {
  if (rank < 0 || rank > kMaxRank) {  // (rank is a public field: never index past shape)
    throw InvalidArgument("TensorView: rank is invalid (rank=" + std::to_string(rank) +
                          ", expected 0 to " + std::to_string(kMaxRank) + ")");
  }
  if (d0 < 0 || d1 < 0 || d0 >= rank || d1 >= rank) {
    throw InvalidArgument(
        "TensorView: transposed dimension out of range (dims=" + std::to_string(d0) + "," +
        std::to_string(d1) + ", expected < rank=" + std::to_string(rank) + ")");
  }
  TensorView t = *this;
  std::swap(t.shape[static_cast<std::size_t>(d0)], t.shape[static_cast<std::size_t>(d1)]);
  std::swap(t.stride[static_cast<std::size_t>(d0)], t.stride[static_cast<std::size_t>(d1)]);
  return t;
}

std::string TensorView::shape_string() const {
  if (rank < 0 || rank > kMaxRank) return "[rank=" + std::to_string(rank) + "]";
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < rank; ++d) os << (d ? ", " : "") << shape[static_cast<std::size_t>(d)];
  os << ']';
  return os.str();
}

// A Tensor's storage: heap memory (std::free), or, for kStreamedTensorBytes and more, a
// StreamedMemory (a mapping of its own on huge pages where the OS offers them), whose address
// the storage holds with its lowest bit set (a StreamedMemory is aligned to more than 1 byte).
namespace {
constexpr std::uintptr_t kStreamedTag = 1;
// Tensors this large are StreamedMemory: glibc maps an allocation past 32 MiB (its largest
// mmap threshold on 64-bit) afresh anyway, so its pages come at first touch either way, here
// on huge pages (touching 48 MiB: 4 ms against 21, large_memory.h); smaller ones, which glibc
// may hand back from memory already touched, stay on the heap.
constexpr std::size_t kStreamedTensorBytes = std::size_t{32} << 20;
}  // namespace

void Tensor::Free::operator()(void* p) const {
  const auto bits = reinterpret_cast<std::uintptr_t>(p);
  if ((bits & kStreamedTag) != 0) {
    delete reinterpret_cast<detail::StreamedMemory*>(bits & ~kStreamedTag);
  } else {
    std::free(p);
  }
}

Tensor::Tensor(DType dtype, std::initializer_list<std::int64_t> shape)
    : Tensor(dtype, shape.begin(), static_cast<int>(shape.size())) {}

Tensor::Tensor(DType dtype, const std::int64_t* shape, int rank) {
  if (size_of(dtype) == 0) {
    throw InvalidArgument("Tensor: dtype is invalid (dtype=" +
                          std::to_string(static_cast<int>(dtype)) + ", expected a DType value)");
  }
  if (rank < 0 || rank > kMaxRank) {
    throw InvalidArgument("Tensor: rank is invalid (rank=" + std::to_string(rank) +
                          ", expected 0 to " + std::to_string(kMaxRank) + ")");
  }
  if (rank > 0 && shape == nullptr) {
    throw InvalidArgument("Tensor: shape is null (shape=nullptr, rank=" + std::to_string(rank) +
                          ", expected " + std::to_string(rank) + " sizes)");
  }
  view_ = make_view(nullptr, dtype, shape, nullptr, static_cast<std::size_t>(rank));
  for (int d = 0; d < rank; ++d) {
    if (shape[d] < 0) {
      throw InvalidArgument("Tensor: shape " + view_.shape_string() +
                            " has a negative size (shape[" + std::to_string(d) +
                            "]=" + std::to_string(shape[d]) + ", expected >= 0)");
    }
  }
  const std::int64_t n = view_.numel();
  if (n < 0 || static_cast<std::uint64_t>(n) > (UINT64_MAX >> 4) / size_of(dtype)) {
    throw InvalidArgument(
        "Tensor: shape " + view_.shape_string() +
        " has too many elements (expected numel * element size to fit in memory)");
  }
  // 64-byte aligned and rounded up to a whole cache line, as aligned_alloc requires.
  const std::size_t bytes = (static_cast<std::size_t>(n) * size_of(dtype) + 63) & ~std::size_t{63};
  // Refused before the allocator sees it, as the calls' memory checks refuse theirs.
  if (const auto limit = detail::exceeded_memory_limit(static_cast<double>(bytes))) {
    char text[160];
    std::snprintf(text, sizeof text, "(bytes=%.4g, expected <= %.4g bytes, %s)",
                  static_cast<double>(bytes), limit->bytes, limit->name);
    throw OutOfMemory("Tensor: shape " + view_.shape_string() +
                      " needs more memory than this process may use " + text);
  }
  auto out_of_memory = [&] {
    return OutOfMemory("Tensor: cannot allocate the storage (bytes=" + std::to_string(bytes) +
                       ", expected that much free memory)");
  };
  if (bytes >= kStreamedTensorBytes) {
    // On huge pages where the OS offers them (StreamedMemory): a dense KV cache in a Tensor is
    // read as fast as PagedKvCache's pools. GQA decode (Zen 3, 1 thread, Hq 32, Hkv 8, Lk
    // 16384: 32 or 64 MiB of K), K/V on huge pages against 4 KiB ones, 3 alternating rounds,
    // median speed ratio: f32 [B, Hkv, L, D] 1.38, [B, L, Hkv, D] 1.02; bf16 1.14 and 1.21.
    // `attncore run --cache-len 16384` (bf16, Hkv 8: a Tensor of 32 MiB per cache), against the
    // version before, 5 alternating rounds: 1.27.
    try {
      auto memory = std::make_unique<detail::StreamedMemory>(bytes);
      view_.data = memory->data();
      storage_.reset(reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(memory.release()) |
                                             kStreamedTag));
    } catch (const std::bad_alloc&) {
      throw out_of_memory();
    }
  } else if (bytes > 0) {
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw out_of_memory();
    std::memset(p, 0, bytes);
    storage_.reset(p);
    view_.data = p;
  }
}

std::string_view name_of(Causal c) {
  switch (c) {
    case Causal::none:
      return "none";
    case Causal::upper_left:
      return "upper-left";
    case Causal::lower_right:
      return "lower-right";
  }
  return "?";
}

std::string_view name_of(Backend b) {
  switch (b) {
    case Backend::automatic:
      return "auto";
    case Backend::reference:
      return "reference";
    case Backend::math:
      return "math";
    case Backend::flash:
      return "flash";
  }
  return "?";
}

Backend backend_from_name(std::string_view name) {
  for (Backend b : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    if (name_of(b) == name) return b;
  }
  throw InvalidArgument("backend_from_name: name is unknown (name=" + std::string(name) +
                        ", expected auto, reference, math or flash)");
}

}  // namespace attncore
