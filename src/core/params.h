// The one description of a validated attention call, as every backend receives it: geometry,
// sequence info, variant (score modifiers and masks) and dropout in `Params`; the views (q, the
// KV source k/v, outputs) in `ForwardArgs` / `BackwardArgs`; threads apart in `Launch`. Only
// src/core/validate.cpp builds a Params; nothing below it re-checks.
//
// Dense and variable-length calls differ only in their SeqInfo. A backend resolves sequence b
// once per work item (resolve_sequence, core/sequence.h) into a dense Params of that sequence's
// lengths with views rebased to its first rows: kernels only ever see dense sequences.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "attncore/options.h"
#include "attncore/tensor.h"
#include "core/exit_guard.h"

namespace attncore::detail {

enum class MaskKind : std::uint8_t { none, boolean, additive };

// Where sequence b's rows are: query rows [q0, q0 + lq) and key rows [k0, k0 + lk) of the
// packed buffers (dense: q0 = k0 = 0, the batch dim addresses the sequence). kv_batch >= 0:
// the keys are in batch row kv_batch of the K/V views (a KV cache's row), not in row b.
// pages (paged cache): sequence b's row of the block table; its keys are the cache's slots
// [k0, k0 + lk), slot s being row s % page_size of page pages[s / page_size].
struct SeqSpan {
  std::int64_t q0, lq, k0, lk;
  std::int64_t kv_batch = -1;
  const std::int32_t* pages = nullptr;
};

// The sequence-info policy: dense (every sequence has lq queries and lk keys), varlen
// (flash-attn's cu_seqlens: sequence b has queries [cu_q[b], cu_q[b+1]) and keys
// [cu_k[b], cu_k[b] + (used_k ? used_k[b] : cu_k[b+1] - cu_k[b]))), or a KV cache (lq queries
// per sequence; sequence b's keys are slots [leftpad[b], cache_seqlens[b]) of cache row
// cache_batch[b], or of row b; paged: of the pages its row of block_table names). A varlen call
// over page pools (block_table set) keeps its queries; its keys are slots [0, used_k[b] or
// cu_k[b+1] - cu_k[b]) of the pages.
struct SeqInfo {
  // Dense: the lengths of every sequence. Varlen: max_seqlen_q / max_seqlen_k as passed (they
  // may exceed the real maxima; dropout addresses elements with them). Cache: Lq and the
  // cache's capacity.
  std::int64_t lq = 0, lk = 0;
  // Varlen only (null otherwise), validated: int32 [B + 1], [B + 1], [B] or null.
  const std::int32_t* cu_q = nullptr;
  const std::int32_t* cu_k = nullptr;
  const std::int32_t* used_k = nullptr;
  // Cache only (null otherwise), validated: int32 [B]; the other two may be null.
  const std::int32_t* cache_seqlens = nullptr;
  const std::int32_t* cache_batch = nullptr;
  const std::int32_t* cache_leftpad = nullptr;
  // Paged cache or varlen over page pools only (null otherwise), validated: int32 [B, pages
  // per sequence], row b at block_table + b * block_table_stride (elements); every page a
  // sequence uses is a valid page of the pool. A cache's lk is then the capacity pages per
  // sequence * page_size.
  const std::int32_t* block_table = nullptr;
  std::int64_t block_table_stride = 0;
  std::int64_t page_size = 0;
  // Varlen and cache: the longest real sequence (sizes workspaces). Varlen: the rows of the
  // buffers (keys over page pools: 0, none).
  std::int64_t longest_q = 0, longest_k = 0;
  std::int64_t rows_q = 0, rows_k = 0;

  bool varlen() const { return cu_q != nullptr; }
  bool cache() const { return cache_seqlens != nullptr; }
  bool paged() const { return block_table != nullptr; }
  // Whether sequences differ (varlen, cache): backends resolve each one (core/sequence.h).
  bool per_sequence() const { return varlen() || cache(); }
  // The longest query / key sequence any work item sees.
  std::int64_t max_q() const { return varlen() ? longest_q : lq; }
  std::int64_t max_k() const { return per_sequence() ? longest_k : lk; }
  SeqSpan at(std::int64_t b) const {
    if (cache()) {
      const std::int64_t k0 = cache_leftpad != nullptr ? cache_leftpad[b] : 0;
      if (block_table != nullptr) {
        return {0, lq, k0, cache_seqlens[b] - k0, -1, block_table + b * block_table_stride};
      }
      return {0, lq, k0, cache_seqlens[b] - k0, cache_batch != nullptr ? cache_batch[b] : b};
    }
    if (!varlen()) return {0, lq, 0, lk};
    const std::int64_t k0 = cu_k[b];
    const std::int64_t keys = used_k != nullptr ? std::int64_t{used_k[b]} : cu_k[b + 1] - k0;
    if (block_table != nullptr) {
      return {cu_q[b], cu_q[b + 1] - cu_q[b], 0, keys, -1, block_table + b * block_table_stride};
    }
    return {cu_q[b], cu_q[b + 1] - cu_q[b], k0, keys};
  }
};

// Dropout (docs/design.md section 1.5): element (b, h, i, j) is addressed as if the batch were
// [B, Hq, rows, cols]: rows = Lq, cols = Lk dense; max_seqlen_q, max_seqlen_k varlen.
struct Dropout {
  double p = 0.0;  // 0 = off
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  std::int64_t rows = 0, cols = 0;
  bool active() const { return p > 0.0; }
};

// A paged KV source (docs/design.md section 1, KV cache): key j of this sequence is row
// (first + j) % page_size of page pages[(first + j) / page_size] of the K/V views, whose dim 0
// is the page and dim 2 the row within the page. pages == nullptr: K/V are plain views.
struct KvPages {
  const std::int32_t* pages = nullptr;
  std::int64_t page_size = 0;
  std::int64_t first = 0;
  bool paged() const { return pages != nullptr; }
};

struct Params {
  // Geometry.
  std::int64_t batch = 0;       // B
  std::int64_t heads_q = 0;     // Hq
  std::int64_t heads_kv = 0;    // Hkv
  std::int64_t head_dim = 0;    // D
  std::int64_t head_dim_v = 0;  // Dv
  std::int64_t group = 1;       // Hq / Hkv: query heads per key/value head
  DType dtype = DType::f32;     // of q and out (and dout, dq, dk, dv); of k and v but below
  // Of k and v: dtype, except a KV cache's (or a varlen call's page pools') bf16 or f16 K/V
  // under an f32 query (forward only; validate_kvcache.cpp, validate_varlen.cpp). Backends
  // read each view in its own dtype and compute in dtype's.
  DType kv_dtype = DType::f32;

  // Sequence info: a resolved (per-sequence) Params is always dense; its keys may be paged.
  SeqInfo seq;
  KvPages kv_pages;  // set only by resolve_sequence, for a sequence whose keys are in pages

  // Variant: score modifiers and masks (docs/design.md section 1.2-1.3).
  double scale = 1.0;
  Causal causal = Causal::none;
  std::int64_t window_left = -1;  // -1 = unbounded; windows wider than Lq + Lk become -1
  std::int64_t window_right = -1;
  double softcap = 0.0;  // 0 = off
  // ALiBi slope of (b, h) is alibi[b * alibi_stride_b + h * alibi_stride_h] (f32).
  const float* alibi = nullptr;
  std::int64_t alibi_stride_b = 0;
  std::int64_t alibi_stride_h = 0;
  // The mask as a rank-4 view [B, Hq, Lq, Lk] with stride 0 on broadcast dims (dense only).
  MaskKind mask_kind = MaskKind::none;
  TensorView mask;
  // The mask's own rank and shape (dbias is reduced to it).
  TensorView mask_original;
  bool compute_dbias = false;

  Dropout dropout;

  // Options::num_splits (flash's split-KV decode, cpu/flash_split_kv.h): 0 = planned.
  int num_splits = 0;

  // No query rows: a forward has nothing to compute or write but the rows past a packed
  // batch's sequences (fill_unused_rows).
  bool empty_output() const { return batch == 0 || heads_q == 0 || seq.max_q() == 0; }
  // Nor any key rows, nor a bias gradient (a broadcast mask's may have elements, zeros): a
  // backward has no gradient to write either (with key rows, dK and dV get zeros).
  bool empty_backward() const {
    return !compute_dbias && (batch == 0 || heads_q == 0 || (seq.max_q() == 0 && seq.max_k() == 0));
  }
};

// Thrown by a backend that finds the call cancelled between two work items, or between two key
// tiles of a flash item (and rethrown by the backward runs that waited for a tile the cancelled
// run abandoned); the entry points turn it into
// attncore::Cancelled with the op's name (cancelled_message; started = false: a flag read
// before anything was written).
struct CancelledWork {};
inline std::string cancelled_message(const char* op, bool started = true) {
  return std::string(op) + ": call is cancelled (cancel=true, expected false); the outputs are " +
         (started ? "incomplete" : "not written");
}

// How a call runs, apart from what it computes.
struct Launch {
  int threads = 1;                            // resolved: >= 1
  const std::atomic<bool>* cancel = nullptr;  // Options::cancel
  const Executor* executor = nullptr;         // Options::executor (run_tasks reads it)

  bool cancelled() const { return cancel != nullptr && cancel->load(std::memory_order_relaxed); }
  // Backends call this between work items: throws CancelledWork once the flag is set or the
  // process began to exit (core/exit_guard.h).
  void check_cancel() const {
    if (cancelled() || g_process_exiting.load(std::memory_order_relaxed)) throw CancelledWork{};
  }
};

// The views of a forward call: q [B, Hq, Lq, D], the KV source k [B, Hkv, Lk, D] and
// v [B, Hkv, Lk, Dv], out [B, Hq, Lq, Dv], lse [B, Hq, Lq] (lse.data may be null: not wanted).
// Varlen calls hold their packed buffers in the same rank-4 form with a batch dim of stride 0:
// q [total_q, Hq, D] as [1, Hq, total_q, D], lse [Hq, total_q] as [1, Hq, total_q].
struct ForwardArgs {
  TensorView q, k, v, out, lse;
};

// The views of a backward call: as ForwardArgs plus dout [B, Hq, Lq, Dv] and the gradients
// dq/dk/dv shaped like q/k/v; dbias shaped like the original mask (data null when not wanted).
struct BackwardArgs {
  TensorView dout, q, k, v, out, lse, dq, dk, dv, dbias;
};

}  // namespace attncore::detail
