// Which compiled GEMM target the math backend runs: the one of the flash target's ISA.
#include "cpu/gemm.h"

#include <cstring>
#include <vector>

#include "cpu/flash.h"

namespace attncore::detail {

namespace {

// Best first, like flash_targets_compiled; generic last (every ISA begins with the baseline).
std::vector<GemmTarget> gemm_targets_compiled() {
#if defined(__x86_64__)
  return {gemm_target_avx512(), gemm_target_avx2(), gemm_target_generic()};
#else
  return {gemm_target_generic()};
#endif
}

}  // namespace

const GemmTarget& gemm_target_chosen() {
  static const std::vector<GemmTarget> targets = gemm_targets_compiled();
  const char* flash = flash_target_chosen().name;
  for (const GemmTarget& t : targets) {
    if (std::strncmp(flash, t.name, std::strlen(t.name)) == 0) return t;
  }
  return targets.back();
}

}  // namespace attncore::detail
