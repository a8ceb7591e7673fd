// attncore info: version, CPU, features, SIMD targets, BLAS, threads, measured FMA peak.
#include <cstdio>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "constants.h"

namespace attncore_tools {
namespace {

std::string join(const std::vector<std::string>& words) {
  std::string s;
  for (const std::string& w : words) {
    if (!s.empty()) s += ' ';
    s += w;
  }
  return s;
}

}  // namespace

int cmd_info(const std::vector<std::string>& args) {
  if (!args.empty()) throw UsageError{"info takes no arguments (got '" + args[0] + "')"};
  const attncore::CpuInfo cpu = attncore::cpu_info();
  const std::string features = join(cpu.features);
  const std::string compiled = join(attncore::simd_targets_compiled());
  const std::string supported = join(attncore::simd_targets_supported());
  const int threads = attncore::default_num_threads();
  std::printf("attncore %s\n", attncore::version());
  std::printf("cpu:       %s, %s, %d logical cores\n",
              cpu.vendor.empty() ? "unknown vendor" : cpu.vendor.c_str(),
              cpu.brand.empty() ? "unknown model" : cpu.brand.c_str(), cpu.logical_cores);
  std::printf("features:  %s\n", features.empty() ? "(none detected)" : features.c_str());
  std::printf("simd:      compiled: %s; this cpu: %s; chosen: %s\n", compiled.c_str(),
              supported.c_str(), attncore::simd_target().c_str());
  std::printf("blas:      %s (math backend GEMMs)\n", attncore::blas_info().c_str());
  std::printf(
      "threads:   %d (ATTNCORE_NUM_THREADS, else the CPUs this process may run on; at most "
      "%d)\n",
      threads, attncore::kMaxThreads);
  std::fflush(stdout);
  const double peak1 = attncore::measure_fma_peak_gflops(1);
  const double peak_all = threads > 1 ? attncore::measure_fma_peak_gflops(threads) : peak1;
  std::printf(
      "fma peak:  %.1f GFLOP/s f32 with 1 thread, %.1f GFLOP/s with %d threads (measured now)\n",
      peak1, peak_all, threads);
  print_constants(attncore::cost_constants(), attncore::measured_cost_constants());
  return kExitOk;
}

}  // namespace attncore_tools
