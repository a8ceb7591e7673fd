// Element access by dtype and the random inputs of a configured call.
#include "inputs.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "measure.h"

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

// int32 offsets [B + 1] of sequences of these lengths, from 0.
Tensor offsets(const std::vector<std::int64_t>& lengths) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(lengths.size()) + 1});
  std::int64_t at = 0;
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    at += lengths[b];
    store(t, static_cast<std::int64_t>(b) + 1, static_cast<double>(at));
  }
  return t;
}

}  // namespace

void require_memory(const char* op, const std::string& what, double bytes) {
  const attncore::MemoryLimit limit = attncore::memory_limit();
  if (bytes <= limit.bytes) return;
  char text[160];
  std::snprintf(text, sizeof text, " (bytes=%.4g, expected <= %.4g, %s); reduce the sizes", bytes,
                limit.bytes, limit.name);
  throw attncore::OutOfMemory(std::string(op) + ": " + what +
                              " need more memory than this process may use" + text);
}

double bytes_of(const TensorView& t) {
  double n = t.rank > 0 ? static_cast<double>(attncore::size_of(t.dtype)) : 0.0;
  for (int d = 0; d < t.rank; ++d) n *= static_cast<double>(t.size(d));
  return n;
}

Tensor allocate_like(const TensorView& t) {
  return t.rank > 0 ? Tensor(t.dtype, t.shape.data(), t.rank) : Tensor();
}

PreparedCall prepare_call(const RunConfig& c, const char* op) {
  // Dense [B, H, L, D] or packed [total, H, D] (RunConfig::views).
  const CallViews shapes = c.views(nullptr);
  // Inputs (dout with --backward) and the outputs run_once allocates (dq, dk, dv: q, k, v's).
  double bytes = bytes_of(shapes.q) + bytes_of(shapes.k) + bytes_of(shapes.v) +
                 bytes_of(shapes.out) + bytes_of(shapes.lse) + bytes_of(shapes.alibi) +
                 bytes_of(shapes.mask);
  if (c.backward) {
    bytes += bytes_of(shapes.out) + bytes_of(shapes.q) + bytes_of(shapes.k) + bytes_of(shapes.v);
  }
  if (c.is_cache()) bytes += cache_bytes(c);
  require_memory(op, c.is_cache() ? "the KV cache and the call's tensors" : "the call's tensors",
                 bytes);
  PreparedCall p;
  p.cfg = c;
  p.q = allocate_like(shapes.q);
  p.k = allocate_like(shapes.k);
  p.v = allocate_like(shapes.v);
  // Inputs in [-1, 1): scores of size ~sqrt(D)/3 * scale, a realistic softmax spread.
  fill_uniform(p.q, c.seed, 1, -1, 1);
  fill_uniform(p.k, c.seed, 2, -1, 1);
  fill_uniform(p.v, c.seed, 3, -1, 1);
  if (c.backward) {
    p.dout = allocate_like(shapes.out);
    fill_uniform(p.dout, c.seed, 4, -1, 1);
  }
  if (c.is_varlen()) {
    p.cu_seqlens_q = offsets(c.varlen);
    p.cu_seqlens_k = offsets(c.varlen_k);
    p.seqs.cu_seqlens_q = p.cu_seqlens_q;
    p.seqs.cu_seqlens_k = p.cu_seqlens_k;
    if (!c.seqused_k.empty()) {
      p.seqused_k = Tensor(DType::i32, {c.batch});
      for (std::int64_t b = 0; b < c.batch; ++b) {
        store(p.seqused_k, b, static_cast<double>(c.seqused_k[static_cast<std::size_t>(b)]));
      }
      p.seqs.seqused_k = p.seqused_k.view();
    }
    p.seqs.max_seqlen_q = c.seqlen_q;
    p.seqs.max_seqlen_k = c.seqlen_k;
  }
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
