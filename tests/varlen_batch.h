// Packed variable-length batches for the varlen tests: the batch's sequences, the options of a
// case, the packed tensors (rows that belong to no sequence hold NaN) and the per-sequence
// dense loop a packed result must equal bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The sequences of one packed batch: query and key lengths, optional seqused_k, and rows of
// the buffers past the last sequence.
struct Batch {
  std::vector<int> lens_q, lens_k;
  std::vector<int> used_k;  // empty: none
  int extra_q = 0, extra_k = 0;
  std::int64_t heads_q = 2, heads_kv = 1, dim = 16, dim_v = 16;
};

// What the options of a case are.
struct VarlenVariant {
  std::string name;
  Causal causal = Causal::none;
  std::int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  int alibi = 0;  // 0 none, 1 [Hq], 2 [B, Hq]
};

inline std::vector<VarlenVariant> varlen_variants() {
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

inline Tensor int_tensor(const std::vector<int>& values) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int));
  return t;
}

inline Packed make_packed(const Batch& batch, DType dtype, const VarlenVariant& variant,
                          std::uint64_t seed) {
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
inline TensorView dense_rows(const Tensor& t, std::int64_t first, std::int64_t count) {
  const TensorView& v = t.view();
  const std::int64_t heads = v.size(1), dim = v.size(2);
  void* data = static_cast<char*>(v.data) +
               first * heads * dim * static_cast<std::int64_t>(size_of(v.dtype));
  return TensorView::contiguous(data, v.dtype, {1, count, heads, dim}).transposed(1, 2);
}

// The options of sequence b run alone: ALiBi [B, Hq] becomes its row b.
inline Options sequence_options(const Packed& p, std::int64_t b) {
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

// Elements [first, first + count) of dim 0 of a packed [rows, H, X] result, as [H, count, X].
inline std::vector<double> packed_rows(const Tensor& t, std::int64_t first, std::int64_t count) {
  return read_view(dense_rows(t, first, count));
}

// LSE [Hq, rows] columns [first, first + count).
inline std::vector<double> packed_lse(const Tensor& lse, std::int64_t first, std::int64_t count) {
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
inline ::testing::AssertionResult equals_sequence_loop(const Packed& p, const ForwardResult& r,
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

// Every packed case: each batch of `list` with each variant (a seed of its own), on every backend
// (flash on every SIMD target in f32, bf16 and f16; math and reference, which do not depend on
// the target, in f32); f(p, backend, seed) checks one (seed: the next case's). The first
// failure, with its case named.
template <class F>
::testing::AssertionResult all_packed_cases(const std::vector<Batch>& list, F&& f) {
  const std::vector<std::string> targets = simd_targets_supported();
  for (const std::string& target : targets) {
    const ScopedTarget scope(target);
    for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
      for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        if (backend != Backend::flash && (dtype != DType::f32 || target != targets.front()))
          continue;
        std::uint64_t seed = 1;
        for (const Batch& batch : list) {
          for (const VarlenVariant& variant : varlen_variants()) {
            const Packed p = make_packed(batch, dtype, variant, seed++);
            ::testing::AssertionResult r = f(p, backend, seed);
            if (!r) {
              return r << " (" << target << " " << name_of(backend) << " " << name_of(dtype) << " "
                       << variant.name << " batch " << seed << ")";
            }
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// 24 decode rows around a 40-row chunk, 4 kv heads of 2 query heads each (the decode rows'
// groups read K and V in place in runs of kv heads; the chunk's 80 rows, more than one work
// item, pack tiles into panels), and a row past them.
inline Batch decode_rows_around_a_chunk() {
  Batch batch{{}, {}, {}, 1, 3, 8, 4, 32, 32};
  for (int b = 0; b < 25; ++b) {
    batch.lens_q.push_back(b == 12 ? 40 : 1);
    batch.lens_k.push_back(b == 12 ? 100 : 30 + b);
  }
  return batch;
}

// A batch of decode rows and prefill chunks (continuous batching), one sequence long enough for
// split-KV decode (the batch split, the chunk's group one item), one without queries and one
// without keys.
inline Batch mixed_batch() {
  return {{1, 6, 1, 0, 13, 1, 1}, {40, 22, 2600, 7, 13, 0, 301}, {}, 2, 0, 4, 2, 32, 32};
}

inline std::vector<Batch> batches() {
  std::vector<Batch> list;
  list.push_back({{5, 1, 17, 0, 9}, {5, 30, 3, 4, 0}, {}, 0, 0, 2, 1, 16, 16});
  list.push_back({{130, 7}, {129, 200}, {100, 150}, 3, 5, 4, 2, 40, 24});
  list.push_back({{1, 1, 1}, {300, 1, 64}, {}, 0, 2, 8, 2, 64, 64});  // decode-shaped
  list.push_back({{70}, {70}, {}, 2, 0, 3, 3, 59, 59});               // one sequence
  list.push_back(decode_rows_around_a_chunk());
  list.push_back(mixed_batch());
  return list;
}

}  // namespace attncore::test
