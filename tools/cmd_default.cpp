// attncore (no arguments): a short sweep that runs every backend forward and backward on a few
// shapes, checks each result against the reference in f64 and times it. Each row is judged by
// docs/design.md section 6's rule, as `run --check` judges (check.h); exit code 1 when an error
// is over its tolerance.
#include <cstdio>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "inputs.h"
#include "measure.h"
#include "progress.h"
#include "run_config.h"

namespace attncore_tools {

using attncore::Backend;
using attncore::Causal;
using attncore::DType;

namespace {

struct SweepCase {
  std::int64_t seqlen, head_dim;
  Causal causal;
  DType dtype;
};

// B = 1, Hq = Hkv = 8: small enough that the whole sweep takes seconds on 2 cores.
constexpr std::int64_t kSweepHeads = 8;
// The reference backend (fp64 loops, ~2.5 GFLOP/s on 2 cores) is timed only up to this length;
// it checks every row.
constexpr std::int64_t kReferenceMaxSeqlen = 256;

}  // namespace

int cmd_default() {
  const SweepCase cases[] = {
      {128, 64, Causal::none, DType::f32},           {128, 128, Causal::lower_right, DType::bf16},
      {256, 64, Causal::lower_right, DType::f32},    {256, 128, Causal::none, DType::f16},
      {512, 64, Causal::none, DType::bf16},          {512, 128, Causal::lower_right, DType::f32},
      {1024, 64, Causal::lower_right, DType::bf16},  {1024, 128, Causal::none, DType::f32},
      {1024, 128, Causal::lower_right, DType::bf16},
  };
  struct Row {
    SweepCase sc;
    Backend backend;
  };
  std::vector<Row> rows;
  for (const SweepCase& sc : cases) {
    if (sc.seqlen <= kReferenceMaxSeqlen) rows.push_back({sc, Backend::reference});
    rows.push_back({sc, Backend::math});
    rows.push_back({sc, Backend::flash});
  }

  const int threads = attncore::default_num_threads();
  Progress progress;
  progress.show("measuring the FMA peak ...");
  const double peak = fma_peak_gflops(threads);
  progress.clear();
  std::printf(
      "attncore %s: forward and backward, B=1 Hq=Hkv=%lld, Lq=Lk, Dv=D, checked against the "
      "reference in f64\n%d threads, measured f32 FMA peak %.0f GFLOP/s\n\n",
      attncore::version(), static_cast<long long>(kSweepHeads), threads, peak);
  std::printf("%-12s %-12s %-5s %-10s %-4s %9s %9s %7s %9s %8s  %s\n", "shape", "causal", "dtype",
              "backend", "pass", "ms", "GFLOP/s", "%peak", "max_err", "err/tol", "");
  int failures = 0, checks = 0;
  for (std::size_t n = 0; n < rows.size(); ++n) {
    const Row& row = rows[n];
    RunConfig c;
    c.heads_q = kSweepHeads;
    c.seqlen_q = row.sc.seqlen;
    c.head_dim = row.sc.head_dim;
    c.causal = row.sc.causal;
    c.dtype = row.sc.dtype;
    c.backend = row.backend;
    c.backward = true;
    c.check = true;
    c.repeat = row.backend == Backend::reference ? 1 : 3;  // the reference is slow and not tuned
    c.finish();
    const std::string shape =
        "L=" + std::to_string(c.seqlen_q) + " D=" + std::to_string(c.head_dim);
    progress.showf("[%zu/%zu] %s %s %s %s", n + 1, rows.size(), shape.c_str(),
                   std::string(name_of(c.causal)).c_str(), std::string(name_of(c.dtype)).c_str(),
                   std::string(name_of(c.backend)).c_str());

    const PreparedCall p = prepare_call(c, "attncore");
    const RunResult r = run_once(p);
    progress.clear();
    const std::string dims = std::to_string(c.seqlen_q) + "x" + std::to_string(c.head_dim);
    // ratio: the error over its tolerance (at most 1 passes; NaN fails).
    auto print_row = [&](const char* pass, double flops, double seconds, double err, double ratio) {
      const double g = gflops(flops, seconds);
      const bool ok = ratio <= 1.0;
      ++checks;
      failures += ok ? 0 : 1;
      std::printf("%-12s %-12s %-5s %-10s %-4s %9.3f %9.1f %6.1f%% %9.2e %8.3f%s %s\n",
                  dims.c_str(), std::string(name_of(c.causal)).c_str(),
                  std::string(name_of(c.dtype)).c_str(), std::string(name_of(c.backend)).c_str(),
                  pass, seconds * 1e3, g, peak > 0 ? 100 * g / peak : 0.0, err, ratio,
                  r.check->full ? " " : "*", ok ? "ok" : "FAIL");
    };
    print_row("fwd", r.flops, r.seconds, r.check->out_err, r.check->out_ratio);
    if (c.backward) {
      print_row("bwd", r.bwd_flops, r.bwd_seconds, *r.check->grad_err, *r.check->grad_ratio);
    }
    std::fflush(stdout);
  }
  std::printf(
      "\nshape = L x D. FLOPs: forward 4*B*Hq*D per visible pair, backward 2.5x forward.\n"
      "max_err: max |result - reference| of out (fwd) and of dq, dk, dv (bwd); err/tol: the\n"
      "largest error over its tolerance by docs/design.md section 6's rule (%s),\n"
      "ok when at most 1; * = the first 2 heads only (the reference is slow on large problems).\n",
      kCheckRule);
  if (failures > 0) {
    throw CheckFailed{std::to_string(failures) + " of " + std::to_string(checks) +
                      " results differ from the reference by more than their tolerance"};
  }
  return kExitOk;
}

}  // namespace attncore_tools
