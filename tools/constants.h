// The cost model's constants as `explain` and `info` show them: the fixed ones the model uses
// (attncore::cost_constants) and the ones measured in this process for comparison
// (attncore::measured_cost_constants).
#pragma once

#include <cstdio>
#include <string>

#include "attncore/attncore.h"
#include "json.h"

namespace attncore_tools {

inline std::string constants_json(const attncore::CostConstants& k) {
  JsonObject j;
  j.add("fma_gflops", k.fma_gflops);
  j.add("memory_gbps", k.memory_gbps);
  j.add("softmax_per_s", k.softmax_per_s);
  j.add("dispatch_seconds", k.dispatch_seconds);
  j.add("measure_seconds", k.measure_seconds);
  j.add("basis", k.basis);
  return j.str();
}

// "f32 FMA 224 GFLOP/s per thread, memory 23.0 GB/s per thread, softmax 183 M elements/s per
// thread, thread pool wake-up 2.0 us"
inline std::string constants_text(const attncore::CostConstants& k) {
  char text[256];
  std::snprintf(text, sizeof text,
                "f32 FMA %.0f GFLOP/s per thread, memory %.1f GB/s per thread, softmax %.0f M "
                "elements/s per thread, thread pool wake-up %.1f us",
                k.fma_gflops, k.memory_gbps, k.softmax_per_s * 1e-6, k.dispatch_seconds * 1e6);
  return text;
}

// The two lines `explain` and `info` print.
inline void print_constants(const attncore::CostConstants& model,
                            const attncore::CostConstants& measured) {
  std::printf("cost model: %s (fixed for SIMD target %s)\n", constants_text(model).c_str(),
              model.basis.c_str());
  std::printf("measured:   %s (in %.0f ms, this process; the choice does not read them)\n",
              constants_text(measured).c_str(), measured.measure_seconds * 1e3);
}

}  // namespace attncore_tools
