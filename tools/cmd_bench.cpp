// attncore bench: flash against math over sequence lengths (a table on stdout, optionally CSV,
// JSON and a PNG chart), and bench --select: auto's choice against every backend over a fixed
// sweep of shapes.
#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "flags.h"
#include "inputs.h"
#include "json.h"
#include "measure.h"
#include "plot.h"
#include "run_config.h"

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;

namespace {

struct BenchRow {
  std::int64_t seqlen;
  DType dtype;
  Causal causal;
  Backend backend;
  const char* pass;                 // "fwd" or "bwd"
  double seconds, gflops, speedup;  // speedup: math's time / this time, same shape and pass
};

// attncore bench --select: does `auto` pick the fastest backend? Each shape's problem is built
// once; every pass times flash, math and auto one after the other (best of --repeat calls
// each), and each backend's time is its median over the passes.
int bench_select(const BenchConfig& bc) {
  struct SelectShape {
    const char* name;
    std::int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
    Causal causal;
  };
  constexpr SelectShape kShapes[] = {
      {"tiny", 1, 1, 1, 16, 16, 64, Causal::none},
      {"small", 1, 8, 8, 32, 32, 64, Causal::none},
      {"L=64", 1, 8, 8, 64, 64, 64, Causal::none},
      {"short", 1, 8, 8, 128, 128, 64, Causal::none},
      {"decode Lk=128", 1, 8, 8, 1, 128, 128, Causal::lower_right},
      {"decode GQA", 4, 32, 8, 1, 4096, 128, Causal::lower_right},
      {"L=512", 1, 16, 16, 512, 512, 128, Causal::none},
      {"long", 1, 16, 16, 2048, 2048, 128, Causal::none},
      {"long causal", 1, 16, 16, 2048, 2048, 128, Causal::lower_right},
  };
  constexpr DType kSelectDTypes[] = {DType::f32, DType::bf16};
  const Backend timed[] = {Backend::flash, Backend::math, Backend::automatic};
  const int threads = bc.run.resolved_threads();
  const char* pass = bc.run.backward ? "backward" : "forward";
  std::printf(
      "attncore %s bench --select: %s, %d threads, median of %d interleaved passes of best of "
      "%d calls\n\n",
      attncore::version(), pass, threads, bc.sweep.passes, bc.run.repeat);
  std::printf("%-14s %-5s %-26s %10s %10s %10s  %-6s %-6s %12s %9s\n", "shape", "dtype",
              "B Hq Hkv Lq Lk D", "flash ms", "math ms", "auto ms", "auto", "best", "choice/best",
              "auto/best");
  double worst = 0, worst_auto = 0;
  for (const SelectShape& sh : kShapes) {
    for (DType dtype : kSelectDTypes) {
      RunConfig c;
      c.batch = sh.batch;
      c.heads_q = sh.heads_q;
      c.heads_kv = sh.heads_kv;
      c.seqlen_q = sh.seqlen_q;
      c.seqlen_k = sh.seqlen_k;
      c.head_dim = sh.head_dim;
      c.causal = sh.causal;
      c.dtype = dtype;
      c.threads = threads;
      c.repeat = bc.run.repeat;
      c.backward = bc.run.backward;
      c.finish();
      PreparedCall p = prepare_call(c);
      static char no_data;
      const CallViews w = c.views(&no_data);
      const Backend chosen =
          c.backward
              ? attncore::explain_backward(w.out, w.q, w.k, w.v, w.out, w.lse, p.options).chosen
              : attncore::explain_forward(w.q, w.k, w.v, p.options).chosen;
      std::vector<double> times[std::size(timed)];
      for (int n = 0; n < bc.sweep.passes; ++n) {
        for (std::size_t b = 0; b < std::size(timed); ++b) {
          p.cfg.backend = timed[b];
          const RunResult r = run_once(p);
          times[b].push_back(c.backward ? r.bwd_seconds : r.seconds);
        }
      }
      double median[std::size(timed)];
      for (std::size_t b = 0; b < std::size(timed); ++b) {
        std::sort(times[b].begin(), times[b].end());
        median[b] = times[b][times[b].size() / 2];
      }
      const std::size_t best = median[0] <= median[1] ? 0 : 1;
      const std::size_t choice = chosen == Backend::flash ? 0 : chosen == Backend::math ? 1 : 2;
      const double ratio = median[choice] / median[best];  // the chosen backend's own timings
      const double auto_ratio = median[2] / median[best];
      worst = std::max(worst, ratio);
      worst_auto = std::max(worst_auto, auto_ratio);
      char dims[64];
      std::snprintf(dims, sizeof dims, "%lld %lld %lld %lld %lld %lld",
                    static_cast<long long>(c.batch), static_cast<long long>(c.heads_q),
                    static_cast<long long>(c.heads_kv), static_cast<long long>(c.seqlen_q),
                    static_cast<long long>(c.seqlen_k), static_cast<long long>(c.head_dim));
      std::printf("%-14s %-5s %-26s %10.4f %10.4f %10.4f  %-6s %-6s %11.2fx %8.2fx\n", sh.name,
                  std::string(name_of(dtype)).c_str(), dims, median[0] * 1e3, median[1] * 1e3,
                  median[2] * 1e3, std::string(name_of(chosen)).c_str(),
                  std::string(name_of(timed[best])).c_str(), ratio, auto_ratio);
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nauto: the backend `auto` chose (attncore explain); best: the faster of flash and math "
      "here;\nchoice/best: the chosen backend's time over the best one's (worst %.2fx);\n"
      "auto/best: auto's own time (the choice and its call) over the best one's, measured in "
      "the same passes (worst %.2fx).\n",
      worst, worst_auto);
  return kExitOk;
}

void write_csv(const BenchConfig& bc, const std::vector<BenchRow>& rows, int threads, double peak) {
  std::FILE* f = std::fopen(bc.sweep.csv.c_str(), "w");
  if (f == nullptr) throw UsageError{"--csv: cannot write '" + bc.sweep.csv + "'"};
  std::fprintf(
      f,
      "seqlen,batch,heads_q,heads_kv,head_dim,dtype,causal,backend,pass,threads,seconds,gflops,"
      "percent_of_peak,speedup_vs_math\n");
  for (const BenchRow& r : rows) {
    std::fprintf(f, "%lld,%lld,%lld,%lld,%lld,%s,%s,%s,%s,%d,%.9g,%.6g,%.4g,%.4g\n",
                 static_cast<long long>(r.seqlen), static_cast<long long>(bc.run.batch),
                 static_cast<long long>(bc.run.heads_q), static_cast<long long>(bc.run.heads_kv),
                 static_cast<long long>(bc.run.head_dim), std::string(name_of(r.dtype)).c_str(),
                 std::string(name_of(r.causal)).c_str(), std::string(name_of(r.backend)).c_str(),
                 r.pass, threads, r.seconds, r.gflops, peak > 0 ? 100 * r.gflops / peak : 0.0,
                 r.speedup);
  }
  std::fclose(f);
}

void write_json(const BenchConfig& bc, const std::vector<BenchRow>& rows, int threads,
                double peak) {
  std::vector<std::string> items;
  for (const BenchRow& r : rows) {
    JsonObject j;
    j.add("seqlen", r.seqlen);
    j.add("dtype", name_of(r.dtype));
    j.add("causal", name_of(r.causal));
    j.add("backend", name_of(r.backend));
    j.add("pass", r.pass);
    j.add("seconds", r.seconds);
    j.add("gflops", r.gflops);
    j.add("percent_of_peak", peak > 0 ? 100 * r.gflops / peak : 0.0);
    j.add("speedup_vs_math", r.speedup);
    items.push_back(j.str());
  }
  JsonObject top;
  top.add("version", attncore::version());
  top.add("batch", bc.run.batch);
  top.add("heads_q", bc.run.heads_q);
  top.add("heads_kv", bc.run.heads_kv);
  top.add("head_dim", bc.run.head_dim);
  top.add("threads", threads);
  top.add("peak_gflops", peak);
  top.add("simd", attncore::simd_target());
  top.add_json("rows", json_array(items));
  std::FILE* f = std::fopen(bc.sweep.json.c_str(), "w");
  if (f == nullptr) throw UsageError{"--json: cannot write '" + bc.sweep.json + "'"};
  std::fprintf(f, "%s\n", top.str().c_str());
  std::fclose(f);
}

void write_png(const BenchConfig& bc, const std::vector<BenchRow>& rows,
               const std::vector<Backend>& backends, int threads, double peak) {
  LineChart chart;
  chart.title = "b=" + std::to_string(bc.run.batch) + " hq=" + std::to_string(bc.run.heads_q) +
                " d=" + std::to_string(bc.run.head_dim) + ", " + std::to_string(threads) +
                " threads, peak " + format("%.0f", peak);
  chart.x_label = "sequence length (lq = lk)";
  chart.y_label = "gflop/s";
  for (const char* pass : {"fwd", "bwd"}) {
    for (Backend backend : backends) {
      for (DType dtype : bc.sweep.dtypes) {
        for (Causal causal : bc.sweep.causals) {
          Series s;
          s.name = std::string(name_of(backend)) + " " + std::string(name_of(dtype)) + " " +
                   std::string(name_of(causal)) + (bc.run.backward ? std::string(" ") + pass : "");
          for (const BenchRow& r : rows) {
            if (r.backend == backend && r.dtype == dtype && r.causal == causal &&
                std::string_view(r.pass) == pass) {
              s.points.emplace_back(static_cast<double>(r.seqlen), r.gflops);
            }
          }
          if (!s.points.empty()) chart.series.push_back(s);
        }
      }
    }
  }
  if (!write_line_chart(chart, bc.sweep.png)) {
    throw UsageError{"--png: cannot write '" + bc.sweep.png + "'"};
  }
}

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  if (asks_for_help(args)) {
    std::fputs(bench_usage_text().c_str(), stdout);
    return kExitOk;
  }
  const BenchConfig bc = parse_bench_flags(args);
  attncore::set_simd_target(bc.run.simd);
  if (bc.sweep.select) return bench_select(bc);
  const int threads = bc.run.resolved_threads();
  std::fprintf(stderr, "measuring the FMA peak ...");
  const double peak = attncore::measure_fma_peak_gflops(threads);
  std::fprintf(stderr, "\r%*s\r", 28, "");
  const std::vector<Backend> backends = {Backend::math, Backend::flash};
  const std::size_t total =
      bc.sweep.seqlens.size() * bc.sweep.dtypes.size() * bc.sweep.causals.size() * backends.size();
  std::printf(
      "attncore %s bench: B=%lld Hq=%lld Hkv=%lld D=%lld, Lq = Lk, forward, %d threads, "
      "measured f32 FMA peak %.0f GFLOP/s (simd %s)\n\n",
      attncore::version(), static_cast<long long>(bc.run.batch),
      static_cast<long long>(bc.run.heads_q), static_cast<long long>(bc.run.heads_kv),
      static_cast<long long>(bc.run.head_dim), threads, peak, attncore::simd_target().c_str());
  std::printf("%8s %-5s %-12s %-7s %-4s %10s %9s %7s %8s\n", "L", "dtype", "causal", "backend",
              "pass", "ms", "GFLOP/s", "%peak", "vs math");
  std::vector<BenchRow> rows;
  std::size_t done = 0;
  for (DType dtype : bc.sweep.dtypes) {
    for (Causal causal : bc.sweep.causals) {
      for (std::int64_t seqlen : bc.sweep.seqlens) {
        double math_seconds = 0, math_bwd_seconds = 0;
        for (Backend backend : backends) {
          constexpr int kBarWidth = 30;
          const int filled = static_cast<int>(kBarWidth * done / total);
          std::fprintf(stderr, "\r[%s%s] %zu/%zu L=%lld %s %s %s   ",
                       std::string(filled, '#').c_str(),
                       std::string(kBarWidth - filled, '.').c_str(), done, total,
                       static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                       std::string(name_of(causal)).c_str(), std::string(name_of(backend)).c_str());
          std::fflush(stderr);
          // The shared flags (B, Hq, Hkv, D, repeat, backward) come with bc.run.
          RunConfig c = bc.run;
          c.seqlen_q = seqlen;
          c.seqlen_k = seqlen;
          c.dtype = dtype;
          c.causal = causal;
          c.backend = backend;
          c.threads = threads;
          const RunResult r = run_once(prepare_call(c));
          if (backend == Backend::math) {
            math_seconds = r.seconds;
            math_bwd_seconds = r.bwd_seconds;
          }
          ++done;
          std::fprintf(stderr, "\r%*s\r", kBarWidth + 60, "");
          auto add_row = [&](const char* pass, double seconds, double flops, double math) {
            const BenchRow row{seqlen,
                               dtype,
                               causal,
                               backend,
                               pass,
                               seconds,
                               gflops(flops, seconds),
                               math > 0 ? math / seconds : 0.0};
            rows.push_back(row);
            std::printf("%8lld %-5s %-12s %-7s %-4s %10.3f %9.1f %6.1f%% %7.2fx\n",
                        static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                        std::string(name_of(causal)).c_str(), std::string(name_of(backend)).c_str(),
                        pass, row.seconds * 1e3, row.gflops,
                        peak > 0 ? 100 * row.gflops / peak : 0.0, row.speedup);
          };
          add_row("fwd", r.seconds, r.flops, math_seconds);
          if (c.backward) add_row("bwd", r.bwd_seconds, r.bwd_flops, math_bwd_seconds);
          std::fflush(stdout);
        }
      }
    }
  }
  std::printf(
      "\nFLOPs: forward 4*B*Hq*D per visible (query, key) pair, backward 2.5x; vs math = math's "
      "time / this time.\n");
  if (!bc.sweep.csv.empty()) write_csv(bc, rows, threads, peak);
  if (!bc.sweep.json.empty()) write_json(bc, rows, threads, peak);
  if (!bc.sweep.png.empty()) write_png(bc, rows, backends, threads, peak);
  return kExitOk;
}

}  // namespace attncore_tools
