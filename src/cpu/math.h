// The `math` backend (PyTorch's sense): per (batch, head) the score matrix S = Q K^T is
// materialised by a BLAS GEMM, the row-wise options and softmax run in between, and O = P V is
// a second GEMM. fp32 accumulation (fp64 for f64 inputs). The baseline the fused kernels must
// beat, and the fallback for anything they do not support.
#pragma once

#include "core/problem.h"

namespace attncore::detail {

void math_forward(const Problem& p, const ForwardArgs& args);
void math_backward(const Problem& p, const BackwardArgs& args);

}  // namespace attncore::detail
