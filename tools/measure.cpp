// One timed (and optionally checked) call, and the FLOP counts of DESIGN.md section 5.
#include "measure.h"

#include <algorithm>
#include <chrono>
#include <limits>

namespace attncore_tools {

using attncore::Causal;
using attncore::DType;
using attncore::Tensor;

namespace {

// (query, key) pairs of one head that causal and window masks leave visible.
double visible_pairs(const RunConfig& c) {
  const std::int64_t lq = c.seqlen_q, lk = c.seqlen_k, shift = lk - lq;
  double pairs = 0;
  for (std::int64_t i = 0; i < lq; ++i) {
    std::int64_t lo = 0, hi = lk - 1;  // inclusive
    if (c.causal == Causal::upper_left) hi = std::min(hi, i);
    if (c.causal == Causal::lower_right) hi = std::min(hi, i + shift);
    if (c.window.left >= 0) lo = std::max(lo, i + shift - c.window.left);
    if (c.window.right >= 0) hi = std::min(hi, i + shift + c.window.right);
    if (hi >= lo) pairs += static_cast<double>(hi - lo + 1);
  }
  return pairs;
}

template <class F>
double best_seconds(int repeat, F&& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

}  // namespace

double forward_flops(const RunConfig& c) {
  return 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * static_cast<double>(c.batch) *
         static_cast<double>(c.heads_q) * visible_pairs(c);
}

double gflops(double flops, double seconds) {
  return flops > 0 && seconds > 0 ? flops / seconds * 1e-9 : 0.0;
}

RunResult run_once(const PreparedCall& p) {
  const RunConfig& c = p.cfg;
  Tensor out(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v});
  Tensor lse(DType::f32, {c.batch, c.heads_q, c.seqlen_q});
  RunResult r;
  r.flops = forward_flops(c);
  r.seconds = best_seconds(c.repeat, [&] {
    attncore::forward_into(p.q, p.k, p.v, out, lse.view(), p.options, c.backend);
  });
  Tensor dq, dk, dv;
  if (c.backward) {
    dq = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim});
    dk = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim});
    dv = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim_v});
    r.bwd_flops = kBackwardFlopFactor * r.flops;
    r.bwd_seconds = best_seconds(c.repeat, [&] {
      attncore::backward_into(p.dout, p.q, p.k, p.v, out, lse, dq, dk, dv, std::nullopt, p.options,
                              c.backend);
    });
  }
  if (c.check) {
    r.check = c.backward ? check_against_reference(p, out, &dq, &dk, &dv)
                         : check_against_reference(p, out, nullptr, nullptr, nullptr);
  }
  return r;
}

}  // namespace attncore_tools
