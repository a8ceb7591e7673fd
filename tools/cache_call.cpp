// `attncore run --cache-len N [--page-size P] [--new-tokens T]`: new tokens attending to a dense
// or paged KV cache (attncore/kvcache.h), timed and checked (measure.h, run_cache).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attncore/kvcache.h"
#include "measure.h"

namespace attncore_tools {

using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;

namespace {

// Rows [first, first + count) of dim 2 of a [B, H, L, D] view.
TensorView rows(const TensorView& t, std::int64_t first, std::int64_t count) {
  TensorView r = t;
  r.data = static_cast<char*>(t.data) +
           first * t.stride_of(2) * static_cast<std::int64_t>(attncore::size_of(t.dtype));
  r.shape[2] = count;
  return r;
}

// Pages per sequence of a paged cache (0: dense).
std::int64_t pages_per_seq(const RunConfig& c) {
  return pages_per_sequence(c.seqlen_k, c.page_size);
}

// The slots of each row of a cache: its capacity (dense) or the page size.
std::int64_t cache_slots(const RunConfig& c) { return c.page_size > 0 ? c.page_size : c.seqlen_k; }

// The cache of one of K or V: rows [0, cache_len) of each sequence of `src`
// ([B, H, cache_len + T, width], contiguous) at slot s of sequence b, which is row s of cache row
// b (dense: [B, capacity, H, width]) or row s % P of page table[b][s / P] (paged:
// [pages, P, H, width]; `table` holds p.block_table's [B, per_seq] entries). Returns the cache in
// the library's [.., H, .., width] order.
struct Cache {
  Tensor storage;
  TensorView view;  // transposed(1, 2): [B or pages, H, capacity or P, width]
};

Cache make_cache(const RunConfig& c, const Tensor& src, const std::int32_t* table,
                 std::int64_t per_seq) {
  const std::int64_t heads = src.size(1), width = src.size(3), capacity = c.seqlen_k;
  const bool paged = c.page_size > 0;
  const std::int64_t slots = cache_slots(c);
  Cache cache;
  cache.storage = allocate_like(cache_storage(c, width, nullptr));
  const auto item = static_cast<std::int64_t>(attncore::size_of(src.dtype()));
  // (An empty cache copies nothing: with --cache-len 0 the batch can be as large as the memory
  // check lets the lengths be.)
  for (std::int64_t b = 0; b < c.batch && c.cache_len > 0; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t s = 0; s < c.cache_len; ++s) {
        const std::int64_t row =
            paged ? table[b * per_seq + s / c.page_size] * slots + s % c.page_size : b * slots + s;
        std::memcpy(static_cast<char*>(cache.storage.data()) + ((row * heads + h) * width) * item,
                    static_cast<const char*>(src.data()) +
                        (((b * heads + h) * capacity + s) * width) * item,
                    static_cast<std::size_t>(width * item));
      }
  cache.view = cache.storage.view().transposed(1, 2);
  return cache;
}

}  // namespace

TensorView cache_storage(const RunConfig& c, std::int64_t width, void* data) {
  const std::int64_t rows = c.page_size > 0 ? c.batch * pages_per_seq(c) : c.batch;
  return TensorView::contiguous(data, c.dtype, {rows, cache_slots(c), c.heads_kv, width});
}

double cache_bytes(const RunConfig& c) {
  // make_cache's storage (cache_storage, its bytes in double: flags can overflow int64).
  const double caches = bytes_of(cache_storage(c, c.head_dim, nullptr)) +
                        bytes_of(cache_storage(c, c.head_dim_v, nullptr));
  // The shuffled order and the block table copied from it: int32 [B, pages_per_seq] each.
  const double tables = 2.0 * static_cast<double>(c.batch) * static_cast<double>(pages_per_seq(c)) *
                        sizeof(std::int32_t);
  // Per sequence, however empty the cache: its int32 length, and the library's own entries of
  // the call's plan (a length, a work estimate, a part count and an append row: 36 bytes), so
  // that a huge --batch over an empty cache is refused here.
  const double sequences = static_cast<double>(c.batch) * (sizeof(std::int32_t) + 36.0);
  return caches + tables + sequences;
}

void add_cache_seqs(PreparedCall& p) {
  const RunConfig& c = p.cfg;
  p.cache_seqlens = Tensor(DType::i32, {c.batch});
  std::fill_n(p.cache_seqlens.data_as<std::int32_t>(), c.batch,
              static_cast<std::int32_t>(c.cache_len));
  p.cache_seqs.cache_seqlens = p.cache_seqlens;
  if (c.page_size > 0) {
    const std::int64_t per_seq = pages_per_seq(c);
    const std::vector<std::int32_t> order = page_order(c.batch * per_seq, c);
    p.block_table = Tensor(DType::i32, {c.batch, per_seq});
    std::copy(order.begin(), order.end(), p.block_table.data_as<std::int32_t>());
    p.cache_seqs.block_table = p.block_table.view();
  }
}

RunResult run_cache(const PreparedCall& p) {
  const RunConfig& c = p.cfg;
  const std::int64_t per_seq = pages_per_seq(c);
  const std::int32_t* table = c.page_size > 0 ? p.block_table.data_as<std::int32_t>() : nullptr;
  const Cache k = make_cache(c, p.k, table, per_seq);
  const Cache v = make_cache(c, p.v, table, per_seq);
  const attncore::KvCacheSeqs& seqs = p.cache_seqs;
  // The new tokens: the last new_tokens rows of p.k / p.v, appended in place by every call.
  const attncore::KvAppend append{rows(p.k, c.cache_len, c.new_tokens),
                                  rows(p.v, c.cache_len, c.new_tokens), std::nullopt, std::nullopt,
                                  false};
  RunResult r;
  r.backend = c.backend == attncore::Backend::automatic
                  ? attncore::explain_forward_kvcache(p.q, k.view, v.view, seqs, p.options).chosen
                  : c.backend;
  r.flops = forward_flops(c);
  r.kv_bytes = visible_keys(c) * static_cast<double>(c.heads_kv) *
               (static_cast<double>(c.head_dim) + static_cast<double>(c.head_dim_v)) *
               static_cast<double>(attncore::size_of(c.dtype));
  attncore::ForwardResult result;
  r.seconds = best_seconds(c.repeat, [&] {
    result = attncore::forward_kvcache(p.q, k.view, v.view, seqs, append, p.options, c.backend);
  });
  if (c.check) r.check = check_against_reference(p, result.out, nullptr, nullptr, nullptr);
  return r;
}

}  // namespace attncore_tools
