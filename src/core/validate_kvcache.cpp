// Input validation of attention over a KV cache (attncore/kvcache.h): q and the cache (of q's
// dtype, or bf16 / f16 under an f32 query), the int32 arrays and their values, then the options
// as for dense calls (no mask, no dropout).
// Messages follow docs/design.md section 4.
#include <algorithm>
#include <string>

#include "attncore/error.h"
#include "core/validate.h"
#include "core/validate_checks.h"

namespace attncore::detail {

namespace {

// An int32 [n] array, contiguous; returns its data.
const std::int32_t* index_array(const Checker& check, const TensorView& t, const char* name,
                                std::int64_t n) {
  check.structure(t, name);
  if (t.dtype != DType::i32) {
    check.fail(std::string(name) + " has the wrong dtype (dtype=" + std::string(name_of(t.dtype)) +
               ", expected i32)");
  }
  if (t.rank != 1 || t.size(0) != n) {
    check.fail(std::string(name) + " has shape " + t.shape_string() + ", expected [" +
               std::to_string(n) + "] ([B])");
  }
  if (n > 1 && t.stride_of(0) != 1) {
    check.fail(std::string(name) + " is not contiguous (stride[0]=" +
               std::to_string(t.stride_of(0)) + ", expected 1); pass a contiguous copy");
  }
  return static_cast<const std::int32_t*>(t.data);
}

}  // namespace

void block_table_of(const Checker& check, const TensorView& t, std::int64_t batch,
                    std::int64_t page_size, const char* pool, const std::string& pool_shape,
                    const char* pool_layout, SeqInfo& seq) {
  if (page_size < 1) {
    check.fail(std::string(pool) + " has shape " + pool_shape + ", expected " + pool_layout +
               " with page_size >= 1 (page_size=" + std::to_string(page_size) + ")");
  }
  check.structure(t, "block_table");
  if (t.dtype != DType::i32) {
    check.fail("block_table has the wrong dtype (dtype=" + std::string(name_of(t.dtype)) +
               ", expected i32)");
  }
  if (t.rank != 2 || t.size(0) != batch) {
    check.fail("block_table has shape " + t.shape_string() + ", expected [" +
               std::to_string(batch) + ", max_pages_per_seq] ([B, max_pages_per_seq])");
  }
  if (t.size(1) > 1 && t.stride_of(1) != 1) {
    check.fail("block_table has a non-unit last stride (stride[1]=" +
               std::to_string(t.stride_of(1)) + ", expected 1); pass a contiguous copy");
  }
  check.count("block_table makes too large a capacity", "max_pages_per_seq * page_size",
              {t.size(1), page_size});
  seq.block_table = static_cast<const std::int32_t*>(t.data);
  seq.block_table_stride = t.stride_of(0);
  seq.page_size = page_size;
}

void check_pages(const Checker& check, const SeqInfo& seq, std::int64_t b, std::int64_t start,
                 std::int64_t end, std::int64_t num_pages, const char* pool) {
  if (start >= end) return;
  const std::int32_t* row = seq.block_table + b * seq.block_table_stride;
  for (std::int64_t i = start / seq.page_size; i <= (end - 1) / seq.page_size; ++i) {
    if (row[i] < 0 || row[i] >= num_pages) {
      check.fail("block_table names no page of the " + std::string(pool) +
                 " for slots in use (block_table[" + std::to_string(b) + "][" + std::to_string(i) +
                 "]=" + std::to_string(row[i]) + ", expected 0 <= page < num_pages=" +
                 std::to_string(num_pages) + " for sequence " + std::to_string(b) + "'s slots [" +
                 std::to_string(start) + ", " + std::to_string(end) + "))");
    }
  }
}

// (Engines keep the cache 16-bit and the rest of the model in f32.)
DType cache_dtype(const Checker& check, const TensorView& q, const TensorView& k,
                  const TensorView& v, const char* k_name, const char* v_name) {
  const std::string kn = k_name;
  check.floating_query(q);
  const bool mixed = q.dtype == DType::f32 && (k.dtype == DType::bf16 || k.dtype == DType::f16);
  if (k.dtype != q.dtype && !mixed) {  // (K first: a V like it is then right)
    check.fail(kn + " has the wrong dtype for the query (" + kn + "=" +
               std::string(name_of(k.dtype)) + ", query=" + std::string(name_of(q.dtype)) +
               ", expected " + kn + " like query, or bf16 or f16 under an f32 query)");
  }
  check.dtype(v, v_name, k.dtype, (" like " + kn).c_str());
  return k.dtype;
}

Params validate_kvcache_forward(const ForwardArgs& a, const KvCacheSeqs& s, const Options& o,
                                Backend backend, bool check_outputs) {
  const Checker check("forward");
  check.backend(backend);
  check.view(a.q, "query", 4, "[B, Hq, Lq, D]");
  const bool paged = s.block_table.has_value();
  check.view(a.k, "k_cache", 4,
             paged ? "[num_pages, Hkv, page_size, D]" : "[B_cache, Hkv, capacity, D]");
  check.view(a.v, "v_cache", 4,
             paged ? "[num_pages, Hkv, page_size, Dv]" : "[B_cache, Hkv, capacity, Dv]");
  Params p;
  p.dtype = a.q.dtype;
  p.kv_dtype = cache_dtype(check, a.q, a.k, a.v, "k_cache", "v_cache");
  check.unit_last_stride(a.q, "query");
  check.unit_last_stride(a.k, "k_cache");
  check.unit_last_stride(a.v, "v_cache");
  p.batch = a.q.size(0);
  p.heads_q = a.q.size(1);
  p.head_dim = a.q.size(3);
  p.heads_kv = a.k.size(1);
  p.head_dim_v = a.v.size(3);
  check.dims(p);
  // Dense: cache rows and slots per row; paged: pages and rows per page.
  const std::int64_t cache_batch = a.k.size(0), rows = a.k.size(2);
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0 || a.k.size(3) != p.head_dim) {
    check.fail("k_cache has shape " + a.k.shape_string() + ", expected " +
               (paged ? "[num_pages, Hkv, page_size, " : "[B_cache, Hkv, capacity, ") +
               std::to_string(p.head_dim) + "] with Hq % Hkv == 0 (Hq=" +
               std::to_string(p.heads_q) + ", Hkv=" + std::to_string(p.heads_kv) + ")");
  }
  check.group(p, o);
  const std::int64_t v_expected[4] = {cache_batch, p.heads_kv, rows, p.head_dim_v};
  check.shape(a.v, "v_cache", v_expected,
              paged ? "[num_pages, Hkv, page_size, Dv] like k_cache"
                    : "[B_cache, Hkv, capacity, Dv] like k_cache");

  SeqInfo& seq = p.seq;
  seq.lq = a.q.size(2);
  seq.cache_seqlens = index_array(check, s.cache_seqlens, "cache_seqlens", p.batch);
  if (paged) {
    block_table_of(check, *s.block_table, p.batch, rows, "k_cache", a.k.shape_string(),
                   "[num_pages, Hkv, page_size, D]", seq);
    if (s.cache_batch_idx.has_value()) {
      check.unsupported(
          "cache_batch_idx is not supported with a paged cache (cache_batch_idx="
          "given, expected none with block_table); flash-attn refuses it too");
    }
  } else if (s.cache_batch_idx.has_value()) {
    seq.cache_batch = index_array(check, *s.cache_batch_idx, "cache_batch_idx", p.batch);
  } else if (cache_batch != p.batch) {
    check.fail("k_cache has shape " + a.k.shape_string() + ", expected a batch of " +
               std::to_string(p.batch) + " like query (B_cache=" + std::to_string(cache_batch) +
               ", expected B_cache == B without cache_batch_idx)");
  }
  const std::int64_t capacity = paged ? s.block_table->size(1) * rows : rows;
  seq.lk = capacity;
  if (s.cache_leftpad.has_value()) {
    seq.cache_leftpad = index_array(check, *s.cache_leftpad, "cache_leftpad", p.batch);
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t end = seq.cache_seqlens[b];
    if (end < 0 || end > capacity) {
      check.fail("cache_seqlens is out of range (cache_seqlens[" + std::to_string(b) +
                 "]=" + std::to_string(end) + ", expected 0 <= cache_seqlens[b] <= capacity=" +
                 (paged ? "max_pages_per_seq * page_size=" : "") + std::to_string(capacity) + ")");
    }
    if (seq.cache_batch != nullptr &&
        (seq.cache_batch[b] < 0 || seq.cache_batch[b] >= cache_batch)) {
      check.fail("cache_batch_idx is out of range (cache_batch_idx[" + std::to_string(b) +
                 "]=" + std::to_string(seq.cache_batch[b]) +
                 ", expected 0 <= idx < B_cache=" + std::to_string(cache_batch) + ")");
    }
    const std::int64_t start = seq.cache_leftpad != nullptr ? seq.cache_leftpad[b] : 0;
    if (start < 0 || start > end) {
      check.fail("cache_leftpad is out of range (cache_leftpad[" + std::to_string(b) +
                 "]=" + std::to_string(start) +
                 ", expected 0 <= cache_leftpad[b] <= "
                 "cache_seqlens[b]=" +
                 std::to_string(end) + ")");
    }
    if (paged) check_pages(check, seq, b, start, end, cache_batch, "cache");
    seq.longest_k = std::max(seq.longest_k, end - start);
  }
  seq.longest_q = seq.lq;
  check.count("query and the cache make too many (query, key) pairs",
              "B * Hq * Lq * the longest cache_seqlens[b] - cache_leftpad[b]",
              {p.batch, p.heads_q, seq.lq, seq.longest_k});
  if (o.mask.has_value()) {
    check.unsupported(
        "mask is not supported with a KV cache (mask=given, expected none); use "
        "causal, window_left/window_right or cache_seqlens");
  }
  resolve_variant(check, o, p);  // (a dropout_p out of range first, as invalid)
  if (o.dropout_p != 0.0) {
    check.unsupported("dropout is not supported with a KV cache (dropout_p=" +
                      fmt_double(o.dropout_p) + ", expected 0)");
  }
  if (!check_outputs) {
    check.count("out would have too many elements", "B * Hq * Lq * Dv",
                {p.batch, p.heads_q, seq.lq, p.head_dim_v});
    return p;
  }
  const std::int64_t out_shape[4] = {p.batch, p.heads_q, seq.lq, p.head_dim_v};
  check.view(a.out, "out", 4, "[B, Hq, Lq, Dv]");
  check.dtype(a.out, "out", p.dtype, "");
  check.shape(a.out, "out", out_shape, "[B, Hq, Lq, Dv]");
  check.unit_last_stride(a.out, "out");
  check.writable(a.out, "out");
  if (a.lse.data != nullptr || a.lse.rank != 0) {
    check.view(a.lse, "lse", 3, "[B, Hq, Lq]");
    check.dtype(a.lse, "lse", p.dtype == DType::f64 ? DType::f64 : DType::f32,
                " (f64 only for f64 inputs)");
    check.shape(a.lse, "lse", out_shape, "[B, Hq, Lq]");
    check.writable(a.lse, "lse");
  }
  check.separate({{&a.out, "out"}, {&a.lse, "lse"}},
                 {{&a.q, "query"},
                  {&a.k, "k_cache"},
                  {&a.v, "v_cache"},
                  alibi_view(o),
                  {&s.cache_seqlens, "cache_seqlens"},
                  {s.cache_batch_idx ? &*s.cache_batch_idx : nullptr, "cache_batch_idx"},
                  {s.cache_leftpad ? &*s.cache_leftpad : nullptr, "cache_leftpad"},
                  {s.block_table ? &*s.block_table : nullptr, "block_table"}});
  return p;
}

}  // namespace attncore::detail
