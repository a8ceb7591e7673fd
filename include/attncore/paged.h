// A paged KV cache that owns its pages (docs/design.md section 1, KV cache): a pool of
// num_pages pages of page_size slots each, a page table mapping each sequence's logical pages to
// pool pages, and each sequence's length, all usable directly by forward_kvcache
// (attncore/kvcache.h):
//
//   k_pages()    [num_pages, page_size, Hkv, D]    flash-attn's layout (pass transposed(1, 2))
//   v_pages()    [num_pages, page_size, Hkv, Dv]
//   page_table() i32 [max_batch, max_pages_per_seq], -1 unmapped   (KvCacheSeqs::block_table)
//   seqlens()    i32 [max_batch]                                     (KvCacheSeqs::cache_seqlens)
//
// The views are live: they address the cache's own memory, which the calls below change in
// place, and stay valid as long as the cache. page_table() is a copy of the cache's own
// bookkeeping, rewritten whenever a call changes a sequence's row: read it, do not write it (a
// write misleads the attention calls that read it until the row next changes, never the
// cache's reference counts or free pages). Sequence b holds logical pages 0, 1, ... (mapped
// in order; its capacity is their count * page_size).
//
// reserve / erase / assign follow torch's PagedAttention (torch.nn.attention.experimental):
// reserve(b, n) maps free pages until b's capacity is at least n (free pages are taken most
// recently freed first, the lowest index first at the start); erase(b) unmaps b's pages and
// returns the ones no other sequence shares; assign(b, positions, k, v) writes K/V rows at
// positions of sequence b. Stricter than torch: every argument is checked before anything
// changes; positions must lie within what b reserved and be distinct; running out of pages
// throws OutOfMemory naming the numbers ("requested 5 pages but only 3 are free"), and
// free_pages() lets a caller ask first.
//
// Beyond torch: fork(src, dst, prefix_len) gives the empty sequence dst the first prefix_len
// slots of src by sharing src's pages (a reference count per page; nothing is copied), and
// assign copies a shared page before writing into it (copy-on-write), so beam search and prompt
// caching copy no K/V. Appends through forward_kvcache's KvAppend with page_table() as the block
// table write the pages as they are mapped: they bypass copy-on-write (and do not change
// seqlens(), which the caller then advances, as with flash-attn).
//
// seqlens()[b] is b's length: assign raises it to the last position written + 1, fork sets
// dst's to prefix_len, erase to 0; callers may also write it (an attention call checks that the
// pages it reads are mapped).
//
// Thread safety: none per instance, like a standard container: calls that change the cache
// (reserve, erase, assign, fork, writes through the views) must not run concurrently with any
// other use of the same cache; concurrent reads (attention calls) are fine.
#pragma once

#include <cstdint>
#include <memory>

#include "attncore/dtype.h"
#include "attncore/export.h"
#include "attncore/tensor.h"

namespace attncore {

class ATTNCORE_API PagedKvCache {
 public:
  // Throws InvalidArgument for sizes < 1 (max_pages_per_seq: 0 = num_pages, at most num_pages),
  // a dtype other than f32, bf16, f16 or f64, or a capacity per sequence
  // (max_pages_per_seq * page_size) past 2^31 - 1; OutOfMemory when the pages exceed the
  // memory this process may use. Pages start zero, every sequence empty.
  PagedKvCache(std::int64_t num_pages, std::int64_t page_size, std::int64_t heads_kv,
               std::int64_t head_dim, std::int64_t head_dim_v, DType dtype,
               std::int64_t max_batch, std::int64_t max_pages_per_seq = 0);
  ~PagedKvCache();
  // Movable; a cache moved from throws InvalidArgument from every method until one is assigned
  // to it.
  PagedKvCache(PagedKvCache&&) noexcept;
  PagedKvCache& operator=(PagedKvCache&&) noexcept;
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  std::int64_t num_pages() const;
  std::int64_t page_size() const;
  std::int64_t heads_kv() const;
  std::int64_t head_dim() const;
  std::int64_t head_dim_v() const;
  DType dtype() const;
  std::int64_t max_batch() const;
  std::int64_t max_pages_per_seq() const;

  const TensorView& k_pages() const;     // [num_pages, page_size, Hkv, D]
  const TensorView& v_pages() const;     // [num_pages, page_size, Hkv, Dv]
  const TensorView& page_table() const;  // i32 [max_batch, max_pages_per_seq]
  const TensorView& seqlens() const;     // i32 [max_batch]

  std::int64_t free_pages() const;
  // Slots sequence b has reserved: its mapped pages * page_size.
  std::int64_t capacity(std::int64_t batch_idx) const;
  // How many sequences map pool page `page` (0: free).
  std::int64_t references(std::int64_t page) const;

  void reserve(std::int64_t batch_idx, std::int64_t seq_len);
  void erase(std::int64_t batch_idx);
  // positions i32 [S], k [S, Hkv, D], v [S, Hkv, Dv] of any float dtype (rounded to the cache's
  // nearest even), any non-negative strides, outside the cache's own memory (InvalidArgument).
  void assign(std::int64_t batch_idx, const TensorView& positions, const TensorView& k,
              const TensorView& v);
  void fork(std::int64_t src, std::int64_t dst, std::int64_t prefix_len);

 private:
  struct State;
  // The state, or InvalidArgument naming `method` when this cache was moved from.
  State& live(const char* method) const;
  std::unique_ptr<State> s_;
};

}  // namespace attncore
