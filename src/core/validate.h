// Every check of every public entry point, in one place (DESIGN.md section 4).
#pragma once

#include "core/problem.h"

namespace attncore::detail {

// Throws InvalidArgument (or Unsupported) with a DESIGN.md section 4 message; else returns the
// resolved problem. With `check_outputs` false the output views are ignored (the library
// allocates them from the problem's sizes); else they are checked too, and `args.lse` may be
// an empty view (rank 0, null data) when the caller does not want the LSE.
Problem validate_forward(const ForwardArgs& args, const Options& options, Backend backend,
                         bool check_outputs);

Problem validate_backward(const BackwardArgs& args, const Options& options, Backend backend,
                          bool check_outputs);

}  // namespace attncore::detail
