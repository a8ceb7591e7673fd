// attncore: exact scaled-dot-product attention.
//
// Layout: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], out [B, Hq, Lq, Dv],
// lse [B, Hq, Lq]. Views are strided in elements; only the last stride must be 1, so the
// flash layout [B, L, H, D] is passed with `view.transposed(1, 2)` and no copy.
#pragma once

#include <optional>

#include "attncore/backend.h"
#include "attncore/dtype.h"
#include "attncore/error.h"
#include "attncore/export.h"
#include "attncore/info.h"
#include "attncore/options.h"
#include "attncore/tensor.h"

namespace attncore {

struct ForwardResult {
  Tensor out;  // [B, Hq, Lq, Dv], dtype of q
  Tensor lse;  // [B, Hq, Lq], f32 (f64 for f64 inputs); -inf on rows with no visible key
};

struct BackwardResult {
  Tensor dq;     // [B, Hq, Lq, D], dtype of q
  Tensor dk;     // [B, Hkv, Lk, D]
  Tensor dv;     // [B, Hkv, Lk, Dv]
  Tensor dbias;  // shape of options.mask (contiguous), when options.compute_dbias; else empty
};

// Attention forward into new tensors.
ATTNCORE_API ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const Options& options = {},
                                   Backend backend = Backend::automatic);

// Attention forward into caller-provided views: `out` [B, Hq, Lq, Dv] of q's dtype (or f32 for
// bf16/f16 inputs: the output unrounded) and, when given, `lse` [B, Hq, Lq] (f32, or f64 for
// f64 inputs). Both are fully written. An output may
// share no byte with another output or with an input (InvalidArgument naming both); outputs
// interleaved in one buffer without touching are fine (the test is exact on element bytes).
ATTNCORE_API void forward_into(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               const Options& options = {}, Backend backend = Backend::automatic);

// Gradients of the forward call with the same q, k, v and options, given its out and lse. For
// bf16/f16 inputs `out` may be f32 (forward_into writes one): Delta = rowsum(dout * out) then
// carries no 16-bit rounding, which dq and dk otherwise inherit (README: 16-bit gradients).
ATTNCORE_API BackwardResult backward(const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& lse,
                                     const Options& options = {},
                                     Backend backend = Backend::automatic);

// The same into caller-provided views (dq/dk/dv shaped like q/k/v and of their dtype; dbias
// shaped like options.mask, required iff options.compute_dbias), none sharing a byte with
// another or with an input: dq, dk, dv may be slices of one packed [B, L, 3, H, D] buffer.
ATTNCORE_API void backward_into(const TensorView& dout, const TensorView& q, const TensorView& k,
                                const TensorView& v, const TensorView& out, const TensorView& lse,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const std::optional<TensorView>& dbias, const Options& options = {},
                                Backend backend = Backend::automatic);

}  // namespace attncore

#include "attncore/varlen.h"
#include "attncore/merge.h"
#include "attncore/kvcache.h"
#include "attncore/paged.h"
