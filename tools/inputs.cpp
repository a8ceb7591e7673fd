// Element access by dtype and the random inputs of a configured call.
#include "inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <tuple>
#include <utility>
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

// A packed batch's pages (--varlen with --page-size): per sequence, and in all (at least one).
struct VarlenPages {
  std::int64_t per_seq = 1, total = 0;
  explicit VarlenPages(const RunConfig& c) {
    for (std::int64_t keys : c.used_k()) {
      const std::int64_t n = pages_per_sequence(keys, c.page_size);
      per_seq = std::max(per_seq, n);
      total += n;
    }
    total = std::max<std::int64_t>(total, 1);
  }
};

// Its pool of K (width D) or V (width Dv) pages over `data`: [pages, page_size, Hkv, width].
TensorView pool_view(const RunConfig& c, std::int64_t width, void* data) {
  return TensorView::contiguous(data, c.dtype,
                                {VarlenPages(c).total, c.page_size, c.heads_kv, width});
}

// Its page pools and block table, in bytes (doubles: flags can overflow int64).
double varlen_pages_bytes(const RunConfig& c) {
  if (!c.is_varlen() || c.page_size <= 0) return 0;
  return bytes_of(pool_view(c, c.head_dim, nullptr)) +
         bytes_of(pool_view(c, c.head_dim_v, nullptr)) +
         static_cast<double>(c.batch) * static_cast<double>(VarlenPages(c).per_seq) *
             sizeof(std::int32_t);
}

// A packed batch's block table, and its sequences over the pools (p.paged_seqs): sequence b's
// used slot s is row s % page_size of page block_table[b][s / page_size], the pages handed out
// in a shuffled order (the run's seed), or one after the other with --pages-in-order; columns
// past a sequence's pages are -1.
void add_block_table(const RunConfig& c, PreparedCall& p) {
  const VarlenPages pages(c);
  const std::vector<std::int32_t> order = page_order(pages.total, c);
  p.block_table = Tensor(DType::i32, {c.batch, pages.per_seq});
  auto* table = p.block_table.data_as<std::int32_t>();
  std::fill_n(table, c.batch * pages.per_seq, -1);
  std::size_t next = 0;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    const std::int64_t n = pages_per_sequence(c.used_k()[static_cast<std::size_t>(b)], c.page_size);
    for (std::int64_t i = 0; i < n; ++i) table[b * pages.per_seq + i] = order[next++];
  }
  p.paged_seqs = p.seqs;
  p.paged_seqs.block_table = p.block_table.view();
}

// The pools of a packed batch: its used keys (p.k, p.v) copied to the slots the block table
// maps them to. After check_call: the library has checked that no sequence uses more keys than
// it has.
void fill_pages(const RunConfig& c, PreparedCall& p) {
  p.k_pages = allocate_like(pool_view(c, c.head_dim, nullptr));
  p.v_pages = allocate_like(pool_view(c, c.head_dim_v, nullptr));
  const std::int64_t ps = c.page_size, per_seq = p.block_table.size(1);
  const auto* table = p.block_table.data_as<const std::int32_t>();
  const auto item = static_cast<std::int64_t>(attncore::size_of(c.dtype));
  std::int64_t k0 = 0;  // sequence b's first row of p.k, p.v
  for (std::int64_t b = 0; b < c.batch; ++b) {
    const std::int64_t keys = c.used_k()[static_cast<std::size_t>(b)];
    for (std::int64_t s = 0; s < keys; ++s) {
      const std::int64_t slot = table[b * per_seq + s / ps] * ps + s % ps;
      for (auto [pool, packed, width] :
           {std::tuple{&p.k_pages, &p.k, c.head_dim}, std::tuple{&p.v_pages, &p.v, c.head_dim_v}}) {
        const std::int64_t row = c.heads_kv * width * item;
        std::memcpy(static_cast<char*>(pool->data()) + slot * row,
                    static_cast<const char*>(packed->data()) + (k0 + s) * row,
                    static_cast<std::size_t>(row));
      }
    }
    k0 += c.varlen_k[static_cast<std::size_t>(b)];
  }
}

}  // namespace

std::vector<std::int32_t> page_order(std::int64_t count, const RunConfig& c) {
  std::vector<std::int32_t> order(static_cast<std::size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  Random rng(c.seed ^ 7);
  for (std::size_t i = order.size(); i > 1 && !c.pages_in_order; --i) {
    std::swap(order[i - 1], order[static_cast<std::size_t>(rng.next() % i)]);
  }
  return order;
}

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

Tensor alibi_slopes(const RunConfig& c) {
  Tensor slopes = allocate_like(c.views(nullptr).alibi);
  if (c.alibi) {
    // The ALiBi paper's slopes: a geometric sequence starting at 2^(-8/Hq).
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      store(slopes, h,
            std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(c.heads_q)));
    }
  }
  return slopes;
}

PreparedCall check_call(const RunConfig& c, const char* op) {
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
  bytes += varlen_pages_bytes(c);
  require_memory(op, c.is_cache() ? "the KV cache and the call's tensors" : "the call's tensors",
                 bytes);
  PreparedCall p;
  p.cfg = c;
  p.alibi = alibi_slopes(c);
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
    if (c.page_size > 0) add_block_table(c, p);
  }
  if (c.is_cache()) add_cache_seqs(p);

  // The views point at one element of the widest dtype (aligned for every dtype); the library
  // reads none of their data. A named backend that cannot run the call is refused here too.
  static double no_data;
  const CallViews w = c.views(&no_data);
  const attncore::Options o = c.options(p.alibi, w.mask);
  if (c.is_cache()) {
    (void)attncore::explain_forward_kvcache(
        w.q, cache_storage(c, c.head_dim, &no_data).transposed(1, 2),
        cache_storage(c, c.head_dim_v, &no_data).transposed(1, 2), p.cache_seqs, o, c.backend);
  } else if (c.is_varlen()) {
    const bool paged = p.paged();
    (void)attncore::explain_forward_varlen(w.q, paged ? pool_view(c, c.head_dim, &no_data) : w.k,
                                           paged ? pool_view(c, c.head_dim_v, &no_data) : w.v,
                                           p.call_seqs(), o, c.backend);
    if (c.backward) {
      (void)attncore::explain_backward_varlen(w.out, w.q, w.k, w.v, w.out, w.lse, p.seqs, o,
                                              c.backend);
    }
  } else {
    (void)attncore::explain_forward(w.q, w.k, w.v, o, c.backend);
    if (c.backward) {
      (void)attncore::explain_backward(w.out, w.q, w.k, w.v, w.out, w.lse, o, c.backend);
    }
  }
  return p;
}

PreparedCall prepare_call(const RunConfig& c, const char* op) {
  PreparedCall p = check_call(c, op);
  const CallViews shapes = c.views(nullptr);
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
  if (p.paged()) fill_pages(c, p);
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
