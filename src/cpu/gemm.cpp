// Which compiled GEMM target the math backend runs: the one of the flash target's ISA.
#include "cpu/gemm.h"

#include <cstring>
#include <iterator>

#include "cpu/flash.h"

namespace attncore::detail {

const GemmTarget& gemm_target_chosen() {
  // Best first, like flash_targets_compiled; generic last (every ISA begins with the baseline).
  // A plain array: nothing to destroy at exit while another thread may still run a call.
#if defined(__x86_64__)
  static const GemmTarget targets[] = {
#if !defined(ATTNCORE_NO_AVX512)  // (CMakeLists.txt's ATTNCORE_SIMD_TARGETS)
    gemm_target_avx512(),
#endif
    gemm_target_avx2(),
    gemm_target_generic()
  };
#else
  static const GemmTarget targets[] = {gemm_target_generic()};
#endif
  const char* flash = flash_target_chosen().name;
  for (const GemmTarget& t : targets) {
    if (std::strncmp(flash, t.name, std::strlen(t.name)) == 0) return t;
  }
  return targets[std::size(targets) - 1];
}

}  // namespace attncore::detail
