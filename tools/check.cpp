// `--check`: a call's results against the reference backend in f64.
//
// The reference runs plain fp64 loops, slow on big problems. Above kFullCheckMaxFlops the check
// covers batch 0 and the first query heads only: whole GQA groups (so dk/dv of the checked key
// heads get every contribution) and at least 2 query heads. The dropout stream position of
// (b = 0, h, i, j) does not depend on B or Hq, so the slice sees the same dropout mask.
#include "check.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attncore_tools {

using attncore::Backend;
using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;

namespace {

// ~0.4 s of reference forward (~2.6 GFLOP/s measured on 2 Zen 5 cores), ~1 s with backward.
constexpr double kFullCheckMaxFlops = 1e9;

struct CheckScope {
  std::int64_t batch, heads_q, heads_kv;
  bool full;
  std::string describe() const {
    if (full) return "all";
    return "batch 0, query heads 0-" + std::to_string(heads_q - 1) + ", key/value heads 0-" +
           std::to_string(heads_kv - 1);
  }
};

CheckScope check_scope(const RunConfig& c) {
  const double all_pairs = static_cast<double>(c.batch) * static_cast<double>(c.heads_q) *
                           static_cast<double>(c.seqlen_q) * static_cast<double>(c.seqlen_k);
  const double cost = 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * all_pairs;
  if (cost <= kFullCheckMaxFlops || c.heads_kv == 0 || c.heads_q % c.heads_kv != 0) {
    return {c.batch, c.heads_q, c.heads_kv, true};
  }
  constexpr std::int64_t kMinHeads = 2;
  const std::int64_t group = c.heads_q / c.heads_kv;
  const std::int64_t groups = std::min(c.heads_kv, (kMinHeads + group - 1) / group);
  CheckScope s{std::min<std::int64_t>(c.batch, 1), groups * group, groups, false};
  s.full = s.batch == c.batch && s.heads_q == c.heads_q;
  return s;
}

// The leading [batch, heads] block of a [B, H, ...] view.
TensorView leading(const TensorView& t, std::int64_t batch, std::int64_t heads) {
  TensorView s = t;
  s.shape[0] = batch;
  s.shape[1] = heads;
  return s;
}

Tensor to_f64(const TensorView& t) {
  Tensor out(DType::f64, t.shape.data(), t.rank);
  std::int64_t i = 0;
  for_each_offset(t, [&](std::int64_t off) { store(out, i++, load(t, off)); });
  return out;
}

// The larger of two errors, NaN if either is NaN (a NaN result is never "small").
double max_err(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return std::max(a, b);
}

// max |a - b| over a strided view `a` and a contiguous f64 tensor `b` of the same shape.
double max_abs_diff(const TensorView& a, const Tensor& b) {
  double err = 0;
  std::int64_t i = 0;
  for_each_offset(
      a, [&](std::int64_t off) { err = max_err(err, std::abs(load(a, off) - load(b, i++))); });
  return err;
}

}  // namespace

CheckResult check_against_reference(const PreparedCall& p, const TensorView& out, const Tensor* dq,
                                    const Tensor* dk, const Tensor* dv) {
  const CheckScope s = check_scope(p.cfg);
  const Tensor q = to_f64(leading(p.q, s.batch, s.heads_q));
  const Tensor k = to_f64(leading(p.k, s.batch, s.heads_kv));
  const Tensor v = to_f64(leading(p.v, s.batch, s.heads_kv));
  attncore::Options o = p.options;
  if (o.alibi_slopes) o.alibi_slopes->shape[0] = s.heads_q;  // [Hq]: the first heads' slopes
  const attncore::ForwardResult ref = attncore::forward(q, k, v, o, Backend::reference);
  CheckResult r;
  r.scope = s.describe();
  r.full = s.full;
  r.out_err = max_abs_diff(leading(out, s.batch, s.heads_q), ref.out);
  if (dq != nullptr) {
    const Tensor dout = to_f64(leading(p.dout, s.batch, s.heads_q));
    const attncore::BackwardResult g =
        attncore::backward(dout, q, k, v, ref.out, ref.lse, o, Backend::reference);
    r.grad_err = max_err(max_abs_diff(leading(*dq, s.batch, s.heads_q), g.dq),
                         max_err(max_abs_diff(leading(*dk, s.batch, s.heads_kv), g.dk),
                                 max_abs_diff(leading(*dv, s.batch, s.heads_kv), g.dv)));
  }
  return r;
}

}  // namespace attncore_tools
