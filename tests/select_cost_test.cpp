// Backend selection's cost model with constants fed in (no timings): a machine like the
// development one and variations of it, the choice it makes and the estimates behind it.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "core/select.h"
#include "select_calls.h"

namespace attncore {
namespace {

using detail::CostModel;
using detail::Pass;
using test::Call;
using test::estimate;
using test::kDefault;
using test::select_call;

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

}  // namespace
}  // namespace attncore
