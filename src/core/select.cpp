// Backend selection: each backend's limits (can_use), the cost model, the thread-local enabled
// list and the choice. Messages follow DESIGN.md section 4.
#include "core/select.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "attncore/error.h"
#include "attncore/info.h"
#include "core/cpu_info.h"
#include "core/threadpool.h"
#include "core/validate.h"
#include "cpu/flash.h"
#include "cpu/math.h"
#include "policy/mask.h"
#include "policy/score_row.h"

namespace attncore {

namespace detail {

namespace {

// Every backend of this build, in the default priority order.
constexpr Backend kAllBackends[] = {Backend::flash, Backend::math, Backend::reference};

bool is_backend(Backend b) {
  return std::find(std::begin(kAllBackends), std::end(kAllBackends), b) != std::end(kAllBackends);
}

std::string list_string(const std::vector<Backend>& backends) {
  std::string s = "[";
  for (std::size_t i = 0; i < backends.size(); ++i) {
    s += (i ? ", " : "") + std::string(name_of(backends[i]));
  }
  return s + "]";
}

std::string join(const std::vector<std::string>& parts, const char* separator) {
  std::string s;
  for (const std::string& part : parts) s += (s.empty() ? "" : separator) + part;
  return s;
}

thread_local std::vector<Backend> t_enabled(std::begin(kAllBackends), std::end(kAllBackends));

// ---------------------------------------------------------------------------------------------
// The cost model. Times are sums of terms of the form work / (rate of one thread), divided by
// the threads that get work, plus fixed costs per call. Work counts what each backend really
// does: flash visits only the key tiles a causal/window band reaches, padded to whole tiles;
// math computes every (query, key) pair and runs std::exp on each, and its backward writes and
// reads two Lq x Lk matrices per head.
//
// Efficiency factors, fitted to `attncore run --json --threads 1` times (median of 3
// interleaved passes, best of 5 calls each; tiny shapes best of 50) on the development machine
// (2 vCPUs of a shared AMD EPYC, Zen 5, avx512bf16 target), with the constants measured by the
// same build (`attncore explain --json`: FMA 224 GFLOP/s, memory 23 GB/s, softmax 183 M
// elements/s per thread). Two shapes that differ only in D give two equations per backend:
// B=1 Hq=8 L=2048 D=128 and D=64 (forward), Hq=4 (backward).

// flash: packing K and V (and in the backward q and dO) into tiles, per element of the padded
// tiles, in FMA-equivalent flops, for f32 tiles and for bf16 pairs: decode B=1 Hq=8 Lq=1 Lk=128
// D=128 (262144 packed elements, in cache) took 51 us in f32 and 23 us in bf16, 27 and 8 us
// beyond the products (perf: pack_tile 54% and 46% of the call).
constexpr double kFlashPackFlops[] = {25, 8};  // f32 tiles, bf16 pairs
// flash forward, decode items of at most one micro-tile of rows on f32 tiles (DirectKv: K and V
// read in place, rows not padded): per K/V element, B=1 Hq=8 Lq=1 D=128 Lk=128 took 26.5 us
// and Lk=1024 196 us (in cache, 240 GFLOP/s), 20.6 and 19.7 flops an element beyond the rest.
constexpr double kFlashDirectFlops = 20;
// flash backward: the same per packed element (q and dO rows, K in two layouts, V in one) with
// each run's dK and dV reduced and stored: B=1 Hq=8 D=64 f32 L=32 took 118 us, L=64 285 us,
// 39 and 82 us beyond the other terms for 81920 and 163840 elements: 114 and 118 flops at 237
// GFLOP/s (bf16 L=32: 124). The term is 2% of the L=2048 backward.
constexpr double kFlashBackwardPackFlops = 115;
// flash: K and V read from memory when the call's K and V exceed this (below, a call that
// repeats finds them in the caches: L2 + L3 of the development machine hold 33 MiB), at this
// share of the measured bandwidth (packing and reading overlap): decode B=4 Hq=32 Hkv=8 Lq=1
// Lk=4096 D=128 (134 MB of f32, 67 MB of bf16) took 8.5 and 4.6 ms, 5.5 and 2.8 ms beyond the
// products, at 35.7 GB/s measured: 0.68 and 0.67.
constexpr double kFlashCachedBytes = 8 << 20;
constexpr double kFlashStreamEfficiency = 0.68;
// flash: the extra cost of a query row in a tile that mask code cuts (the band's edge, or the
// last tile when it is short), FMA-equivalent flops (its scalar mask loop and the row's fixed
// softmax work, which a full tile spreads over 128 keys): B=1 Hq=8 D=64 L=32 (256 rows, every
// tile cut) took 48.8 us in f32 and 32.2 us in bf16, 26 and 18 us beyond the other terms; L=64
// (512 rows) 125 and 82 us, 53 and 35 us beyond: 24.8K and 25K flops a row in f32, 17K and
// 16.5K in bf16, at 241 GFLOP/s (per row, not per pair: the per-pair fits disagreed 2x).
constexpr double kFlashCutRowFlops[] = {25000, 17000};  // f32 tiles, bf16 pairs
// flash forward: D=128 108 ms, D=64 61.8 ms: 0.88 of the FMA peak on the products, and 106
// FMA-equivalent flops per score for the online softmax (exp2 polynomial, max, sum, rescale).
constexpr double kFlashEfficiency = 0.88;
constexpr double kFlashSoftmaxFlops = 106;
// flash forward with native bf16 dot products (vdpbf16ps: twice the flops of an FMA): bf16
// D=128 65.8 ms, with the softmax term above: 1.67 of the f32 FMA peak.
constexpr double kFlashBf16DotEfficiency = 1.67;
// flash backward (2.5x the forward's flops), for f32 tiles and for bf16 pairs on native dots:
// B=1 Hq=16 L=2048, medians of 3 at 237 GFLOP/s: f32 D=128 427 ms, D=64 215 ms: 0.854 of the
// peak and 10 flops a pair beyond the products; bf16 244 and 128 ms: 1.56 and 42.
constexpr double kFlashBackwardEfficiency[] = {0.854, 1.56};
constexpr double kFlashBackwardSoftmaxFlops[] = {10, 42};

// math: OpenBLAS sgemm's share of the FMA peak on the attention GEMMs (blocks of 128 query
// rows), and the cost of one score in elements of the measured softmax row (scale, masks,
// softmax, LSE): forward D=128 336 ms, D=64 246 ms: 0.455 and 0.85.
constexpr double kMathGemmEfficiency = 0.455;
constexpr double kMathSoftmaxCost = 0.85;
// math: the fixed cost of one query row (softmax_row's log and division, the row's setup) in
// softmax-row elements: B=1 Hq=8 L=32 D=64 took 73 us (1 thread), about 10 us (256 rows)
// beyond the other terms; B=1 Hq=1 L=16: 3.4 us.
constexpr double kMathRowCost = 10;
// math: converting one 16-bit element to f32, in FMA-equivalent flops: decode B=1 Hq=8 Lq=1
// Lk=128 D=128 took 0.32 ms in bf16 and 0.08 ms in f32, 0.92 ns more for each of the 262144
// converted elements; B=4 Hq=32 Hkv=8 Lq=1 Lk=4096: 0.74 ns. 190 at 224 GFLOP/s is 0.85 ns.
constexpr double kMathConvertFlops = 190;
// math: K and V streamed per block of query rows: decode B=4 Hq=32 Hkv=8 Lq=1 Lk=4096 D=128
// f32 took 52.9 ms, 49 ms of it for 537 MB of K and V: 0.47 of the measured 23 GB/s.
constexpr double kMathStreamEfficiency = 0.47;
// math backward: B=1 Hq=16 L=2048 D=128 f32 took 1131 ms (1 thread); GEMMs at the forward's
// efficiency and the two Lq x Lk matrices (P * M and dS, written once and read twice: 24 bytes
// a pair) at the memory bandwidth leave 1.15 softmax-row elements a pair (fitted at 1.52-1.72
// on two shapes before the backward's BLAS calls were batched per head).
constexpr double kMathBackwardSoftmaxCost = 1.15;
constexpr double kMathBackwardBytesPerPair = 24;
// math backward: storing one dK or dV element (store_rows, per kv head), FMA-equivalent flops:
// decode B=1 Hq=8 Lq=1 Lk=128 D=128 f32 took 0.36 ms, 0.22 ms beyond the other terms for
// 262144 elements (perf: store_rows 39% of the call); B=4 Hq=32 Hkv=8 Lk=4096 then comes
// within 10%. Shapes with Lq >= Lk (L=32, 64) store the same and run 20-30% faster than this
// term says: it decides only decode-shaped backwards, where it is measured.
constexpr double kMathBackwardStoreFlops = 200;

// Fixed cost per call, forward and backward (validation, allocation, the row loops' setup):
// with these, B=1 Hq=1 L=16 D=64 on 1 thread is estimated at flash 4.3 and 13 us, math 3.9 and
// 11 us, measured 4.4 and 9, 3.4 and 7 (the backward's other terms run over by the same 4 us
// on both, which keeps their order).
constexpr double kFlashCallSeconds[] = {1e-6, 5e-6};
constexpr double kMathCallSeconds[] = {1e-6, 4e-6};

// math: query rows per block (src/cpu/math.cpp kBlockRows): K and V are read once per block.
constexpr double kMathBlockRows = 128;
// The backward's FLOPs over the forward's (DESIGN.md section 5).
constexpr double kBackwardFlops = 2.5;

double round_up(double x, double m) { return std::ceil(x / m) * m; }

// (query, key) pairs of one head that causal and window masks leave visible (tensor masks are
// data and are not discounted). Exact up to 64 rows, else 64 evenly spaced rows scaled.
double visible_pairs(const Problem& p) {
  const double all = static_cast<double>(p.seqlen_q) * static_cast<double>(p.seqlen_k);
  if (p.causal == Causal::none && p.window_left < 0 && p.window_right < 0) return all;
  const CausalWindowMask mask(p);
  constexpr std::int64_t kSamples = 64;
  if (p.seqlen_q <= kSamples) return static_cast<double>(mask.visible_pairs());
  double sum = 0;
  for (std::int64_t s = 0; s < kSamples; ++s) {
    const KeyRange r = mask.row((2 * s + 1) * p.seqlen_q / (2 * kSamples));
    sum += static_cast<double>(r.end - r.begin);
  }
  return sum * static_cast<double>(p.seqlen_q) / kSamples;
}

struct Sizes {
  double batch, heads_q, heads_kv, lq, lk, dims, element, threads;
};

Sizes sizes_of(const Problem& p) {
  return {static_cast<double>(p.batch),          static_cast<double>(p.heads_q),
          static_cast<double>(p.heads_kv),       static_cast<double>(p.seqlen_q),
          static_cast<double>(p.seqlen_k),       static_cast<double>(p.head_dim + p.head_dim_v),
          static_cast<double>(size_of(p.dtype)), static_cast<double>(std::max(1, p.threads))};
}

// A parallel region of `work` seconds on one thread: the caller starts at once and helpers
// once awake (`wake` seconds on), so it takes work / threads + wake * (1 - 1 / threads), and
// never more than `work` (the caller takes every task when the helpers are late: threadpool.cpp).
double parallel_seconds(double work, double threads, double wake) {
  if (threads <= 1) return work;
  return std::min(work, work / threads + wake * (1 - 1 / threads));
}

// Memory traffic is shared by the threads (the decode shapes barely speed up with a second
// thread on the development machine: flash 24.5 -> 21.2 ms, math 52.9 -> 46.2 ms), so byte
// terms are not divided by the thread count; work terms are, over the threads that get work.
double estimate_flash(Pass pass, const Problem& p, const CostModel& m) {
  const Sizes s = sizes_of(p);
  const double flops_per_s = m.machine.fma_gflops * 1e9;
  const double bytes_per_s = m.machine.memory_gbps * 1e9;
  const double tile = m.flash_key_tile;
  const bool bf16_dot = p.dtype == DType::bf16 && m.flash_bf16_dot;  // bf16 pairs, native dots
  const double groups = s.batch * s.heads_kv;
  const double group_rows = s.heads_q / s.heads_kv * s.lq;
  // Keys per query row the kernel computes: whole tiles, the last one's keys rounded up to
  // whole micro-tiles, and along a band's edge half a tile more on average (a band that hides
  // nothing, as lower-right causal at Lq = 1, cuts no tile).
  const bool banded = (p.causal != Causal::none || p.window_left >= 0 || p.window_right >= 0) &&
                      visible_pairs(p) < s.lq * s.lk;
  const double lk_pad = round_up(s.lk, m.flash_tile_cols);
  const bool short_last_tile = std::fmod(s.lk, tile) != 0;
  const double keys = !banded    ? lk_pad
                      : s.lq > 0 ? std::min(lk_pad, visible_pairs(p) / s.lq + tile / 2)
                                 : 0;
  // Decode items of at most one micro-tile of rows read K and V in place (f32 tiles): their
  // rows are not padded, and no tile is packed.
  const bool direct =
      pass == Pass::forward && flash_reads_kv_in_place(p, m.flash_tile_rows, m.flash_bf16_dot);
  const double rows_pad = groups * (direct ? group_rows : round_up(group_rows, m.flash_tile_rows));
  const double pairs = rows_pad * keys;
  // Rows of tiles the mask code cuts: one tile per row along a band's edge, and the last tile
  // when Lk is not a whole number of tiles.
  const double cut_rows =
      rows_pad * std::min(std::ceil(keys / tile), (banded ? 1.0 : 0.0) + (short_last_tile ? 1 : 0));
  // Packed elements: K and V once per group (the packing reads them); the backward also packs
  // q and dO. Other traffic: q read and out written (backward: and the gradients).
  double packed = groups * lk_pad * s.dims;
  double compute, bytes, items;
  if (pass == Pass::forward) {
    const double efficiency = bf16_dot ? kFlashBf16DotEfficiency : kFlashEfficiency;
    compute = pairs * (2 * s.dims / efficiency + kFlashSoftmaxFlops) / flops_per_s;
    bytes = s.batch * s.heads_q * s.lq * s.dims * s.element;
    items = groups * std::ceil(group_rows / m.flash_block_rows);
  } else {
    compute = pairs *
              (kBackwardFlops * 2 * s.dims / kFlashBackwardEfficiency[bf16_dot ? 1 : 0] +
               kFlashBackwardSoftmaxFlops[bf16_dot ? 1 : 0]) /
              flops_per_s;
    // Items as flash_backward cuts them; each run of heads packs the K/V tiles it visits, K in
    // two layouts (for S and for dQ) and V in one (for dP).
    const FlashBackwardPlan plan = plan_flash_backward(p, m.flash_key_tile, p.compute_dbias);
    const double runs = groups * static_cast<double>(plan.runs);
    packed = runs * lk_pad * static_cast<double>(2 * p.head_dim + p.head_dim_v) +
             s.batch * s.heads_q * s.lq * s.dims;
    bytes = (groups * s.lk + 3 * s.batch * s.heads_q * s.lq) * s.dims * s.element;
    items = runs * static_cast<double>(plan.parts);
  }
  compute += cut_rows * kFlashCutRowFlops[bf16_dot ? 1 : 0] / flops_per_s;
  // Packing: per-element work, or reading K and V from memory, whichever is slower (each
  // thread reads its own groups: decode B=4 Hq=32 Hkv=8 Lk=4096 ran 2.0x faster on 2 threads).
  const double kv_bytes = groups * s.lk * s.dims * s.element;
  const double read =
      kv_bytes > kFlashCachedBytes ? kv_bytes / (bytes_per_s * kFlashStreamEfficiency) : 0;
  const double per_element = pass == Pass::backward ? kFlashBackwardPackFlops
                             : direct               ? kFlashDirectFlops
                                                    : kFlashPackFlops[bf16_dot ? 1 : 0];
  const double pack = std::max(packed * per_element / flops_per_s, read);
  const double threads = std::max(1.0, std::min(s.threads, items));
  return kFlashCallSeconds[pass == Pass::forward ? 0 : 1] +
         parallel_seconds(compute + pack, threads, m.machine.dispatch_seconds) +
         bytes / bytes_per_s;
}

double estimate_math(Pass pass, const Problem& p, const CostModel& m) {
  const Sizes s = sizes_of(p);
  const double flops_per_s = m.machine.fma_gflops * 1e9;
  const double bytes_per_s = m.machine.memory_gbps * 1e9;
  const double pairs = s.batch * s.heads_q * s.lq * s.lk;  // every pair, masked or not
  const double q_blocks = std::ceil(s.lq / kMathBlockRows);
  const double k_blocks = std::ceil(s.lk / kMathBlockRows);
  const bool converted = p.dtype != DType::f32 && p.dtype != DType::f64;
  const bool forward = pass == Pass::forward;
  const double gemm_flops = (forward ? 1 : kBackwardFlops) * 2 * s.dims * pairs;
  const double softmax_cost = forward ? kMathSoftmaxCost : kMathBackwardSoftmaxCost;
  const double rows = s.batch * s.heads_q * s.lq;
  // 16-bit inputs are converted to f32: K and V once per kv head, q (and dout) per block.
  const double conversions =
      converted ? (s.batch * s.heads_kv * s.lk + (forward ? 1 : 2) * rows) * s.dims : 0;
  const double stores = forward ? 0 : s.batch * s.heads_kv * s.lk * s.dims;  // dK and dV
  const double compute = (gemm_flops / kMathGemmEfficiency + conversions * kMathConvertFlops +
                          stores * kMathBackwardStoreFlops) /
                             flops_per_s +
                         (pairs * softmax_cost + rows * kMathRowCost) / m.machine.softmax_per_s;
  // K and V streamed once per block of query rows (BLAS's GEMV-like products at Lq = 1 run far
  // below the bandwidth: kMathStreamEfficiency); q and out (backward: dout and the gradients)
  // once; the backward's Lq x Lk matrices.
  double bytes = s.batch * s.heads_q * q_blocks * s.lk * s.dims * 4 / kMathStreamEfficiency +
                 s.batch * s.heads_q * s.lq * s.dims * s.element;
  if (!forward) bytes = 2 * bytes + pairs * kMathBackwardBytesPerPair;
  // Parallel regions that wake the pool (a region with one task runs inline): forward, the
  // tasks of each (batch, kv head) and the conversions of K and V; backward, per query head
  // passes 1 and 3 over query blocks and pass 4 over key blocks, and the conversions.
  const double tasks = s.heads_q / s.heads_kv * q_blocks;
  const double kv_conversions =  // K and V, each about Lk * dims / 2 elements
      converted && s.lk * s.dims / 2 >= kMathParallelConvertElements ? 2 : 0;
  double regions = 0;
  if (forward) {
    regions = s.batch * s.heads_kv * ((tasks >= 2 ? 1 : 0) + kv_conversions);
  } else {
    regions = s.batch * s.heads_q * ((q_blocks >= 2 ? 2 : 0) + (k_blocks >= 2 ? 1 : 0)) +
              s.batch * s.heads_kv * kv_conversions;
  }
  const double threads = std::max(1.0, std::min(s.threads, forward ? tasks : q_blocks));
  // Each region: its share of the work plus a helper's wake-up, at most its work alone.
  const double per_region = compute / std::max(1.0, regions);
  const double parallel =
      regions > 0 ? regions * parallel_seconds(per_region, threads, m.machine.dispatch_seconds)
                  : compute / threads;
  return kMathCallSeconds[forward ? 0 : 1] + parallel + bytes / bytes_per_s;
}

// ---------------------------------------------------------------------------------------------
// Measuring the constants (about 20-30 ms once per process).

// Keeps the measured loops' results alive: a store the compiler must perform.
std::atomic<float> g_measure_sink{0.0f};

// One thread reading a 48 MiB buffer (1.5x the 32 MiB L3 of the development machine, more
// than most CPUs' last-level cache), written first so that its pages exist: the better of 2
// passes. Huge pages, where the OS offers them, make the first touch cheap: 4 ms instead of
// 21 ms for the 12288 small-page faults (measured on the development machine).
double measure_memory_gbps() {
  constexpr std::size_t kBytes = std::size_t{48} << 20;
  constexpr std::size_t kCount = kBytes / sizeof(float);
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  std::unique_ptr<float, decltype(&std::free)> buffer(
      static_cast<float*>(std::aligned_alloc(kHugePage, kBytes)), &std::free);
  if (!buffer) throw std::bad_alloc();
  float* data = buffer.get();
#if defined(__linux__)
  madvise(data, kBytes, MADV_HUGEPAGE);  // advice only: ignored where unsupported
#endif
  std::memset(data, 0, kBytes);
  double best = 0;
  float sink = 0;
  for (int run = 0; run < 2; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    float acc[16] = {};
    for (std::size_t i = 0; i < kCount; i += 16) {
      for (int l = 0; l < 16; ++l) acc[l] += data[i + static_cast<std::size_t>(l)];
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (float a : acc) sink += a;
    best = std::max(best, kBytes / std::chrono::duration<double>(t1 - t0).count() * 1e-9);
  }
  g_measure_sink.store(sink, std::memory_order_relaxed);
  return best;
}

// The math backend's softmax row (policy/score_row.h) on 2048 scores in cache: elements/s,
// the best of 20 runs of 8 rows (each row copied in first, untimed).
double measure_softmax_per_s() {
  constexpr std::int64_t kRow = 2048, kRows = 8;
  std::vector<float> source(kRow), scores(kRow);
  for (std::int64_t j = 0; j < kRow; ++j) source[j] = static_cast<float>((j * 37) % 101) * 0.05f;
  double best = 0;
  float sink = 0;
  for (int run = 0; run < 20; ++run) {
    std::chrono::steady_clock::duration elapsed{};
    for (int r = 0; r < kRows; ++r) {
      std::copy(source.begin(), source.end(), scores.begin());
      const auto t0 = std::chrono::steady_clock::now();
      sink += softmax_row(scores.data(), kRow);
      elapsed += std::chrono::steady_clock::now() - t0;
    }
    best = std::max(best, kRows * kRow / std::chrono::duration<double>(elapsed).count());
  }
  g_measure_sink.store(sink, std::memory_order_relaxed);
  return best;
}

// How long a sleeping helper of the thread pool takes to start a task: a 2-task region whose
// caller, in its task, waits up to 1 ms for the helper to start the other. Where no helper
// comes (the pool busy with another caller's job, or the process held to one CPU), 1 ms: the
// model then expects no gain from a second thread, which the caller's taking every task
// bounds (parallel_seconds). The fastest of 16
// after 4 that start the worker and let it settle (the fastest: the least disturbed on a
// shared host, where the median swung from 5 to 45 us between processes). 0 with one core.
double measure_dispatch_seconds() {
  if (default_num_threads() < 2) return 0;
  double best = HUGE_VAL;
  for (int run = 0; run < 20; ++run) {
    std::atomic<bool> started{false};
    std::chrono::steady_clock::time_point t_start{};
    const std::thread::id caller = std::this_thread::get_id();
    const auto t0 = std::chrono::steady_clock::now();
    run_tasks(2, 2, [&](int) {
      if (std::this_thread::get_id() != caller) {
        t_start = std::chrono::steady_clock::now();
        started.store(true, std::memory_order_release);
        return;
      }
      while (!started.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1)) {
        std::this_thread::yield();  // the helper's own clock times it; on one CPU it can run
      }
    });
    if (!started.load()) return 1e-3;  // no helper came
    if (run >= 4) best = std::min(best, std::chrono::duration<double>(t_start - t0).count());
  }
  return best;
}

CostConstants measure_cost_constants() {
  const auto t0 = std::chrono::steady_clock::now();
  CostConstants c{};
  constexpr double kFmaRunSeconds = 0.002;  // 3 runs of 2 ms: within 3% of the 0.06 s probe
  c.fma_gflops = measure_fma_peak_gflops(1, kFmaRunSeconds, 3);
  c.memory_gbps = measure_memory_gbps();
  c.softmax_per_s = measure_softmax_per_s();
  c.dispatch_seconds = measure_dispatch_seconds();
  c.measure_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return c;
}

std::string not_enabled_reason(Backend b, const std::vector<Backend>& enabled) {
  const std::string name(name_of(b));
  return name + ": backend is not enabled on this thread (enabled=" + list_string(enabled) +
         ", expected " + name + " among them); see BackendScope or set_enabled_backends";
}

}  // namespace

const char* name_of(Pass pass) { return pass == Pass::forward ? "forward" : "backward"; }

std::vector<std::string> can_use(Backend backend, Pass pass, const Problem& p) {
  (void)pass;  // today every backend has the same limits in both passes
  std::vector<std::string> reasons;
  switch (backend) {
    case Backend::flash:
      if (p.dtype == DType::f64) {
        reasons.push_back(
            "flash: dtype f64 is not supported (dtype=f64, expected f32, bf16 or f16); math and "
            "reference run f64");
      }
      break;
    case Backend::math: {
      // The math backend hands sizes, and the Lq x Lk score matrix of one head in its backward,
      // to BLAS as 32-bit ints.
      constexpr std::int64_t kMax = INT_MAX;
      const struct {
        const char* name;
        std::int64_t value;
      } sizes[] = {{"Lq", p.seqlen_q}, {"Lk", p.seqlen_k}, {"D", p.head_dim}, {"Dv", p.head_dim_v}};
      bool each_fits = true;
      for (const auto& size : sizes) {
        if (size.value > kMax) {
          each_fits = false;
          reasons.push_back(std::string("math: ") + size.name +
                            " does not fit BLAS's 32-bit sizes (" + size.name + "=" +
                            std::to_string(size.value) +
                            ", expected <= 2147483647); flash and reference have no such limit");
        }
      }
      if (each_fits && p.seqlen_k > 0 && p.seqlen_q > kMax / p.seqlen_k) {
        reasons.push_back("math: Lq * Lk does not fit BLAS's 32-bit sizes (Lq=" +
                          std::to_string(p.seqlen_q) + ", Lk=" + std::to_string(p.seqlen_k) +
                          ", expected Lq * Lk <= 2147483647); flash and reference have no such "
                          "limit");
      }
      break;
    }
    case Backend::reference:
    case Backend::automatic:
      break;
  }
  return reasons;
}

CostModel current_cost_model() {
  static const CostConstants measured = measure_cost_constants();
  CostModel m;
  m.machine = measured;
  const FlashTarget& target = flash_target_chosen();
  m.flash_key_tile = target.layout.key_tile;
  m.flash_tile_cols = target.layout.dv_align;
  m.flash_tile_rows = target.layout.tile_rows;
  m.flash_block_rows = target.layout.block_rows;
  m.flash_bf16_dot = target.layout.bf16_dot;
  m.choice_threads = default_num_threads();
  return m;
}

double estimate_seconds(Backend backend, Pass pass, const Problem& p, const CostModel& model) {
  switch (backend) {
    case Backend::flash:
      return estimate_flash(pass, p, model);
    case Backend::math:
      return estimate_math(pass, p, model);
    default:
      return -1;
  }
}

Explanation select(Pass pass, const Problem& p, Backend requested,
                   const std::vector<Backend>& enabled, const CostModel& model) {
  Explanation e;
  e.chosen = Backend::automatic;
  std::vector<Backend> order = enabled;
  for (Backend b : kAllBackends) {
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  }
  for (Backend b : order) {
    BackendVerdict v{b, std::find(enabled.begin(), enabled.end(), b) != enabled.end(),
                     can_use(b, pass, p), -1.0};
    if (v.reasons.empty()) v.estimated_seconds = estimate_seconds(b, pass, p, model);
    if (requested == Backend::automatic && !v.enabled) {
      v.reasons.push_back(not_enabled_reason(b, enabled));
    }
    e.verdicts.push_back(std::move(v));
  }
  if (requested != Backend::automatic) {
    for (const BackendVerdict& v : e.verdicts) {
      if (v.backend == requested && v.reasons.empty()) e.chosen = requested;
    }
    return e;
  }
  // The fastest estimate among the enabled backends that can run, reference aside; backends
  // without an estimate rank after those with one, in priority order. The estimates compared
  // are those at the model's choice_threads, so that the choice, and with it every bit of the
  // result, does not depend on the call's thread count (DESIGN.md section 6); the verdicts
  // show the call's own.
  Problem reference_call = p;
  reference_call.threads = std::max(1, model.choice_threads);
  const BackendVerdict* best = nullptr;
  double best_rank = HUGE_VAL;
  for (const BackendVerdict& v : e.verdicts) {
    if (!v.reasons.empty() || v.backend == Backend::reference) continue;
    const double t = reference_call.threads == p.threads
                         ? v.estimated_seconds
                         : estimate_seconds(v.backend, pass, reference_call, model);
    const double rank = t >= 0 ? t : HUGE_VAL;  // no estimate: after those with one
    if (best == nullptr || rank < best_rank) {
      best = &v;
      best_rank = rank;
    }
  }
  if (best != nullptr) {
    e.chosen = best->backend;
    return e;
  }
  for (const BackendVerdict& v : e.verdicts) {
    if (v.backend == Backend::reference && v.reasons.empty()) e.chosen = Backend::reference;
  }
  return e;
}

Backend select_backend(Pass pass, const Problem& p, Backend requested) {
  if (requested != Backend::automatic) {
    const std::vector<std::string> reasons = can_use(requested, pass, p);
    if (reasons.empty()) return requested;
    const std::string op = name_of(pass), name(name_of(requested));
    throw Unsupported(op + ": backend " + name + " cannot run this call (backend=" + name +
                      ", expected a backend that supports it); " + join(reasons, "; "));
  }
  const Explanation e = select(pass, p, requested, t_enabled, current_cost_model());
  if (e.chosen != Backend::automatic) return e.chosen;
  const std::string op = name_of(pass);
  std::vector<std::string> reasons;
  for (const BackendVerdict& v : e.verdicts) {
    reasons.insert(reasons.end(), v.reasons.begin(), v.reasons.end());
  }
  throw Unsupported(op + ": no backend can run this call (enabled=" + list_string(t_enabled) +
                    ", expected one whose checks pass); " + join(reasons, "; "));
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Public API (attncore/backend.h).

std::vector<Backend> enabled_backends() { return detail::t_enabled; }

std::vector<Backend> set_enabled_backends(std::vector<Backend> backends) {
  if (backends.empty()) {
    throw InvalidArgument(
        "set_enabled_backends: backends is empty (backends=[], expected at least one of "
        "flash, math, reference)");
  }
  std::vector<Backend> unique;
  for (Backend b : backends) {
    if (!detail::is_backend(b)) {
      const std::string value =
          b == Backend::automatic ? std::string("auto") : std::to_string(static_cast<unsigned>(b));
      throw InvalidArgument("set_enabled_backends: backends has an invalid entry (backend=" +
                            value + ", expected flash, math or reference)");
    }
    if (std::find(unique.begin(), unique.end(), b) == unique.end()) unique.push_back(b);
  }
  std::swap(detail::t_enabled, unique);
  return unique;
}

BackendScope::BackendScope(std::vector<Backend> backends)
    : previous_(set_enabled_backends(std::move(backends))) {}

BackendScope::~BackendScope() { std::swap(detail::t_enabled, previous_); }

std::string Explanation::summary() const {
  std::ostringstream os;
  for (const BackendVerdict& v : verdicts) {
    os << name_of(v.backend) << (v.enabled ? "" : " (not enabled)") << ": ";
    if (v.reasons.empty()) {
      os << "can run";
    } else {
      os << "cannot run";
    }
    if (v.estimated_seconds >= 0) os << ", estimated " << v.estimated_seconds * 1e3 << " ms";
    os << '\n';
    for (const std::string& r : v.reasons) os << "  - " << r << '\n';
  }
  os << "chosen: " << (chosen == Backend::automatic ? "none" : name_of(chosen)) << '\n';
  return os.str();
}

Explanation explain_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const Options& options) {
  const detail::ForwardArgs args{q, k, v, {}, {}};
  detail::Problem p =
      detail::validate_forward(args, options, Backend::automatic, /*check_outputs=*/false);
  p.threads = detail::resolve_threads(p.threads);
  return detail::select(detail::Pass::forward, p, Backend::automatic, detail::t_enabled,
                        detail::current_cost_model());
}

Explanation explain_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const TensorView& out, const TensorView& lse,
                             const Options& options) {
  const detail::BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  detail::Problem p =
      detail::validate_backward(args, options, Backend::automatic, /*check_outputs=*/false);
  p.threads = detail::resolve_threads(p.threads);
  return detail::select(detail::Pass::backward, p, Backend::automatic, detail::t_enabled,
                        detail::current_cost_model());
}

CostConstants cost_constants() { return detail::current_cost_model().machine; }

}  // namespace attncore
