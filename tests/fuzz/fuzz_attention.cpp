// The libFuzzer target (README: Reliability): decodes an input's bytes into one call of the C++
// API (dense forward and backward, variable-length forward and backward, KV-cache forward over
// rows or pages with and without an append, merge_attention_states, or a call of absurd size)
// with shapes, strides (zero and overlapping included), dtypes, options and small data, at most
// ~10^7 flops, runs it on every backend and checks it as tests/fuzz/fuzz_check.h says. The
// cases are in fuzz_dense.cpp and fuzz_inference.cpp.
#include <cstddef>
#include <cstdint>

#include "fuzz_cases.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace attncore::fuzz;
  Reader r(data, size);
  switch (r.byte() % 8) {
    case 0:
    case 1:
    case 2:
      fuzz_dense(r);
      break;
    case 3:
    case 4:
      fuzz_varlen(r);
      break;
    case 5:
      fuzz_kvcache(r);
      break;
    case 6:
      fuzz_merge(r);
      break;
    default:
      if (r.chance(32)) fuzz_absurd(r);
      else fuzz_paged(r);
  }
  return 0;
}
