// Merging attention results over disjoint key sets (docs/design.md section 1.12): the exact
// combination split-KV decode, cascade (shared-prefix) attention and sequence parallelism are
// built on.
//
//   lse = log(exp(lse_a) + exp(lse_b))        (computed stably)
//   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
//
// A side with LSE -inf contributes nothing (whatever its output holds); both -inf give output 0
// and LSE -inf. An LSE of NaN or +inf gives NaN in that row (attncore gives -inf to a row with no
// visible key, where flash-attn's CUDA kernels write +inf: replace it with -inf before merging
// such results). The outputs may be of any rank and layout: out_a, out_b, out [..., Dv] of one
// shape and dtype (f32, bf16, f16 or f64), each LSE shaped as the output without its last dim
// (f32; f64 for f64 outputs), any non-negative strides (the last dim's too). So dense
// [B, Hq, Lq, Dv] with LSE [B, Hq, Lq], flash-layout [B, Lq, Hq, Dv] with LSE [B, Hq, Lq]
// seen as lse.transposed(1, 2), and varlen [total_q, Hq, Dv] with LSE [Hq, total_q] seen as
// lse.transposed(0, 1) all work.
//
// Cancellation: when `cancel` is not null, the call reads *cancel before it starts and between
// blocks of rows, and once it reads true, stops and throws attncore::Cancelled (the outputs are
// then incomplete), as Options::cancel does for attention calls.
#pragma once

#include <atomic>

#include "attncore/export.h"
#include "attncore/tensor.h"

namespace attncore {

struct MergeResult {
  Tensor out;  // the shape of out_a, contiguous
  Tensor lse;  // out's shape without its last dim
};

ATTNCORE_API MergeResult merge_attention_states(const TensorView& out_a, const TensorView& lse_a,
                                                const TensorView& out_b, const TensorView& lse_b,
                                                int num_threads = 0,
                                                const std::atomic<bool>* cancel = nullptr);

// Into caller-provided views. `out` may be the very view out_a or out_b (and `lse` lse_a or
// lse_b): each row is read before it is written, so a running merge needs no copy.
ATTNCORE_API void merge_attention_states_into(const TensorView& out_a, const TensorView& lse_a,
                                              const TensorView& out_b, const TensorView& lse_b,
                                              const TensorView& out, const TensorView& lse,
                                              int num_threads = 0,
                                              const std::atomic<bool>* cancel = nullptr);

}  // namespace attncore
