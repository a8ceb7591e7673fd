// The sequence-info policy resolved for one sequence (docs/design.md section 1, variable-length
// batches): sequence b of a call as a dense call of its own lengths, with its views rebased to
// the sequence's first rows. The batch index keeps its meaning (ALiBi slopes, dropout
// addresses); varlen views have a batch stride of 0, so b addresses no memory.
//
// Backends resolve once per work item; a dense call resolves to itself.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/params.h"

namespace attncore::detail {

// Rows [first, first + count) of dim 2 of a rank-3 or rank-4 view.
inline TensorView rows_of(const TensorView& t, std::int64_t first, std::int64_t count) {
  if (t.data == nullptr) return t;
  TensorView r = t;
  r.data = static_cast<char*>(t.data) +
           first * t.stride[2] * static_cast<std::int64_t>(size_of(t.dtype));
  r.shape[2] = count;
  return r;
}

// Params of sequence b: dense, its own lengths; a paged sequence keeps where its keys are in
// kv_pages. Dropout keeps the call's addressing.
inline Params sequence_params(const Params& p, const SeqSpan& s) {
  Params r = p;
  const std::int64_t page_size = p.seq.page_size;
  r.seq = SeqInfo{};
  r.seq.lq = s.lq;
  r.seq.lk = s.lk;
  if (s.pages != nullptr) r.kv_pages = KvPages{s.pages, page_size, s.k0};
  return r;
}

// Key rows [first, first + count) of K or V; with kv_batch >= 0, of batch row kv_batch (the
// view's batch stride becomes 0: the sequence's own index b then addresses no memory). A
// paged sequence's K/V stay the page pools (its keys are found through Params::kv_pages).
inline TensorView kv_rows_of(const TensorView& t, const SeqSpan& s) {
  if (s.pages != nullptr) return t;
  TensorView r = rows_of(t, s.k0, s.lk);
  if (s.kv_batch >= 0 && r.data != nullptr) {
    r.data = static_cast<char*>(r.data) +
             s.kv_batch * r.stride[0] * static_cast<std::int64_t>(size_of(r.dtype));
    r.stride[0] = 0;
  }
  return r;
}

inline ForwardArgs sequence_args(const ForwardArgs& a, const SeqSpan& s) {
  return {rows_of(a.q, s.q0, s.lq), kv_rows_of(a.k, s), kv_rows_of(a.v, s),
          rows_of(a.out, s.q0, s.lq), rows_of(a.lse, s.q0, s.lq)};
}

inline BackwardArgs sequence_args(const BackwardArgs& a, const SeqSpan& s) {
  return {rows_of(a.dout, s.q0, s.lq), rows_of(a.q, s.q0, s.lq),
          kv_rows_of(a.k, s),          kv_rows_of(a.v, s),
          rows_of(a.out, s.q0, s.lq),  rows_of(a.lse, s.q0, s.lq),
          rows_of(a.dq, s.q0, s.lq),   kv_rows_of(a.dk, s),
          kv_rows_of(a.dv, s),         a.dbias};
}

// The element offset of (batch b, kv head h, key j, dim 0) in K or V of a resolved sequence,
// paged or not: for a paged one, row (first + j) % page_size of page
// pages[(first + j) / page_size] (b addresses nothing).
inline std::int64_t kv_offset(const Params& p, const TensorView& t, std::int64_t b, std::int64_t h,
                              std::int64_t j) {
  if (!p.kv_pages.paged()) return b * t.stride[0] + h * t.stride[1] + j * t.stride[2];
  const std::int64_t slot = p.kv_pages.first + j;
  return p.kv_pages.pages[slot / p.kv_pages.page_size] * t.stride[0] + h * t.stride[1] +
         (slot % p.kv_pages.page_size) * t.stride[2];
}

// A call's sequence b, resolved: what a backend's work item runs on.
template <class Args>
struct Sequence {
  Params p;
  Args a;
};

template <class Args>
Sequence<Args> resolve_sequence(const Params& p, const Args& a, std::int64_t b) {
  if (!p.seq.per_sequence()) return {p, a};
  const SeqSpan s = p.seq.at(b);
  return {sequence_params(p, s), sequence_args(a, s)};
}

// For backends that want plain K/V views: a paged sequence's K and V copied row by row (same
// dtype, so the same bits) into k_rows [1, Hkv, Lk, D] and v_rows [1, Hkv, Lk, Dv] (batch
// stride 0), its Params made unpaged. Anything else is returned as it is.
Sequence<ForwardArgs> gather_kv_pages(const Params& p, const ForwardArgs& a, Tensor* k_rows,
                                      Tensor* v_rows);

// A varlen or cache call seen as a dense batch of the same number of sequences, query rows and
// (query, key) pairs: Lq = the mean query length, Lk = pairs / query rows (rounded). What the
// cost model prices; a dense call is itself.
inline Params dense_equivalent(const Params& p) {
  if (!p.seq.per_sequence()) return p;
  double rows = 0, pairs = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const SeqSpan s = p.seq.at(b);
    rows += static_cast<double>(s.lq);
    pairs += static_cast<double>(s.lq) * static_cast<double>(s.lk);
  }
  const double batch = static_cast<double>(std::max<std::int64_t>(p.batch, 1));
  const SeqSpan mean{0, static_cast<std::int64_t>(std::llround(rows / batch)), 0,
                     rows > 0 ? static_cast<std::int64_t>(std::llround(pairs / rows)) : 0};
  return sequence_params(p, mean);
}

// Varlen calls: rows of the buffers that belong to no sequence (past cu_seqlens_q[-1]; keys
// past cu_seqlens_k[-1] or between seqused_k[b] and the next sequence) get what docs/design.md
// section 1 says: output 0 and LSE -inf; zero dq, dk, dv. Dense calls: nothing to do.
void fill_unused_rows(const Params& p, const ForwardArgs& a);
void fill_unused_rows(const Params& p, const BackwardArgs& a);

}  // namespace attncore::detail

namespace attncore::detail {

// Runs f(params, args, b_begin, b_end) over the call: once over the whole batch for a dense
// call; once per sequence for a varlen or cache call, each resolved (f then sees
// b_end = b_begin + 1).
template <class Args, class F>
void for_each_sequence(const Params& p, const Args& a, F&& f) {
  if (!p.seq.per_sequence()) {
    f(p, a, std::int64_t{0}, p.batch);
    return;
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const Sequence<Args> s = resolve_sequence(p, a, b);
    f(s.p, s.a, b, b + 1);
  }
}

}  // namespace attncore::detail
