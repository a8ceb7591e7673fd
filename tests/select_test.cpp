// Backend selection (core/select, attncore/backend.h): every reason a backend gives for not
// running a call, the error when nothing can run, explicit requests, the thread-local enabled
// list and its scopes, and the cost model's choice with injected constants (no timings).
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
#include "testing/tensors.h"

namespace attncore {
namespace {

using detail::CostModel;
using detail::Pass;

const std::vector<Backend> kDefault = {Backend::flash, Backend::math, Backend::reference};

// Views of any size over one byte: explain and selection read shapes, never data.
char g_no_data;
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

// A call as selection sees it: what it computes (Params) and on how many threads.
struct Call : detail::Params {
  int threads = 1;
};

double estimate(Backend b, Pass pass, const Call& c, const CostModel& m) {
  return detail::estimate_seconds(b, pass, c, detail::Launch{c.threads}, m);
}

Explanation select_call(Pass pass, const Call& c, Backend requested,
                        const std::vector<Backend>& enabled, const CostModel& m) {
  return detail::select(pass, c, detail::Launch{c.threads}, requested, enabled, m);
}

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

// The cost model with constants fed in: a machine like the development one, and variations.
CostModel test_model() {
  CostModel m;
  m.machine.fma_gflops = 200;
  m.machine.memory_gbps = 20;
  m.machine.softmax_per_s = 2e8;
  m.machine.dispatch_seconds = 5e-6;
  m.flash_key_tile = 128;
  m.flash_tile_rows = 8;
  m.flash_block_rows = 64;
  m.flash_bf16_dot = true;
  return m;
}

Call problem(std::int64_t batch, std::int64_t heads_q, std::int64_t heads_kv, std::int64_t lq,
                std::int64_t lk, std::int64_t d, DType dtype = DType::f32, int threads = 1) {
  Call p;
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.group = heads_q / heads_kv;
  p.seq.lq = lq;
  p.seq.lk = lk;
  p.head_dim = p.head_dim_v = d;
  p.dtype = p.kv_dtype = dtype;
  p.threads = threads;
  return p;
}

Backend choose(const Call& p, const CostModel& m, Pass pass = Pass::forward) {
  return select_call(pass, p, Backend::automatic, kDefault, m).chosen;
}

// flash's cost term prices K and V by the cache's dtype: a memory-bound decode (an f32 query,
// Hq=32 Hkv=8 Lk=16384) over a bf16 cache is estimated well under the same over an f32 one.
TEST(SelectCostModel, FlashPricesTheCacheDtype) {
  const CostModel m = test_model();
  auto flash = [&](DType kv) {
    Call p = problem(1, 32, 8, 1, 16384, 128);
    p.kv_dtype = kv;
    return estimate(Backend::flash, Pass::forward, p, m);
  };
  EXPECT_GT(flash(DType::bf16), 0);
  EXPECT_LT(flash(DType::bf16), 0.75 * flash(DType::f32));
  EXPECT_LT(flash(DType::f16), 0.75 * flash(DType::f32));
}

TEST(SelectCostModel, FlashForLargeProblems) {
  const CostModel m = test_model();
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (int threads : {1, 2, 8}) {
      for (Pass pass : {Pass::forward, Pass::backward}) {
        Call p = problem(1, 16, 16, 2048, 2048, 128, dtype, threads);
        EXPECT_EQ(choose(p, m, pass), Backend::flash);
        p.causal = Causal::lower_right;
        EXPECT_EQ(choose(p, m, pass), Backend::flash);
      }
    }
  }
  // Decode with GQA: math reads K and V once per query head, flash once per group.
  EXPECT_EQ(choose(problem(4, 32, 8, 1, 4096, 128), m), Backend::flash);
}

// Split-KV parts are work items of their own: one kv group's decode, forced into 4 parts, is
// estimated faster on 2 threads than unsplit (one item: one thread), and no faster on 1.
TEST(SelectCostModel, FlashCountsSplitParts) {
  const CostModel m = test_model();
  Call one = problem(1, 32, 1, 1, 16384, 128, DType::f32, 2);
  one.num_splits = 1;
  Call parts = one;
  parts.num_splits = 4;
  EXPECT_LT(estimate(Backend::flash, Pass::forward, parts, m),
            0.75 * estimate(Backend::flash, Pass::forward, one, m));
  one.threads = parts.threads = 1;
  EXPECT_GE(estimate(Backend::flash, Pass::forward, parts, m),
            estimate(Backend::flash, Pass::forward, one, m));
}

// The choice compares estimates at the model's choice_threads, so that it, and with it every
// bit of the result, is the same for any thread count of the call, even where the call's own
// estimates rank the backends the other way (a slow pool wake-up penalises math's many
// parallel regions on 2+ threads).
TEST(SelectCostModel, ChoiceDoesNotDependOnTheThreadCount) {
  CostModel m = test_model();
  m.machine.dispatch_seconds = 0;  // flash's 8 heads gain 8 threads; math's 1 task gains none
  m.choice_threads = 1;
  bool ranks_differ = false;  // the case the rule is for occurs in this sweep
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      for (std::int64_t l : {16, 32, 64, 128, 256, 512}) {
        const Backend one = choose(problem(1, 8, 8, l, l, 64, dtype, 1), m, pass);
        for (int threads : {2, 8}) {
          const Call p = problem(1, 8, 8, l, l, 64, dtype, threads);
          EXPECT_EQ(choose(p, m, pass), one) << "L=" << l << " threads=" << threads;
          const bool flash_faster = estimate(Backend::flash, pass, p, m) <
                                    estimate(Backend::math, pass, p, m);
          ranks_differ |= flash_faster != (one == Backend::flash);
        }
      }
    }
  }
  EXPECT_TRUE(ranks_differ);
}

TEST(SelectCostModel, MathForTinyProblems) {
  // 16 keys padded to a 32-key micro-tile, and a cut tile's per-row costs.
  const CostModel m = test_model();
  EXPECT_EQ(choose(problem(1, 1, 1, 16, 16, 64), m), Backend::math);
  EXPECT_EQ(choose(problem(1, 1, 1, 16, 16, 64), m, Pass::backward), Backend::math);
}

TEST(SelectCostModel, ConstantsMoveTheChoice) {
  // A middle-sized problem: the softmax rate of the unfused path decides.
  const Call p = problem(1, 8, 8, 64, 64, 64);
  CostModel slow_exp = test_model(), fast_exp = test_model();
  slow_exp.machine.softmax_per_s = 1e7;
  fast_exp.machine.softmax_per_s = 1e11;
  EXPECT_EQ(choose(p, slow_exp), Backend::flash);
  EXPECT_EQ(choose(p, fast_exp), Backend::math);
  // Faster FMAs make every estimate smaller; a slower memory makes math's decode dearer.
  CostModel fast = test_model();
  fast.machine.fma_gflops *= 2;
  const Call big = problem(1, 16, 16, 1024, 1024, 128);
  for (Backend b : {Backend::flash, Backend::math}) {
    EXPECT_LT(estimate(b, Pass::forward, big, fast),
              estimate(b, Pass::forward, big, test_model()));
  }
  EXPECT_LT(estimate(Backend::reference, Pass::forward, big, test_model()), 0);
}

TEST(SelectCostModel, CausalHalvesFlashNotMath) {
  const CostModel m = test_model();
  Call p = problem(1, 16, 16, 4096, 4096, 128);
  const double flash = estimate(Backend::flash, Pass::forward, p, m);
  const double math = estimate(Backend::math, Pass::forward, p, m);
  p.causal = Causal::upper_left;
  EXPECT_LT(estimate(Backend::flash, Pass::forward, p, m), 0.6 * flash);
  EXPECT_DOUBLE_EQ(estimate(Backend::math, Pass::forward, p, m), math);
}

TEST(SelectCostModel, ShortLastTileCostsItsMicroTiles) {
  // Lk = 129 and 160 both end in one 32-key micro-tile past 128: flash computes the same (only
  // the bytes of K and V read differ).
  const CostModel m = test_model();
  for (Pass pass : {Pass::forward, Pass::backward}) {
    const double lk129 =
        estimate(Backend::flash, pass, problem(1, 8, 8, 256, 129, 64), m);
    const double lk160 =
        estimate(Backend::flash, pass, problem(1, 8, 8, 256, 160, 64), m);
    const double lk256 =
        estimate(Backend::flash, pass, problem(1, 8, 8, 256, 256, 64), m);
    EXPECT_NEAR(lk129, lk160, 1e-2 * lk160);
    EXPECT_LT(lk160, 0.9 * lk256);
  }
}

TEST(SelectCostModel, ABandThatHidesNothingCutsNothing) {
  // Lower-right causal at Lq = 1 sees every key: the same work as no mask.
  const CostModel m = test_model();
  Call plain = problem(4, 32, 8, 1, 4096, 128), causal = plain;
  causal.causal = Causal::lower_right;
  EXPECT_DOUBLE_EQ(estimate(Backend::flash, Pass::forward, causal, m),
                   estimate(Backend::flash, Pass::forward, plain, m));
}

TEST(SelectCostModel, MoreThreadsNeverCostMoreThanOne) {
  // However slow the wake-up, the pool's caller can do every task alone.
  CostModel m = test_model();
  m.machine.dispatch_seconds = 1.0;
  for (Backend b : {Backend::flash, Backend::math}) {
    for (Pass pass : {Pass::forward, Pass::backward}) {
      for (std::int64_t l : {16, 256, 2048}) {
        const double one =
            estimate(b, pass, problem(1, 8, 8, l, l, 64, DType::f32, 1), m);
        const double two =
            estimate(b, pass, problem(1, 8, 8, l, l, 64, DType::f32, 2), m);
        EXPECT_LE(two, one) << name_of(b) << " L=" << l;
      }
    }
  }
}

TEST(SelectCostModel, TiesGoToTheEarlierBackend) {
  // Equal estimates: both backends at the same (infinite) cost; the priority order decides.
  CostModel m = test_model();
  m.machine.fma_gflops = 0;  // every estimate is +inf
  const Call p = problem(1, 2, 2, 64, 64, 32);
  EXPECT_EQ(select_call(Pass::forward, p, Backend::automatic, kDefault, m).chosen,
            Backend::flash);
  EXPECT_EQ(select_call(Pass::forward, p, Backend::automatic,
                           {Backend::math, Backend::flash, Backend::reference}, m)
                .chosen,
            Backend::math);
}

// The model reads constants fixed for the best SIMD target this CPU supports, whatever target
// the calls use, so that the choice depends on no measurement.
TEST(SelectCostModel, ConstantsAreFixedPerSimdTarget) {
  const CostConstants c = cost_constants();
  EXPECT_EQ(c.basis, simd_targets_supported().front());
  EXPECT_GT(c.fma_gflops, 0);
  EXPECT_GT(c.memory_gbps, 0);
  EXPECT_GT(c.softmax_per_s, 0);
  EXPECT_GT(c.dispatch_seconds, 0);
  EXPECT_EQ(c.measure_seconds, 0);
  const CostConstants model = detail::current_cost_model().machine;
  EXPECT_EQ(model.fma_gflops, c.fma_gflops);
  EXPECT_EQ(model.memory_gbps, c.memory_gbps);
  EXPECT_EQ(model.softmax_per_s, c.softmax_per_s);
  EXPECT_EQ(model.dispatch_seconds, c.dispatch_seconds);
  const std::string previous = set_simd_target("generic");
  EXPECT_EQ(cost_constants().fma_gflops, c.fma_gflops);
  EXPECT_EQ(cost_constants().basis, c.basis);
  set_simd_target(previous);
  // The measuring machine's row.
  if (c.basis == "avx512bf16") {
    EXPECT_EQ(c.fma_gflops, 233);
    EXPECT_EQ(c.memory_gbps, 31);
    EXPECT_EQ(c.softmax_per_s, 238e6);
  }
}

TEST(SelectCostModel, MeasuredConstantsArePositive) {
  const CostConstants c = measured_cost_constants();
  EXPECT_EQ(c.basis, "measured");
  EXPECT_GT(c.fma_gflops, 0);
  EXPECT_GT(c.memory_gbps, 0);
  EXPECT_GT(c.softmax_per_s, 0);
  EXPECT_GE(c.dispatch_seconds, 0);
  EXPECT_GT(c.measure_seconds, 0);
  // Measured once: the same values on every later call.
  EXPECT_EQ(measured_cost_constants().fma_gflops, c.fma_gflops);
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
