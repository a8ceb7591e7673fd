// Sizes past 64 bits (docs/design.md section 4): stride-0 views make absurd sizes cheap to
// build, and every count a call forms from them is checked at validation, before any work: the
// (query, key) pairs B * Hq * Lq * Lk (every score's index, and dropout's stream positions),
// the element count of an output the library allocates, and a view's last address.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "attncore/attncore.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

using test::invalid_argument_message;

const Backend kBackends[] = {Backend::automatic, Backend::reference, Backend::math, Backend::flash};

// Lk = 2^57 keys against 128 queries (D = 1): 2^64 pairs, on every backend, forward and
// backward, allocating or not, with dropout or not.
TEST(Sizes, PairsPast64BitsAreInvalid) {
  float one = 0.5f;
  const std::int64_t lk = std::int64_t{1} << 57;
  const TensorView q = TensorView::strided(&one, DType::f32, {1, 1, 128, 1}, {0, 0, 0, 1});
  const TensorView kv = TensorView::strided(&one, DType::f32, {1, 1, lk, 1}, {0, 0, 0, 1});
  Tensor out(DType::f32, {1, 1, 128, 1}), lse(DType::f32, {1, 1, 128});
  const std::string expected =
      "query and key make too many (query, key) pairs (B * Hq * Lq * Lk=1.84467e+19, expected "
      "< 2^63)";
  for (const double dropout : {0.0, 0.1}) {
    Options o;
    o.dropout_p = dropout;
    for (Backend b : kBackends) {
      SCOPED_TRACE(std::string(name_of(b)) + " dropout " + std::to_string(dropout));
      EXPECT_EQ(invalid_argument_message([&] { (void)forward(q, kv, kv, o, b); }),
                "forward: " + expected);
      EXPECT_EQ(invalid_argument_message([&] { forward_into(q, kv, kv, out, lse.view(), o, b); }),
                "forward: " + expected);
      EXPECT_EQ(invalid_argument_message([&] { (void)backward(out, q, kv, kv, out, lse, o, b); }),
                "backward: " + expected);
    }
    EXPECT_EQ(invalid_argument_message([&] { (void)explain_forward(q, kv, kv, o); }),
              "forward: " + expected);
  }
  // 2^62 pairs (with dropout: stream positions up to offset + 2^62) are valid; explain runs
  // nothing.
  const TensorView kv62 =
      TensorView::strided(&one, DType::f32, {1, 1, std::int64_t{1} << 55, 1}, {0, 0, 0, 1});
  Options o;
  o.dropout_p = 0.1;
  o.offset = ~std::uint64_t{0};
  EXPECT_NO_THROW((void)explain_forward(q, kv62, kv62, o));
  // Batch and heads count too: B * Hq = 2^40 and Lq = 2^10, against Lk = 2^12 (2^62 pairs:
  // valid) and 2^13 (2^63: invalid).
  const TensorView q_many =
      TensorView::strided(&one, DType::f32, {1 << 20, 1 << 20, 1 << 10, 8}, {0, 0, 0, 1});
  const TensorView kv_many =
      TensorView::strided(&one, DType::f32, {1 << 20, 1 << 20, 1 << 12, 8}, {0, 0, 0, 1});
  EXPECT_NO_THROW((void)explain_forward(q_many, kv_many, kv_many, {}));
  const TensorView kv_more =
      TensorView::strided(&one, DType::f32, {1 << 20, 1 << 20, 1 << 13, 8}, {0, 0, 0, 1});
  EXPECT_EQ(invalid_argument_message([&] { (void)explain_forward(q_many, kv_more, kv_more, {}); }),
            "forward: query and key make too many (query, key) pairs (B * Hq * Lq * "
            "Lk=9.22337e+18, expected < 2^63)");
}

// An output the library allocates must have an element count that fits: Lq = 2^30 queries of
// D = 1 against values of Dv = 2^40 make an out of 2^70 elements (dense and packed).
TEST(Sizes, AllocatedOutputsPast64BitsAreInvalid) {
  float one = 0.5f;
  const std::int64_t lq = std::int64_t{1} << 30, dv = std::int64_t{1} << 40;
  const TensorView q = TensorView::strided(&one, DType::f32, {1, 1, lq, 1}, {0, 0, 0, 1});
  const TensorView k = TensorView::strided(&one, DType::f32, {1, 1, 1, 1}, {0, 0, 0, 1});
  const TensorView v = TensorView::strided(&one, DType::f32, {1, 1, 1, dv}, {0, 0, 0, 1});
  for (Backend b : kBackends) {
    EXPECT_EQ(invalid_argument_message([&] { (void)forward(q, k, v, {}, b); }),
              "forward: out would have too many elements (B * Hq * Lq * Dv=1.18059e+21, "
              "expected < 2^63)")
        << name_of(b);
  }
  const TensorView packed_q = TensorView::strided(&one, DType::f32, {lq, 1, 1}, {0, 0, 1});
  const TensorView packed_k = TensorView::strided(&one, DType::f32, {1, 1, 1}, {0, 0, 1});
  const TensorView packed_v = TensorView::strided(&one, DType::f32, {1, 1, dv}, {0, 0, 1});
  const std::int32_t cu_q[] = {0, static_cast<std::int32_t>(lq)}, cu_k[] = {0, 1};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu_q), DType::i32, {2});
  seqs.cu_seqlens_k = TensorView::contiguous(const_cast<std::int32_t*>(cu_k), DType::i32, {2});
  seqs.max_seqlen_q = lq;
  seqs.max_seqlen_k = 1;
  EXPECT_EQ(
      invalid_argument_message([&] { (void)forward_varlen(packed_q, packed_k, packed_v, seqs); }),
      "forward: out would have too many elements (total_q * Hq * Dv=1.18059e+21, "
      "expected < 2^63)");
}

// A view whose last byte would lie past the end of the address space.
TEST(Sizes, ViewsThatWrapTheAddressSpaceAreInvalid) {
  void* top = reinterpret_cast<void*>(~std::uintptr_t{0} - 103);  // (a multiple of 4)
  const TensorView q = TensorView::contiguous(top, DType::f32, {1, 1, 1, 64});
  const Tensor kv(DType::f32, {1, 1, 4, 64});
  const std::string message = invalid_argument_message([&] { (void)forward(q, kv, kv); });
  EXPECT_EQ(message.rfind("forward: query spans past the end of the address space", 0), 0u)
      << message;
}

// A view whose data is not at a multiple of its element size (a numpy view at an odd byte
// offset): refused, where the checks and kernels would read it as misaligned floats or ints.
TEST(Sizes, MisalignedViewsAreInvalid) {
  alignas(64) static unsigned char bytes[4096] = {};
  const TensorView q = TensorView::contiguous(bytes + 1, DType::f32, {1, 1, 1, 64});
  const Tensor kv(DType::f32, {1, 1, 4, 64});
  EXPECT_EQ(invalid_argument_message([&] { (void)forward(q, kv, kv); }),
            "forward: query is not aligned to its element size (address % 4=1, expected 0); "
            "copy it to an aligned buffer");
  const Tensor q_ok(DType::f32, {1, 1, 1, 64});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = TensorView::contiguous(bytes + 2, DType::i32, {1});
  EXPECT_EQ(invalid_argument_message([&] { (void)forward_kvcache(q_ok, kv, kv, seqs); }),
            "forward: cache_seqlens is not aligned to its element size (address % 4=2, "
            "expected 0); copy it to an aligned buffer");
  const TensorView half = TensorView::contiguous(bytes + 3, DType::bf16, {1, 1, 1, 64});
  EXPECT_EQ(invalid_argument_message([&] { (void)forward(half, half, half); }).rfind(
                "forward: query is not aligned to its element size (address % 2=1", 0),
            0u);
}

// Lengths near 2^62 that the pair count lets through (an empty batch takes any lengths; one
// query row takes 2^62 keys), with windows as wide: the window arithmetic stays in range (the
// sanitizer builds would stop on an overflow), an empty batch runs without a workspace, and
// the cost model prices the one row.
TEST(Sizes, LengthsNear63BitsKeepTheWindowArithmeticInRange) {
  float one = 0.5f;
  const std::int64_t huge = std::int64_t{1} << 62;
  const TensorView empty_q = TensorView::strided(&one, DType::f32, {0, 1, huge, 1}, {0, 0, 0, 1});
  const TensorView long_k = TensorView::strided(&one, DType::f32, {0, 1, huge, 1}, {0, 0, 0, 1});
  for (const std::int64_t window : {std::int64_t{-1}, std::int64_t{0}, huge, INT64_MAX}) {
    Options o;
    o.window_left = o.window_right = window;
    for (Backend backend : {Backend::automatic, Backend::flash}) {
      ForwardResult r;
      ASSERT_NO_THROW(r = forward(empty_q, long_k, long_k, o, backend)) << window;
      EXPECT_EQ(r.out.numel(), 0);
    }
  }
  const TensorView q = TensorView::strided(&one, DType::f32, {1, 1, 1, 1}, {0, 0, 0, 1});
  const TensorView k = TensorView::strided(&one, DType::f32, {1, 1, huge, 1}, {0, 0, 0, 1});
  for (const std::int64_t window : {huge - 1, huge, huge + 1, INT64_MAX}) {
    Options o;
    o.window_right = window;
    o.window_left = window;
    EXPECT_NO_THROW((void)explain_forward(q, k, k, o)) << window;
  }
}

}  // namespace
}  // namespace attncore
