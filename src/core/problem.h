// A validated attention call: sizes, resolved options and views, as every backend receives it.
// Only src/core/validate.cpp builds one; nothing below it re-checks.
#pragma once

#include <cstdint>

#include "attncore/options.h"
#include "attncore/tensor.h"

namespace attncore::detail {

enum class MaskKind : std::uint8_t { none, boolean, additive };

struct Problem {
  std::int64_t batch = 0;       // B
  std::int64_t heads_q = 0;     // Hq
  std::int64_t heads_kv = 0;    // Hkv
  std::int64_t seqlen_q = 0;    // Lq
  std::int64_t seqlen_k = 0;    // Lk
  std::int64_t head_dim = 0;    // D
  std::int64_t head_dim_v = 0;  // Dv
  std::int64_t group = 1;       // Hq / Hkv: query heads per key/value head
  DType dtype = DType::f32;     // of q, k, v, out (and dout, dq, dk, dv)

  double scale = 1.0;
  Causal causal = Causal::none;
  std::int64_t window_left = -1;  // -1 = unbounded; windows wider than Lq + Lk become -1
  std::int64_t window_right = -1;
  double softcap = 0.0;  // 0 = off

  // ALiBi slope of (b, h) is alibi[b * alibi_stride_b + h * alibi_stride_h] (f32).
  const float* alibi = nullptr;
  std::int64_t alibi_stride_b = 0;
  std::int64_t alibi_stride_h = 0;

  // The mask as a rank-4 view [B, Hq, Lq, Lk] with stride 0 on broadcast dims.
  MaskKind mask_kind = MaskKind::none;
  TensorView mask;
  // The mask's own rank and shape (dbias is reduced to it).
  TensorView mask_original;
  bool compute_dbias = false;

  double dropout_p = 0.0;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;

  int threads = 1;

  bool empty_output() const { return batch == 0 || heads_q == 0 || seqlen_q == 0; }
};

// The views of a forward call: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv],
// out [B, Hq, Lq, Dv], lse [B, Hq, Lq] (lse.data may be null: not wanted).
struct ForwardArgs {
  TensorView q, k, v, out, lse;
};

// The views of a backward call: as ForwardArgs plus dout [B, Hq, Lq, Dv] and the gradients
// dq/dk/dv shaped like q/k/v; dbias shaped like the original mask (data null when not wanted).
struct BackwardArgs {
  TensorView dout, q, k, v, out, lse, dq, dk, dv, dbias;
};

}  // namespace attncore::detail
