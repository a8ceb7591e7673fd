// Cancellation (Options::cancel): a flag set before the call makes it throw attncore::Cancelled
// before anything is allocated or written; a flag set from another thread during a long call
// makes every backend stop between work items and throw Cancelled, much sooner than the call
// would have ended (a ratio of times measured in the same test, never an absolute time).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "attncore/attncore.h"

namespace attncore {
namespace {

using Clock = std::chrono::steady_clock;

void fill(const Tensor& t, int seed) {
  auto* x = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x[i] = static_cast<float>((i * 29 + seed * 7) % 19) * 0.05f - 0.45f;
  }
}

// The message of the Cancelled `call` throws ("" if it throws nothing or something else).
std::string cancelled_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const Cancelled& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("other error: ") + e.what();
  }
  return "";
}

// A call's tensors, f32: q, k, v [1, H, L, D] filled, the outputs beside them.
struct CallTensors {
  Tensor q, k, v, out, lse, dq, dk, dv;
  CallTensors(std::int64_t h, std::int64_t l, std::int64_t d)
      : q(DType::f32, {1, h, l, d}),
        k(DType::f32, {1, h, l, d}),
        v(DType::f32, {1, h, l, d}),
        out(DType::f32, {1, h, l, d}),
        lse(DType::f32, {1, h, l}),
        dq(DType::f32, {1, h, l, d}),
        dk(DType::f32, {1, h, l, d}),
        dv(DType::f32, {1, h, l, d}) {
    fill(q, 1);
    fill(k, 2);
    fill(v, 3);
  }
};

TEST(Cancel, FlagSetBeforeTheCall) {
  CallTensors c(2, 64, 32);
  std::atomic<bool> cancel{true};
  Options o;
  o.cancel = &cancel;
  const std::string not_written =
      "call is cancelled (cancel=true, expected false); the outputs are not written";
  for (Backend b : {Backend::automatic, Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(b)));
    fill(c.out, 9);
    const float first = c.out.data_as<float>()[0];
    EXPECT_EQ(cancelled_message([&] { forward_into(c.q, c.k, c.v, c.out, c.lse.view(), o, b); }),
              "forward: " + not_written);
    EXPECT_EQ(c.out.data_as<float>()[0], first);  // not written
    EXPECT_EQ(cancelled_message([&] { (void)forward(c.q, c.k, c.v, o, b); }),
              "forward: " + not_written);
    EXPECT_EQ(cancelled_message([&] {
                backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv, std::nullopt, o,
                              b);
              }),
              "backward: " + not_written);
    EXPECT_EQ(cancelled_message([&] { (void)backward(c.out, c.q, c.k, c.v, c.out, c.lse, o, b); }),
              "backward: " + not_written);
  }
  // Packed batches too.
  const std::int32_t cu[] = {0, 30, 64};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu), DType::i32, {3});
  seqs.cu_seqlens_k = seqs.cu_seqlens_q;
  seqs.max_seqlen_q = seqs.max_seqlen_k = 34;
  Tensor packed(DType::f32, {64, 2, 32});
  fill(packed, 4);
  EXPECT_EQ(cancelled_message([&] { (void)forward_varlen(packed, packed, packed, seqs, o); }),
            "forward: " + not_written);
  // A flag that stays false changes nothing.
  std::atomic<bool> never{false};
  Options quiet;
  quiet.cancel = &never;
  const ForwardResult a = forward(c.q, c.k, c.v, quiet, Backend::flash);
  const ForwardResult b = forward(c.q, c.k, c.v, {}, Backend::flash);
  for (std::int64_t i = 0; i < a.out.numel(); ++i) {
    ASSERT_EQ(a.out.data_as<float>()[i], b.out.data_as<float>()[i]);
  }
}

// Times `call` with no flag set; then, up to three times, runs it with a flag another thread
// sets a tenth of that time after the start, and expects Cancelled each time and at least one
// run to end in less than `within` of the full time (half by default; other processes may slow
// one run).
void expect_cancels_early(const char* op, const std::function<void(const Options&)>& call,
                          double within = 0.5) {
  Options full;
  const auto t0 = Clock::now();
  call(full);
  const double full_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  double best_ratio = HUGE_VAL;
  for (int attempt = 0; attempt < 3 && best_ratio >= within; ++attempt) {
    std::atomic<bool> cancel{false};
    Options o;
    o.cancel = &cancel;
    std::thread setter([&] {
      std::this_thread::sleep_for(std::chrono::duration<double>(full_seconds / 10));
      cancel.store(true);
    });
    const auto t1 = Clock::now();
    const std::string message = cancelled_message([&] { call(o); });
    const double seconds = std::chrono::duration<double>(Clock::now() - t1).count();
    setter.join();
    EXPECT_EQ(message, std::string(op) +
                           ": call is cancelled (cancel=true, expected false); the outputs are "
                           "incomplete");
    best_ratio = std::min(best_ratio, seconds / full_seconds);
  }
  EXPECT_LT(best_ratio, within) << "uncancelled call " << full_seconds << " s";
}

// Problems of about 0.1-0.5 s on two cores for each backend.
TEST(Cancel, EveryBackendStopsBetweenWorkItems) {
  struct Case {
    Backend backend;
    std::int64_t heads, len;
  };
  for (const Case& k : {Case{Backend::reference, 4, 384}, Case{Backend::math, 8, 1536},
                        Case{Backend::flash, 8, 3072}}) {
    SCOPED_TRACE(std::string(name_of(k.backend)));
    CallTensors c(k.heads, k.len, 64);
    expect_cancels_early("forward", [&](const Options& o) {
      forward_into(c.q, c.k, c.v, c.out, c.lse.view(), o, k.backend);
    });
    expect_cancels_early("backward", [&](const Options& o) {
      backward_into(c.out, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv, std::nullopt, o,
                    k.backend);
    });
  }
}

// One thread (the caller alone), and the flash forward's two modes: kv groups spread over the
// threads (many heads) and one group's items shared (one head).
TEST(Cancel, FlashModesAndOneThread) {
  CallTensors many(16, 1536, 64), one(1, 8192, 64);
  for (int threads : {1, 0}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    for (CallTensors* c : {&many, &one}) {
      expect_cancels_early("forward", [&](const Options& base) {
        Options o = base;
        o.num_threads = threads;
        forward_into(c->q, c->k, c->v, c->out, c->lse.view(), o, Backend::flash);
      });
    }
  }
}

// A decode over one long cache is a single work item (one kv group, no key splits): the
// flag is also read between its key tiles. K and V broadcast one row over 2^24 keys (no
// memory), q one row: about 0.1-0.4 s on one thread.
TEST(Cancel, WithinOneLongDecodeItem) {
  constexpr std::int64_t kKeys = std::int64_t{1} << 24, kDim = 64;
  Tensor q(DType::f32, {1, 1, 1, kDim}), row(DType::f32, {kDim}), out(DType::f32, {1, 1, 1, kDim});
  fill(q, 6);
  fill(row, 7);
  const TensorView kv =
      TensorView::strided(row.data(), DType::f32, {1, 1, kKeys, kDim}, {0, 0, 0, 1});
  expect_cancels_early("forward", [&](const Options& base) {
    Options o = base;
    o.num_threads = 1;
    o.num_splits = 1;
    forward_into(q, kv, kv, out, std::nullopt, o, Backend::flash);
  });
}

// A backward's tensors over one kv head: q [1, Hq, rows, 64] against K = V, one row broadcast
// over `keys` keys (no memory); out and lse from the forward (with `options`); dq, dk, dv to
// write (dK and dV are real memory: keys x 256 bytes each).
struct BroadcastKeys {
  static constexpr std::int64_t kDim = 64;
  Tensor q, row, out, lse, dq, dk, dv;
  TensorView kv;

  BroadcastKeys(std::int64_t heads_q, std::int64_t rows, std::int64_t keys, int seed,
                const Options& options = {})
      : q(DType::f32, {1, heads_q, rows, kDim}),
        row(DType::f32, {kDim}),
        out(DType::f32, {1, heads_q, rows, kDim}),
        lse(DType::f32, {1, heads_q, rows}),
        dq(DType::f32, {1, heads_q, rows, kDim}),
        dk(DType::f32, {1, 1, keys, kDim}),
        dv(DType::f32, {1, 1, keys, kDim}) {
    fill(q, seed);
    fill(row, seed + 1);
    kv = TensorView::strided(row.data(), DType::f32, {1, 1, keys, kDim}, {0, 0, 0, 1});
    forward_into(q, kv, kv, out, lse.view(), options, Backend::flash);
  }
};

// A backward over one head with an additive mask (its dBias: the key parts that would cut the
// work into items are not made) is one long work item; the flag is also read between its key
// tiles. 2^18 keys, 128 query rows, the mask a row [1, 1, 1, Lk] of zeros: about 0.2-0.6 s on
// one thread.
TEST(Cancel, WithinOneLongBackwardItem) {
  constexpr std::int64_t kKeys = std::int64_t{1} << 18;
  Tensor mask(DType::f32, {1, 1, 1, kKeys}), dbias(DType::f32, {1, 1, 1, kKeys});
  std::fill_n(mask.data_as<float>(), kKeys, 0.0f);
  Options masked;
  masked.num_threads = 1;
  masked.mask = mask.view();
  BroadcastKeys c(1, 128, kKeys, 8, masked);
  expect_cancels_early("backward", [&](const Options& flag) {
    Options o = masked;
    o.cancel = flag.cancel;
    o.compute_dbias = true;
    backward_into(c.out, c.q, c.kv, c.kv, c.out, c.lse, c.dq, c.dk, c.dv, dbias.view(), o,
                  Backend::flash);
  });
}

// A GQA backward whose kv head's four query heads run as four runs (rows too long to share
// one), one long item each (four runs: no key parts), each adding a key tile's dK, dV after the
// run before: on 2 threads two runs at once, the second waiting for the first's tiles. A run
// stopped between tiles abandons its tiles and the run waiting for them stops too, with no
// hang: the call returns within 0.3 of its time (the two first items alone take half of it).
// 2^16 keys, 512 query rows a head.
TEST(Cancel, WithinGqaBackwardRuns) {
  BroadcastKeys c(4, 512, std::int64_t{1} << 16, 10);
  expect_cancels_early(
      "backward",
      [&](const Options& flag) {
        Options o = flag;
        o.num_threads = 2;
        backward_into(c.out, c.q, c.kv, c.kv, c.out, c.lse, c.dq, c.dk, c.dv, std::nullopt, o,
                      Backend::flash);
      },
      0.3);
}

// The same kind of backward (four chained runs on 2 threads, shorter) with the flag set at 40
// times spread over its length: every call throws Cancelled or completes, none hangs (ctest's
// timeout), and one that completes gives the uncancelled call's bits.
TEST(Cancel, GqaBackwardRunsAtAnyTime) {
  BroadcastKeys c(4, 256, std::int64_t{1} << 14, 12);
  Options two;
  two.num_threads = 2;
  const auto t0 = Clock::now();
  const BackwardResult want = backward(c.out, c.q, c.kv, c.kv, c.out, c.lse, two, Backend::flash);
  const double full_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  int cancelled = 0;
  for (int i = 0; i < 40; ++i) {
    std::atomic<bool> cancel{false};
    Options o = two;
    o.cancel = &cancel;
    std::thread setter([&] {
      std::this_thread::sleep_for(std::chrono::duration<double>(full_seconds * i / 40));
      cancel.store(true);
    });
    try {
      const BackwardResult got = backward(c.out, c.q, c.kv, c.kv, c.out, c.lse, o, Backend::flash);
      for (const auto& [a, b] : {std::pair{&got.dq, &want.dq}, std::pair{&got.dk, &want.dk}}) {
        EXPECT_EQ(std::memcmp(a->data(), b->data(), static_cast<std::size_t>(b->numel()) * 4), 0)
            << "flag at " << i << "/40";
      }
    } catch (const Cancelled&) {
      ++cancelled;
    }
    setter.join();
  }
  EXPECT_GT(cancelled, 0);
}

// A packed batch's backward (items taken longest sequence first).
TEST(Cancel, VarlenBackward) {
  const std::int32_t cu[] = {0, 1500, 1800, 4000};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu), DType::i32, {4});
  seqs.cu_seqlens_k = seqs.cu_seqlens_q;
  seqs.max_seqlen_q = seqs.max_seqlen_k = 2200;
  Tensor q(DType::f32, {4000, 8, 64}), out(DType::f32, {4000, 8, 64}), lse(DType::f32, {8, 4000});
  Tensor dq(DType::f32, {4000, 8, 64}), dk(DType::f32, {4000, 8, 64}),
      dv(DType::f32, {4000, 8, 64});
  fill(q, 5);
  forward_varlen_into(q, q, q, seqs, out, lse.view(), {}, Backend::flash);
  expect_cancels_early("backward", [&](const Options& o) {
    backward_varlen_into(out, q, q, q, out, lse, seqs, dq, dk, dv, o, Backend::flash);
  });
}

}  // namespace
}  // namespace attncore
