#include "core/large_memory.h"

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attncore::detail {

void* allocate_streamed(std::size_t bytes) {
  const bool large = bytes >= kLargeBytes;
  void* p = nullptr;
  if (posix_memalign(&p, large ? kLargeBytes : 64, bytes) != 0) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (large) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: its failure changes nothing
#endif
  return p;
}

}  // namespace attncore::detail
