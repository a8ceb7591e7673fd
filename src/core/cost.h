// Pieces every backend's cost term shares (src/cpu/*_cost.cpp): the call's sizes as doubles,
// the visible pairs of the causal/window band, and the time of a parallel region.
//
// Times are sums of terms of the form work / (rate of one thread), divided by the threads
// that get work, plus fixed costs per call. Every factor carries the measurement that fitted
// it, taken with `attncore run --json --threads 1` (median of 3 interleaved passes, best of 5
// calls each; tiny shapes best of 50) on 2 cores of an AMD EPYC (Zen 5, avx512bf16 target), with
// the constants measured by the same build (`attncore explain
// --json`: FMA 224 GFLOP/s, memory 23 GB/s, softmax 183 M elements/s per thread).
#pragma once

#include <algorithm>
#include <cmath>

#include "core/backend_table.h"
#include "policy/mask.h"

namespace attncore::detail {

// The backward's FLOPs over the forward's (docs/design.md section 5).
constexpr double kBackwardFlops = 2.5;

inline double round_up_to(double x, double m) { return std::ceil(x / m) * m; }

// (query, key) pairs of one head of one dense sequence that causal and window masks leave
// visible (tensor masks are data and are not discounted). Exact up to 64 rows, else 64 evenly
// spaced rows scaled.
inline double visible_pairs(const Params& p) {
  const double all = static_cast<double>(p.seq.lq) * static_cast<double>(p.seq.lk);
  if (p.causal == Causal::none && p.window_left < 0 && p.window_right < 0) return all;
  const CausalWindowMask mask(p);
  constexpr std::int64_t kSamples = 64;
  if (p.seq.lq <= kSamples) return static_cast<double>(mask.visible_pairs());
  double sum = 0;
  // Row (2s + 1) Lq / 128, formed without the product (Lq may be near 2^63 in an empty batch).
  const std::int64_t whole = p.seq.lq / (2 * kSamples), rest = p.seq.lq % (2 * kSamples);
  for (std::int64_t s = 0; s < kSamples; ++s) {
    const KeyRange r = mask.row((2 * s + 1) * whole + (2 * s + 1) * rest / (2 * kSamples));
    sum += static_cast<double>(r.end - r.begin);
  }
  return sum * static_cast<double>(p.seq.lq) / kSamples;
}

// The call's sizes as the cost terms use them (a varlen call arrives as its dense equivalent,
// core/sequence.h).
struct Sizes {
  double batch, heads_q, heads_kv, lq, lk, dims;
  double element, kv_element;  // bytes of an element of q and out; of k and v (a 16-bit cache)
  double threads;
};

inline Sizes sizes_of(const Params& p, const Launch& launch) {
  return {static_cast<double>(p.batch),
          static_cast<double>(p.heads_q),
          static_cast<double>(p.heads_kv),
          static_cast<double>(p.seq.lq),
          static_cast<double>(p.seq.lk),
          static_cast<double>(p.head_dim + p.head_dim_v),
          static_cast<double>(size_of(p.dtype)),
          static_cast<double>(size_of(p.kv_dtype)),
          static_cast<double>(std::max(1, launch.threads))};
}

// A parallel region of `work` seconds on one thread: the caller starts at once and helpers
// once awake (`wake` seconds on), so it takes work / threads + wake * (1 - 1 / threads), and
// never more than `work` (the caller takes every task when the helpers are late: threadpool.cpp).
inline double parallel_seconds(double work, double threads, double wake) {
  if (threads <= 1) return work;
  return std::min(work, work / threads + wake * (1 - 1 / threads));
}

}  // namespace attncore::detail
