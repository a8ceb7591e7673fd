// Variable-length batches (attncore/varlen.h): the packed forward equals the loop over single
// dense sequences bitwise, on every backend and SIMD target; thread-count invariance; backward
// and forward against the fp64 oracle per sequence; dropout against the padded dense batch
// with its key-padding mask; unused rows. (Bad inputs, empty and huge batches and the
// planner: varlen_edges_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"
#include "varlen_batch.h"

namespace attncore::test {
namespace {

TEST(Varlen, ForwardEqualsThePerSequenceLoopBitwise) {
  ASSERT_TRUE(all_packed_cases(batches(), [](const Packed& p, Backend backend, std::uint64_t) {
    const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
    return equals_sequence_loop(p, r, backend);
  }));
}

TEST(Varlen, ResultsDoNotDependOnTheThreadCount) {
  // One long sequence among many short ones: the planner runs it with every thread.
  Batch batch;
  batch.lens_q.assign(40, 3);
  batch.lens_k.assign(40, 5);
  batch.lens_q[17] = 300;
  batch.lens_k[17] = 280;
  batch.heads_q = 4;
  batch.heads_kv = 1;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Packed p = make_packed(batch, dtype, varlen_variants()[1], 5);
    std::vector<double> first_out, first_dq;
    for (int threads : {1, 2, 3}) {
      Options o = p.options;
      o.num_threads = threads;
      const ForwardResult f = forward_varlen(p.q, p.k, p.v, p.seqs, o, Backend::flash);
      const BackwardResult g =
          backward_varlen(f.out, p.q, p.k, p.v, f.out, f.lse, p.seqs, o, Backend::flash);
      std::vector<double> out = read_view(f.out.view());
      std::vector<double> grads = read_view(g.dq.view());
      for (double x : read_view(g.dk.view())) grads.push_back(x);
      for (double x : read_view(g.dv.view())) grads.push_back(x);
      if (threads == 1) {
        first_out = out;
        first_dq = grads;
      } else {
        EXPECT_TRUE(same_bits(out, first_out, "out at " + std::to_string(threads) + " threads"));
        EXPECT_TRUE(same_bits(grads, first_dq, "grads at " + std::to_string(threads) + " threads"));
      }
    }
  }
}

// Flash's forward of p (its options) on 1, 2 and 3 threads: the same bits each time, the first
// equal to the loop over the sequences; that out and lse.
std::pair<std::vector<double>, std::vector<double>> thread_count_free(const Packed& p) {
  std::vector<double> out, lse;
  for (int threads : {1, 2, 3}) {
    Options o = p.options;
    o.num_threads = threads;
    const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, o, Backend::flash);
    if (threads == 1) {
      out = read_view(r.out.view());
      lse = read_view(r.lse.view());
      EXPECT_TRUE(equals_sequence_loop(p, r, Backend::flash));
      continue;
    }
    EXPECT_TRUE(same_bits(read_view(r.out.view()), out, "out, threads"));
    EXPECT_TRUE(same_bits(read_view(r.lse.view()), lse, "lse, threads"));
  }
  return {out, lse};
}

// Decode-shaped sequences long enough to be split (split-KV, planned or forced): each one is
// split as its own dense call would be, so the packed batch still equals the loop over its
// sequences bit for bit, on any thread count.
TEST(Varlen, SplitKvDecodeEqualsThePerSequenceLoop) {
  const Batch batch{{1, 2, 0, 1}, {3000, 40, 500, 2100}, {2900, 40, 0, 2100}, 2, 3, 4, 1, 64, 48};
  for (int splits : {0, 3}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      Packed p = make_packed(batch, dtype, varlen_variants()[1], 70 + splits);
      p.options.num_splits = splits;
      SCOPED_TRACE(std::string(name_of(dtype)) + " num_splits " + std::to_string(splits));
      const auto [first_out, first_lse] = thread_count_free(p);
      if (splits == 3) {  // the parts ran: their merge rounds differently from one pass
        Options o = p.options;
        o.num_splits = 1;
        const ForwardResult unsplit = forward_varlen(p.q, p.k, p.v, p.seqs, o, Backend::flash);
        EXPECT_FALSE(same_bits(read_view(unsplit.out.view()), first_out, "unsplit") &&
                     same_bits(read_view(unsplit.lse.view()), first_lse, "unsplit"));
      }
    }
  }
}

// Decode of 8 query heads on each kv head (one in-place item of 8 rows, more than AVX2's
// micro-tile) and of 12 (two in-place items of 6 rows), many sequences of one row: whether the
// planner spreads the groups over the threads depends on the thread count, and the items never
// get a panel either way: the same bits on any thread count, equal to the loop over the
// sequences.
TEST(Varlen, WideGroupDecodeIsThreadCountFree) {
  for (std::int64_t heads_q : {16, 24}) {
    Batch batch{std::vector<int>(24, 1), std::vector<int>(24, 700), {}, 0, 0, heads_q, 2, 64, 64};
    batch.lens_k[5] = 3000;
    for (DType dtype : {DType::f32, DType::bf16}) {
      Packed p = make_packed(batch, dtype, varlen_variants()[1], 90);
      p.options.num_splits = 1;  // (the split driver, which the long sequence takes, has no panel)
      SCOPED_TRACE(std::string(name_of(dtype)) + " heads_q " + std::to_string(heads_q));
      thread_count_free(p);
    }
  }
}

// A batch holding a chunk of several work items (70 rows per head: 280 rows of its kv group)
// beside long decode rows is not split, forced or planned: the same bits as num_splits = 1, on
// any thread count.
TEST(Varlen, BatchWithAChunkIsNotSplit) {
  const Batch batch{{1, 70, 1}, {3000, 260, 2100}, {}, 2, 3, 4, 1, 64, 48};
  for (DType dtype : {DType::f32, DType::bf16}) {
    Packed p = make_packed(batch, dtype, varlen_variants()[1], 90);
    p.options.num_splits = 1;
    const ForwardResult unsplit = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, Backend::flash);
    for (int splits : {0, 3}) {
      for (int threads : {1, 2}) {
        Options o = p.options;
        o.num_splits = splits;
        o.num_threads = threads;
        const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, o, Backend::flash);
        const std::string what = std::string(name_of(dtype)) + " num_splits " +
                                 std::to_string(splits) + " threads " + std::to_string(threads);
        EXPECT_TRUE(same_bits(read_view(r.out.view()), read_view(unsplit.out.view()), what));
        EXPECT_TRUE(same_bits(read_view(r.lse.view()), read_view(unsplit.lse.view()), what));
      }
    }
  }
}

// The oracle's spec for sequence b of a packed batch.
Spec sequence_spec(const Packed& p, std::int64_t b) {
  Spec s;
  s.scale = 1.0 / std::sqrt(static_cast<double>(p.batch.dim));
  s.causal = p.options.causal == Causal::upper_left    ? CausalMode::upper_left
             : p.options.causal == Causal::lower_right ? CausalMode::lower_right
                                                       : CausalMode::none;
  s.window_left = p.options.window_left;
  s.window_right = p.options.window_right;
  s.softcap = p.options.softcap;
  if (p.options.alibi_slopes) {
    const std::vector<double> all = read_view(p.alibi.view());
    const std::int64_t h = p.batch.heads_q;
    const std::int64_t first = p.alibi.view().rank == 2 ? b * h : 0;
    s.alibi.assign(all.begin() + first, all.begin() + first + h);
  }
  return s;
}

TEST(Varlen, BackwardMatchesTheOracle) {
  std::uint64_t seed = 40;
  for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      if (backend == Backend::reference && dtype != DType::f32) continue;
      for (const Batch& batch : batches()) {
        for (const VarlenVariant& variant : varlen_variants()) {
          const Packed p = make_packed(batch, dtype, variant, seed++);
          SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)) + " " +
                       variant.name + " seed " + std::to_string(seed));
          const ForwardResult f = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
          // dout: values in [-1, 1) on used rows, NaN elsewhere (never read).
          Tensor dout = make_packed(batch, dtype, variant, seed + 1000).q;
          if (batch.dim_v != batch.dim) {
            Batch swapped = batch;
            swapped.dim = batch.dim_v;
            dout = make_packed(swapped, dtype, variant, seed + 1000).q;
          }
          const BackwardResult g =
              backward_varlen(dout, p.q, p.k, p.v, f.out, f.lse, p.seqs, p.options, backend);
          // Each gradient of the whole batch (every sequence's rows one after another) against
          // the oracle's, under section 6's rule: a maximum over a sequence of a few rows is
          // too noisy a measure of the naive run's error.
          struct Gathered {
            std::vector<double> got, exact, naive;
            void add(const std::vector<double>& g, const std::vector<double>& e,
                     const std::vector<double>& n) {
              got.insert(got.end(), g.begin(), g.end());
              exact.insert(exact.end(), e.begin(), e.end());
              naive.insert(naive.end(), n.begin(), n.end());
            }
          } dq, dk, dv;
          for (std::int64_t b = 0; b < p.count(); ++b) {
            const std::int64_t q0 = p.cu_q[static_cast<std::size_t>(b)];
            const std::int64_t lq = batch.lens_q[static_cast<std::size_t>(b)];
            const std::int64_t k0 = p.cu_k[static_cast<std::size_t>(b)];
            const std::int64_t lk = p.used(b);
            Dims dims{1, batch.heads_q, batch.heads_kv, lq, lk, batch.dim, batch.dim_v};
            const Spec spec = sequence_spec(p, b);
            const std::vector<double> q = packed_rows(p.q, q0, lq), k = packed_rows(p.k, k0, lk),
                                      v = packed_rows(p.v, k0, lk), d = packed_rows(dout, q0, lq);
            const OracleForward of = oracle_forward(dims, spec, q, k, v);
            const OracleForward naive_f = oracle_forward(dims, spec, q, k, v, rounder_for(dtype));
            EXPECT_TRUE(all_close(packed_rows(f.out, q0, lq), of.out,
                                  out_tolerance(dtype, v, of.out, naive_f.out, 0.0), "out"));
            const OracleBackward ob = oracle_backward(dims, spec, q, k, v, d);
            const OracleBackward naive =
                oracle_backward(dims, spec, q, k, v, d, rounder_for(dtype));
            dq.add(packed_rows(g.dq, q0, lq), ob.dq, naive.dq);
            dk.add(packed_rows(g.dk, k0, lk), ob.dk, naive.dk);
            dv.add(packed_rows(g.dv, k0, lk), ob.dv, naive.dv);
            // Keys between seqused_k and the next sequence belong to no used key: zero.
            const std::int64_t unused = batch.lens_k[static_cast<std::size_t>(b)] - lk;
            for (double x : packed_rows(g.dk, k0 + lk, unused)) ASSERT_EQ(x, 0.0);
            for (double x : packed_rows(g.dv, k0 + lk, unused)) ASSERT_EQ(x, 0.0);
          }
          const double scale = std::max({max_abs(dq.exact), max_abs(dk.exact), max_abs(dv.exact)});
          for (const auto& [name, t] :
               {std::pair<const char*, const Gathered*>{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
            EXPECT_TRUE(all_close(t->got, t->exact,
                                  grad_tolerance(dtype, t->exact, t->naive, scale), name));
          }
          for (double x : packed_rows(g.dq, p.cu_q.back(), batch.extra_q)) ASSERT_EQ(x, 0.0);
          for (double x : packed_rows(g.dk, p.cu_k.back(), batch.extra_k)) ASSERT_EQ(x, 0.0);
          for (double x : packed_rows(g.dv, p.cu_k.back(), batch.extra_k)) ASSERT_EQ(x, 0.0);
        }
      }
    }
  }
}

TEST(Varlen, DropoutDrawsTheMaskOfThePaddedDenseBatch) {
  // Non-causal: the packed batch and the same batch right-padded to (max_q, max_k) with a
  // key-padding mask draw the same mask (docs/design.md section 1.5); max_seqlen may exceed the
  // real maxima and the addresses follow the values passed.
  Batch batch{{5, 12, 0, 9}, {20, 3, 6, 14}, {}, 0, 0, 2, 2, 16, 16};
  for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
    for (std::int64_t pad : {0, 3}) {
      Packed p = make_packed(batch, DType::f32, varlen_variants()[0], 77);
      p.seqs.max_seqlen_q += pad;
      p.seqs.max_seqlen_k += pad;
      p.options.dropout_p = 0.3;
      p.options.seed = 1234;
      p.options.offset = 8;
      const std::int64_t mq = p.seqs.max_seqlen_q, mk = p.seqs.max_seqlen_k;
      const ForwardResult f = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
      // The padded batch as the oracle sees it.
      Dims dims{p.count(), batch.heads_q, batch.heads_kv, mq, mk, batch.dim, batch.dim_v};
      std::vector<double> q(static_cast<std::size_t>(numel_of(dims.q_shape())), 0.0);
      std::vector<double> k(static_cast<std::size_t>(numel_of(dims.k_shape())), 0.0);
      std::vector<double> v(static_cast<std::size_t>(numel_of(dims.v_shape())), 0.0);
      DenseMask mask;
      mask.is_bool = true;
      mask.shape = {p.count(), 1, 1, mk};
      mask.values.assign(static_cast<std::size_t>(p.count() * mk), 0.0);
      for (std::int64_t b = 0; b < p.count(); ++b) {
        const std::int64_t lq = batch.lens_q[static_cast<std::size_t>(b)];
        const std::int64_t lk = batch.lens_k[static_cast<std::size_t>(b)];
        auto place = [&](const std::vector<double>& rows, std::vector<double>& dst,
                         std::int64_t heads, std::int64_t len, std::int64_t max_len,
                         std::int64_t dim) {  // rows [H, len, dim] -> dst [B, H, max_len, dim]
          for (std::int64_t h = 0; h < heads; ++h)
            for (std::int64_t i = 0; i < len; ++i)
              for (std::int64_t e = 0; e < dim; ++e)
                dst[static_cast<std::size_t>(((b * heads + h) * max_len + i) * dim + e)] =
                    rows[static_cast<std::size_t>((h * len + i) * dim + e)];
        };
        place(packed_rows(p.q, p.cu_q[static_cast<std::size_t>(b)], lq), q, batch.heads_q, lq, mq,
              batch.dim);
        place(packed_rows(p.k, p.cu_k[static_cast<std::size_t>(b)], lk), k, batch.heads_kv, lk, mk,
              batch.dim);
        place(packed_rows(p.v, p.cu_k[static_cast<std::size_t>(b)], lk), v, batch.heads_kv, lk, mk,
              batch.dim_v);
        for (std::int64_t j = 0; j < lk; ++j) mask.values[static_cast<std::size_t>(b * mk + j)] = 1;
      }
      Spec spec;
      spec.scale = 1.0 / std::sqrt(static_cast<double>(batch.dim));
      spec.mask = mask;
      spec.dropout_p = 0.3;
      spec.seed = 1234;
      spec.offset = 8;
      const OracleForward o = oracle_forward(dims, spec, q, k, v);
      for (std::int64_t b = 0; b < p.count(); ++b) {
        const std::int64_t lq = batch.lens_q[static_cast<std::size_t>(b)];
        std::vector<double> want;
        for (std::int64_t h = 0; h < batch.heads_q; ++h)
          for (std::int64_t i = 0; i < lq; ++i)
            for (std::int64_t e = 0; e < batch.dim_v; ++e)
              want.push_back(o.out[static_cast<std::size_t>(
                  ((b * batch.heads_q + h) * mq + i) * batch.dim_v + e)]);
        EXPECT_TRUE(all_close(packed_rows(f.out, p.cu_q[static_cast<std::size_t>(b)], lq), want,
                              1e-5 * max_abs(v) / 0.7,
                              std::string(name_of(backend)) + " sequence " + std::to_string(b)));
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
