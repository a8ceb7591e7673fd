// Rows of a varlen call's buffers that belong to no sequence, and a paged sequence gathered
// into plain K/V rows (core/sequence.h).
#include "core/sequence.h"

#include <cmath>
#include <cstring>
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

// Rows of a paged K or V view ([num_pages, H, page_size, width]) of sequence p into dst
// [1, H, Lk, width], contiguous.
void gather_rows(const Params& p, const TensorView& pool, std::int64_t width, Tensor* dst) {
  const std::int64_t heads = pool.shape[1], lk = p.seq.lk;
  *dst = Tensor(pool.dtype, {1, heads, lk, width});
  const auto row_bytes = static_cast<std::size_t>(width) * size_of(pool.dtype);
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t j = 0; j < lk; ++j) {
      std::memcpy(
          static_cast<char*>(dst->data()) + (h * lk + j) * static_cast<std::int64_t>(row_bytes),
          static_cast<const char*>(pool.data) +
              kv_offset(p, pool, 0, h, j) * static_cast<std::int64_t>(size_of(pool.dtype)),
          row_bytes);
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

Sequence<ForwardArgs> gather_kv_pages(const Params& p, const ForwardArgs& a, Tensor* k_rows,
                                      Tensor* v_rows) {
  if (!p.kv_pages.paged()) return {p, a};
  gather_rows(p, a.k, p.head_dim, k_rows);
  gather_rows(p, a.v, p.head_dim_v, v_rows);
  Sequence<ForwardArgs> r{p, a};
  r.p.kv_pages = KvPages{};
  r.a.k = k_rows->view();
  r.a.v = v_rows->view();
  r.a.k.stride[0] = r.a.v.stride[0] = 0;
  return r;
}

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
