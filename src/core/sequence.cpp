// Rows of a varlen call's buffers that belong to no sequence (core/sequence.h).
#include "core/sequence.h"

#include <cmath>
#include <vector>

#include "core/convert.h"

namespace attncore::detail {

namespace {

// Writes `value` into rows [begin, end) of dim 2 of a rank-4 view, every head.
void fill_rows(const TensorView& t, std::int64_t begin, std::int64_t end, float value) {
  if (t.data == nullptr || begin >= end) return;
  const std::vector<float> row(static_cast<std::size_t>(t.shape[3]), value);
  for (std::int64_t h = 0; h < t.shape[1]; ++h) {
    for (std::int64_t r = begin; r < end; ++r) {
      store_row(row.data(), t.shape[3], t.data, t.dtype, offset4(t, 0, h, r, 0));
    }
  }
}

// Rank-3 [1, Hq, rows] views (the LSE).
void fill_lse(const TensorView& t, std::int64_t begin, std::int64_t end) {
  if (t.data == nullptr) return;
  for (std::int64_t h = 0; h < t.shape[1]; ++h) {
    for (std::int64_t r = begin; r < end; ++r) {
      store_element(t.data, t.dtype, h * t.stride[1] + r * t.stride[2], -INFINITY);
    }
  }
}

// Calls f(begin, end) for each run of key rows no sequence uses.
template <class F>
void for_each_unused_key_run(const Params& p, F&& f) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const SeqSpan s = p.seq.at(b);
    f(s.k0 + s.lk, std::int64_t{p.seq.cu_k[b + 1]});
  }
  f(std::int64_t{p.seq.cu_k[p.batch]}, p.seq.rows_k);
}

}  // namespace

void fill_unused_rows(const Params& p, const ForwardArgs& a) {
  if (!p.seq.varlen()) return;
  const std::int64_t end = p.seq.cu_q[p.batch];
  fill_rows(a.out, end, p.seq.rows_q, 0.0f);
  fill_lse(a.lse, end, p.seq.rows_q);
}

void fill_unused_rows(const Params& p, const BackwardArgs& a) {
  if (!p.seq.varlen()) return;
  fill_rows(a.dq, p.seq.cu_q[p.batch], p.seq.rows_q, 0.0f);
  for_each_unused_key_run(p, [&](std::int64_t begin, std::int64_t end) {
    fill_rows(a.dk, begin, end, 0.0f);
    fill_rows(a.dv, begin, end, 0.0f);
  });
}

}  // namespace attncore::detail
