// The `reference` backend: plain loops over (b, h, i, j), fp64 accumulation, every option.
// Obviously correct first, fast never.
#pragma once

#include "core/problem.h"

namespace attncore::detail {

void reference_forward(const Problem& p, const ForwardArgs& args);
void reference_backward(const Problem& p, const BackwardArgs& args);

}  // namespace attncore::detail
