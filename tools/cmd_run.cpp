// attncore run: one configured call on random data, dense, a packed variable-length batch
// (--varlen) or new tokens over a dense or paged KV cache (--cache-len), timed (best of --repeat),
// in GFLOP/s and percent of the measured FMA peak, optionally checked against the reference backend
// (exit code 1 when an error is over the tolerance of docs/design.md section 6); as text or as one
// JSON object (--json; main.cpp prints the object of a call that fails before it prints its own).
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "flags.h"
#include "inputs.h"
#include "json.h"
#include "measure.h"
#include "run_config.h"

namespace attncore_tools {

namespace {

int run(const RunConfig& c) {
  attncore::set_simd_target(c.simd);  // "" = the automatic choice
  const PreparedCall p = prepare_call(c, "run");
  const RunResult r = run_once(p);
  const int threads = c.resolved_threads();
  const double peak = fma_peak_gflops(threads);
  const double fwd_gflops = gflops(r.flops, r.seconds);
  const double bwd_gflops = gflops(r.bwd_flops, r.bwd_seconds);
  std::optional<double> err, grad_err;
  if (r.check) {
    err = r.check->out_err;
    grad_err = r.check->grad_err;
  }
  const bool failed = r.check && !r.check->passed();
  const std::string failure =
      failed ? "check failed: an error is over its tolerance (error/tolerance " +
                   format("%.3g", r.check->worst_ratio) + ")"
             : "";

  if (c.json) {
    JsonObject j;
    j.add("version", attncore::version());
    j.add("backend", name_of(r.backend));  // the one that ran: `auto`'s choice
    if (c.backward) j.add("bwd_backend", name_of(r.bwd_backend));
    j.add("requested_backend", name_of(c.backend));
    c.add_shape(j);
    j.add("window_left", c.window.left);
    j.add("window_right", c.window.right);
    j.add("softcap", c.softcap);
    j.add("alibi", c.alibi);
    j.add("mask", name_of(c.mask));
    j.add("dropout", c.dropout);
    j.add("seed", c.seed);
    j.add("threads", threads);
    j.add("num_splits", c.num_splits);
    j.add("simd", attncore::simd_target());
    j.add("repeat", c.repeat);
    j.add("flops", r.flops);
    j.add("flop_count", c.is_varlen()
                            ? "2*(D+Dv) per causal/window-visible pair of each sequence"
                            : "2*(D+Dv) per causal/window-visible pair; bool mask not discounted");
    j.add("seconds", r.seconds);
    j.add("gflops", fwd_gflops);
    j.add("peak_gflops", peak);
    j.add("percent_of_peak", peak > 0 ? 100 * fwd_gflops / peak : 0.0);
    if (c.is_cache()) {
      j.add("kv_bytes", r.kv_bytes);
      j.add("kv_gbps", r.seconds > 0 ? r.kv_bytes / r.seconds * 1e-9 : 0.0);
    }
    if (c.backward) {
      j.add("bwd_flops", r.bwd_flops);
      j.add("bwd_seconds", r.bwd_seconds);
      j.add("bwd_gflops", bwd_gflops);
      j.add("bwd_percent_of_peak", peak > 0 ? 100 * bwd_gflops / peak : 0.0);
    }
    j.add("max_abs_err", err);
    if (c.backward) j.add("max_abs_err_grad", grad_err);
    if (r.check) {
      j.add("checked", r.check->scope);
      j.add("tolerance", r.check->out_tolerance);
      j.add("error_over_tolerance", r.check->worst_ratio);
      j.add("check_passed", r.check->passed());
    } else {
      j.add_null("checked");
    }
    if (failed) j.add("error", failure);
    print_json_object(j);
    if (failed) throw CheckFailed{failure};
    return kExitOk;
  }

  std::string ran(name_of(r.backend));
  if (c.backward && r.bwd_backend != r.backend)
    ran += ", backward " + std::string(name_of(r.bwd_backend));
  if (c.backend == attncore::Backend::automatic) ran += " (auto)";
  std::printf("attncore run: backend=%s dtype=%s %s causal=%s threads=%d\n", ran.c_str(),
              std::string(name_of(c.dtype)).c_str(), c.shape_text().c_str(),
              std::string(name_of(c.causal)).c_str(), threads);
  std::printf(
      "forward:   best of %d: %.3f ms, %.1f GFLOP/s (%.1f%% of the measured %.0f GFLOP/s FMA "
      "peak)\n",
      c.repeat, r.seconds * 1e3, fwd_gflops, peak > 0 ? 100 * fwd_gflops / peak : 0.0, peak);
  if (c.is_cache()) {
    std::printf("K/V read:  %.4g bytes, %.2f GB/s\n", r.kv_bytes,
                r.seconds > 0 ? r.kv_bytes / r.seconds * 1e-9 : 0.0);
  }
  if (c.backward) {
    std::printf("backward:  best of %d: %.3f ms, %.1f GFLOP/s (%.1f%% of peak)\n", c.repeat,
                r.bwd_seconds * 1e3, bwd_gflops, peak > 0 ? 100 * bwd_gflops / peak : 0.0);
  }
  if (r.check) {
    std::printf("check:     max_abs_err %.3g (tolerance %.3g)", r.check->out_err,
                r.check->out_tolerance);
    if (r.check->grad_err) std::printf(", max_abs_err_grad %.3g", *r.check->grad_err);
    std::printf(" (against reference in f64; checked: %s)\n", r.check->scope.c_str());
    std::printf("           largest error/tolerance %.3g: %s (tolerance %s)\n",
                r.check->worst_ratio, failed ? "FAILED" : "passed", kCheckRule);
  }
  std::printf("flops:     %.4g forward: 2*(D+Dv) per causal/window-visible pair%s%s\n", r.flops,
              c.is_varlen() ? " of each sequence" : ", bool mask not discounted",
              c.backward ? "; backward 2.5x forward" : "");
  if (failed) throw CheckFailed{failure};
  return kExitOk;
}

}  // namespace

int cmd_run(const std::vector<std::string>& args) {
  if (asks_for_run_help(args)) {
    std::fputs(usage_text().c_str(), stdout);
    return kExitOk;
  }
  return run(parse_run_flags(args));
}

}  // namespace attncore_tools
