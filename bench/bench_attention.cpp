// Attention forward and backward on shapes taken from real models, per backend and dtype.
//
// Counters: GFLOP/s (docs/design.md section 5: forward 4*B*Hq*D per visible (query, key) pair with
// Dv = D, backward 2.5x forward) and %peak, against the f32 FMA peak of all default threads,
// measured once when the program starts. Times are wall-clock (the library runs threads).
//
//   build/release/bench/bench_attention                              # everything, a few minutes
//   build/release/bench/bench_attention --benchmark_filter='fwd/.*/f32'
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "attncore/attncore.h"

namespace {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;
using attncore::Tensor;

// Attention shapes of the models they are named after (prefill: Lq = Lk; decode: Lq = 1).
struct Shape {
  const char* model;
  std::int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  Causal causal;
  bool with_math;  // false where the unfused baseline takes tens of seconds per call
};
constexpr Shape kShapes[] = {
    {"bert-large", 8, 16, 16, 512, 512, 64, Causal::none, true},            // encoder, batch 8
    {"gpt2-medium", 1, 16, 16, 1024, 1024, 64, Causal::lower_right, true},  // decoder, D = 64
    {"encoder-d128", 1, 16, 16, 2048, 2048, 128, Causal::none, true},       // ViT/DiT-style
    {"llama2-7b", 1, 32, 32, 2048, 2048, 128, Causal::lower_right, true},   // MHA
    {"mistral-7b", 2, 32, 8, 1024, 1024, 128, Causal::lower_right, true},   // GQA 4:1, batch 2
    {"llama3-8b", 1, 32, 8, 4096, 4096, 128, Causal::lower_right, true},    // GQA 4:1
    {"llama3-8b-16k", 1, 32, 8, 16384, 16384, 128, Causal::lower_right, false},  // long prefill
    {"llama3-8b-decode", 4, 32, 8, 1, 8192, 128, Causal::lower_right, true},     // one new token
};
constexpr DType kDTypes[] = {DType::f32, DType::bf16};
constexpr Backend kBackends[] = {Backend::math, Backend::flash};

double g_peak_gflops = 0;  // measured once in main()

// Uniform values in [-1, 1) from a 64-bit LCG (Knuth's MMIX constants); the data only needs to
// be deterministic and softmax-realistic.
void fill(const Tensor& t, std::uint64_t seed) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float x = static_cast<float>(static_cast<double>(s >> 11) * 0x1.0p-53 * 2 - 1);
    switch (t.dtype()) {
      case DType::f32:
        t.data_as<float>()[i] = x;
        break;
      case DType::bf16:
        t.data_as<attncore::bf16>()[i] = attncore::bf16(x);
        break;
      case DType::f16:
        t.data_as<attncore::f16>()[i] = attncore::f16(x);
        break;
      default:
        break;
    }
  }
}

// Pairs a lower-right causal mask leaves: row i sees min(Lk, i + Lk - Lq + 1) keys.
double visible_pairs(const Shape& s) {
  const double lq = static_cast<double>(s.seqlen_q), lk = static_cast<double>(s.seqlen_k);
  if (s.causal == Causal::none) return lq * lk;
  return lq * lk - lq * (lq - 1) / 2;  // Lq <= Lk
}

double forward_flops(const Shape& s) {
  return 4.0 * static_cast<double>(s.batch * s.heads_q * s.head_dim) * visible_pairs(s);
}
constexpr double kBackwardFlopFactor = 2.5;

void set_counters(benchmark::State& state, double flops, double seconds) {
  const double gflops =
      seconds > 0 ? flops * static_cast<double>(state.iterations()) / seconds * 1e-9 : 0;
  state.counters["GFLOP/s"] = gflops;
  state.counters["%peak"] = g_peak_gflops > 0 ? 100 * gflops / g_peak_gflops : 0;
}

using Clock = std::chrono::steady_clock;

void bench_attention(benchmark::State& state, Shape s, DType dtype, Backend backend,
                     bool backward) {
  Tensor q(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim});
  Tensor k(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim});
  Tensor v(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim});
  Tensor out(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim});
  Tensor lse(DType::f32, {s.batch, s.heads_q, s.seqlen_q});
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  attncore::Options options;
  options.causal = s.causal;
  double seconds = 0;
  try {
    if (!backward) {
      for (auto _ : state) {
        const auto t0 = Clock::now();
        attncore::forward_into(q, k, v, out, lse.view(), options, backend);
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        state.SetIterationTime(dt);
        seconds += dt;
      }
      set_counters(state, forward_flops(s), seconds);
      return;
    }
    Tensor dout(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim});
    Tensor dq(dtype, {s.batch, s.heads_q, s.seqlen_q, s.head_dim});
    Tensor dk(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim});
    Tensor dv(dtype, {s.batch, s.heads_kv, s.seqlen_k, s.head_dim});
    fill(dout, 4);
    attncore::forward_into(q, k, v, out, lse.view(), options, backend);
    for (auto _ : state) {
      const auto t0 = Clock::now();
      attncore::backward_into(dout, q, k, v, out, lse, dq, dk, dv, std::nullopt, options, backend);
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      state.SetIterationTime(dt);
      seconds += dt;
    }
    set_counters(state, kBackwardFlopFactor * forward_flops(s), seconds);
  } catch (const attncore::Error& e) {
    state.SkipWithError(e.what());
  }
}

void register_benchmarks() {
  for (bool backward : {false, true}) {
    for (Backend backend : kBackends) {
      for (const Shape& s : kShapes) {
        if (backend == Backend::math && !s.with_math) continue;
        for (DType dtype : kDTypes) {
          // fwd/flash/llama3-8b/B1_Hq32_Hkv8_Lq4096_Lk4096_D128_lower-right/f32
          const std::string name =
              std::string(backward ? "bwd/" : "fwd/") + std::string(attncore::name_of(backend)) +
              "/" + s.model + "/B" + std::to_string(s.batch) + "_Hq" + std::to_string(s.heads_q) +
              "_Hkv" + std::to_string(s.heads_kv) + "_Lq" + std::to_string(s.seqlen_q) + "_Lk" +
              std::to_string(s.seqlen_k) + "_D" +
              std::to_string(s.head_dim) + "_" + std::string(attncore::name_of(s.causal)) + "/" +
              std::string(attncore::name_of(dtype));
          benchmark::RegisterBenchmark(name.c_str(), bench_attention, s, dtype, backend, backward)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int threads = attncore::default_num_threads();
  g_peak_gflops = attncore::measure_fma_peak_gflops(threads);
  char peak[64];
  std::snprintf(peak, sizeof peak, "%.1f GFLOP/s f32 (%d threads)", g_peak_gflops, threads);
  benchmark::AddCustomContext("fma_peak", peak);
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
