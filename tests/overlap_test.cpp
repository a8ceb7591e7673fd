// Outputs that share memory (docs/design.md section 4): an output may share no byte with
// another output or with an input, dense and varlen, forward and backward, refused with
// InvalidArgument naming both arrays before anything is written. The test is exact on the
// elements' bytes, so outputs interleaved in one buffer without touching (dq, dk, dv as slices
// of a packed [total, 3, H, D] or [B, L, 3, H, D] buffer) are accepted.
#include "core/overlap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

using test::invalid_argument_message;

using detail::views_overlap;

// Whether `message` starts with `prefix`.
::testing::AssertionResult starts_with(const std::string& message, const std::string& prefix) {
  if (message.rfind(prefix, 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << message << "\" does not start with \"" << prefix << "\"";
}

void fill(const Tensor& t, float seed) {
  auto* x = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x[i] = static_cast<float>((i * 37 + static_cast<std::int64_t>(seed * 11)) % 23) * 0.05f - 0.5f;
  }
}

// ---------------------------------------------------------------------------------------------
// views_overlap itself.

TEST(Overlap, ExactOnElementBytes) {
  std::vector<float> buffer(1024);
  float* base = buffer.data();
  auto view = [](void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                 std::initializer_list<std::int64_t> strides) {
    return TensorView::strided(data, dtype, shape, strides);
  };
  // Disjoint, identical, partly overlapping.
  const TensorView a = view(base, DType::f32, {4, 8}, {8, 1});
  EXPECT_FALSE(views_overlap(a, view(base + 32, DType::f32, {4, 8}, {8, 1})));
  EXPECT_TRUE(views_overlap(a, a));
  EXPECT_TRUE(views_overlap(a, view(base + 31, DType::f32, {4, 8}, {8, 1})));
  // Columns of one matrix: [8, 4] with row stride 8 at columns 0-3 and 4-7 interleave.
  const TensorView left = view(base, DType::f32, {8, 4}, {8, 1});
  EXPECT_FALSE(views_overlap(left, view(base + 4, DType::f32, {8, 4}, {8, 1})));
  EXPECT_TRUE(views_overlap(left, view(base + 3, DType::f32, {8, 4}, {8, 1})));
  // Even and odd elements; then strides of 2 and 4 from 1 (odd) against evens, and stride 3
  // from 1 (1, 4, 7: meets 4).
  const TensorView even = view(base, DType::f32, {16}, {2});
  EXPECT_FALSE(views_overlap(even, view(base + 1, DType::f32, {16}, {2})));
  EXPECT_FALSE(views_overlap(even, view(base + 1, DType::f32, {8}, {4})));
  EXPECT_TRUE(views_overlap(even, view(base + 1, DType::f32, {3}, {3})));
  // Bytes, not elements: a float 2 bytes in shares bytes; bf16 after the last float does not.
  char* bytes = reinterpret_cast<char*>(base);
  EXPECT_TRUE(
      views_overlap(view(bytes, DType::f32, {4}, {1}), view(bytes + 2, DType::f32, {4}, {1})));
  EXPECT_FALSE(
      views_overlap(view(bytes, DType::f32, {4}, {1}), view(bytes + 16, DType::bf16, {8}, {1})));
  EXPECT_TRUE(
      views_overlap(view(bytes, DType::f32, {4}, {1}), view(bytes + 14, DType::bf16, {8}, {1})));
  // Strided f32 columns against bf16 pairs between them.
  EXPECT_FALSE(views_overlap(view(bytes, DType::f32, {8}, {2}),
                             view(bytes + 4, DType::bf16, {8, 2}, {4, 1})));
  // Broadcast (stride-0) dims and empty views.
  EXPECT_TRUE(views_overlap(view(base, DType::f32, {5, 8}, {0, 1}), a));
  EXPECT_FALSE(views_overlap(view(base, DType::f32, {0, 8}, {8, 1}), a));
  EXPECT_FALSE(views_overlap(TensorView{}, a));
}

// The packed gradient layouts: q, k, v (and their gradients) as slices of one buffer.
TEST(Overlap, PackedSlicesInterleaveWithoutTouching) {
  const std::int64_t total = 37, h = 3, d = 24;
  std::vector<float> packed(static_cast<std::size_t>(total * 3 * h * d));  // [total, 3, H, D]
  auto slice = [&](std::int64_t which, std::int64_t shift = 0) {
    return TensorView::strided(packed.data() + which * h * d + shift, DType::f32, {total, h, d},
                               {3 * h * d, d, 1});
  };
  EXPECT_FALSE(views_overlap(slice(0), slice(1)));
  EXPECT_FALSE(views_overlap(slice(0), slice(2)));
  EXPECT_FALSE(views_overlap(slice(1), slice(2)));
  EXPECT_TRUE(views_overlap(slice(0), slice(1, -1)));  // one element back: meets q's last head
  EXPECT_TRUE(views_overlap(slice(1), slice(1, d / 2)));
  // Dense [B, L, 3, H, D] seen as [B, H, L, D] views.
  const std::int64_t b = 2, l = 19;
  std::vector<float> dense(static_cast<std::size_t>(b * l * 3 * h * d));
  auto head_view = [&](std::int64_t which) {
    return TensorView::strided(dense.data() + which * h * d, DType::f32, {b, h, l, d},
                               {l * 3 * h * d, d, 3 * h * d, 1});
  };
  EXPECT_FALSE(views_overlap(head_view(0), head_view(1)));
  EXPECT_FALSE(views_overlap(head_view(2), head_view(0)));
}

// ---------------------------------------------------------------------------------------------
// Through the API.

struct Dense {
  static constexpr std::int64_t kB = 2, kHq = 4, kHkv = 2, kLq = 9, kLk = 13, kD = 16;
  Tensor q{DType::f32, {kB, kHq, kLq, kD}}, k{DType::f32, {kB, kHkv, kLk, kD}},
      v{DType::f32, {kB, kHkv, kLk, kD}};
  Tensor out{DType::f32, {kB, kHq, kLq, kD}}, lse{DType::f32, {kB, kHq, kLq}};
  Tensor dq{DType::f32, {kB, kHq, kLq, kD}}, dk{DType::f32, {kB, kHkv, kLk, kD}},
      dv{DType::f32, {kB, kHkv, kLk, kD}};
  Dense() {
    fill(q, 1);
    fill(k, 2);
    fill(v, 3);
    forward_into(q, k, v, out, lse.view(), {}, Backend::reference);
  }
};

TEST(Overlap, DenseOutputsThatShareMemoryAreRefused) {
  Dense c;
  for (Backend backend : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    // out is the query (in place); the LSE inside out; out over an additive mask.
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_into(c.q, c.k, c.v, c.q, std::nullopt, {}, backend);
                            }),
                            "forward: out overlaps query (out=bytes [0x"));
    const TensorView lse_in_out =
        TensorView::contiguous(c.out.data_as<float>() + 5, DType::f32, {2, 4, 9});
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_into(c.q, c.k, c.v, c.out, lse_in_out, {}, backend);
                            }),
                            "forward: lse overlaps out ("));
    Options masked;
    masked.mask = TensorView::contiguous(c.dq.data(), DType::f32, {9, 13});
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_into(c.q, c.k, c.v, c.dq, std::nullopt, masked, backend);
                            }),
                            "forward: out overlaps mask ("));
    // Backward: dq on dout; dv on dk; dk on the value; dbias on the mask.
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.out, c.dk, c.dv,
                                            std::nullopt, {}, backend);
                            }),
                            "backward: dq overlaps dout ("));
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dk,
                                            std::nullopt, {}, backend);
                            }),
                            "backward: dv overlaps dk ("));
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, c.v, c.dv,
                                            std::nullopt, {}, backend);
                            }),
                            "backward: dk overlaps value ("));
    Tensor mask(DType::f32, {9, 13});
    Options with_dbias;
    with_dbias.mask = mask.view();
    with_dbias.compute_dbias = true;
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv,
                                            mask.view(), with_dbias, backend);
                            }),
                            "backward: dbias overlaps mask ("));
  }
  // Nothing was written: out still holds the reference forward's result.
  Tensor again(DType::f32, {2, 4, 9, 16});
  forward_into(c.q, c.k, c.v, again, std::nullopt, {}, Backend::reference);
  EXPECT_EQ(std::memcmp(again.data(), c.out.data(), 2 * 4 * 9 * 16 * sizeof(float)), 0);
}

// self_overlapping against every pair of element offsets, over every view of rank 3 with sizes
// 1 to 3 and strides 0 to 7 (its search, and the nested strides it clears without one).
TEST(Overlap, SelfOverlapMatchesEveryPairOfElements) {
  std::vector<float> buffer(256, 0.0f);
  for (int code = 0; code < 27 * 512; ++code) {
    const std::int64_t sizes[3] = {1 + code % 3, 1 + code / 3 % 3, 1 + code / 9 % 3};
    const std::int64_t strides[3] = {code / 27 % 8, code / 216 % 8, code / 1728 % 8};
    std::vector<std::int64_t> offsets;
    for (std::int64_t i = 0; i < sizes[0]; ++i)
      for (std::int64_t j = 0; j < sizes[1]; ++j)
        for (std::int64_t k = 0; k < sizes[2]; ++k)
          offsets.push_back(i * strides[0] + j * strides[1] + k * strides[2]);
    std::sort(offsets.begin(), offsets.end());
    const bool coincide = std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
    const TensorView view =
        TensorView::strided(buffer.data(), DType::f32, {sizes[0], sizes[1], sizes[2]},
                            {strides[0], strides[1], strides[2]});
    ASSERT_EQ(detail::self_overlapping(view), coincide)
        << view.shape_string() << " strides " << strides[0] << ", " << strides[1] << ", "
        << strides[2];
  }
}

// An output whose own elements share addresses (found by the fuzzer: out [B, H, L, D] with row
// stride 1 was accepted and written, rows over one another). Refused like a zero stride, before
// anything is written, for every output of every call; views whose elements interleave without
// coinciding are not self-overlapping.
TEST(Overlap, SelfOverlappingOutputsAreRefused) {
  std::vector<float> buffer(4096, 7.0f);
  float* base = buffer.data();
  using detail::self_overlapping;
  EXPECT_TRUE(self_overlapping(TensorView::strided(base, DType::f32, {9, 16}, {1, 1})));
  EXPECT_TRUE(self_overlapping(TensorView::strided(base, DType::f32, {3, 4}, {2, 1})));
  EXPECT_TRUE(self_overlapping(TensorView::strided(base, DType::f32, {2, 3, 4}, {0, 4, 1})));
  EXPECT_TRUE(self_overlapping(TensorView::strided(base, DType::f32, {2, 3, 5}, {6, 2, 1})));
  EXPECT_FALSE(self_overlapping(TensorView::strided(base, DType::f32, {2, 3, 4}, {12, 4, 1})));
  EXPECT_FALSE(
      self_overlapping(TensorView::strided(base, DType::f32, {2, 4, 3, 5}, {60, 5, 20, 1})));
  EXPECT_FALSE(
      self_overlapping(TensorView::strided(base, DType::f32, {3, 2}, {2, 5})));  // interleaved
  EXPECT_FALSE(self_overlapping(TensorView::strided(base, DType::f32, {1, 5, 1}, {0, 1, 0})));

  Dense c;
  const TensorView rows_overlap =
      TensorView::strided(base, DType::f32, {2, 4, 9, 16}, {36, 9, 1, 1});
  const TensorView lse_overlap = TensorView::strided(base + 2048, DType::f32, {2, 4, 9}, {9, 1, 1});
  const TensorView dk_overlap =
      TensorView::strided(base, DType::f32, {2, 2, 13, 16}, {26, 13, 1, 1});
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    EXPECT_TRUE(
        starts_with(invalid_argument_message([&] {
                      forward_into(c.q, c.k, c.v, rows_overlap, std::nullopt, {}, backend);
                    }),
                    "forward: out is an output whose elements overlap (shape=[2, 4, 9, 16], "
                    "strides=[36, 9, 1, 1]"));
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_into(c.q, c.k, c.v, c.dq, lse_overlap, {}, backend);
                            }),
                            "forward: lse is an output whose elements overlap"));
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, dk_overlap,
                                            c.dv, std::nullopt, {}, backend);
                            }),
                            "backward: dk is an output whose elements overlap"));
  }
  for (float x : buffer) ASSERT_EQ(x, 7.0f);  // nothing written
}

// Gradients into one packed [B, L, 3, H, D] buffer (flash-attn's qkvpacked layout): accepted,
// and the same bits as into separate buffers.
TEST(Overlap, DenseGradientsIntoOnePackedBuffer) {
  const std::int64_t b = 2, h = 3, l = 21, d = 16;
  Tensor q(DType::f32, {b, h, l, d}), k(DType::f32, {b, h, l, d}), v(DType::f32, {b, h, l, d});
  fill(q, 4);
  fill(k, 5);
  fill(v, 6);
  Tensor packed(DType::f32, {b * l, 3, h, d});  // [B, L, 3, H, D]
  auto part = [&](std::int64_t which) {
    return TensorView::strided(packed.data_as<float>() + which * h * d, DType::f32, {b, h, l, d},
                               {l * 3 * h * d, d, 3 * h * d, 1});
  };
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    const ForwardResult f = forward(q, k, v, {}, backend);
    const BackwardResult separate = backward(f.out, q, k, v, f.out, f.lse, {}, backend);
    ASSERT_NO_THROW(backward_into(f.out, q, k, v, f.out, f.lse, part(0), part(1), part(2),
                                  std::nullopt, {}, backend));
    const Tensor* expected[] = {&separate.dq, &separate.dk, &separate.dv};
    for (std::int64_t which = 0; which < 3; ++which) {
      const TensorView got = part(which);
      const float* want = expected[which]->data_as<float>();
      for (std::int64_t e = 0; e < b * h * l * d; ++e) {
        const std::int64_t bi = e / (h * l * d), hi = e / (l * d) % h, li = e / d % l, di = e % d;
        const float x = static_cast<const float*>(
            got.data)[bi * got.stride[0] + hi * got.stride[1] + li * got.stride[2] + di];
        ASSERT_EQ(x, want[e]) << "part " << which << " element " << e;
      }
    }
  }
}

// A packed batch: gradients into one [total, 3, H, D] buffer, and outputs over the index
// arrays (int32 in a float buffer).
TEST(Overlap, VarlenOutputs) {
  const std::int64_t total = 40, h = 2, d = 16;
  const std::int32_t cu[] = {0, 17, 17, 40};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu), DType::i32, {4});
  seqs.cu_seqlens_k = seqs.cu_seqlens_q;
  seqs.max_seqlen_q = seqs.max_seqlen_k = 23;
  Tensor q(DType::f32, {total, h, d}), k(DType::f32, {total, h, d}), v(DType::f32, {total, h, d});
  fill(q, 7);
  fill(k, 8);
  fill(v, 9);
  Tensor packed(DType::f32, {total, 3, h, d});
  auto part = [&](std::int64_t which, std::int64_t shift = 0) {
    return TensorView::strided(packed.data_as<float>() + which * h * d + shift, DType::f32,
                               {total, h, d}, {3 * h * d, d, 1});
  };
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    const ForwardResult f = forward_varlen(q, k, v, seqs, {}, backend);
    const BackwardResult separate =
        backward_varlen(f.out, q, k, v, f.out, f.lse, seqs, {}, backend);
    ASSERT_NO_THROW(backward_varlen_into(f.out, q, k, v, f.out, f.lse, seqs, part(0), part(1),
                                         part(2), {}, backend));
    const Tensor* expected[] = {&separate.dq, &separate.dk, &separate.dv};
    for (std::int64_t which = 0; which < 3; ++which) {
      for (std::int64_t row = 0; row < total; ++row) {
        ASSERT_EQ(
            std::memcmp(packed.data_as<float>() + (row * 3 + which) * h * d,
                        expected[which]->data_as<float>() + row * h * d, h * d * sizeof(float)),
            0)
            << "part " << which << " row " << row;
      }
    }
    // dk shifted half a head onto dq's last head's rows: refused.
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              backward_varlen_into(f.out, q, k, v, f.out, f.lse, seqs, part(0),
                                                   part(1, -d / 2), part(2), {}, backend);
                            }),
                            "backward: dk overlaps dq ("));
    // out over the query; out over cu_seqlens_q (an int32 array inside its buffer).
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_varlen_into(q, k, v, seqs, q, std::nullopt, {}, backend);
                            }),
                            "forward: out overlaps query ("));
    Tensor out(DType::f32, {total, h, d});
    std::memcpy(out.data(), cu, sizeof cu);
    VarlenSeqs inside = seqs;
    inside.cu_seqlens_q = TensorView::contiguous(out.data(), DType::i32, {4});
    EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                              forward_varlen_into(q, k, v, inside, out, std::nullopt, {}, backend);
                            }),
                            "forward: out overlaps cu_seqlens_q ("));
  }
}

TEST(Overlap, KvCacheOutputs) {
  Tensor q(DType::f32, {1, 2, 1, 16}), cache(DType::f32, {1, 2, 8, 16});
  const std::int32_t lengths[] = {5};
  KvCacheSeqs seqs;
  seqs.cache_seqlens = TensorView::contiguous(const_cast<std::int32_t*>(lengths), DType::i32, {1});
  const TensorView out_in_cache = TensorView::contiguous(cache.data(), DType::f32, {1, 2, 1, 16});
  EXPECT_TRUE(starts_with(invalid_argument_message([&] {
                            forward_kvcache_into(q, cache, cache, seqs, out_in_cache, std::nullopt);
                          }),
                          "forward: out overlaps k_cache ("));
}

}  // namespace
}  // namespace attncore
