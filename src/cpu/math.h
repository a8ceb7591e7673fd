// The `math` backend (PyTorch's sense): per (batch, head) the score matrix S = Q K^T is
// materialised by a GEMM (cpu/gemm.h), the row-wise options and softmax run in between, and
// O = P V is a second GEMM. fp32 accumulation (fp64 for f64 inputs). The baseline the fused kernels
// must beat, and the fallback for anything they do not support.
#pragma once

#include <cstdint>

#include <string>
#include <vector>

#include "core/backend_table.h"

namespace attncore::detail {

// 16-bit rows are converted to f32 by several threads only from this many elements on: waking
// the pool costs 4-35 us (the dispatch the cost model measures), converting an element 0.74-0.85
// ns (select.cpp: kMathConvertFlops), so a second thread gains only past about 2^15 elements.
// Below it, small bf16 calls on 2 threads took 0.95 ms against 0.15 ms on one.
constexpr std::int64_t kMathParallelConvertElements = std::int64_t{1} << 16;

void math_forward(const Params& p, const Launch& launch, const ForwardArgs& args);
void math_backward(const Params& p, const Launch& launch, const BackwardArgs& args);

// Its entry in the backend table (math_cost.cpp).
void math_can_use(Pass pass, const Params& p, std::vector<std::string>& reasons);
double math_estimate(Pass pass, const Params& p, const Launch& launch, const CostModel& model);
double math_workspace_bytes(Pass pass, const Params& p, const Launch& launch);

}  // namespace attncore::detail
