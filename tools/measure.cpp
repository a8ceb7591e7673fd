// One timed (and optionally checked) call, and the FLOP counts of docs/design.md section 5.
#include "measure.h"

#include <algorithm>
#include <chrono>
#include <limits>

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::Tensor;

namespace {

// (query, key) pairs of one sequence and head that causal and window masks leave visible.
double sequence_pairs(const RunConfig& c, std::int64_t lq, std::int64_t lk) {
  const std::int64_t shift = lk - lq;
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

}  // namespace

double visible_pairs(const RunConfig& c) {
  if (!c.is_varlen())
    return static_cast<double>(c.batch) * sequence_pairs(c, c.seqlen_q, c.seqlen_k);
  double pairs = 0;
  for (std::size_t b = 0; b < c.varlen.size(); ++b) {
    pairs += sequence_pairs(c, c.varlen[b], c.used_k()[b]);
  }
  return pairs;
}

double forward_flops(const RunConfig& c) {
  return 2.0 * static_cast<double>(c.head_dim + c.head_dim_v) * static_cast<double>(c.heads_q) *
         visible_pairs(c);
}

double gflops(double flops, double seconds) {
  return flops > 0 && seconds > 0 ? flops / seconds * 1e-9 : 0.0;
}

RunResult run_once(const PreparedCall& p) {
  const RunConfig& c = p.cfg;
  if (c.is_cache()) return run_cache(p);
  const CallViews shapes = c.views(nullptr);
  const Tensor out = allocate_like(shapes.out);
  const Tensor lse = allocate_like(shapes.lse);
  RunResult r;
  // What `auto` runs: the library's choice depends only on the call and the machine, so
  // explaining the same call names the backend the timed calls run.
  r.backend = r.bwd_backend = c.backend;
  if (c.backend == Backend::automatic) {
    r.backend = c.is_varlen()
                    ? attncore::explain_forward_varlen(p.q, p.k, p.v, p.seqs, p.options).chosen
                    : attncore::explain_forward(p.q, p.k, p.v, p.options).chosen;
  }
  r.flops = forward_flops(c);
  r.seconds = best_seconds(c.repeat, [&] {
    if (c.is_varlen()) {
      attncore::forward_varlen_into(p.q, p.k, p.v, p.seqs, out, lse.view(), p.options, c.backend);
    } else {
      attncore::forward_into(p.q, p.k, p.v, out, lse.view(), p.options, c.backend);
    }
  });
  Tensor dq, dk, dv;
  if (c.backward) {
    dq = allocate_like(shapes.q);
    dk = allocate_like(shapes.k);
    dv = allocate_like(shapes.v);
    if (c.backend == Backend::automatic) {
      r.bwd_backend =
          c.is_varlen()
              ? attncore::explain_backward_varlen(p.dout, p.q, p.k, p.v, out, lse, p.seqs,
                                                  p.options)
                    .chosen
              : attncore::explain_backward(p.dout, p.q, p.k, p.v, out, lse, p.options).chosen;
    }
    r.bwd_flops = kBackwardFlopFactor * r.flops;
    r.bwd_seconds = best_seconds(c.repeat, [&] {
      if (c.is_varlen()) {
        attncore::backward_varlen_into(p.dout, p.q, p.k, p.v, out, lse, p.seqs, dq, dk, dv,
                                       p.options, c.backend);
      } else {
        attncore::backward_into(p.dout, p.q, p.k, p.v, out, lse, dq, dk, dv, std::nullopt,
                                p.options, c.backend);
      }
    });
  }
  if (c.check) {
    r.check = c.backward ? check_against_reference(p, out, &dq, &dk, &dv)
                         : check_against_reference(p, out, nullptr, nullptr, nullptr);
  }
  return r;
}

}  // namespace attncore_tools
