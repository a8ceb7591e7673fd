// Variable-length ("packed") batches, flash-attn's varlen layout: the sequences of a batch are
// concatenated along the row dim, and int32 offsets say where each begins.
//
//   q   [total_q, Hq, D]     sequence b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b+1])
//   k   [total_k, Hkv, D]    its keys rows [cu_seqlens_k[b], cu_seqlens_k[b+1]) (or the first
//   v   [total_k, Hkv, Dv]   seqused_k[b] of them)
//   out [total_q, Hq, Dv], lse [Hq, total_q] (f32; f64 for f64 inputs)
//
// Causal alignment, windows and ALiBi apply per sequence; dropout addresses element (b, h, i, j)
// as in a batch padded to [B, Hq, max_seqlen_q, max_seqlen_k]. Buffers may hold more rows than
// the sequences use: unused query rows get output 0 and LSE -inf, unused rows of dq, dk, dv get
// 0. Tensor masks are not supported with varlen calls (Unsupported).
//
// Over page pools (VarlenSeqs::block_table, flash-attn's paged varlen call; forward only): k
// and v are pools of pages, as a paged KV cache holds them (attncore/kvcache.h,
// attncore/paged.h),
//
//   k   [num_pages, page_size, Hkv, D]   sequence b's keys are the first seqused_k[b] (else
//   v   [num_pages, page_size, Hkv, Dv]  cu_seqlens_k[b+1] - cu_seqlens_k[b]) slots of its
//                                        pages: slot s is row s % page_size of page
//                                        block_table[b][s / page_size]
//
// of q's dtype, or bf16 / f16 under an f32 query. Every page a sequence's keys use must be a
// page of the pool (-1 marks a page not mapped). The keys of a sequence may be cut into
// split-KV parts as those of the same call without pages are: the results are bitwise those of
// the call on the gathered keys. Dropout and the backward are not supported over pages
// (Unsupported). One call serves a whole batch of prefill chunks and decode rows (continuous
// batching).
#pragma once

#include <cstdint>
#include <optional>

#include "attncore/attncore.h"
#include "attncore/export.h"

namespace attncore {

struct VarlenSeqs {
  TensorView cu_seqlens_q{};              // i32 [B + 1], from 0, non-decreasing, contiguous
  TensorView cu_seqlens_k{};              // i32 [B + 1], likewise
  std::optional<TensorView> seqused_k{};  // i32 [B]: keys of sequence b actually used
  std::int64_t max_seqlen_q = 0;        // >= every query length (may be larger)
  std::int64_t max_seqlen_k = 0;        // >= every key length (may be larger)
  // i32 [B, max_pages_per_seq], inner stride 1: k and v are page pools (above).
  std::optional<TensorView> block_table{};
};

// Forward into new tensors: out [total_q, Hq, Dv], lse [Hq, total_q].
ATTNCORE_API ForwardResult forward_varlen(const TensorView& q, const TensorView& k,
                                          const TensorView& v, const VarlenSeqs& seqs,
                                          const Options& options = {},
                                          Backend backend = Backend::automatic);

// Forward into caller-provided views: out [total_q, Hq, Dv] of q's dtype and, when given,
// lse [Hq, total_q]. Both are fully written.
ATTNCORE_API void forward_varlen_into(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const VarlenSeqs& seqs, const TensorView& out,
                                      const std::optional<TensorView>& lse,
                                      const Options& options = {},
                                      Backend backend = Backend::automatic);

// Gradients of the forward call with the same inputs, given its out and lse. dbias is never
// returned (no tensor masks).
ATTNCORE_API BackwardResult backward_varlen(const TensorView& dout, const TensorView& q,
                                            const TensorView& k, const TensorView& v,
                                            const TensorView& out, const TensorView& lse,
                                            const VarlenSeqs& seqs, const Options& options = {},
                                            Backend backend = Backend::automatic);

ATTNCORE_API void backward_varlen_into(const TensorView& dout, const TensorView& q,
                                       const TensorView& k, const TensorView& v,
                                       const TensorView& out, const TensorView& lse,
                                       const VarlenSeqs& seqs, const TensorView& dq,
                                       const TensorView& dk, const TensorView& dv,
                                       const Options& options = {},
                                       Backend backend = Backend::automatic);

// Validate like forward_varlen / backward_varlen (reading the sequence arrays) and explain the
// automatic choice on this thread (attncore/backend.h); run nothing. A named `backend` that
// cannot run the call is refused as explain_forward refuses it.
ATTNCORE_API Explanation explain_forward_varlen(const TensorView& q, const TensorView& k,
                                                const TensorView& v, const VarlenSeqs& seqs,
                                                const Options& options = {},
                                                Backend backend = Backend::automatic);
ATTNCORE_API Explanation explain_backward_varlen(const TensorView& dout, const TensorView& q,
                                                 const TensorView& k, const TensorView& v,
                                                 const TensorView& out, const TensorView& lse,
                                                 const VarlenSeqs& seqs,
                                                 const Options& options = {},
                                                 Backend backend = Backend::automatic);

}  // namespace attncore
