// Backend selection (DESIGN.md section 2: validate -> select -> plan -> kernel): what each
// backend cannot run, the cost model, and the choice. One place for all of it; api.cpp asks
// select_backend() and the explain functions of attncore/backend.h read the same verdicts.
#pragma once

#include <string>
#include <vector>

#include "attncore/backend.h"
#include "core/problem.h"

namespace attncore::detail {

enum class Pass : std::uint8_t { forward, backward };
const char* name_of(Pass pass);

// Why `backend` cannot run pass `pass` of `p`, one DESIGN.md section 4 sentence each with the
// backend's name as its subject ("flash: dtype f64 is not supported (...)"); empty: it can.
// This thread's enabled list is not consulted (see select()).
std::vector<std::string> can_use(Backend backend, Pass pass, const Problem& p);

// What the cost model reads: the measured constants of this CPU and the shapes of the flash
// kernel the calls would run (its SIMD target).
struct CostModel {
  CostConstants machine;
  int flash_key_tile = 128;     // keys per tile
  int flash_tile_cols = 32;     // keys of a micro-tile (a short last tile is padded to it)
  int flash_tile_rows = 8;      // rows of the micro-tile (query rows are padded to it)
  int flash_block_rows = 64;    // query rows per work item
  bool flash_bf16_dot = false;  // bf16 products on native dot instructions (forward)
  // The thread count automatic selection compares estimates at, whatever a call's own: the
  // library's default (every core), so that the choice suits the usual call and does not
  // depend on the call's thread count.
  int choice_threads = 1;
};

// The model of this process: constants measured once (lazily, thread-safe), kernel shapes of
// the SIMD target chosen now.
CostModel current_cost_model();

// Estimated seconds of `backend` on `p` (p.threads resolved), a pure function of its
// arguments; < 0 for backends the model does not cover (reference).
double estimate_seconds(Backend backend, Pass pass, const Problem& p, const CostModel& model);

// The verdict of every backend on `p` and the choice for `requested`, a pure function of its
// arguments. With `requested` = automatic: the rules of attncore/backend.h over `enabled`;
// otherwise `requested` if it can run the call (the enabled list does not restrict it).
// `chosen` is automatic when nothing can run.
Explanation select(Pass pass, const Problem& p, Backend requested,
                   const std::vector<Backend>& enabled, const CostModel& model);

// The backend to run: select() with this thread's enabled list and the current cost model.
// Throws Unsupported (every rejected backend and its reasons) when nothing can run.
Backend select_backend(Pass pass, const Problem& p, Backend requested);

}  // namespace attncore::detail
