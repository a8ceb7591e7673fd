// The backends as selection and the entry points reach them (docs/design.md section 2): one table
// of {name, can_use, cost estimate, forward, backward, workspace}. src/core knows only this
// interface; src/backends.cpp lists the concrete backends, and each owns its cost term.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/backend.h"
#include "core/params.h"

namespace attncore::detail {

enum class Pass : std::uint8_t { forward, backward };
const char* name_of(Pass pass);

// What the cost model reads: the measured constants of this CPU and the shapes of the flash
// kernel the calls would run (its SIMD target; filled by the flash backend's `describe`).
struct CostModel {
  CostConstants machine;
  int flash_key_tile = 128;     // keys per tile
  int flash_tile_cols = 32;     // keys of a micro-tile (a short last tile is padded to it)
  int flash_tile_rows = 8;      // rows of the micro-tile (query rows are padded to it)
  int flash_block_rows = 64;    // query rows per work item
  bool flash_bf16_dot = false;  // bf16 products on native dot instructions (forward)
  // The thread count automatic selection compares estimates at, whatever a call's own: the
  // machine's logical cores (not the affinity mask or ATTNCORE_NUM_THREADS), so that the choice
  // suits the usual call and depends on no setting of the process or the call.
  int choice_threads = 1;
};

struct BackendEntry {
  Backend id;
  // Appends why the backend cannot run pass `pass` of `p`: docs/design.md section 4 sentences with
  // the backend's name as their subject ("flash: dtype f64 is not supported (...)").
  void (*can_use)(Pass pass, const Params& p, std::vector<std::string>& reasons);
  // Estimated seconds of the call, a pure function of its arguments; null: not modelled.
  double (*estimate)(Pass pass, const Params& p, const Launch& launch, const CostModel& model);
  void (*forward)(const Params& p, const Launch& launch, const ForwardArgs& args);
  void (*backward)(const Params& p, const Launch& launch, const BackwardArgs& args);
  // Bytes of scratch memory the call allocates (beyond its outputs), computed before any work;
  // the entry points refuse a call whose workspace exceeds the machine's memory.
  double (*workspace_bytes)(Pass pass, const Params& p, const Launch& launch);
  // Fills the model's fields that describe this backend's kernels; null: none.
  void (*describe)(CostModel& model);
};

// Every backend of this build, in the default priority order (defined in src/backends.cpp).
const std::vector<BackendEntry>& backend_table();
// The entry of `b`; null for automatic or a value no backend of this build has.
const BackendEntry* find_backend(Backend b);

}  // namespace attncore::detail
