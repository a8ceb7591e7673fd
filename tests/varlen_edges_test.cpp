// Variable-length batches (attncore/varlen.h) at their edges: every bad input refused with a
// clear error, empty batches and sequences, thousands of sequences, and the flash planner's
// balance over threads and the cost model's dense equivalent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attncore/attncore.h"
#include "core/sequence.h"
#include "cpu/flash.h"
#include "testing/random.h"
#include "testing/tensors.h"
#include "varlen_batch.h"

namespace attncore::test {
namespace {

TEST(Varlen, BadInputsAreRefusedWithClearErrors) {
  const Batch batch{{3, 4}, {5, 6}, {}, 0, 0, 2, 1, 8, 8};
  const Packed good = make_packed(batch, DType::f32, varlen_variants()[0], 3);
  auto forward_with = [&](const VarlenSeqs& s) {
    return invalid_argument_message([&] { forward_varlen(good.q, good.k, good.v, s); });
  };
  auto expect = [&](const VarlenSeqs& s, const std::string& part) {
    const std::string message = forward_with(s);
    EXPECT_NE(message.find(part), std::string::npos) << "message: " << message;
    EXPECT_EQ(message.rfind("forward: ", 0), 0u) << message;
  };
  VarlenSeqs s = good.seqs;
  Tensor f32_cu = make_tensor(DType::f32, {3}, {0, 3, 7});
  s.cu_seqlens_q = f32_cu.view();
  expect(s, "cu_seqlens_q has the wrong dtype (dtype=f32, expected i32)");
  Tensor wrong_len = int_tensor({0, 5});
  s = good.seqs;
  s.cu_seqlens_k = wrong_len.view();
  expect(s, "cu_seqlens_k has shape [2], expected [3]");
  Tensor not_zero = int_tensor({1, 3, 7});
  s = good.seqs;
  s.cu_seqlens_q = not_zero.view();
  expect(s, "cu_seqlens_q does not start at 0");
  Tensor decreasing = int_tensor({0, 5, 4});
  s = good.seqs;
  s.cu_seqlens_k = decreasing.view();
  expect(s, "cu_seqlens_k is decreasing");
  Tensor negative = int_tensor({0, -2, 7});
  s = good.seqs;
  s.cu_seqlens_q = negative.view();
  expect(s, "cu_seqlens_q is decreasing");
  Tensor past = int_tensor({0, 3, 8});
  s = good.seqs;
  s.cu_seqlens_q = past.view();
  expect(s, "cu_seqlens_q ends past the rows of query (cu_seqlens_q[2]=8, expected <= 7)");
  s = good.seqs;
  s.max_seqlen_q = 3;
  expect(s, "max_seqlen_q is smaller than a sequence (max_seqlen_q=3, expected >= the longest");
  s = good.seqs;
  s.max_seqlen_k = -1;
  expect(s, "max_seqlen_k is smaller than a sequence");
  s = good.seqs;
  s.max_seqlen_k = std::int64_t{1} << 40;
  expect(s, "max_seqlen_k is too large (max_seqlen_k=1099511627776, expected <= 2147483647)");
  Tensor long_used = int_tensor({5, 7});
  s = good.seqs;
  s.seqused_k = long_used.view();
  expect(s, "seqused_k is out of range (seqused_k[1]=7, expected 0 <= seqused_k[b] <= 6");
  Tensor negative_used = int_tensor({-1, 2});
  s.seqused_k = negative_used.view();
  expect(s, "seqused_k is out of range (seqused_k[0]=-1");
  Tensor short_used = int_tensor({1});
  s.seqused_k = short_used.view();
  expect(s, "seqused_k has shape [1], expected [2]");
  Tensor empty_cu(DType::i32, {0});
  s = good.seqs;
  s.cu_seqlens_q = empty_cu.view();
  expect(s, "cu_seqlens_q has shape [0], expected [1]");
  Tensor strided = int_tensor({0, 9, 3, 9, 7, 9});
  s = good.seqs;
  s.cu_seqlens_q = TensorView::strided(strided.data(), DType::i32, {3}, {2});
  expect(s, "cu_seqlens_q is not contiguous (stride[0]=2, expected 1); pass a contiguous copy");
  // A value tensor where an index array belongs and an index array where values belong.
  const std::string int_query =
      invalid_argument_message([&] { forward_varlen(good.cu_q_t, good.k, good.v, good.seqs); });
  EXPECT_NE(int_query.find("query has the wrong rank"), std::string::npos) << int_query;
  Tensor int_values(DType::i32, {7, 2, 8});
  const std::string int_dtype =
      invalid_argument_message([&] { forward_varlen(int_values, good.k, good.v, good.seqs); });
  EXPECT_NE(int_dtype.find("query has an unsupported dtype (dtype=i32"), std::string::npos)
      << int_dtype;
  // Dense-layout tensors.
  Tensor rank4(DType::f32, {1, 7, 2, 8});
  EXPECT_NE(invalid_argument_message([&] {
              forward_varlen(rank4, good.k, good.v, good.seqs);
            }).find("query has the wrong rank (rank=4, expected 3: [total_q, Hq, D])"),
            std::string::npos);
  // Outputs of the wrong shape.
  Tensor out(DType::f32, {6, 2, 8});
  EXPECT_NE(invalid_argument_message([&] {
              forward_varlen_into(good.q, good.k, good.v, good.seqs, out, std::nullopt);
            }).find("out has shape [6, 2, 8], expected [7, 2, 8] ([total_q, Hq, Dv])"),
            std::string::npos);
  Tensor lse(DType::f32, {7, 2});
  Tensor out_ok(DType::f32, {7, 2, 8});
  EXPECT_NE(invalid_argument_message([&] {
              forward_varlen_into(good.q, good.k, good.v, good.seqs, out_ok, lse.view());
            }).find("lse has shape [7, 2], expected [2, 7] ([Hq, total_q])"),
            std::string::npos);
  // Tensor masks are not supported.
  Tensor mask(DType::b8, {7, 11});
  Options with_mask;
  with_mask.mask = mask.view();
  EXPECT_THROW(forward_varlen(good.q, good.k, good.v, good.seqs, with_mask), Unsupported);
  EXPECT_NE(error_message([&] {
              forward_varlen(good.q, good.k, good.v, good.seqs, with_mask);
            }).find("forward: mask is not supported with variable-length sequences"),
            std::string::npos);
  // Backward checks its own arrays the same way.
  const ForwardResult f = forward_varlen(good.q, good.k, good.v, good.seqs);
  s = good.seqs;
  s.cu_seqlens_k = decreasing.view();
  const std::string back = invalid_argument_message(
      [&] { backward_varlen(f.out, good.q, good.k, good.v, f.out, f.lse, s); });
  EXPECT_EQ(back.rfind("backward: cu_seqlens_k is decreasing", 0), 0u) << back;
}

TEST(Varlen, EmptyBatchesAndSequences) {
  // B = 0: cu_seqlens [0]; buffers may still hold rows (all unused).
  Batch none{{}, {}, {}, 2, 3, 2, 1, 8, 8};
  const Packed p = make_packed(none, DType::f32, varlen_variants()[0], 9);
  for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
    const ForwardResult f = forward_varlen(p.q, p.k, p.v, p.seqs, {}, backend);
    for (double x : read_view(f.out.view())) EXPECT_EQ(x, 0.0);
    for (double x : read_view(f.lse.view())) EXPECT_EQ(x, -INFINITY);
    const BackwardResult g =
        backward_varlen(f.out, p.q, p.k, p.v, f.out, f.lse, p.seqs, {}, backend);
    for (double x : read_view(g.dq.view())) EXPECT_EQ(x, 0.0);
    for (double x : read_view(g.dk.view())) EXPECT_EQ(x, 0.0);
  }
}

// Sequences without rows do no work however many heads their empty tensors claim: before, the
// backward looped, or sized a list, per query head (2^61 of them here); and the reference's
// workspace, sized by the key length, was refused for a dense batch of nothing.
TEST(Varlen, EmptySequencesOfHugeHeadCountsDoNoWork) {
  const std::int64_t heads = std::int64_t{1} << 61;
  float cell = 0;
  const TensorView q = TensorView::contiguous(&cell, DType::f32, {0, heads, 8});
  const TensorView kv = TensorView::contiguous(&cell, DType::f32, {0, 1, 8});
  Tensor cu(DType::i32, {3});
  std::fill_n(cu.data_as<std::int32_t>(), 3, 0);
  VarlenSeqs s;
  s.cu_seqlens_q = s.cu_seqlens_k = cu.view();
  for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
    SCOPED_TRACE(name_of(backend));
    const ForwardResult f = forward_varlen(q, kv, kv, s, {}, backend);
    EXPECT_EQ(f.out.view().numel(), 0);
    const BackwardResult g = backward_varlen(f.out, q, kv, kv, f.out, f.lse, s, {}, backend);
    EXPECT_EQ(g.dq.view().numel(), 0);
    EXPECT_EQ(g.dk.view().numel(), 0);
  }
  // A dense batch of nothing over a key length the reference's workspace could not hold (8
  // bytes per key and thread: 1.1e12 bytes), refused before.
  const TensorView q0 = TensorView::contiguous(&cell, DType::f32, {0, 1, 1, 8});
  const TensorView kv0 = TensorView::contiguous(&cell, DType::f32, {0, 1, INT32_MAX, 8});
  Options o;
  o.num_threads = 64;
  EXPECT_EQ(forward(q0, kv0, kv0, o, Backend::reference).lse.view().numel(), 0);
}

// Thousands of sequences, one of them long: every sequence matches its own dense call.
TEST(Varlen, ThousandsOfSequences) {
  Batch batch;
  Random rng(11);
  for (int b = 0; b < 2000; ++b) {
    batch.lens_q.push_back(static_cast<int>(rng.uniform(0, 4)));
    batch.lens_k.push_back(static_cast<int>(rng.uniform(0, 6)));
  }
  batch.lens_q[1500] = 200;
  batch.lens_k[1500] = 190;
  const Packed p = make_packed(batch, DType::f32, varlen_variants()[1], 12);
  const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, Backend::flash);
  for (std::int64_t b :
       {std::int64_t{0}, std::int64_t{999}, std::int64_t{1500}, std::int64_t{1999}}) {
    const std::int64_t q0 = p.cu_q[static_cast<std::size_t>(b)];
    const std::int64_t lq = batch.lens_q[static_cast<std::size_t>(b)];
    const std::int64_t k0 = p.cu_k[static_cast<std::size_t>(b)];
    const ForwardResult one = forward(dense_rows(p.q, q0, lq), dense_rows(p.k, k0, p.used(b)),
                                      dense_rows(p.v, k0, p.used(b)), p.options, Backend::flash);
    EXPECT_TRUE(same_bits(packed_rows(r.out, q0, lq), read_view(one.out.view()),
                          "sequence " + std::to_string(b)));
  }
}

// The flash planner spreads kv groups over threads in an order that balances them, or runs a
// dominant sequence with every thread on its items. Each thread's work (query rows x keys) is
// counted as the pool would hand the work out: whole groups to the least loaded thread in plan
// order (spread), or each group's items over the threads (else).
TEST(Varlen, FlashPlanBalancesThreads) {
  const detail::FlashLayout layout = detail::flash_target_chosen().layout;
  const std::pair<std::int64_t, std::int64_t> heads[] = {{1, 1}, {2, 2}, {16, 16}, {32, 1}, {8, 2}};
  for (const auto& [heads_q, heads_kv] : heads) {
    for (int threads : {2, 3, 4}) {
      Batch batch;
      batch.lens_q.assign(64, 16);
      batch.lens_k.assign(64, 16);
      batch.lens_q[40] = batch.lens_k[40] = 8192;
      batch.heads_q = heads_q;
      batch.heads_kv = heads_kv;
      batch.dim = batch.dim_v = 64;
      const Packed p = make_packed(batch, DType::f32, varlen_variants()[0], 1);
      detail::Params params;
      params.batch = p.count();
      params.heads_q = heads_q;
      params.heads_kv = heads_kv;
      params.group = heads_q / heads_kv;
      params.head_dim = params.head_dim_v = 64;
      params.seq.cu_q = p.cu_q.data();
      params.seq.cu_k = p.cu_k.data();
      params.seq.lq = params.seq.longest_q = 8192;
      params.seq.lk = params.seq.longest_k = 8192;
      params.seq.rows_q = p.rows_q;
      params.seq.rows_k = p.rows_k;
      const detail::FlashForwardPlan plan =
          detail::plan_flash_forward(params, threads, layout, false);
      std::vector<double> load(static_cast<std::size_t>(threads), 0.0);
      auto least = [&] { return std::min_element(load.begin(), load.end()); };
      double total = 0;
      for (std::int64_t g : plan.order) {
        const std::int64_t b = g / heads_kv;
        const double lq = batch.lens_q[static_cast<std::size_t>(b)];
        const double lk = batch.lens_k[static_cast<std::size_t>(b)];
        const double rows = lq * static_cast<double>(heads_q / heads_kv);  // the group's rows
        total += rows * lk;
        if (plan.spread) {
          *least() += rows * lk;
        } else {
          for (double row0 = 0; row0 < rows; row0 += layout.block_rows)
            *least() += std::min<double>(layout.block_rows, rows - row0) * lk;
        }
      }
      const double most = *std::max_element(load.begin(), load.end());
      EXPECT_LE(most, 1.05 * total / threads)
          << "Hq=" << heads_q << " Hkv=" << heads_kv << " threads=" << threads
          << " spread=" << plan.spread;
      // The backward: items (runs of heads, key-tile parts) in flash_backward_order, each to
      // the least loaded thread. Its grain is a run of one head for long sequences, so when the
      // long sequence's items do not divide among the threads (Hq = 1 on 2 threads, 16 heads on
      // 3) threads idle: checked where they divide.
      const detail::FlashBackwardPlan bplan =
          detail::plan_flash_backward(params, layout.key_tile, false);
      if (heads_kv * bplan.runs * bplan.parts % threads != 0) continue;
      const std::vector<std::int64_t> border =
          detail::flash_backward_order(params, bplan.runs, bplan.parts);
      std::vector<double> bload(static_cast<std::size_t>(threads), 0.0);
      double btotal = 0;
      for (std::int64_t n : border) {
        const std::int64_t kv_run = n / bplan.parts, b = kv_run / (bplan.runs * heads_kv);
        const std::int64_t run = kv_run % bplan.runs;
        const std::int64_t heads =
            std::min(bplan.run_heads, heads_q / heads_kv - run * bplan.run_heads);
        const double w = static_cast<double>(heads) * batch.lens_q[static_cast<std::size_t>(b)] *
                         batch.lens_k[static_cast<std::size_t>(b)] /
                         static_cast<double>(bplan.parts);
        btotal += w;
        *std::min_element(bload.begin(), bload.end()) += w;
      }
      EXPECT_LE(*std::max_element(bload.begin(), bload.end()), 1.05 * btotal / threads)
          << "backward Hq=" << heads_q << " Hkv=" << heads_kv << " threads=" << threads;
    }
  }
}

// A varlen batch of decode rows around a prefill chunk, its kv heads inside a key's row: the
// decode rows' groups take runs of kv heads (every head once), the chunk's one head per item;
// a max_seqlen_q above every real length plans as the real one does.
TEST(Varlen, FlashPlanRunsDecodeRowsAmongChunks) {
  const detail::FlashLayout layout = detail::flash_target_chosen().layout;
  const Batch batch = decode_rows_around_a_chunk();
  const Packed p = make_packed(batch, DType::f32, varlen_variants()[0], 1);
  detail::Params params;
  params.batch = p.count();
  params.heads_q = batch.heads_q;
  params.heads_kv = batch.heads_kv;
  params.group = batch.heads_q / batch.heads_kv;
  params.head_dim = params.head_dim_v = batch.dim;
  params.seq.cu_q = p.cu_q.data();
  params.seq.cu_k = p.cu_k.data();
  params.seq.lq = params.seq.longest_q = p.max_q;
  params.seq.lk = params.seq.longest_k = p.max_k;
  params.seq.rows_q = p.rows_q;
  params.seq.rows_k = p.rows_k;
  for (int threads : {1, 2}) {
    const detail::FlashForwardPlan plan =
        detail::plan_flash_forward(params, threads, layout, /*heads_in_rows=*/true);
    ASSERT_TRUE(plan.spread && !plan.on_the_fly) << threads;  // (the chunk's panels)
    ASSERT_GT(plan.item_heads, 1) << threads;
    std::vector<int> seen(static_cast<std::size_t>(params.batch * params.heads_kv), 0);
    for (std::int64_t g : detail::run_order(plan, params)) {
      const std::int64_t b = g / params.heads_kv, heads = plan.heads_of(params, b);
      const bool decode = batch.lens_q[static_cast<std::size_t>(b)] == 1;
      EXPECT_EQ(heads, decode ? plan.item_heads : 1) << b;
      for (std::int64_t x = g; x < g + heads && x / params.heads_kv == b; ++x) {
        ++seen[static_cast<std::size_t>(x)];
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1);
  }
  // Decode rows alone, with max_seqlen_q far above their one row: on the fly, runs of heads.
  Batch decode;
  decode.lens_q.assign(4, 1);
  decode.lens_k.assign(4, 300);
  decode.heads_q = decode.heads_kv = 4;
  const Packed d = make_packed(decode, DType::f32, varlen_variants()[0], 2);
  detail::Params dp = params;
  dp.batch = d.count();
  dp.heads_q = dp.heads_kv = 4;
  dp.group = 1;
  dp.seq.cu_q = d.cu_q.data();
  dp.seq.cu_k = d.cu_k.data();
  dp.seq.lq = 4096;  // max_seqlen_q as passed
  dp.seq.longest_q = 1;
  dp.seq.lk = dp.seq.longest_k = 300;
  const detail::FlashForwardPlan plan = detail::plan_flash_forward(dp, 1, layout, true);
  EXPECT_TRUE(plan.on_the_fly);
  EXPECT_EQ(plan.item_heads, 4);
}

// The cost model prices a varlen call as the dense batch of the same sequences, query rows and
// pairs: (3 x 5) + (1 x 30) + (17 x 3) = 96 pairs over 21 rows.
TEST(Varlen, CostModelSeesTheDenseEquivalent) {
  const Packed p = make_packed({{3, 1, 17}, {5, 30, 3}, {}, 0, 0, 2, 1, 16, 16}, DType::f32,
                               varlen_variants()[0], 1);
  detail::Params params;
  params.batch = 3;
  params.seq.cu_q = p.cu_q.data();
  params.seq.cu_k = p.cu_k.data();
  params.seq.lq = 100;  // max_seqlen as passed: not what the model prices
  params.seq.lk = 100;
  const detail::Params dense = detail::dense_equivalent(params);
  EXPECT_FALSE(dense.seq.varlen());
  EXPECT_EQ(dense.seq.lq, 7);  // 21 rows / 3
  EXPECT_EQ(dense.seq.lk, 5);  // 96 pairs / 21 rows = 4.6
  EXPECT_EQ(dense.batch, 3);
}

}  // namespace
}  // namespace attncore::test
