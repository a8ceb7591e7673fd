// The machine's read bandwidth, measured: what a memory-bound kernel (decode over a long KV cache)
// can at best stream from memory, and the baseline `attncore bench --decode` reports its K/V rates
// against.
//
// Each thread sums its own contiguous part of one buffer far larger than the caches, with 8
// independent vector accumulators. One accumulator would measure the latency of the add chain (a
// probe summing into one double measured 7 GB/s on a machine that streams 25-40), not the memory.
// Two patterns, in alternate runs: one stream (the part from start to end) and two at once (4
// accumulators each, as decode reads K and V: kPairFloats); the result is the faster pattern's
// median. On Zen 3 (1 thread, 512 MiB, three runs of a scratch loop, medians of 7 alternating
// rounds) two streams (the part's halves) read 21.7-22.9 GB/s where one read 19.6-20.4, four
// 20.7-21.2, eight 19.9-21.3, and one with software prefetches 1 or 4 KiB ahead 14-16: a
// one-stream probe was beaten by decode itself (f32 MHA at 106-115% of it). Each thread writes its
// part first (first touch: the pages are its own, resident, and not the shared zero page), then
// every run is timed from the first thread's start to the last one's end. With piece_bytes, each
// thread reads its part in pieces of that size in a fixed shuffled order, as decode reads a paged
// KV cache (two streams: two pieces at once, as K's page and V's).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <latch>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attncore/error.h"
#include "attncore/info.h"
#include "attncore/options.h"
#include "core/cpu_info.h"
#include "core/large_memory.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 warns, wrongly, that its own _mm512_undefined_* placeholders may be read
// uninitialised where _mm512_reduce_add_ps is inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace attncore {
namespace {

// 512 MiB: 16x a 32 MiB L3 (the measuring machines' last level), so that less than 1/16 of a
// pass can come from any cache; a pass takes ~13 ms at 40 GB/s. Smaller when the process may
// use less than 8x that.
constexpr double kProbeBytes = 512.0 * 1024 * 1024;
constexpr int kRuns = 5;    // the median of 5 runs
constexpr int kPasses = 2;  // passes over the buffer per run
// The two-stream pattern over a whole part reads two adjacent blocks of 1 MiB at a time. Zen 3,
// 1 thread, 512 MiB, two runs of 7 alternating rounds, medians, GB/s: one stream 14.9-15.3,
// the part's two halves at once 16.4 (256 MiB apart: the same DRAM banks, at a guess), the
// second half shifted by an odd number of lines 18.4-19.0, blocks of 1 MiB two at a time
// 19.9-20.0, of 64 KiB 18.9-19.6.
constexpr std::size_t kPairFloats = std::size_t{1} << 18;

// Each sum reads two runs of 4 vectors per step, p + i and q + i, into 8 accumulators, for i =
// 0, step, 2 step, ... below n: one stream is q = p + 4 vectors with a step of 8 (8 adjacent
// vectors a step), two streams are p and q with a step of 4. n and step are multiples of the
// 4 vectors' floats.
#if defined(__x86_64__)
// 16 floats a vector.
__attribute__((target("avx512f"))) float sum_zmm(const float* p, const float* q, std::size_t n,
                                                 std::size_t step) {
  __m512 acc[8];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  for (std::size_t i = 0; i < n; i += step) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      acc[k] = _mm512_add_ps(acc[k], _mm512_load_ps(p + i + 16 * k));
      acc[k + 4] = _mm512_add_ps(acc[k + 4], _mm512_load_ps(q + i + 16 * k));
    }
  }
  for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
  return _mm512_reduce_add_ps(acc[0]);
}

// 8 floats a vector.
__attribute__((target("avx2"))) float sum_ymm(const float* p, const float* q, std::size_t n,
                                              std::size_t step) {
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (std::size_t i = 0; i < n; i += step) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      acc[k] = _mm256_add_ps(acc[k], _mm256_load_ps(p + i + 8 * k));
      acc[k + 4] = _mm256_add_ps(acc[k + 4], _mm256_load_ps(q + i + 8 * k));
    }
  }
  for (int k = 1; k < 8; ++k) acc[0] = _mm256_add_ps(acc[0], acc[k]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  float sum = 0;
  for (float x : lanes) sum += x;
  return sum;
}
#endif

// Portable: 4 floats a vector, 32 scalar accumulators (vectorised by the compiler where it can).
float sum_scalar(const float* p, const float* q, std::size_t n, std::size_t step) {
  float acc[32] = {};
  for (std::size_t i = 0; i < n; i += step) {
    for (int k = 0; k < 16; ++k) {
      acc[k] += p[i + static_cast<std::size_t>(k)];
      acc[k + 16] += q[i + static_cast<std::size_t>(k)];
    }
  }
  float sum = 0;
  for (float x : acc) sum += x;
  return sum;
}

struct Sum {
  float (*fn)(const float*, const float*, std::size_t, std::size_t);
  std::size_t run;  // floats in 4 vectors
  // n floats from p (a multiple of 2 runs), as one stream
  float one(const float* p, std::size_t n) const { return fn(p, p + run, n, 2 * run); }
  // n floats from each of p and q (a multiple of a run), at once
  float two(const float* p, const float* q, std::size_t n) const { return fn(p, q, n, run); }
};

Sum pick_sum() {
#if defined(__x86_64__)
  const CpuInfo info = cpu_info();
  if (info.has("avx512f")) return {sum_zmm, 64};
  if (info.has("avx2")) return {sum_ymm, 32};
#endif
  return {sum_scalar, 16};
}

std::atomic<float> g_bandwidth_sink{0.0f};

}  // namespace

double measure_read_bandwidth_gbs(int threads, std::int64_t piece_bytes) {
  if (threads <= 0) threads = default_num_threads();
  if (threads > kMaxThreads) {
    throw InvalidArgument(
        "measure_read_bandwidth_gbs: threads is too large (threads=" + std::to_string(threads) +
        ", expected <= " + std::to_string(kMaxThreads) + ")");
  }
  if (piece_bytes < 0) {
    throw InvalidArgument("measure_read_bandwidth_gbs: piece_bytes is negative (piece_bytes=" +
                          std::to_string(piece_bytes) +
                          ", expected 0 or a positive multiple of 512)");
  }
  if (piece_bytes % 512 != 0) {
    throw InvalidArgument(
        "measure_read_bandwidth_gbs: piece_bytes is not a multiple of 512 (piece_bytes=" +
        std::to_string(piece_bytes) + ", expected 0 or a positive multiple of 512)");
  }
  const double bytes = std::min(kProbeBytes, memory_limit().bytes / 8);
  // Each thread's part: whole 512-byte blocks of one buffer (StreamedMemory: on huge pages where
  // the OS gives them).
  constexpr std::size_t kBlockFloats = 128;
  const auto per_thread =
      static_cast<std::size_t>(bytes / 4 / threads) / kBlockFloats * kBlockFloats;
  if (per_thread == 0) {
    throw Error("measure_read_bandwidth_gbs: too little memory for the probe (threads=" +
                std::to_string(threads) + ", expected at least " + std::to_string(threads * 512) +
                " bytes to be available)");
  }
  // Pieces of each part read in a fixed shuffled order (one piece: the part, in order).
  // (Compared in 64 bits before the conversion: a size_t of 32 bits would wrap.)
  if (static_cast<std::uint64_t>(piece_bytes) / 4 > static_cast<std::uint64_t>(per_thread)) {
    throw InvalidArgument(
        "measure_read_bandwidth_gbs: piece_bytes is larger than a thread's part "
        "of the buffer (piece_bytes=" +
        std::to_string(piece_bytes) + ", expected <= " + std::to_string(per_thread * 4) + ")");
  }
  const std::size_t piece =
      piece_bytes > 0 ? static_cast<std::size_t>(piece_bytes) / 4 : per_thread;
  std::vector<std::size_t> order(per_thread / piece);
  for (std::size_t n = 0; n < order.size(); ++n) order[n] = n;
  std::uint32_t state = 777;
  for (std::size_t n = order.size(); n > 1; --n) {  // Fisher-Yates, fixed seed
    state = state * 1664525u + 1013904223u;
    std::swap(order[n - 1], order[state % static_cast<std::uint32_t>(n)]);
  }
  const std::size_t read_per_thread = order.size() * piece;
  const std::size_t total = per_thread * static_cast<std::size_t>(threads);
  const std::size_t alloc_bytes = total * sizeof(float);
  detail::StreamedMemory memory;
  try {
    memory = detail::StreamedMemory(alloc_bytes);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("measure_read_bandwidth_gbs: cannot allocate the probe's buffer (bytes=" +
                      std::to_string(alloc_bytes) + ", expected that much free memory)");
  }
  float* const buffer = static_cast<float*>(memory.data());
  const Sum sum = pick_sum();
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> start(static_cast<std::size_t>(threads));
  std::vector<Clock::time_point> stop(static_cast<std::size_t>(threads));
  std::vector<double> seconds[2];  // [streams - 1]: the runs' times
  std::size_t recorded = 0;
  std::barrier sync(threads, [&]() noexcept {
    // Between runs (the last thread to arrive runs this): record the run just timed (the runs
    // alternate one stream and two).
    const auto first = *std::min_element(start.begin(), start.end());
    const auto last = *std::max_element(stop.begin(), stop.end());
    if (last > first) {
      seconds[recorded % 2].push_back(std::chrono::duration<double>(last - first).count());
      ++recorded;
    }
  });
  std::latch go(1);
  std::atomic<bool> abort{false};
  auto body = [&](int t) {
    go.wait();
    if (abort.load()) return;
    float* part = buffer + static_cast<std::size_t>(t) * per_thread;
    std::fill_n(part, per_thread, 1.0f);  // first touch by the thread that reads it
    const auto slot = static_cast<std::size_t>(t);
    start[slot] = stop[slot] = Clock::now();
    sync.arrive_and_wait();  // records nothing: start == stop
    for (int run = 0; run < 2 * kRuns; ++run) {
      start[slot] = Clock::now();
      float s = 0;
      for (int pass = 0; pass < kPasses; ++pass) {
        if (run % 2 == 0) {  // one stream: the pieces one after another
          for (std::size_t n : order) s += sum.one(part + n * piece, piece);
        } else if (order.size() == 1) {  // two: adjacent blocks two at a time, in order
          std::size_t i = 0;
          for (; i + 2 * kPairFloats <= piece; i += 2 * kPairFloats) {
            s += sum.two(part + i, part + i + kPairFloats, kPairFloats);
          }
          if (i < piece) s += sum.one(part + i, piece - i);
        } else {  // two: the pieces two at a time (a last odd one alone)
          for (std::size_t i = 0; i + 1 < order.size(); i += 2) {
            s += sum.two(part + order[i] * piece, part + order[i + 1] * piece, piece);
          }
          if (order.size() % 2 == 1) s += sum.one(part + order.back() * piece, piece);
        }
      }
      stop[slot] = Clock::now();
      g_bandwidth_sink.store(s, std::memory_order_relaxed);
      sync.arrive_and_wait();
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<std::size_t>(threads - 1));
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  } catch (const std::system_error& e) {
    abort.store(true);  // the threads started return before the barrier
    go.count_down();
    for (std::thread& th : pool) th.join();
    throw Error("measure_read_bandwidth_gbs: threads cannot be started (threads=" +
                std::to_string(threads) + ", expected what the system allows; " + e.what() + ")");
  }
  go.count_down();
  body(0);  // the calling thread is thread 0
  for (std::thread& th : pool) th.join();
  // The faster of the two patterns' medians.
  double best = 0;
  for (std::vector<double>& runs : seconds) {
    std::sort(runs.begin(), runs.end());
    best = std::max(best, static_cast<double>(read_per_thread) * static_cast<double>(threads) *
                              sizeof(float) * kPasses / runs[runs.size() / 2] * 1e-9);
  }
  return best;
}

}  // namespace attncore
