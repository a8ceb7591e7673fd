// The backend table of this build (core/backend_table.h), in the default priority order: the
// one place that names the concrete backends.
#include "core/backend_table.h"
#include "cpu/flash.h"
#include "cpu/math.h"
#include "reference/reference.h"

namespace attncore::detail {

// Never destroyed, like every static a call reads: a thread the program did not join may be
// inside a call while the process exits (tests/exit_test.cpp).
const std::vector<BackendEntry>& backend_table() {
  static const std::vector<BackendEntry>* const table = new std::vector<BackendEntry>{
      {Backend::flash, flash_can_use, flash_estimate, flash_forward, flash_backward,
       flash_workspace_bytes, flash_describe},
      {Backend::math, math_can_use, math_estimate, math_forward, math_backward,
       math_workspace_bytes, nullptr},
      {Backend::reference, nullptr, nullptr, reference_forward, reference_backward,
       reference_workspace_bytes, nullptr},
  };
  return *table;
}

const BackendEntry* find_backend(Backend b) {
  for (const BackendEntry& e : backend_table()) {
    if (e.id == b) return &e;
  }
  return nullptr;
}

}  // namespace attncore::detail
