// One timed (and optionally checked) call, and the FLOP counts its rates are based on.
//
// FLOPs (docs/design.md section 5): forward 2*(D + Dv) per visible (query, key) pair and head, that
// is 4*B*Hq*Lq*Lk*D with no mask and Dv = D; backward 2.5x forward. "Visible" counts the pairs
// that causal and window masks leave; a boolean mask is data, not structure, and is not
// discounted (its pairs are counted as visible). A packed batch counts each sequence's own pairs
// (its Lq_b queries against its used keys, causal and window aligned per sequence).
#pragma once

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>

#include "check.h"
#include "inputs.h"
#include "run_config.h"

namespace attncore_tools {

double forward_flops(const RunConfig& c);
// (query, key) pairs of one head that causal and window masks leave visible, over the whole
// batch (B times one sequence's for a dense call; the sum over the sequences of a packed one).
double visible_pairs(const RunConfig& c);
// Keys some query row sees, summed over the sequences (not over heads): what a forward must
// read of K and V, per kv head.
double visible_keys(const RunConfig& c);
constexpr double kBackwardFlopFactor = 2.5;  // docs/design.md section 5

// FLOPs over seconds in GFLOP/s; 0 when either is 0.
double gflops(double flops, double seconds);

// The f32 FMA peak (attncore::measure_fma_peak_gflops) of `threads` threads, measured on at
// most as many threads as the machine has logical cores: more threads than cores share them
// and reach no higher peak, and each one only lengthens the measurement (1024 threads on 2
// cores took minutes).
double fma_peak_gflops(int threads);

// The shortest of `repeat` timed calls of f, in seconds.
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

struct RunResult {
  // The backends that ran the forward and the backward: cfg.backend, or the one `auto` chose.
  attncore::Backend backend = attncore::Backend::automatic;
  attncore::Backend bwd_backend = attncore::Backend::automatic;
  double flops = 0, seconds = 0;
  double bwd_flops = 0, bwd_seconds = 0;
  std::optional<CheckResult> check;
  double kv_bytes = 0;  // a cache call: the K/V bytes one call reads (each key some row sees, once)
};

// Times the forward (and with cfg.backward the backward) on cfg.backend, best of cfg.repeat
// calls each, then checks the results when cfg.check asks for it. Dense calls go through
// forward_into / backward_into, packed ones through forward_varlen_into / backward_varlen_into.
RunResult run_once(const PreparedCall& p);

// A KV-cache call (cfg.is_cache(), cache_call.cpp): the first cache_len rows of each
// sequence's p.k / p.v go into a dense or paged cache, the last new_tokens rows are appended by
// each timed call (at the same slots every time), and the result is checked against p as the
// dense call it equals.
RunResult run_cache(const PreparedCall& p);
// The bytes a cache call allocates beside its tensors: its K and V caches (cache_storage), the
// page order and block table, and its lengths.
double cache_bytes(const RunConfig& c);
// A cache call's K (width D) or V (width Dv) cache over `data`, as run_cache holds it:
// [B (dense) or B * pages per sequence (paged), slots (capacity or page size), Hkv, width],
// contiguous; the library takes its transposed(1, 2).
attncore::TensorView cache_storage(const RunConfig& c, std::int64_t width, void* data);
// A cache call's int32 arrays into p, from p.cfg: p.cache_seqlens (cache_len for each sequence)
// and, paged, p.block_table (each sequence's pages in the run's order, page_order), both viewed
// by p.cache_seqs.
void add_cache_seqs(PreparedCall& p);

}  // namespace attncore_tools
