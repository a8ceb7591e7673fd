// TensorView (contiguous / strided / transposed views, numel and its overflow) and Tensor
// (64-byte aligned, zero-initialised, contiguous storage; bad arguments refused).
#include "attncore/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "attncore/error.h"
#include "core/large_memory.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

constexpr std::int64_t kBig = std::int64_t{1} << 32;

TEST(TensorView, ContiguousHasRowMajorStrides) {
  int dummy = 0;
  const TensorView v = TensorView::contiguous(&dummy, DType::bf16, {2, 3, 4, 5});  // [2, 3, 4, 5]
  EXPECT_EQ(v.data, &dummy);
  EXPECT_EQ(v.dtype, DType::bf16);
  EXPECT_EQ(v.rank, 4);
  EXPECT_EQ(v.size(0), 2);
  EXPECT_EQ(v.size(3), 5);
  EXPECT_EQ(v.stride_of(0), 60);
  EXPECT_EQ(v.stride_of(1), 20);
  EXPECT_EQ(v.stride_of(2), 5);
  EXPECT_EQ(v.stride_of(3), 1);
  EXPECT_EQ(v.numel(), 120);
  EXPECT_EQ(v.shape_string(), "[2, 3, 4, 5]");
}

TEST(TensorView, LowerRanks) {
  const TensorView v1 = TensorView::contiguous(nullptr, DType::f32, {7});  // [7]
  EXPECT_EQ(v1.rank, 1);
  EXPECT_EQ(v1.stride_of(0), 1);
  EXPECT_EQ(v1.numel(), 7);
  EXPECT_EQ(v1.shape_string(), "[7]");
  const TensorView v2 = TensorView::contiguous(nullptr, DType::f32, {3, 9});  // [3, 9]
  EXPECT_EQ(v2.stride_of(0), 9);
  EXPECT_EQ(v2.stride_of(1), 1);
  EXPECT_EQ(v2.numel(), 27);
  const TensorView v3 = TensorView::contiguous(nullptr, DType::f64, {2, 3, 0});  // [2, 3, 0]
  EXPECT_EQ(v3.numel(), 0);
  EXPECT_EQ(v3.shape_string(), "[2, 3, 0]");
}

TEST(TensorView, StridedKeepsTheGivenStrides) {
  float buf[64] = {};
  // [2, 3, 4] with padded rows of 5 and a broadcast (stride 0) middle dim.
  const TensorView v = TensorView::strided(buf, DType::f32, {2, 3, 4}, {5, 0, 1});
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.stride_of(0), 5);
  EXPECT_EQ(v.stride_of(1), 0);
  EXPECT_EQ(v.stride_of(2), 1);
  EXPECT_EQ(v.numel(), 24);
}

TEST(TensorView, TransposedSwapsShapeAndStride) {
  int dummy = 0;
  // [B=2, L=5, H=3, D=8] as [B, H, L, D].
  const TensorView bshd = TensorView::contiguous(&dummy, DType::f16, {2, 5, 3, 8});
  const TensorView bhsd = bshd.transposed(1, 2);
  EXPECT_EQ(bhsd.data, &dummy);
  EXPECT_EQ(bhsd.dtype, DType::f16);
  EXPECT_EQ(bhsd.rank, 4);
  EXPECT_EQ(bhsd.size(0), 2);
  EXPECT_EQ(bhsd.size(1), 3);
  EXPECT_EQ(bhsd.size(2), 5);
  EXPECT_EQ(bhsd.size(3), 8);
  EXPECT_EQ(bhsd.stride_of(0), 120);
  EXPECT_EQ(bhsd.stride_of(1), 8);
  EXPECT_EQ(bhsd.stride_of(2), 24);
  EXPECT_EQ(bhsd.stride_of(3), 1);
  EXPECT_EQ(bhsd.numel(), 240);
  // Transposing back restores the original view; transposing a dim with itself is a no-op.
  const TensorView back = bhsd.transposed(2, 1);
  EXPECT_EQ(back.shape, bshd.shape);
  EXPECT_EQ(back.stride, bshd.stride);
  const TensorView same = bshd.transposed(3, 3);
  EXPECT_EQ(same.shape, bshd.shape);
  EXPECT_EQ(same.stride, bshd.stride);
}

// rank is a public field: a view whose rank was written past kMaxRank (or negative) is refused
// by transposed, which indexed shape[5] of a view of rank 7 (UB) before it was checked.
TEST(TensorView, TransposedRefusesAnInvalidRank) {
  float x[8] = {};
  for (const int rank : {kMaxRank + 1, 7, -1}) {
    TensorView t = TensorView::contiguous(x, DType::f32, {2, 4});
    t.rank = rank;
    try {
      (void)t.transposed(5, 6);
      FAIL() << "rank " << rank << ": no exception";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), "TensorView: rank is invalid (rank=" +
                                           std::to_string(rank) + ", expected 0 to " +
                                           std::to_string(kMaxRank) + ")");
    }
  }
}

TEST(TensorView, NumelOverflowIsMinusOne) {
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {kBig, kBig}).numel(), -1);      // 2^64
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {kBig, kBig / 2}).numel(), -1);  // 2^63
  EXPECT_EQ(
      TensorView::contiguous(nullptr, DType::f32, {1 << 16, 1 << 16, 1 << 16, 1 << 16}).numel(),
      -1);  // 2^64 in four factors, none of them large
  EXPECT_EQ(
      TensorView::contiguous(nullptr, DType::f32, {3, std::numeric_limits<std::int64_t>::max() / 2})
          .numel(),
      -1);
  // A zero size wins over a product past int64 in any order (nothing to count).
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {kBig, kBig, 0}).numel(), 0);
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {0, kBig, kBig}).numel(), 0);
  // The largest products that fit are exact.
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {kBig, kBig / 4}).numel(),
            std::int64_t{1} << 62);
  EXPECT_EQ(
      TensorView::contiguous(nullptr, DType::f32, {std::numeric_limits<std::int64_t>::max(), 1})
          .numel(),
      std::numeric_limits<std::int64_t>::max());
}

TEST(TensorView, NumelWithAZeroDimIsZeroEvenWhenTheOthersOverflow) {
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::f32, {kBig, kBig, 0}).numel(), 0);
}

// A rank past what shape holds (kMaxRank sizes) reads nothing past it: numel -1, the shape
// named by its rank; a Tensor of a null shape is refused.
TEST(TensorView, RanksPastTheArrayAreNeverRead) {
  TensorView t = TensorView::contiguous(nullptr, DType::f32, {2, 3});
  for (int rank : {-1, kMaxRank + 1, 9}) {
    t.rank = rank;
    EXPECT_EQ(t.numel(), -1);
    EXPECT_EQ(t.shape_string(), "[rank=" + std::to_string(rank) + "]");
  }
  try {
    Tensor bad(DType::f32, nullptr, 2);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Tensor: shape is null (shape=nullptr, rank=2, expected 2 sizes)");
  }
}

TEST(Tensor, DefaultIsUndefined) {
  const Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.rank(), 0);
}

TEST(Tensor, IsAlignedZeroedAndContiguous) {
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::b8}) {
    for (std::int64_t n : {1, 3, 17, 1000, 65537}) {
      const Tensor t(dtype, {n, 3});  // [n, 3]
      ASSERT_TRUE(t.defined());
      EXPECT_EQ(t.dtype(), dtype);
      EXPECT_EQ(t.rank(), 2);
      EXPECT_EQ(t.size(0), n);
      EXPECT_EQ(t.size(1), 3);
      EXPECT_EQ(t.numel(), 3 * n);
      EXPECT_EQ(t.view().stride_of(0), 3);
      EXPECT_EQ(t.view().stride_of(1), 1);
      ASSERT_NE(t.data(), nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u)
          << name_of(dtype) << " n=" << n;
      const auto* bytes = t.data_as<unsigned char>();
      const std::size_t size = static_cast<std::size_t>(t.numel()) * size_of(dtype);
      std::size_t nonzero = 0;
      for (std::size_t i = 0; i < size; ++i) nonzero += bytes[i] != 0;
      EXPECT_EQ(nonzero, 0u) << name_of(dtype) << " n=" << n;
      // The whole extent is writable (ASan checks the allocation is large enough).
      std::memset(t.data(), 0x5a, size);
    }
  }
}

TEST(Tensor, ZeroInitialisedAfterEarlierAllocationsWereDirtied) {
  for (int round = 0; round < 4; ++round) {
    Tensor dirty(DType::f32, {4096});  // [4096]
    std::memset(dirty.data(), 0xff, 4096 * 4);
  }
  const Tensor t(DType::f32, {4096});  // [4096]
  for (std::int64_t i = 0; i < 4096; ++i) ASSERT_EQ(t.data_as<float>()[i], 0.0f) << i;
}

// From 32 MiB on (tensor.cpp's kStreamedTensorBytes), a Tensor's storage is a mapping of its
// own (StreamedMemory): zeroed, 2 MiB aligned where it is on huge pages, writable to its end,
// freed as it goes (moved, dirtied and made again), on either side of the threshold.
TEST(Tensor, LargeStorageIsZeroedAlignedAndFreed) {
  constexpr std::int64_t kStreamed = std::int64_t{32} << 20;
  for (std::int64_t bytes : {kStreamed - 64, kStreamed, kStreamed + 4, kStreamed + (3 << 20)}) {
    for (int round = 0; round < 3; ++round) {
      Tensor made(DType::f32, {bytes / 4});  // [bytes / 4]
      const Tensor t = std::move(made);
      EXPECT_FALSE(made.defined());  // NOLINT(bugprone-use-after-move): moved from
      const auto address = reinterpret_cast<std::uintptr_t>(t.data());
      EXPECT_EQ(address % 64, 0u);
      if (detail::kStreamedOnHugePages && bytes >= kStreamed) {
        EXPECT_EQ(address % detail::kHugePageBytes, 0u) << bytes;
      }
      const auto* data = t.data_as<unsigned char>();
      std::size_t nonzero = 0;
      for (std::int64_t i = 0; i < t.numel() * 4; ++i) nonzero += data[i] != 0;
      ASSERT_EQ(nonzero, 0u) << bytes << " round " << round;
      std::memset(t.data(), 0xff, static_cast<std::size_t>(t.numel()) * 4);
    }
  }
}

TEST(Tensor, PointerRankConstructorMatchesInitializerList) {
  const std::int64_t shape[4] = {2, 3, 5, 7};
  const Tensor a(DType::f16, shape, 4);  // [2, 3, 5, 7]
  const Tensor b(DType::f16, {2, 3, 5, 7});
  EXPECT_EQ(a.view().shape, b.view().shape);
  EXPECT_EQ(a.view().stride, b.view().stride);
  EXPECT_EQ(a.view().stride_of(0), 105);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);
}

TEST(Tensor, EmptyShapesAreLegal) {
  const Tensor t(DType::f32, {2, 0, 5});  // [2, 0, 5]
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.size(1), 0);
}

// Bad arguments are refused with attncore's errors before anything is allocated: a dtype
// outside the enum, a rank outside 0..4, a negative size, and storage past the memory this
// process may use (the allocator never sees such a size).
TEST(Tensor, BadArgumentsAreRefused) {
  const std::string dtype =
      test::invalid_argument_message([] { const Tensor t(static_cast<DType>(50), {4}); });
  EXPECT_EQ(dtype, "Tensor: dtype is invalid (dtype=50, expected a DType value)");
  const std::int64_t shape[1] = {4};
  EXPECT_EQ(test::invalid_argument_message([&] { const Tensor t(DType::f32, shape, -1); }),
            "Tensor: rank is invalid (rank=-1, expected 0 to 4)");
  EXPECT_EQ(test::invalid_argument_message([] {
              const Tensor t(DType::f32, {-1, 4});
            }),
            "Tensor: shape [-1, 4] has a negative size (shape[0]=-1, expected >= 0)");
  try {
    const Tensor t(DType::f32, {std::int64_t{1} << 40, std::int64_t{1} << 10});  // 4 PiB
    ADD_FAILURE() << "no exception";
  } catch (const OutOfMemory& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind("Tensor: shape [1099511627776, 1024] needs more memory than this "
                            "process may use (bytes=4.504e+15, expected <= ",
                            0),
              0u)
        << message;
  }
}

TEST(Tensor, MoveKeepsStorage) {
  Tensor a(DType::f32, {8});  // [8]
  a.data_as<float>()[3] = 2.5f;
  void* p = a.data();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.data_as<float>()[3], 2.5f);
  const TensorView& v = b;  // implicit view
  EXPECT_EQ(v.data, p);
}

}  // namespace
}  // namespace attncore
