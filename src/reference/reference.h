// The `reference` backend: plain loops over (b, h, i, j), fp64 accumulation, every option.
// Obviously correct first, fast never.
#pragma once

#include "core/params.h"

namespace attncore::detail {

void reference_forward(const Params& p, const Launch& launch, const ForwardArgs& args);
void reference_backward(const Params& p, const Launch& launch, const BackwardArgs& args);

}  // namespace attncore::detail
