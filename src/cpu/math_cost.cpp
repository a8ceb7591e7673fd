// The math backend's entry in the backend table: what it cannot run (sizes past 32 bits) and
// its cost term (fitted to its measured times; core/cost.h says how).
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "core/cost.h"
#include "cpu/math.h"

namespace attncore::detail {

namespace {

// math: the GEMMs' (cpu/gemm.h) share of the FMA peak on the attention products (blocks of 128
// query rows), and the cost of one score in elements of the measured softmax row (scale,
// masks, softmax, LSE): forward B=1 Hq=8 L=2048 f32, 1 thread, D=64 172.7 ms and D=128
// 215.2 ms (medians of 3, avx512bf16 constants): 0.96 and 0.92. (OpenBLAS's sgemm, used
// before, ran at 0.455.)
constexpr double kMathGemmEfficiency = 0.96;
constexpr double kMathSoftmaxCost = 0.92;
// math: the fixed cost of one query row (softmax_row's log and division, the row's setup) in
// softmax-row elements: B=1 Hq=8 L=32 D=64 took 73 us (1 thread), about 10 us (256 rows)
// beyond the other terms; B=1 Hq=1 L=16: 3.4 us.
constexpr double kMathRowCost = 10;
// math: converting one 16-bit element to f32, in FMA-equivalent flops: decode B=1 Hq=8 Lq=1
// Lk=128 D=128 took 0.32 ms in bf16 and 0.08 ms in f32, 0.92 ns more for each of the 262144
// converted elements; B=4 Hq=32 Hkv=8 Lq=1 Lk=4096: 0.74 ns. 190 at 224 GFLOP/s is 0.85 ns.
constexpr double kMathConvertFlops = 190;
// math: K and V streamed per block of query rows: decode B=4 Hq=Hkv=8 Lq=1 Lk=4096 D=128 f32
// took 4.76 ms, about 4.3 ms of it for 134 MB of K and V: the full bandwidth (the GEMM reads
// them in place at Lq = 1). With Hq = 4 Hkv the repeats come from cache: B=4 Hq=32 Hkv=8 took
// 11.9 ms where this term says 17 ms, which errs towards flash.
constexpr double kMathStreamEfficiency = 1.0;
// math backward: B=1 Hq=16 L=2048 D=128 f32 took 737 ms (1 thread, median of 3; 1131 ms with
// OpenBLAS); GEMMs at the forward's efficiency and the two Lq x Lk matrices (P * M and dS,
// written once and read twice: 24 bytes a pair) at the memory bandwidth leave 0.90
// softmax-row elements a pair.
constexpr double kMathBackwardSoftmaxCost = 0.90;
constexpr double kMathBackwardBytesPerPair = 24;
// math backward: storing one dK or dV element (store_rows, per kv head), FMA-equivalent flops:
// decode B=1 Hq=8 Lq=1 Lk=128 D=128 f32 took 0.235 ms (median of 3; 0.36 ms with OpenBLAS),
// 0.15 ms beyond the other terms for 262144 elements (perf: store_rows 39% of the call then).
// Shapes with Lq >= Lk (L=32, 64) store the same and run 20-30% faster than this term says: it
// decides only decode-shaped backwards, where it is measured.
constexpr double kMathBackwardStoreFlops = 135;

// Fixed cost per call, forward and backward (validation, allocation, the row loops' setup):
// with these, B=1 Hq=1 L=16 D=64 on 1 thread is estimated at flash 4.3 and 13 us, math 3.9 and
// 11 us, measured 4.4 and 9, 3.4 and 7 (the backward's other terms run over by the same 4 us
// on both, which keeps their order).
constexpr double kMathCallSeconds[] = {1e-6, 4e-6};

// math: query rows per block (src/cpu/math.cpp kBlockRows): K and V are read once per block.
constexpr double kMathBlockRows = 128;
double estimate_math(Pass pass, const Params& p, const Launch& launch, const CostModel& m) {
  const Sizes s = sizes_of(p, launch);
  const double flops_per_s = m.machine.fma_gflops * 1e9;
  const double bytes_per_s = m.machine.memory_gbps * 1e9;
  const double pairs = s.batch * s.heads_q * s.lq * s.lk;  // every pair, masked or not
  const double q_blocks = std::ceil(s.lq / kMathBlockRows);
  const double k_blocks = std::ceil(s.lk / kMathBlockRows);
  // 16-bit inputs are converted to f32: q's (and dout's) and K/V's dtypes apart (an f32 query
  // over a 16-bit cache converts K and V only).
  const bool converted = p.dtype != DType::f32 && p.dtype != DType::f64;
  const bool kv_converted = p.kv_dtype != DType::f32 && p.kv_dtype != DType::f64;
  const bool forward = pass == Pass::forward;
  const double gemm_flops = (forward ? 1 : kBackwardFlops) * 2 * s.dims * pairs;
  const double softmax_cost = forward ? kMathSoftmaxCost : kMathBackwardSoftmaxCost;
  const double rows = s.batch * s.heads_q * s.lq;
  // K and V once per kv head, q (and dout) per block.
  const double conversions = ((kv_converted ? s.batch * s.heads_kv * s.lk : 0) +
                              (converted ? (forward ? 1 : 2) * rows : 0)) *
                             s.dims;
  const double stores = forward ? 0 : s.batch * s.heads_kv * s.lk * s.dims;  // dK and dV
  const double compute = (gemm_flops / kMathGemmEfficiency + conversions * kMathConvertFlops +
                          stores * kMathBackwardStoreFlops) /
                             flops_per_s +
                         (pairs * softmax_cost + rows * kMathRowCost) / m.machine.softmax_per_s;
  // K and V streamed once per block of query rows (kMathStreamEfficiency); q and out
  // (backward: dout and the gradients) once; the backward's Lq x Lk matrices.
  double bytes = s.batch * s.heads_q * q_blocks * s.lk * s.dims * 4 / kMathStreamEfficiency +
                 s.batch * s.heads_q * s.lq * s.dims * s.element;
  if (!forward) bytes = 2 * bytes + pairs * kMathBackwardBytesPerPair;
  // Parallel regions that wake the pool (a region with one task runs inline): forward, the
  // tasks of each (batch, kv head) and the conversions of K and V; backward, per query head
  // passes 1 and 3 over query blocks and pass 4 over key blocks, and the conversions.
  const double tasks = s.heads_q / s.heads_kv * q_blocks;
  const double kv_conversions =  // K and V, each about Lk * dims / 2 elements
      kv_converted && s.lk * s.dims / 2 >= kMathParallelConvertElements ? 2 : 0;
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

}  // namespace

void math_can_use(Pass, const Params& p, std::vector<std::string>& reasons) {
  // Sizes past 32 bits, refused since math ran on BLAS (32-bit sizes). Its own GEMMs
  // (cpu/gemm.h) take 64-bit sizes; the limit and its messages stay until the tests and
  // programs that use it as "a call math cannot run" move to another one.
  constexpr std::int64_t kMax = INT_MAX;
  const struct {
    const char* name;
    std::int64_t value;
  } sizes[] = {
      {"Lq", p.seq.max_q()}, {"Lk", p.seq.max_k()}, {"D", p.head_dim}, {"Dv", p.head_dim_v}};
  bool each_fits = true;
  for (const auto& size : sizes) {
    if (size.value > kMax) {
      each_fits = false;
      reasons.push_back(std::string("math: ") + size.name + " does not fit BLAS's 32-bit sizes (" +
                        size.name + "=" + std::to_string(size.value) +
                        ", expected <= 2147483647); flash and reference have no such limit");
    }
  }
  if (each_fits && p.seq.max_k() > 0 && p.seq.max_q() > kMax / p.seq.max_k()) {
    reasons.push_back("math: Lq * Lk does not fit BLAS's 32-bit sizes (Lq=" +
                      std::to_string(p.seq.max_q()) + ", Lk=" + std::to_string(p.seq.max_k()) +
                      ", expected Lq * Lk <= 2147483647); flash and reference have no such "
                      "limit");
  }
}

double math_estimate(Pass pass, const Params& p, const Launch& launch, const CostModel& m) {
  return estimate_math(pass, p, launch, m);
}

double math_workspace_bytes(Pass pass, const Params& p, const Launch& launch) {
  const double element = p.dtype == DType::f64 ? 8 : 4;
  const double lq = static_cast<double>(p.seq.max_q()), lk = static_cast<double>(p.seq.max_k());
  const double d = static_cast<double>(p.head_dim), dv = static_cast<double>(p.head_dim_v);
  const double threads = std::max(1, launch.threads), block = std::min(lq, kMathBlockRows);
  // K and V of one kv head in the compute type; per thread a block's q, scores and output.
  const double kv = lk * (d + dv);
  // Keys in pages (a paged cache, a varlen call over page pools): a sequence's K and V gathered
  // out of the pages in their dtype (every head).
  const double gathered =
      p.seq.paged() ? static_cast<double>(p.heads_kv * size_of(p.kv_dtype)) * kv : 0;
  if (pass == Pass::forward) return gathered + element * (kv + threads * block * (d + lk + dv + 1));
  // The backward's P * M, dS and softcap derivative [Lq, Lk], dK and dV sums, q and dO of a
  // head, and per thread a block's q, dO, out and dQ.
  return element * (3 * lq * lk + 2 * kv + lq * (d + dv) + threads * block * 2 * (d + dv));
}

}  // namespace attncore::detail
