// attncore bench: flash against math over sequence lengths (a table on stdout, optionally CSV,
// JSON and a PNG chart); bench --select: auto's choice against every backend over a fixed
// sweep of shapes; bench --varlen: a ragged batch packed against dense and padded batches.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "flags.h"
#include "inputs.h"
#include "json.h"
#include "measure.h"
#include "plot.h"
#include "progress.h"
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
      PreparedCall p = prepare_call(c, "bench");
      static double no_data;  // (explain reads no data; aligned for every dtype)
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

// An output file (--csv, --json, --png) that cannot be written, `error` the errno value (0:
// unknown). Exit code 1, as a library error's: the command line is well formed, the system
// refuses the file.
std::runtime_error cannot_write(const char* flag, const std::string& file, int error) {
  return std::runtime_error("bench: " + std::string(flag) + " file cannot be written (" + flag +
                            "=" + file + ", expected a file this process may create or write" +
                            (error != 0 ? std::string(": ") + std::strerror(error) : "") + ")");
}

// `file` opened with `mode`: "w" to write it, "a" to check it before a sweep (its contents kept;
// created empty where there is none).
std::FILE* open_output(const char* flag, const std::string& file, const char* mode) {
  std::FILE* f = std::fopen(file.c_str(), mode);
  if (f == nullptr) throw cannot_write(flag, file, errno);
  return f;
}

// Closes `file`, written through f: a write that failed (a full disk) or a close that did is
// the command's failure (its file incomplete), not a silent exit 0.
void close_output(const char* flag, const std::string& file, std::FILE* f) {
  const bool failed = std::ferror(f) != 0;
  const int error = errno;
  if (std::fclose(f) != 0 || failed) throw cannot_write(flag, file, failed ? error : errno);
}

// Refuses, before anything is measured, an output file the command could not write at its end.
void check_outputs(const BenchSweep& s) {
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--csv", &s.csv}, {"--json", &s.json}, {"--png", &s.png}};
  for (const auto& [flag, file] : outputs) {
    if (file->empty() || (file == &s.json && *file == "-")) continue;
    std::fclose(open_output(flag, *file, "a"));
  }
}

void write_csv(const BenchConfig& bc, const std::vector<BenchRow>& rows, int threads, double peak) {
  std::FILE* f = open_output("--csv", bc.sweep.csv, "w");
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
  close_output("--csv", bc.sweep.csv, f);
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
  write_json_object(bc.sweep.json, top);
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
  if (!write_line_chart(chart, bc.sweep.png)) throw cannot_write("--png", bc.sweep.png, 0);
}

// ---------------------------------------------------------------------------------------------
// bench --varlen.

// The batch: 32 sequences, lengths log-uniform between 64 and 2048 (drawn once with a fixed seed
// and kept here, so that runs compare across builds and machines), the spread of a ragged
// fine-tuning batch: 14826 tokens, root-mean-square length 721; padded to the longest it holds
// 8.1x as many (query, key) pairs. Lq_b = Lk_b (self-attention).
constexpr std::int64_t kVarlenLengths[] = {
    288,  197, 73, 1083, 96,  227, 75, 371, 563, 106, 175, 186,  2048, 480, 410, 64,
    1886, 98,  82, 1124, 120, 139, 78, 253, 108, 473, 611, 1254, 1709, 82,  88,  279};

struct VarlenRow {
  DType dtype;
  Causal causal;
  const char* pass;                                   // "fwd" or "bwd"
  double varlen_s, dense_s, padded_s;                 // seconds
  double varlen_gflops, dense_gflops, padded_gflops;  // useful work (see bench_varlen)
  double over_dense() const { return dense_gflops > 0 ? varlen_gflops / dense_gflops : 0.0; }
  double over_padded() const { return varlen_s > 0 ? padded_s / varlen_s : 0.0; }
};

// The packed batch (a), the dense batch of equal work (b) and the padded batch (c) of bench
// --varlen, each timed forward and backward on flash. GFLOP/s of (a) and (c) count the real
// sequences' visible pairs (so padding shows as lost throughput), those of (b) its own.
int bench_varlen(const BenchConfig& bc) {
  const std::vector<std::int64_t> lengths(std::begin(kVarlenLengths), std::end(kVarlenLengths));
  const auto batch = static_cast<std::int64_t>(lengths.size());
  double pairs = 0;  // sum of Lq_b * Lk_b
  std::int64_t tokens = 0;
  for (const std::int64_t l : lengths) {
    pairs += static_cast<double>(l) * static_cast<double>(l);
    tokens += l;
  }
  const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  // (b): as many sequences, each of the root-mean-square length, so B * L^2 is the packed pair
  // count to within the rounding of L.
  const auto dense_len = static_cast<std::int64_t>(std::llround(std::sqrt(pairs / batch)));
  const double dense_pairs =
      static_cast<double>(batch) * static_cast<double>(dense_len) * static_cast<double>(dense_len);
  const double padded_pairs =
      static_cast<double>(batch) * static_cast<double>(longest) * static_cast<double>(longest);

  const bool json_to_stdout = bc.sweep.json == "-";
  std::FILE* const table = json_to_stdout ? stderr : stdout;
  const int threads = bc.run.resolved_threads();
  // The calls of one dtype and causal kind: (a) packed, (b) dense and (c) padded (its
  // key-padding mask is added once it is prepared), on flash, forward and backward. The shared
  // flags (Hq, Hkv, D, repeat, threads) come with bc.run.
  struct VarlenCalls {
    RunConfig packed, dense, padded;
  };
  auto calls_of = [&](DType dtype, Causal causal) {
    RunConfig base = bc.run;
    base.dtype = dtype;
    base.causal = causal;
    base.backend = Backend::flash;
    base.threads = threads;
    base.backward = true;
    base.check = false;
    VarlenCalls calls{base, base, base};
    calls.packed.varlen = lengths;
    calls.packed.varlen_k.clear();
    calls.packed.seqused_k.clear();
    calls.packed.finish();
    calls.dense.batch = batch;
    calls.dense.seqlen_q = calls.dense.seqlen_k = dense_len;
    calls.padded.batch = batch;
    calls.padded.seqlen_q = calls.padded.seqlen_k = longest;
    return calls;
  };
  // Every call is checked before anything is measured (check_call): one refused fails at once.
  for (DType dtype : bc.sweep.dtypes) {
    for (Causal causal : bc.sweep.causals) {
      const VarlenCalls calls = calls_of(dtype, causal);
      for (const RunConfig* c : {&calls.packed, &calls.dense, &calls.padded}) {
        (void)check_call(*c, "bench");
      }
    }
  }
  Progress progress;
  progress.show("measuring the FMA peak ...");
  const double peak = fma_peak_gflops(threads);
  progress.clear();
  std::string list;
  for (const std::int64_t l : lengths) list += (list.empty() ? "" : ",") + std::to_string(l);
  std::fprintf(table,
               "attncore %s bench --varlen: flash, Hq=%lld Hkv=%lld D=%lld, %d thread%s, best of "
               "%d calls, measured f32 FMA peak %.0f GFLOP/s (simd %s)\n",
               attncore::version(), static_cast<long long>(bc.run.heads_q),
               static_cast<long long>(bc.run.heads_kv), static_cast<long long>(bc.run.head_dim),
               threads, threads == 1 ? "" : "s", bc.run.repeat, peak,
               attncore::simd_target().c_str());
  std::fprintf(table,
               "varlen: %lld sequences packed, Lq = Lk = %s\n"
               "        (%lld tokens, %.0f pairs)\n"
               "dense:  %lld x %lld, the root-mean-square length: %.0f pairs (%+.3f%% of "
               "varlen's)\n"
               "padded: %lld x %lld with a key-padding bool mask [%lld, 1, 1, %lld]: %.0f pairs, "
               "%.1f%% of them real\n\n",
               static_cast<long long>(batch), list.c_str(), static_cast<long long>(tokens), pairs,
               static_cast<long long>(batch), static_cast<long long>(dense_len), dense_pairs,
               100 * (dense_pairs / pairs - 1), static_cast<long long>(batch),
               static_cast<long long>(longest), static_cast<long long>(batch),
               static_cast<long long>(longest), padded_pairs, 100 * pairs / padded_pairs);
  std::fprintf(table, "%-5s %-12s %-4s %10s %9s %10s %9s %10s %9s %13s %14s\n", "dtype", "causal",
               "pass", "varlen ms", "GFLOP/s", "dense ms", "GFLOP/s", "padded ms", "GFLOP/s",
               "varlen/dense", "varlen/padded");
  std::fflush(table);

  std::vector<VarlenRow> rows;
  for (DType dtype : bc.sweep.dtypes) {
    for (Causal causal : bc.sweep.causals) {
      const VarlenCalls calls = calls_of(dtype, causal);
      auto show = [&](const char* what) {
        progress.showf("%s %s %s ...", std::string(name_of(dtype)).c_str(),
                       std::string(name_of(causal)).c_str(), what);
      };
      show("varlen");
      const RunResult a = run_once(prepare_call(calls.packed, "bench"));

      show("dense");
      const RunResult b = run_once(prepare_call(calls.dense, "bench"));

      show("padded");
      RunResult c;
      {
        PreparedCall p = prepare_call(calls.padded, "bench");
        p.mask = attncore::Tensor(DType::b8, {batch, 1, 1, longest});  // true: a real key
        for (std::int64_t s = 0; s < batch; ++s) {
          for (std::int64_t j = 0; j < lengths[static_cast<std::size_t>(s)]; ++j) {
            store(p.mask, s * longest + j, 1.0);
          }
        }
        p.options.mask = p.mask.view();
        c = run_once(p);
      }
      progress.clear();

      // (a) and (c) do the same useful work: the real sequences' visible pairs, a.flops.
      rows.push_back({dtype, causal, "fwd", a.seconds, b.seconds, c.seconds,
                      gflops(a.flops, a.seconds), gflops(b.flops, b.seconds),
                      gflops(a.flops, c.seconds)});
      rows.push_back({dtype, causal, "bwd", a.bwd_seconds, b.bwd_seconds, c.bwd_seconds,
                      gflops(a.bwd_flops, a.bwd_seconds), gflops(b.bwd_flops, b.bwd_seconds),
                      gflops(a.bwd_flops, c.bwd_seconds)});
      for (std::size_t n = rows.size() - 2; n < rows.size(); ++n) {
        const VarlenRow& r = rows[n];
        std::fprintf(table,
                     "%-5s %-12s %-4s %10.2f %9.1f %10.2f %9.1f %10.2f %9.1f %12.2fx %13.2fx\n",
                     std::string(name_of(r.dtype)).c_str(), std::string(name_of(r.causal)).c_str(),
                     r.pass, r.varlen_s * 1e3, r.varlen_gflops, r.dense_s * 1e3, r.dense_gflops,
                     r.padded_s * 1e3, r.padded_gflops, r.over_dense(), r.over_padded());
      }
      std::fflush(table);
    }
  }
  // The notes under the table, one line each in the JSON.
  constexpr const char* kFlopNote =
      "GFLOP/s: 2*(D+Dv) per visible (query, key) pair and head, backward 2.5x; varlen and padded\n"
      "count the real sequences' pairs (padding is lost throughput), dense its own.";
  constexpr const char* kRatioNote =
      "varlen/dense: varlen's GFLOP/s over dense's; varlen/padded: padded's time over varlen's.";
  constexpr const char* kCausalNote =
      "Causal, padded: the same causal kind on the padded Lmax x Lmax with the key-padding mask.\n"
      "On the real rows it equals per-sequence causal here because Lq_b = Lk_b and the padding\n"
      "is on the right; with Lq_b != Lk_b, per-sequence lower-right alignment would differ.";
  std::fprintf(table, "\n%s\n%s\n%s\n", kFlopNote, kRatioNote, kCausalNote);
  auto one_line = [](std::string text) {
    std::replace(text.begin(), text.end(), '\n', ' ');
    return text;
  };

  if (!bc.sweep.json.empty()) {
    std::vector<std::string> items;
    for (const VarlenRow& r : rows) {
      JsonObject j;
      j.add("dtype", name_of(r.dtype));
      j.add("causal", name_of(r.causal));
      j.add("pass", r.pass);
      j.add("varlen_seconds", r.varlen_s);
      j.add("varlen_gflops", r.varlen_gflops);
      j.add("dense_seconds", r.dense_s);
      j.add("dense_gflops", r.dense_gflops);
      j.add("padded_seconds", r.padded_s);
      j.add("padded_gflops", r.padded_gflops);
      j.add("varlen_over_dense", r.over_dense());
      j.add("varlen_over_padded", r.over_padded());
      items.push_back(j.str());
    }
    std::vector<std::string> lens;
    for (const std::int64_t l : lengths) lens.push_back(std::to_string(l));
    JsonObject top;
    top.add("version", attncore::version());
    top.add("bench", "varlen");
    top.add("backend", "flash");
    top.add("heads_q", bc.run.heads_q);
    top.add("heads_kv", bc.run.heads_kv);
    top.add("head_dim", bc.run.head_dim);
    top.add("head_dim_v", bc.run.head_dim_v);
    top.add("threads", threads);
    top.add("repeat", bc.run.repeat);
    top.add("peak_gflops", peak);
    top.add("simd", attncore::simd_target());
    top.add("batch", batch);
    top.add_json("seqlens", json_array(lens));
    top.add("total_tokens", tokens);
    top.add("pairs", pairs);
    top.add("dense_batch", batch);
    top.add("dense_seqlen", dense_len);
    top.add("dense_pairs", dense_pairs);
    top.add("padded_seqlen", longest);
    top.add("padded_pairs", padded_pairs);
    top.add("flop_count", one_line(kFlopNote));
    top.add("causal_note", one_line(kCausalNote));
    top.add_json("rows", json_array(items));
    write_json_object(bc.sweep.json, top);
  }
  return kExitOk;
}

}  // namespace

void write_json_object(const std::string& file, const JsonObject& j) {
  if (file == "-") return print_json_object(j);
  std::FILE* f = open_output("--json", file, "w");
  std::fprintf(f, "%s\n", j.str().c_str());
  close_output("--json", file, f);
}

int cmd_bench(const std::vector<std::string>& args) {
  if (asks_for_bench_help(args)) {
    std::fputs(bench_usage_text().c_str(), stdout);
    return kExitOk;
  }
  const BenchConfig bc = parse_bench_flags(args);
  attncore::set_simd_target(bc.run.simd);  // (an unknown target refused before any file is made)
  check_outputs(bc.sweep);
  if (bc.sweep.select) return bench_select(bc);
  if (bc.sweep.varlen) return bench_varlen(bc);
  if (bc.sweep.decode) return bench_decode(bc);
  // --json -: the JSON object alone on stdout, the table on stderr.
  std::FILE* const table = bc.sweep.json == "-" ? stderr : stdout;
  const int threads = bc.run.resolved_threads();
  const std::vector<Backend> backends = {Backend::math, Backend::flash};
  // The call at one point; the shared flags (B, Hq, Hkv, D, repeat, backward) come with bc.run.
  auto point = [&](DType dtype, Causal causal, std::int64_t seqlen, Backend backend) {
    RunConfig c = bc.run;
    c.seqlen_q = seqlen;
    c.seqlen_k = seqlen;
    c.dtype = dtype;
    c.causal = causal;
    c.backend = backend;
    c.threads = threads;
    return c;
  };
  // Every point is checked before anything is measured (check_call), in the order they are
  // measured: a length whose tensors would not fit, or a call the library refuses, fails at
  // once, not after the points before it.
  for (DType dtype : bc.sweep.dtypes) {
    for (Causal causal : bc.sweep.causals) {
      for (std::int64_t seqlen : bc.sweep.seqlens) {
        for (Backend backend : backends) {
          (void)check_call(point(dtype, causal, seqlen, backend), "bench");
        }
      }
    }
  }
  Progress progress;
  progress.show("measuring the FMA peak ...");
  const double peak = fma_peak_gflops(threads);
  progress.clear();
  const std::size_t total =
      bc.sweep.seqlens.size() * bc.sweep.dtypes.size() * bc.sweep.causals.size() * backends.size();
  std::fprintf(table,
               "attncore %s bench: B=%lld Hq=%lld Hkv=%lld D=%lld, Lq = Lk, forward, %d threads, "
               "measured f32 FMA peak %.0f GFLOP/s (simd %s)\n\n",
               attncore::version(), static_cast<long long>(bc.run.batch),
               static_cast<long long>(bc.run.heads_q), static_cast<long long>(bc.run.heads_kv),
               static_cast<long long>(bc.run.head_dim), threads, peak,
               attncore::simd_target().c_str());
  std::fprintf(table, "%8s %-5s %-12s %-7s %-4s %10s %9s %7s %8s\n", "L", "dtype", "causal",
               "backend", "pass", "ms", "GFLOP/s", "%peak", "vs math");
  std::vector<BenchRow> rows;
  std::size_t done = 0;
  for (DType dtype : bc.sweep.dtypes) {
    for (Causal causal : bc.sweep.causals) {
      for (std::int64_t seqlen : bc.sweep.seqlens) {
        double math_seconds = 0, math_bwd_seconds = 0;
        for (Backend backend : backends) {
          constexpr int kBarWidth = 30;
          const int filled = static_cast<int>(kBarWidth * done / total);
          progress.showf("[%s%s] %zu/%zu L=%lld %s %s %s", std::string(filled, '#').c_str(),
                         std::string(kBarWidth - filled, '.').c_str(), done, total,
                         static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                         std::string(name_of(causal)).c_str(),
                         std::string(name_of(backend)).c_str());
          const RunConfig c = point(dtype, causal, seqlen, backend);
          const RunResult r = run_once(prepare_call(c, "bench"));
          if (backend == Backend::math) {
            math_seconds = r.seconds;
            math_bwd_seconds = r.bwd_seconds;
          }
          ++done;
          progress.clear();
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
            std::fprintf(table, "%8lld %-5s %-12s %-7s %-4s %10.3f %9.1f %6.1f%% %7.2fx\n",
                         static_cast<long long>(seqlen), std::string(name_of(dtype)).c_str(),
                         std::string(name_of(causal)).c_str(),
                         std::string(name_of(backend)).c_str(), pass, row.seconds * 1e3, row.gflops,
                         peak > 0 ? 100 * row.gflops / peak : 0.0, row.speedup);
          };
          add_row("fwd", r.seconds, r.flops, math_seconds);
          if (c.backward) add_row("bwd", r.bwd_seconds, r.bwd_flops, math_bwd_seconds);
          std::fflush(table);
        }
      }
    }
  }
  std::fprintf(
      table,
      "\nFLOPs: forward 4*B*Hq*D per visible (query, key) pair, backward 2.5x; vs math = math's "
      "time / this time.\n");
  if (!bc.sweep.csv.empty()) write_csv(bc, rows, threads, peak);
  if (!bc.sweep.json.empty()) write_json(bc, rows, threads, peak);
  if (!bc.sweep.png.empty()) write_png(bc, rows, backends, threads, peak);
  return kExitOk;
}

}  // namespace attncore_tools
