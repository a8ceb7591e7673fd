// attncore info: version, CPU, features, SIMD targets, BLAS, threads, measured FMA peak and read
// bandwidth, and the
// cost model's constants (fixed and measured); --json: the same as one JSON object.
#include <cstdio>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "constants.h"
#include "json.h"
#include "measure.h"

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

std::string json_strings(const std::vector<std::string>& words) {
  std::vector<std::string> quoted;
  for (const std::string& w : words) quoted.push_back(JsonObject::quoted(w));
  return json_array(quoted);
}

}  // namespace

int cmd_info(const std::vector<std::string>& args) {
  bool json = false;
  for (const std::string& a : args) {
    if (a != "--json") throw UsageError{"info takes only --json (got '" + a + "')"};
    if (json) throw UsageError{"--json is given twice (expected each flag once)"};
    json = true;
  }
  const attncore::CpuInfo cpu = attncore::cpu_info();
  const std::vector<std::string> compiled = attncore::simd_targets_compiled();
  const std::vector<std::string> supported = attncore::simd_targets_supported();
  const int threads = attncore::default_num_threads();
  if (json) {
    const double peak1 = attncore::measure_fma_peak_gflops(1);
    const double peak_all = threads > 1 ? fma_peak_gflops(threads) : peak1;
    JsonObject j;
    j.add("version", attncore::version());
    j.add("cpu_vendor", cpu.vendor);
    j.add("cpu_brand", cpu.brand);
    j.add("cpu_family", cpu.family);
    j.add("cpu_model", cpu.model);
    j.add("logical_cores", cpu.logical_cores);
    j.add_json("features", json_strings(cpu.features));
    j.add_json("simd_compiled", json_strings(compiled));
    j.add_json("simd_supported", json_strings(supported));
    j.add("simd", attncore::simd_target());
    j.add("threads", threads);
    j.add("max_threads", attncore::kMaxThreads);
    j.add("fma_peak_gflops_1_thread", peak1);
    j.add("fma_peak_gflops", peak_all);
    const double bw1 = attncore::measure_read_bandwidth_gbs(1);
    j.add("read_bandwidth_gbs_1_thread", bw1);
    j.add("read_bandwidth_gbs", threads > 1 ? attncore::measure_read_bandwidth_gbs(threads) : bw1);
    j.add_json("cost_constants", constants_json(attncore::cost_constants()));
    j.add_json("measured_constants", constants_json(attncore::measured_cost_constants()));
    print_json_object(j);
    return kExitOk;
  }
  const std::string features = join(cpu.features);
  std::printf("attncore %s\n", attncore::version());
  char family[48] = "";  // x86 only
  if (cpu.family > 0) {
    std::snprintf(family, sizeof family, "family 0x%X model 0x%X, ", cpu.family, cpu.model);
  }
  std::printf("cpu:       %s, %s, %s%d logical cores\n",
              cpu.vendor.empty() ? "unknown vendor" : cpu.vendor.c_str(),
              cpu.brand.empty() ? "unknown model" : cpu.brand.c_str(), family, cpu.logical_cores);
  std::printf("features:  %s\n", features.empty() ? "(none detected)" : features.c_str());
  std::printf("simd:      compiled: %s; this cpu: %s; chosen: %s\n", join(compiled).c_str(),
              join(supported).c_str(), attncore::simd_target().c_str());
  std::printf(
      "threads:   %d (ATTNCORE_NUM_THREADS, else the CPUs this process may run on; at most "
      "%d)\n",
      threads, attncore::kMaxThreads);
  std::fflush(stdout);
  const double peak1 = attncore::measure_fma_peak_gflops(1);
  const double peak_all = threads > 1 ? fma_peak_gflops(threads) : peak1;
  std::printf(
      "fma peak:  %.1f GFLOP/s f32 with 1 thread, %.1f GFLOP/s with %d threads (measured now)\n",
      peak1, peak_all, threads);
  std::fflush(stdout);
  const double bw1 = attncore::measure_read_bandwidth_gbs(1);
  const double bw_all = threads > 1 ? attncore::measure_read_bandwidth_gbs(threads) : bw1;
  std::printf(
      "read bw:   %.1f GB/s with 1 thread, %.1f GB/s with %d threads (512 MiB, 8 vector "
      "accumulators per thread, one stream or two at once, the faster's median of 5; measured "
      "now)\n",
      bw1, bw_all, threads);
  print_constants(attncore::cost_constants(), attncore::measured_cost_constants());
  return kExitOk;
}

}  // namespace attncore_tools
