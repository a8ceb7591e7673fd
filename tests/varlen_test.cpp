// Variable-length batches (attncore/varlen.h): the packed forward equals the loop over single
// dense sequences bitwise, on every backend and SIMD target; thread-count invariance; backward
// and forward against the fp64 oracle per sequence; dropout against the padded dense batch
// with its key-padding mask; unused rows; every bad input; the flash planner's balance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attncore/attncore.h"
#include "core/sequence.h"
#include "cpu/flash.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The sequences of one packed batch: query and key lengths, optional seqused_k, and rows of
// the buffers past the last sequence.
struct Batch {
  std::vector<int> lens_q, lens_k;
  std::vector<int> used_k;  // empty: none
  int extra_q = 0, extra_k = 0;
  std::int64_t heads_q = 2, heads_kv = 1, dim = 16, dim_v = 16;
};

// What the options of a case are.
struct Variant {
  std::string name;
  Causal causal = Causal::none;
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
};

std::vector<Variant> variants() {
  return {{"plain"},
          {"causal_lr", Causal::lower_right},
          {"causal_ul", Causal::upper_left},
          {"window", Causal::none, 5, 3},
          {"softcap", Causal::none, -1, -1, 2.5},
          {"alibi_h", Causal::none, -1, -1, 0.0, 1},
          {"combo_bh", Causal::lower_right, 9, -1, 4.0, 2}};
}

// A packed batch in memory: q [rows_q, Hq, D], k [rows_k, Hkv, D], v [rows_k, Hkv, Dv]; rows
// that belong to no sequence (and keys between seqused_k and the next sequence) hold NaN, so
// that reading them shows.
struct Packed {
  Batch batch;
  DType dtype;
  std::vector<int> cu_q, cu_k;
  std::int64_t rows_q = 0, rows_k = 0, max_q = 0, max_k = 0;
  Tensor q, k, v, cu_q_t, cu_k_t, used_t, alibi;
  VarlenSeqs seqs;
  Options options;

  std::int64_t count() const { return static_cast<std::int64_t>(batch.lens_q.size()); }
  std::int64_t used(std::int64_t b) const {
    return batch.used_k.empty() ? batch.lens_k[static_cast<std::size_t>(b)]
                                : batch.used_k[static_cast<std::size_t>(b)];
  }
};

Tensor int_tensor(const std::vector<int>& values) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int));
  return t;
}

Packed make_packed(const Batch& batch, DType dtype, const Variant& variant, std::uint64_t seed) {
  Packed p;
  p.batch = batch;
  p.dtype = dtype;
  p.cu_q = {0};
  p.cu_k = {0};
  for (std::size_t b = 0; b < batch.lens_q.size(); ++b) {
    p.cu_q.push_back(p.cu_q.back() + batch.lens_q[b]);
    p.cu_k.push_back(p.cu_k.back() + batch.lens_k[b]);
    p.max_q = std::max<std::int64_t>(p.max_q, batch.lens_q[b]);
    p.max_k = std::max<std::int64_t>(p.max_k, batch.lens_k[b]);
  }
  p.rows_q = p.cu_q.back() + batch.extra_q;
  p.rows_k = p.cu_k.back() + batch.extra_k;
  Random rng(seed);
  auto fill = [&](std::int64_t rows, std::int64_t heads, std::int64_t dim, bool keys) {
    std::vector<double> values(static_cast<std::size_t>(rows * heads * dim));
    for (std::int64_t r = 0; r < rows; ++r) {
      bool used_row = false;
      const std::vector<int>& cu = keys ? p.cu_k : p.cu_q;
      for (std::int64_t b = 0; b < p.count(); ++b) {
        const std::int64_t len = keys ? p.used(b) : batch.lens_q[static_cast<std::size_t>(b)];
        used_row |=
            r >= cu[static_cast<std::size_t>(b)] && r < cu[static_cast<std::size_t>(b)] + len;
      }
      for (std::int64_t e = 0; e < heads * dim; ++e) {
        values[static_cast<std::size_t>(r * heads * dim + e)] =
            used_row ? round_to(rng.uniform(-1.0, 1.0), dtype) : kNaN;
      }
    }
    return make_tensor(dtype, {rows, heads, dim}, values);
  };
  p.q = fill(p.rows_q, batch.heads_q, batch.dim, false);
  p.k = fill(p.rows_k, batch.heads_kv, batch.dim, true);
  p.v = fill(p.rows_k, batch.heads_kv, batch.dim_v, true);
  p.cu_q_t = int_tensor(p.cu_q);
  p.cu_k_t = int_tensor(p.cu_k);
  p.seqs.cu_seqlens_q = p.cu_q_t.view();
  p.seqs.cu_seqlens_k = p.cu_k_t.view();
  p.seqs.max_seqlen_q = p.max_q;
  p.seqs.max_seqlen_k = p.max_k;
  if (!batch.used_k.empty()) {
    p.used_t = int_tensor(batch.used_k);
    p.seqs.seqused_k = p.used_t.view();
  }
  p.options.causal = variant.causal;
  p.options.window_left = variant.window_left;
  p.options.window_right = variant.window_right;
  p.options.softcap = variant.softcap;
  if (variant.alibi != 0) {
    const std::int64_t n = variant.alibi == 1 ? batch.heads_q : p.count() * batch.heads_q;
    std::vector<double> slopes(static_cast<std::size_t>(n));
    for (std::size_t s = 0; s < slopes.size(); ++s)
      slopes[s] = 0.05 + 0.11 * static_cast<double>(s % 7);
    p.alibi = variant.alibi == 1 ? make_tensor(DType::f32, {n}, slopes)
                                 : make_tensor(DType::f32, {p.count(), batch.heads_q}, slopes);
    p.options.alibi_slopes = p.alibi.view();
  }
  return p;
}

// Rows [first, first + count) of a packed [rows, H, D] tensor as a dense [1, H, count, D] view.
TensorView dense_rows(const Tensor& t, std::int64_t first, std::int64_t count) {
  const TensorView& v = t.view();
  const std::int64_t heads = v.size(1), dim = v.size(2);
  void* data = static_cast<char*>(v.data) +
               first * heads * dim * static_cast<std::int64_t>(size_of(v.dtype));
  return TensorView::contiguous(data, v.dtype, {1, count, heads, dim}).transposed(1, 2);
}

// The options of sequence b run alone: ALiBi [B, Hq] becomes its row b.
Options sequence_options(const Packed& p, std::int64_t b) {
  Options o = p.options;
  if (o.alibi_slopes && o.alibi_slopes->rank == 2) {
    TensorView row = *o.alibi_slopes;
    row.data = static_cast<float*>(row.data) + b * row.stride_of(0);
    row.rank = 1;
    row.shape[0] = row.shape[1];
    row.stride[0] = row.stride[1];
    o.alibi_slopes = row;
  }
  return o;
}

// Bitwise equality of two value lists (NaN equal to NaN).
::testing::AssertionResult same_bits(const std::vector<double>& got,
                                     const std::vector<double>& want, const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (std::size_t e = 0; e < got.size(); ++e) {
    const bool both_nan = std::isnan(got[e]) && std::isnan(want[e]);
    if (!both_nan && std::memcmp(&got[e], &want[e], sizeof(double)) != 0) {
      return ::testing::AssertionFailure()
             << what << ": element " << e << " is " << got[e] << ", expected " << want[e];
    }
  }
  return ::testing::AssertionSuccess();
}

// Elements [first, first + count) of dim 0 of a packed [rows, H, X] result, as [H, count, X].
std::vector<double> packed_rows(const Tensor& t, std::int64_t first, std::int64_t count) {
  return read_view(dense_rows(t, first, count));
}

// LSE [Hq, rows] columns [first, first + count).
std::vector<double> packed_lse(const Tensor& lse, std::int64_t first, std::int64_t count) {
  const std::vector<double> all = read_view(lse.view());
  const std::int64_t rows = lse.view().size(1);
  std::vector<double> out;
  for (std::int64_t h = 0; h < lse.view().size(0); ++h) {
    for (std::int64_t i = first; i < first + count; ++i) {
      out.push_back(all[static_cast<std::size_t>(h * rows + i)]);
    }
  }
  return out;
}

// Whether a packed result is, bit for bit, the loop over its sequences run one by one as dense
// calls on `backend` (with the batch's options), and its rows past the last sequence output 0
// and LSE -inf.
::testing::AssertionResult equals_sequence_loop(const Packed& p, const ForwardResult& r,
                                                Backend backend) {
  for (std::int64_t b = 0; b < p.count(); ++b) {
    const std::int64_t q0 = p.cu_q[static_cast<std::size_t>(b)];
    const std::int64_t lq = p.batch.lens_q[static_cast<std::size_t>(b)];
    const std::int64_t k0 = p.cu_k[static_cast<std::size_t>(b)];
    const ForwardResult one =
        forward(dense_rows(p.q, q0, lq), dense_rows(p.k, k0, p.used(b)),
                dense_rows(p.v, k0, p.used(b)), sequence_options(p, b), backend);
    const std::string seq = " of sequence " + std::to_string(b);
    auto same = same_bits(packed_rows(r.out, q0, lq), read_view(one.out.view()), "out" + seq);
    if (!same) return same;
    same = same_bits(packed_lse(r.lse, q0, lq), read_view(one.lse.view()), "lse" + seq);
    if (!same) return same;
  }
  const std::int64_t end = p.cu_q.back();
  for (double x : packed_rows(r.out, end, p.rows_q - end)) {
    if (x != 0.0) return ::testing::AssertionFailure() << "an unused row's output is " << x;
  }
  for (double x : packed_lse(r.lse, end, p.rows_q - end)) {
    if (x != -INFINITY) return ::testing::AssertionFailure() << "an unused row's LSE is " << x;
  }
  return ::testing::AssertionSuccess();
}

std::vector<Batch> batches() {
  std::vector<Batch> list;
  list.push_back({{5, 1, 17, 0, 9}, {5, 30, 3, 4, 0}, {}, 0, 0, 2, 1, 16, 16});
  list.push_back({{130, 7}, {129, 200}, {100, 150}, 3, 5, 4, 2, 40, 24});
  list.push_back({{1, 1, 1}, {300, 1, 64}, {}, 0, 2, 8, 2, 64, 64});  // decode-shaped
  list.push_back({{70}, {70}, {}, 2, 0, 3, 3, 59, 59});               // one sequence
  return list;
}

TEST(Varlen, ForwardEqualsThePerSequenceLoopBitwise) {
  std::vector<std::string> targets = simd_targets_supported();
  for (const std::string& target : targets) {
    const ScopedTarget scope(target);
    for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
      for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        if (backend != Backend::flash && (dtype != DType::f32 || target != targets.front()))
          continue;  // math and reference do not depend on the SIMD target
        std::uint64_t seed = 1;
        for (const Batch& batch : batches()) {
          for (const Variant& variant : variants()) {
            const Packed p = make_packed(batch, dtype, variant, seed++);
            SCOPED_TRACE(target + " " + std::string(name_of(backend)) + " " +
                         std::string(name_of(dtype)) + " " + variant.name + " batch " +
                         std::to_string(seed));
            const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
            ASSERT_TRUE(equals_sequence_loop(p, r, backend));
          }
        }
      }
    }
  }
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
    const Packed p = make_packed(batch, dtype, variants()[1], 5);
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

// Decode-shaped sequences long enough to be split (split-KV, planned or forced): each one is
// split as its own dense call would be, so the packed batch still equals the loop over its
// sequences bit for bit, on any thread count.
TEST(Varlen, SplitKvDecodeEqualsThePerSequenceLoop) {
  const Batch batch{{1, 2, 0, 1}, {3000, 40, 500, 2100}, {2900, 40, 0, 2100}, 2, 3, 4, 1, 64, 48};
  for (int splits : {0, 3}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      Packed p = make_packed(batch, dtype, variants()[1], 70 + splits);
      p.options.num_splits = splits;
      SCOPED_TRACE(std::string(name_of(dtype)) + " num_splits " + std::to_string(splits));
      std::vector<double> first_out, first_lse;
      for (int threads : {1, 2, 3}) {
        Options o = p.options;
        o.num_threads = threads;
        const ForwardResult r = forward_varlen(p.q, p.k, p.v, p.seqs, o, Backend::flash);
        if (threads > 1) {
          EXPECT_TRUE(same_bits(read_view(r.out.view()), first_out, "out, threads"));
          EXPECT_TRUE(same_bits(read_view(r.lse.view()), first_lse, "lse, threads"));
          continue;
        }
        first_out = read_view(r.out.view());
        first_lse = read_view(r.lse.view());
        EXPECT_TRUE(equals_sequence_loop(p, r, Backend::flash));
      }
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

// A batch holding a chunk of several work items (70 rows per head: 280 rows of its kv group)
// beside long decode rows is not split, forced or planned: the same bits as num_splits = 1, on
// any thread count.
TEST(Varlen, BatchWithAChunkIsNotSplit) {
  const Batch batch{{1, 70, 1}, {3000, 260, 2100}, {}, 2, 3, 4, 1, 64, 48};
  for (DType dtype : {DType::f32, DType::bf16}) {
    Packed p = make_packed(batch, dtype, variants()[1], 90);
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
        for (const Variant& variant : variants()) {
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
            const double scale = std::max({max_abs(ob.dq), max_abs(ob.dk), max_abs(ob.dv)});
            EXPECT_TRUE(all_close(packed_rows(g.dq, q0, lq), ob.dq,
                                  grad_tolerance(dtype, ob.dq, naive.dq, scale),
                                  "dq of sequence " + std::to_string(b)));
            EXPECT_TRUE(all_close(packed_rows(g.dk, k0, lk), ob.dk,
                                  grad_tolerance(dtype, ob.dk, naive.dk, scale),
                                  "dk of sequence " + std::to_string(b)));
            EXPECT_TRUE(all_close(packed_rows(g.dv, k0, lk), ob.dv,
                                  grad_tolerance(dtype, ob.dv, naive.dv, scale),
                                  "dv of sequence " + std::to_string(b)));
            // Keys between seqused_k and the next sequence belong to no used key: zero.
            const std::int64_t unused = batch.lens_k[static_cast<std::size_t>(b)] - lk;
            for (double x : packed_rows(g.dk, k0 + lk, unused)) ASSERT_EQ(x, 0.0);
            for (double x : packed_rows(g.dv, k0 + lk, unused)) ASSERT_EQ(x, 0.0);
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
      Packed p = make_packed(batch, DType::f32, variants()[0], 77);
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

// The message of the error `call` throws, or "" if it throws none.
template <class Error, class F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Varlen, BadInputsAreRefusedWithClearErrors) {
  const Batch batch{{3, 4}, {5, 6}, {}, 0, 0, 2, 1, 8, 8};
  const Packed good = make_packed(batch, DType::f32, variants()[0], 3);
  auto forward_with = [&](const VarlenSeqs& s) {
    return error_of<InvalidArgument>([&] { forward_varlen(good.q, good.k, good.v, s); });
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
  expect(s, "cu_seqlens_q is not contiguous (stride[0]=2, expected 1)");
  // A value tensor where an index array belongs and an index array where values belong.
  const std::string int_query =
      error_of<InvalidArgument>([&] { forward_varlen(good.cu_q_t, good.k, good.v, good.seqs); });
  EXPECT_NE(int_query.find("query has the wrong rank"), std::string::npos) << int_query;
  Tensor int_values(DType::i32, {7, 2, 8});
  const std::string int_dtype =
      error_of<InvalidArgument>([&] { forward_varlen(int_values, good.k, good.v, good.seqs); });
  EXPECT_NE(int_dtype.find("query has an unsupported dtype (dtype=i32"), std::string::npos)
      << int_dtype;
  // Dense-layout tensors.
  Tensor rank4(DType::f32, {1, 7, 2, 8});
  EXPECT_NE(error_of<InvalidArgument>([&] {
              forward_varlen(rank4, good.k, good.v, good.seqs);
            }).find("query has the wrong rank (rank=4, expected 3: [total_q, Hq, D])"),
            std::string::npos);
  // Outputs of the wrong shape.
  Tensor out(DType::f32, {6, 2, 8});
  EXPECT_NE(error_of<InvalidArgument>([&] {
              forward_varlen_into(good.q, good.k, good.v, good.seqs, out, std::nullopt);
            }).find("out has shape [6, 2, 8], expected [7, 2, 8] ([total_q, Hq, Dv])"),
            std::string::npos);
  Tensor lse(DType::f32, {7, 2});
  Tensor out_ok(DType::f32, {7, 2, 8});
  EXPECT_NE(error_of<InvalidArgument>([&] {
              forward_varlen_into(good.q, good.k, good.v, good.seqs, out_ok, lse.view());
            }).find("lse has shape [7, 2], expected [2, 7] ([Hq, total_q])"),
            std::string::npos);
  // Tensor masks are not supported.
  Tensor mask(DType::b8, {7, 11});
  Options with_mask;
  with_mask.mask = mask.view();
  EXPECT_NE(error_of<Unsupported>([&] {
              forward_varlen(good.q, good.k, good.v, good.seqs, with_mask);
            }).find("forward: mask is not supported with variable-length sequences"),
            std::string::npos);
  // Backward checks its own arrays the same way.
  const ForwardResult f = forward_varlen(good.q, good.k, good.v, good.seqs);
  s = good.seqs;
  s.cu_seqlens_k = decreasing.view();
  const std::string back = error_of<InvalidArgument>(
      [&] { backward_varlen(f.out, good.q, good.k, good.v, f.out, f.lse, s); });
  EXPECT_EQ(back.rfind("backward: cu_seqlens_k is decreasing", 0), 0u) << back;
}

TEST(Varlen, EmptyBatchesAndSequences) {
  // B = 0: cu_seqlens [0]; buffers may still hold rows (all unused).
  Batch none{{}, {}, {}, 2, 3, 2, 1, 8, 8};
  const Packed p = make_packed(none, DType::f32, variants()[0], 9);
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
  const Packed p = make_packed(batch, DType::f32, variants()[1], 12);
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
      const Packed p = make_packed(batch, DType::f32, variants()[0], 1);
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

}  // namespace
}  // namespace attncore::test

namespace attncore::test {
namespace {

// The cost model prices a varlen call as the dense batch of the same sequences, query rows and
// pairs: (3 x 5) + (1 x 30) + (17 x 3) = 96 pairs over 21 rows.
TEST(Varlen, CostModelSeesTheDenseEquivalent) {
  const Packed p =
      make_packed({{3, 1, 17}, {5, 30, 3}, {}, 0, 0, 2, 1, 16, 16}, DType::f32, variants()[0], 1);
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
