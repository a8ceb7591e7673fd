// The explain_* functions with a named backend (attncore/backend.h): a backend that cannot run
// the call is refused as the call with it refuses it (the same message), before the caller
// prepares anything; one that can, disabled on this thread or not, passes, and the explanation
// stays automatic's. Dense, varlen and KV-cache calls, forward and backward, with an append.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

// Views of any size over one byte: explain reads shapes, never data.
alignas(64) char g_no_data;
TensorView fake(DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(&g_no_data, dtype, shape);
}

TEST(ExplainBackend, RefusedAsTheCallRefusesIt) {
  const Tensor q64(DType::f64, {1, 2, 4, 8});
  const TensorView v = q64.view();
  const std::string want = test::error_message([&] { forward(v, v, v, {}, Backend::flash); });
  ASSERT_NE(want.find("forward: backend flash cannot run this call"), std::string::npos) << want;
  EXPECT_EQ(test::error_message([&] { explain_forward(v, v, v, {}, Backend::flash); }), want);
  const Tensor lse(DType::f64, {1, 2, 4});
  EXPECT_NE(test::error_message([&] {
              explain_backward(v, v, v, v, v, lse.view(), {}, Backend::flash);
            }).find("backward: backend flash cannot run this call"),
            std::string::npos);
  EXPECT_EQ(explain_forward(v, v, v, {}, Backend::math).chosen,
            explain_forward(v, v, v, {}).chosen);
  {
    const BackendScope math_only({Backend::math});  // named backends ignore the scope
    const TensorView q = fake(DType::f32, {1, 2, 4, 8});
    EXPECT_NO_THROW(explain_forward(q, q, q, {}, Backend::flash));
  }
  const std::int32_t cu[] = {0, 3, 4};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu), DType::i32, {3});
  seqs.cu_seqlens_k = seqs.cu_seqlens_q;
  seqs.max_seqlen_q = seqs.max_seqlen_k = 3;
  const TensorView packed = fake(DType::f64, {4, 2, 8});
  const std::string varlen = test::error_message(
      [&] { explain_forward_varlen(packed, packed, packed, seqs, {}, Backend::flash); });
  EXPECT_NE(varlen.find("backend flash cannot run this call"), std::string::npos) << varlen;
  const TensorView lse_packed = fake(DType::f64, {2, 4});
  EXPECT_NE(test::error_message([&] {
              explain_backward_varlen(packed, packed, packed, packed, packed, lse_packed, seqs, {},
                                      Backend::flash);
            }).find("backend flash cannot run this call"),
            std::string::npos);
  const std::int32_t lens[] = {4};
  KvCacheSeqs cache;
  cache.cache_seqlens = TensorView::contiguous(const_cast<std::int32_t*>(lens), DType::i32, {1});
  const TensorView cached = fake(DType::f64, {1, 2, 4, 8}), q1 = fake(DType::f64, {1, 2, 1, 8});
  const std::string kv = test::error_message(
      [&] { explain_forward_kvcache(q1, cached, cached, cache, {}, Backend::flash); });
  EXPECT_NE(kv.find("backend flash cannot run this call"), std::string::npos) << kv;
  EXPECT_NO_THROW(explain_forward_kvcache(q1, cached, cached, cache, {}, Backend::math));
  // With an append: its checks, then the backend's (the cache holds 4 of 8 slots).
  const std::int32_t half[] = {4};
  KvCacheSeqs filling;
  filling.cache_seqlens = TensorView::contiguous(const_cast<std::int32_t*>(half), DType::i32, {1});
  const Tensor k_cache(DType::f64, {1, 2, 8, 8}), v_cache(DType::f64, {1, 2, 8, 8});
  KvAppend append;
  append.k_new = append.v_new = fake(DType::f64, {1, 2, 1, 8});
  const std::string appending = test::error_message([&] {
    explain_forward_kvcache(q1, k_cache.view(), v_cache.view(), filling, append, {},
                            Backend::flash);
  });
  EXPECT_NE(appending.find("backend flash cannot run this call"), std::string::npos) << appending;
  EXPECT_NO_THROW(explain_forward_kvcache(q1, k_cache.view(), v_cache.view(), filling, append, {},
                                          Backend::math));
}

}  // namespace
}  // namespace attncore
