// Attention over a KV cache (flash-attn's flash_attn_with_kvcache layout), forward only:
//
//   q       [B, Hq, Lq, D]                new query rows (flash layout [B, Lq, Hq, D] passed as
//                                         its transposed(1, 2) view)
//   k_cache [B_cache, Hkv, capacity, D]   (flash layout [B_cache, capacity, Hkv, D] transposed)
//   v_cache [B_cache, Hkv, capacity, Dv]
//   out [B, Hq, Lq, Dv], lse [B, Hq, Lq]
//
// Sequence b attends to cache slots [leftpad[b], cache_seqlens[b]) of cache row
// cache_batch_idx[b] (or row b): cache_seqlens is the physical end of its keys, cache_leftpad
// the physical start, and positions are logical (slot minus leftpad) for the causal diagonal
// (lower-right, against the sequence's length), windows and ALiBi. Slots outside the range are
// never read. Decode is Lq = 1; chunked prefill Lq > 1. Tensor masks and dropout are not
// supported with a cache (Unsupported); q and the cache share one dtype.
#pragma once

#include <optional>

#include "attncore/attncore.h"

namespace attncore {

struct KvCacheSeqs {
  TensorView cache_seqlens;                   // i32 [B]: 0 <= cache_seqlens[b] <= capacity
  std::optional<TensorView> cache_batch_idx;  // i32 [B]: rows of the cache, 0 <= idx < B_cache
  std::optional<TensorView> cache_leftpad;    // i32 [B]: 0 <= leftpad[b] <= cache_seqlens[b]
};

ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                              const TensorView& v_cache, const KvCacheSeqs& seqs,
                              const Options& options = {}, Backend backend = Backend::automatic);

// Into caller-provided views: out [B, Hq, Lq, Dv] and, when given, lse [B, Hq, Lq].
void forward_kvcache_into(const TensorView& q, const TensorView& k_cache,
                          const TensorView& v_cache, const KvCacheSeqs& seqs,
                          const TensorView& out, const std::optional<TensorView>& lse,
                          const Options& options = {}, Backend backend = Backend::automatic);

}  // namespace attncore
