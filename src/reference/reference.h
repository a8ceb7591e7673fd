// The `reference` backend: plain loops over (b, h, i, j), fp64 accumulation, every option.
// Obviously correct first, fast never.
#pragma once

#include "core/backend_table.h"

namespace attncore::detail {

void reference_forward(const Params& p, const Launch& launch, const ForwardArgs& args);
void reference_backward(const Params& p, const Launch& launch, const BackwardArgs& args);
// Bytes the call allocates: per thread, a row's scores (and in the backward a kv head's dK, dV).
double reference_workspace_bytes(Pass pass, const Params& p, const Launch& launch);

}  // namespace attncore::detail
