// One timed (and optionally checked) call, and the FLOP counts of docs/design.md section 5.
#include "measure.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::Tensor;

namespace {

// Integers past int64 without overflow: sequence lengths and windows come from flags (up to
// 2^63 - 1 each), and counts of pairs reach their product.
__extension__ typedef __int128 Wide;

// Pairs (i, j), 0 <= i < lq, 0 <= j < lk, with j - i <= d. Row i holds clamp(i + d + 1, 0, lk)
// of them: none before row `first`, all lk from row `full` on, i + d + 1 in between.
Wide pairs_up_to_diagonal(Wide lq, Wide lk, Wide d) {
  const Wide first = std::clamp(-d, Wide{0}, lq);
  const Wide full = std::clamp(lk - 1 - d, first, lq);
  // Rows [first, full): an arithmetic series from first + d + 1 to full + d.
  const Wide between = (full - first) * ((first + d + 1) + (full + d)) / 2;
  return between + (lq - full) * lk;
}

// The diagonals a sequence's rows see, as causal and window masks leave them: row i sees the
// keys j with lo <= j - i <= hi (the windows are aligned to the bottom-right diagonal j - i =
// lk - lq, as in the library).
struct Diagonals {
  Wide lo, hi;
};
Diagonals visible_diagonals(const RunConfig& c, std::int64_t lq, std::int64_t lk) {
  const Wide shift = Wide{lk} - lq;
  Wide lo = -Wide{lq}, hi = lk;  // no bound: every key of every row
  if (c.causal == Causal::upper_left) hi = std::min(hi, Wide{0});
  if (c.causal == Causal::lower_right) hi = std::min(hi, shift);
  if (c.window.left >= 0) lo = std::max(lo, shift - c.window.left);
  if (c.window.right >= 0) hi = std::min(hi, shift + c.window.right);
  return {lo, hi};
}

// (query, key) pairs of one sequence and head left visible, counted in closed form.
double sequence_pairs(const RunConfig& c, std::int64_t lq, std::int64_t lk) {
  if (lq <= 0 || lk <= 0) return 0;
  const auto [lo, hi] = visible_diagonals(c, lq, lk);
  if (hi < lo) return 0;
  return static_cast<double>(pairs_up_to_diagonal(lq, lk, hi) -
                             pairs_up_to_diagonal(lq, lk, lo - 1));
}

// Keys of one sequence that some row sees: key j is seen by a row i in [0, lq) with lo <= j -
// i <= hi, so j runs from max(0, lo) to min(lk - 1, lq - 1 + hi).
double sequence_keys(const RunConfig& c, std::int64_t lq, std::int64_t lk) {
  if (lq <= 0 || lk <= 0) return 0;
  const auto [lo, hi] = visible_diagonals(c, lq, lk);
  if (hi < lo) return 0;
  const Wide first = std::max(Wide{0}, lo), last = std::min(Wide{lk} - 1, Wide{lq} - 1 + hi);
  return last < first ? 0 : static_cast<double>(last - first + 1);
}

// `per_sequence` summed over the batch's sequences.
double over_sequences(const RunConfig& c,
                      double (*per_sequence)(const RunConfig&, std::int64_t, std::int64_t)) {
  if (!c.is_varlen()) return static_cast<double>(c.batch) * per_sequence(c, c.seqlen_q, c.seqlen_k);
  double sum = 0;
  for (std::size_t b = 0; b < c.varlen.size(); ++b) {
    sum += per_sequence(c, c.varlen[b], c.used_k()[b]);
  }
  return sum;
}

}  // namespace

double visible_pairs(const RunConfig& c) { return over_sequences(c, sequence_pairs); }

double visible_keys(const RunConfig& c) { return over_sequences(c, sequence_keys); }

double forward_flops(const RunConfig& c) {
  return 2.0 * (static_cast<double>(c.head_dim) + static_cast<double>(c.head_dim_v)) *
         static_cast<double>(c.heads_q) * visible_pairs(c);
}

double gflops(double flops, double seconds) {
  return flops > 0 && seconds > 0 ? flops / seconds * 1e-9 : 0.0;
}

double fma_peak_gflops(int threads) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());  // 0: unknown
  return attncore::measure_fma_peak_gflops(cores > 0 ? std::min(threads, cores) : threads);
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
    r.backend = c.is_varlen() ? attncore::explain_forward_varlen(p.q, p.call_k(), p.call_v(),
                                                                 p.call_seqs(), p.options)
                                    .chosen
                              : attncore::explain_forward(p.q, p.k, p.v, p.options).chosen;
  }
  r.flops = forward_flops(c);
  r.seconds = best_seconds(c.repeat, [&] {
    if (c.is_varlen()) {  // (over page pools with --page-size)
      attncore::forward_varlen_into(p.q, p.call_k(), p.call_v(), p.call_seqs(), out, lse.view(),
                                    p.options, c.backend);
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
