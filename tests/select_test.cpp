// Backend selection (core/select, attncore/backend.h): every reason a backend gives for not
// running a call, the error when nothing can run, explicit requests, the thread-local enabled
// list and its scopes (the cost model's choice: select_cost_test.cpp).
#include "core/select.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "attncore/attncore.h"
#include "select_calls.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

using detail::CostModel;
using detail::Pass;
using test::Call;
using test::estimate;
using test::kDefault;
using test::select_call;

// Views of any size over one byte: explain and selection read shapes, never data.
alignas(64) char g_no_data;  // (aligned for every dtype: views must be)
TensorView fake(DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(&g_no_data, dtype, shape);
}
// Outputs of calls refused before anything is written: output `n` at (n + 1) * 2^40 bytes
// past the inputs, so that it shares no byte with them or with another output (an output may
// not).
TensorView fake_out(DType dtype, std::initializer_list<std::int64_t> shape, int n = 0) {
  void* far = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(&g_no_data) +
                                      (static_cast<std::uintptr_t>(n + 1) << 40));
  return TensorView::contiguous(far, dtype, shape);
}

const BackendVerdict& verdict_of(const Explanation& e, Backend b) {
  for (const BackendVerdict& v : e.verdicts) {
    if (v.backend == b) return v;
  }
  throw std::logic_error("no verdict");
}

// The message of the Unsupported that fn throws ("" if it throws nothing).
template <class Fn>
std::string unsupported_message(Fn&& fn) {
  try {
    fn();
  } catch (const Unsupported& e) {
    return e.what();
  }
  return "";
}

constexpr std::int64_t kBig = std::int64_t{INT_MAX} + 1;  // 2^31: one past BLAS's sizes
const char* const kNoLimit = "; flash and reference have no such limit";

// ---------------------------------------------------------------------------------------------
// Every reason, through explain (the verdicts) and through an explicit request (the error).

TEST(SelectReasons, FlashRejectsF64) {
  const TensorView q = fake(DType::f64, {1, 2, 8, 16});
  const std::string reason =
      "flash: dtype f64 is not supported (dtype=f64, expected f32, bf16 or f16); math and "
      "reference run f64";
  const Explanation e = explain_forward(q, q, q, {});
  EXPECT_EQ(verdict_of(e, Backend::flash).reasons, std::vector<std::string>{reason});
  EXPECT_LT(verdict_of(e, Backend::flash).estimated_seconds, 0);
  EXPECT_TRUE(verdict_of(e, Backend::math).reasons.empty());
  EXPECT_EQ(e.chosen, Backend::math);
  const TensorView lse = fake(DType::f64, {1, 2, 8});
  const Explanation b = explain_backward(q, q, q, q, q, lse, {});
  EXPECT_EQ(verdict_of(b, Backend::flash).reasons, std::vector<std::string>{reason});
  // An explicit request throws before anything is written.
  const TensorView out = fake_out(DType::f64, {1, 2, 8, 16});
  EXPECT_EQ(
      unsupported_message([&] { forward_into(q, q, q, out, std::nullopt, {}, Backend::flash); }),
      "forward: backend flash cannot run this call (backend=flash, expected a backend "
      "that supports it); " +
          reason);
  EXPECT_EQ(unsupported_message([&] {
              backward_into(q, q, q, q, q, lse, out, fake_out(DType::f64, {1, 2, 8, 16}, 1),
                            fake_out(DType::f64, {1, 2, 8, 16}, 2), std::nullopt, {},
                            Backend::flash);
            }),
            "backward: backend flash cannot run this call (backend=flash, expected a backend "
            "that supports it); " +
                reason);
}

// Flash scores in log2 units: a scale whose product with log2(e) overflows f32 gave wrong
// outputs; auto takes math for it, and flash named refuses it.
TEST(SelectReasons, FlashRejectsScalesPastItsLog2Units) {
  const TensorView q = fake(DType::f32, {1, 2, 8, 16});
  Options o;
  o.scale = 3e38;
  const Explanation e = explain_forward(q, q, q, o);
  ASSERT_EQ(verdict_of(e, Backend::flash).reasons.size(), 1u);
  EXPECT_EQ(
      verdict_of(e, Backend::flash)
          .reasons[0]
          .rfind("flash: scale is too large for its log2 units (scale=3e+38, expected |scale| <= "
                 "2.35865e+38",
                 0),
      0u)
      << verdict_of(e, Backend::flash).reasons[0];
  EXPECT_EQ(e.chosen, Backend::math);
  o.scale = 2.35e38;  // (its product with log2(e) is finite)
  EXPECT_TRUE(verdict_of(explain_forward(q, q, q, o), Backend::flash).reasons.empty());
}

struct MathLimit {
  const char* name;
  std::int64_t lq, lk, d, dv;
  std::string reason;
};

TEST(SelectReasons, MathRejectsSizesBeyondInt32) {
  const std::string big = std::to_string(kBig);
  const MathLimit cases[] = {
      {"Lq", kBig, 0, 4, 4, "math: Lq does not fit BLAS's 32-bit sizes (Lq=" + big},
      {"Lk", 0, kBig, 4, 4, "math: Lk does not fit BLAS's 32-bit sizes (Lk=" + big},
      {"D", 1, 1, kBig, 4, "math: D does not fit BLAS's 32-bit sizes (D=" + big},
      {"Dv", 1, 1, 4, kBig, "math: Dv does not fit BLAS's 32-bit sizes (Dv=" + big},
      {"Lq * Lk", 65536, 32769, 4, 4,
       "math: Lq * Lk does not fit BLAS's 32-bit sizes (Lq=65536, Lk=32769, expected Lq * Lk"},
  };
  for (const MathLimit& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string reason =
        c.reason + (c.lq == 65536 ? " <= 2147483647)" : ", expected <= 2147483647)") + kNoLimit;
    const TensorView q = fake(DType::f32, {1, 1, c.lq, c.d});
    const TensorView k = fake(DType::f32, {1, 1, c.lk, c.d});
    const TensorView v = fake(DType::f32, {1, 1, c.lk, c.dv});
    const Explanation e = explain_forward(q, k, v, {});
    EXPECT_EQ(verdict_of(e, Backend::math).reasons, std::vector<std::string>{reason});
    EXPECT_TRUE(verdict_of(e, Backend::flash).reasons.empty());
    EXPECT_TRUE(verdict_of(e, Backend::reference).reasons.empty());
    EXPECT_EQ(e.chosen, Backend::flash);
    const TensorView out = fake_out(DType::f32, {1, 1, c.lq, c.dv});
    EXPECT_EQ(
        unsupported_message([&] { forward_into(q, k, v, out, std::nullopt, {}, Backend::math); }),
        "forward: backend math cannot run this call (backend=math, expected a backend that "
        "supports it); " +
            reason);
  }
  // The product is checked only when each size fits (one reason, not two).
  const TensorView q = fake(DType::f32, {1, 1, kBig, 4});
  const TensorView k = fake(DType::f32, {1, 1, 2, 4});
  EXPECT_EQ(verdict_of(explain_forward(q, k, k, {}), Backend::math).reasons.size(), 1u);
}

TEST(SelectReasons, NotEnabledOnThisThread) {
  const TensorView q = fake(DType::f32, {1, 2, 8, 16});
  const BackendScope scope({Backend::math});
  const Explanation e = explain_forward(q, q, q, {});
  for (Backend b : {Backend::flash, Backend::reference}) {
    const std::string name(name_of(b));
    const BackendVerdict& v = verdict_of(e, b);
    EXPECT_FALSE(v.enabled);
    EXPECT_EQ(v.reasons, std::vector<std::string>{
                             name +
                             ": backend is not enabled on this thread (enabled=[math], "
                             "expected " +
                             name + " among them); see BackendScope or set_enabled_backends"});
  }
  EXPECT_TRUE(verdict_of(e, Backend::math).enabled);
  EXPECT_TRUE(verdict_of(e, Backend::math).reasons.empty());
  EXPECT_EQ(e.chosen, Backend::math);
  // Disabled backends that could run keep their estimate (what the scope costs).
  EXPECT_GT(verdict_of(e, Backend::flash).estimated_seconds, 0);
}

TEST(SelectReasons, ReferenceRunsEverything) {
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    Call p;
    p.dtype = p.kv_dtype = dtype;
    p.batch = p.heads_q = p.heads_kv = 1;
    p.seq.lq = p.seq.lk = p.head_dim = p.head_dim_v = kBig;
    for (Pass pass : {Pass::forward, Pass::backward}) {
      EXPECT_TRUE(detail::can_use(Backend::reference, pass, p).empty());
    }
  }
}

TEST(SelectReasons, NothingCanRunListsEveryBackend) {
  const TensorView q = fake(DType::f32, {1, 1, 65536, 4});
  const TensorView k = fake(DType::f32, {1, 1, 65536, 4});
  const TensorView out = fake_out(DType::f32, {1, 1, 65536, 4});
  const BackendScope scope({Backend::math});
  const Explanation e = explain_forward(q, k, k, {});
  EXPECT_EQ(e.chosen, Backend::automatic);
  const std::string message =
      unsupported_message([&] { forward_into(q, k, k, out, std::nullopt, {}); });
  EXPECT_EQ(message.rfind("forward: no backend can run this call (enabled=[math], expected one "
                          "whose checks pass); math: Lq * Lk does not fit BLAS's 32-bit sizes",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find("; flash: backend is not enabled on this thread"), std::string::npos);
  EXPECT_NE(message.find("; reference: backend is not enabled on this thread"), std::string::npos);
  EXPECT_NE(e.summary().find("chosen: none"), std::string::npos) << e.summary();

  // f64 with only flash enabled: flash's own reason and the other two.
  const TensorView q64 = fake(DType::f64, {1, 1, 4, 4});
  const BackendScope flash_only({Backend::flash});
  const std::string m64 = unsupported_message([&] {
    forward_into(q64, q64, q64, fake_out(DType::f64, {1, 1, 4, 4}), std::nullopt, {});
  });
  EXPECT_NE(m64.find("flash: dtype f64 is not supported"), std::string::npos) << m64;
  EXPECT_NE(m64.find("math: backend is not enabled"), std::string::npos) << m64;
  EXPECT_NE(m64.find("reference: backend is not enabled"), std::string::npos) << m64;
}

// ---------------------------------------------------------------------------------------------
// The enabled list and its scopes.

TEST(SelectScope, DefaultAndSet) {
  EXPECT_EQ(enabled_backends(), kDefault);
  const std::vector<Backend> previous = set_enabled_backends({Backend::math, Backend::flash});
  EXPECT_EQ(previous, kDefault);
  EXPECT_EQ(enabled_backends(), (std::vector<Backend>{Backend::math, Backend::flash}));
  // Repeats count once, at their first position.
  set_enabled_backends({Backend::reference, Backend::math, Backend::reference});
  EXPECT_EQ(enabled_backends(), (std::vector<Backend>{Backend::reference, Backend::math}));
  set_enabled_backends(kDefault);
  EXPECT_EQ(enabled_backends(), kDefault);
}

TEST(SelectScope, RejectsBadLists) {
  auto message = [](std::vector<Backend> list) -> std::string {
    try {
      set_enabled_backends(std::move(list));
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message({}),
            "set_enabled_backends: backends is empty (backends=[], expected at least one of "
            "flash, math, reference)");
  EXPECT_EQ(message({Backend::math, Backend::automatic}),
            "set_enabled_backends: backends has an invalid entry (backend=auto, expected flash, "
            "math or reference)");
  EXPECT_EQ(message({static_cast<Backend>(9)}),
            "set_enabled_backends: backends has an invalid entry (backend=9, expected flash, "
            "math or reference)");
  EXPECT_THROW(BackendScope({}), InvalidArgument);
  EXPECT_EQ(enabled_backends(), kDefault);  // a rejected list changes nothing
}

TEST(SelectScope, NestsAndRestores) {
  {
    const BackendScope outer({Backend::math, Backend::reference});
    EXPECT_EQ(enabled_backends(), (std::vector<Backend>{Backend::math, Backend::reference}));
    {
      const BackendScope inner({Backend::reference});
      EXPECT_EQ(enabled_backends(), std::vector<Backend>{Backend::reference});
    }
    EXPECT_EQ(enabled_backends(), (std::vector<Backend>{Backend::math, Backend::reference}));
  }
  EXPECT_EQ(enabled_backends(), kDefault);
}

TEST(SelectScope, RestoresOnException) {
  try {
    const BackendScope scope({Backend::flash});
    throw std::runtime_error("leaving the scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(enabled_backends(), kDefault);
  // The library's own exception from inside a scope.
  const TensorView q = fake(DType::f64, {1, 1, 4, 4});
  EXPECT_THROW(
      {
        const BackendScope scope({Backend::flash});
        forward_into(q, q, q, fake_out(DType::f64, {1, 1, 4, 4}), std::nullopt, {});
      },
      Unsupported);
  EXPECT_EQ(enabled_backends(), kDefault);
}

TEST(SelectScope, IsThreadLocal) {
  const BackendScope scope({Backend::reference});
  std::vector<Backend> seen_there, after_there;
  std::thread other([&] {
    seen_there = enabled_backends();
    const BackendScope theirs({Backend::math});
    after_there = enabled_backends();
  });
  other.join();
  EXPECT_EQ(seen_there, kDefault);
  EXPECT_EQ(after_there, std::vector<Backend>{Backend::math});
  EXPECT_EQ(enabled_backends(), std::vector<Backend>{Backend::reference});
}

// ---------------------------------------------------------------------------------------------
// Choices.

TEST(SelectChoice, ExplicitRequestsIgnoreTheScope) {
  const Tensor q(DType::f32, {1, 1, 4, 8});
  const Tensor q64(DType::f64, {1, 1, 4, 8});
  const BackendScope scope({Backend::math});
  EXPECT_NO_THROW(forward(q, q, q, {}, Backend::flash));
  EXPECT_NO_THROW(forward(q, q, q, {}, Backend::reference));
  const BackendScope flash_only({Backend::flash});
  EXPECT_NO_THROW(forward(q64, q64, q64, {}, Backend::math));
  EXPECT_THROW(forward(q64, q64, q64, {}, Backend::flash), Unsupported);
}

TEST(SelectChoice, ReferenceOnlyWhenNothingElseCan) {
  const TensorView q = fake(DType::f32, {1, 2, 64, 32});
  EXPECT_NE(explain_forward(q, q, q, {}).chosen, Backend::reference);
  {
    const BackendScope scope({Backend::reference, Backend::math});  // reference first
    EXPECT_EQ(explain_forward(q, q, q, {}).chosen, Backend::math);
  }
  {
    const BackendScope scope({Backend::reference});
    EXPECT_EQ(explain_forward(q, q, q, {}).chosen, Backend::reference);
  }
  const TensorView q64 = fake(DType::f64, {1, 2, 64, 32});
  const BackendScope scope({Backend::flash, Backend::reference});
  EXPECT_EQ(explain_forward(q64, q64, q64, {}).chosen, Backend::reference);
}

TEST(SelectChoice, VerdictsFollowThePriorityOrder) {
  const TensorView q = fake(DType::f32, {1, 2, 8, 16});
  const BackendScope scope({Backend::reference, Backend::flash});
  const Explanation e = explain_forward(q, q, q, {});
  ASSERT_EQ(e.verdicts.size(), 3u);
  EXPECT_EQ(e.verdicts[0].backend, Backend::reference);
  EXPECT_EQ(e.verdicts[1].backend, Backend::flash);
  EXPECT_EQ(e.verdicts[2].backend, Backend::math);
  EXPECT_LT(e.verdicts[0].estimated_seconds, 0);  // the model does not cover reference
  EXPECT_NE(e.summary().find("chosen: flash"), std::string::npos) << e.summary();
}

TEST(SelectChoice, ExplainValidates) {
  const TensorView q = fake(DType::f32, {1, 3, 8, 16});
  const TensorView k = fake(DType::f32, {1, 2, 8, 16});
  EXPECT_THROW(explain_forward(q, k, k, {}), InvalidArgument);
  const TensorView lse = fake(DType::f32, {1, 3, 8});
  EXPECT_THROW(explain_backward(q, q, k, k, q, lse, {}), InvalidArgument);
}

// Packed batches: explained like the dense call of the same sequences (the sequence arrays are
// read and validated), f64 going to math, and bad offsets refused.
TEST(SelectChoice, ExplainVarlen) {
  const std::int32_t cu[] = {0, 700, 2000}, bad[] = {0, 900, 800};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu), DType::i32, {3});
  seqs.cu_seqlens_k = seqs.cu_seqlens_q;
  seqs.max_seqlen_q = seqs.max_seqlen_k = 1300;
  const TensorView q = fake(DType::f32, {2000, 8, 64});
  const TensorView lse = fake(DType::f32, {8, 2000});
  EXPECT_EQ(explain_forward_varlen(q, q, q, seqs).chosen, Backend::flash);
  EXPECT_EQ(explain_backward_varlen(q, q, q, q, q, lse, seqs).chosen, Backend::flash);
  const TensorView q64 = fake(DType::f64, {2000, 8, 64});
  EXPECT_EQ(explain_forward_varlen(q64, q64, q64, seqs).chosen, Backend::math);
  VarlenSeqs decreasing = seqs;
  decreasing.cu_seqlens_k = TensorView::contiguous(const_cast<std::int32_t*>(bad), DType::i32, {3});
  EXPECT_THROW(explain_forward_varlen(q, q, q, decreasing), InvalidArgument);
}

TEST(SelectNames, BackendFromName) {
  for (Backend b : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    EXPECT_EQ(backend_from_name(name_of(b)), b);
  }
  try {
    backend_from_name("cuda");
    FAIL() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(),
                 "backend_from_name: name is unknown (name=cuda, expected auto, reference, math "
                 "or flash)");
  }
}

// The math backend copies rows whose stride does not fit BLAS's 32-bit leading dimension
// (instead of truncating it): K's two rows lie 2^31 + 64 floats apart, in a reserved mapping
// of which only the two rows' pages are touched.
TEST(SelectMath, RowStrideBeyondInt32) {
  constexpr std::int64_t kD = 4, kStride = std::int64_t{INT_MAX} + 65;
  const std::size_t bytes = static_cast<std::size_t>(kStride + kD) * sizeof(float);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  float* k_rows = static_cast<float*>(map);
  const float k0[kD] = {0.5f, -1, 0.25f, 2}, k1[kD] = {-0.5f, 1, 1.5f, -2};
  std::copy(k0, k0 + kD, k_rows);
  std::copy(k1, k1 + kD, k_rows + kStride);
  const TensorView k = TensorView::strided(k_rows, DType::f32, {1, 1, 2, kD}, {0, 0, kStride, 1});
  const Tensor q = test::make_tensor(DType::f32, {1, 1, 2, kD}, {1, 2, 3, 4, -1, 0, 1, 0.5});
  const Tensor v = test::make_tensor(DType::f32, {1, 1, 2, kD}, {1, 0, 0, 1, 0, 1, 1, 0});
  const ForwardResult math = forward(q, k, v, {}, Backend::math);
  const ForwardResult ref = forward(q, k, v, {}, Backend::reference);
  const std::vector<double> got = test::read_view(math.out), want = test::read_view(ref.out);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
  munmap(map, bytes);
}

}  // namespace
}  // namespace attncore
