// Element access by dtype and the random inputs of a configured call.
#include "inputs.h"

#include <cmath>

namespace attncore_tools {

using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;

void store(const TensorView& t, std::int64_t offset, double value) {
  switch (t.dtype) {
    case DType::f32:
      static_cast<float*>(t.data)[offset] = static_cast<float>(value);
      break;
    case DType::f64:
      static_cast<double*>(t.data)[offset] = value;
      break;
    case DType::bf16:
      static_cast<attncore::bf16*>(t.data)[offset] = attncore::bf16(static_cast<float>(value));
      break;
    case DType::f16:
      static_cast<attncore::f16*>(t.data)[offset] = attncore::f16(static_cast<float>(value));
      break;
    case DType::b8:
      static_cast<std::uint8_t*>(t.data)[offset] = value != 0.0;
      break;
    case DType::i32:
      static_cast<std::int32_t*>(t.data)[offset] = static_cast<std::int32_t>(value);
      break;
  }
}

double load(const TensorView& t, std::int64_t offset) {
  switch (t.dtype) {
    case DType::f32:
      return static_cast<const float*>(t.data)[offset];
    case DType::f64:
      return static_cast<const double*>(t.data)[offset];
    case DType::bf16:
      return static_cast<float>(static_cast<const attncore::bf16*>(t.data)[offset]);
    case DType::f16:
      return static_cast<float>(static_cast<const attncore::f16*>(t.data)[offset]);
    case DType::b8:
      return static_cast<const std::uint8_t*>(t.data)[offset];
    case DType::i32:
      return static_cast<const std::int32_t*>(t.data)[offset];
  }
  return 0;
}

namespace {

// Share of true entries of a random boolean mask: most pairs take part, as with padding.
constexpr double kBoolMaskKeep = 0.9;

// Fills a contiguous tensor with uniform values in [lo, hi); `stream` separates the tensors.
void fill_uniform(const Tensor& t, std::uint64_t seed, std::uint64_t stream, double lo, double hi) {
  Random rng(seed ^ (stream * 0xD1B54A32D192ED03ull));
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) store(t, i, lo + (hi - lo) * rng.uniform());
}

Tensor allocate_like(const TensorView& t) {
  return t.rank > 0 ? Tensor(t.dtype, t.shape.data(), t.rank) : Tensor();
}

}  // namespace

PreparedCall prepare_call(const RunConfig& c) {
  PreparedCall p;
  p.cfg = c;
  p.q = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim});
  p.k = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim});
  p.v = Tensor(c.dtype, {c.batch, c.heads_kv, c.seqlen_k, c.head_dim_v});
  // Inputs in [-1, 1): scores of size ~sqrt(D)/3 * scale, a realistic softmax spread.
  fill_uniform(p.q, c.seed, 1, -1, 1);
  fill_uniform(p.k, c.seed, 2, -1, 1);
  fill_uniform(p.v, c.seed, 3, -1, 1);
  if (c.backward) {
    p.dout = Tensor(c.dtype, {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v});
    fill_uniform(p.dout, c.seed, 4, -1, 1);
  }
  const CallViews shapes = c.views(nullptr);
  p.alibi = allocate_like(shapes.alibi);
  if (c.alibi) {
    // The ALiBi paper's slopes: a geometric sequence starting at 2^(-8/Hq).
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      store(p.alibi, h,
            std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(c.heads_q)));
    }
  }
  p.mask = allocate_like(shapes.mask);
  if (c.mask == MaskKind::boolean) {
    Random rng(c.seed ^ 5);
    for (std::int64_t i = 0; i < p.mask.numel(); ++i)
      store(p.mask, i, rng.uniform() < kBoolMaskKeep);
  } else if (c.mask == MaskKind::additive) {
    fill_uniform(p.mask, c.seed, 6, -2, 0);
  }
  p.options = c.options(p.alibi, p.mask);
  return p;
}

}  // namespace attncore_tools
