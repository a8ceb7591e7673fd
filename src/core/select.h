// Backend selection (docs/design.md section 2: validate -> select -> plan -> kernel) over the
// backend table (core/backend_table.h): api.cpp asks select_backend() and the explain functions
// of attncore/backend.h read the same verdicts.
#pragma once

#include <string>
#include <vector>

#include "attncore/backend.h"
#include "core/backend_table.h"

namespace attncore::detail {

// Why `backend` cannot run pass `pass` of `p`, one docs/design.md section 4 sentence each with the
// backend's name as its subject ("flash: dtype f64 is not supported (...)"); empty: it can.
// This thread's enabled list is not consulted (see select()).
std::vector<std::string> can_use(Backend backend, Pass pass, const Params& p);

// The model of this process: constants measured once (lazily, thread-safe), kernel shapes
// described by the backends (the flash kernel's SIMD target chosen now).
CostModel current_cost_model();

// Estimated seconds of `backend` on `p` with `launch`, a pure function of its arguments; < 0
// for backends the model does not cover (reference).
double estimate_seconds(Backend backend, Pass pass, const Params& p, const Launch& launch,
                        const CostModel& model);

// The verdict of every backend on `p` and the choice for `requested`, a pure function of its
// arguments. With `requested` = automatic: the rules of attncore/backend.h over `enabled`;
// otherwise `requested` if it can run the call (the enabled list does not restrict it).
// `chosen` is automatic when nothing can run.
Explanation select(Pass pass, const Params& p, const Launch& launch, Backend requested,
                   const std::vector<Backend>& enabled, const CostModel& model);

// The backend to run: select() with this thread's enabled list and the current cost model.
// Throws Unsupported (every rejected backend and its reasons) when nothing can run.
Backend select_backend(Pass pass, const Params& p, const Launch& launch, Backend requested);

// The explain_* functions' answer for the validated call `p` (attncore/backend.h): select() for
// automatic on this thread, after refusing a named `backend` that cannot run the call as the call
// itself refuses it (select_backend).
Explanation explain_call(Pass pass, const Params& p, const Options& options, Backend backend);

}  // namespace attncore::detail
