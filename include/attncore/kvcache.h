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
// supported with a cache (Unsupported).
//
// Dtypes: q and the cache share one dtype (f32, f64, bf16 or f16), or an f32 query attends to a
// bf16 or f16 cache (k_cache and v_cache alike): K and V are widened to f32 exactly, the
// products are f32, and out and lse are f32; the result is bitwise the same call over an f32
// cache holding the widened values (every SIMD target, GCC and clang builds). Other mixes are
// refused (InvalidArgument).
//
// With a KvAppend, new keys and values are first written into the cache in place at slots
// [cache_seqlens[b], cache_seqlens[b] + L_new) (rotated first, in f32, when rotary tables are
// given, then rounded once to the cache's dtype, to nearest even), then q attends to the cache as
// if cache_seqlens[b] were cache_seqlens[b] + L_new (the caller's array is not changed). Rotary
// rotates the first rotary_dim dims of each new key at its logical position cache_seqlens[b] -
// leftpad[b] + j, and of query row i at that position plus i when causal or windowed, else at
// cache_seqlens[b] - leftpad[b] (flash-attn's convention); interleaved pairs dims (2i, 2i + 1),
// else dim i with dim i + rotary_dim / 2.
//
// Paged cache (KvCacheSeqs::block_table given): k_cache is a pool of pages
// [num_pages, Hkv, page_size, D] (flash layout [num_pages, page_size, Hkv, D] transposed(1, 2),
// as for the dense cache), v_cache [num_pages, Hkv, page_size, Dv], any page_size >= 1. Each
// sequence has capacity max_pages_per_seq * page_size; its slot s is row s % page_size of page
// block_table[b][s / page_size]. Every page a sequence uses (slots [leftpad, cache_seqlens),
// after the append) must be in [0, num_pages); other entries (-1 for unmapped) are not read.
// cache_batch_idx is refused with a block table (flash-attn refuses it too); cache_leftpad
// works. Appends write through the block table as given: a page two sequences share is written
// for both (attncore/paged.h's PagedKvCache copies shared pages before writing; this does not).
#pragma once

#include <optional>

#include "attncore/attncore.h"
#include "attncore/export.h"

namespace attncore {

struct KvCacheSeqs {
  TensorView cache_seqlens{};                   // i32 [B]: 0 <= cache_seqlens[b] <= capacity
  std::optional<TensorView> cache_batch_idx{};  // i32 [B]: rows of the cache, 0 <= idx < B_cache
  std::optional<TensorView> cache_leftpad{};    // i32 [B]: 0 <= leftpad[b] <= cache_seqlens[b]
  std::optional<TensorView> block_table{};      // i32 [B, max_pages_per_seq]; -1 = unmapped
};

struct KvAppend {
  // In the cache's dtype, or in q's (f32 over a 16-bit cache); v_new in k_new's.
  TensorView k_new{};  // [B, Hkv, L_new, D] (flash layout: transposed(1, 2))
  TensorView v_new{};  // [B, Hkv, L_new, Dv]
  // Rotary tables, f32 [positions, rotary_dim / 2] both, or neither: rotary_dim = 2 x their
  // width, even and <= D; positions must cover every rotated position.
  std::optional<TensorView> rotary_cos{}, rotary_sin{};
  bool rotary_interleaved = false;
};

ATTNCORE_API ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                           const TensorView& v_cache, const KvCacheSeqs& seqs,
                                           const Options& options = {},
                                           Backend backend = Backend::automatic);

// Into caller-provided views: out [B, Hq, Lq, Dv] and, when given, lse [B, Hq, Lq].
ATTNCORE_API void forward_kvcache_into(const TensorView& q, const TensorView& k_cache,
                                       const TensorView& v_cache, const KvCacheSeqs& seqs,
                                       const TensorView& out, const std::optional<TensorView>& lse,
                                       const Options& options = {},
                                       Backend backend = Backend::automatic);

// Appends k_new / v_new into the cache (in place), then attends (see above). Appending with
// cache_batch_idx needs distinct rows (two sequences cannot write one cache row).
ATTNCORE_API ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                           const TensorView& v_cache, const KvCacheSeqs& seqs,
                                           const KvAppend& append, const Options& options = {},
                                           Backend backend = Backend::automatic);

// The same into caller-provided views, out [B, Hq, Lq, Dv] and, when given, lse [B, Hq, Lq]
// (which share no byte with any array of the call): a decode step that appends allocates no
// output (with rotary tables, the rotated query is still a copy).
ATTNCORE_API void forward_kvcache_into(const TensorView& q, const TensorView& k_cache,
                                       const TensorView& v_cache, const KvCacheSeqs& seqs,
                                       const KvAppend& append, const TensorView& out,
                                       const std::optional<TensorView>& lse,
                                       const Options& options = {},
                                       Backend backend = Backend::automatic);

// Validate like forward_kvcache (reading the index arrays) and explain the backend choice
// (attncore/backend.h), without running anything. A named `backend` that cannot run the call is
// refused as explain_forward refuses it.
ATTNCORE_API Explanation explain_forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                                 const TensorView& v_cache, const KvCacheSeqs& seqs,
                                                 const Options& options = {},
                                                 Backend backend = Backend::automatic);

// The same for a call with an append: validates everything forward_kvcache with `append` checks
// (writing nothing) and explains the choice for the call that attends after it.
ATTNCORE_API Explanation explain_forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                                 const TensorView& v_cache, const KvCacheSeqs& seqs,
                                                 const KvAppend& append,
                                                 const Options& options = {},
                                                 Backend backend = Backend::automatic);

}  // namespace attncore
