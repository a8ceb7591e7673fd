// Every check of every public entry point, in one place (docs/design.md section 4).
#pragma once

#include "attncore/kvcache.h"
#include "attncore/varlen.h"
#include "core/params.h"

namespace attncore::detail {

// Throws InvalidArgument (or Unsupported) with a docs/design.md section 4 message; else returns the
// resolved problem. With `check_outputs` false the output views are ignored (the library
// allocates them from the problem's sizes); else they are checked too, and `args.lse` may be
// an empty view (rank 0, null data) when the caller does not want the LSE.
Params validate_forward(const ForwardArgs& args, const Options& options, Backend backend,
                         bool check_outputs);

Params validate_backward(const BackwardArgs& args, const Options& options, Backend backend,
                          bool check_outputs);

// Variable-length calls (attncore/varlen.h). `args` holds the caller's packed views (q
// [total_q, Hq, D], ..., lse [Hq, total_q]); on return they are in the rank-4 form of
// core/params.h (a batch dim of stride 0; page pools [num_pages, page_size, Hkv, D] as a paged
// cache's views, [num_pages, Hkv, page_size, D]). Nothing is read past the rows the buffers
// hold.
Params validate_varlen_forward(ForwardArgs& args, const VarlenSeqs& seqs, const Options& options,
                               Backend backend, bool check_outputs);

Params validate_varlen_backward(BackwardArgs& args, const VarlenSeqs& seqs,
                                const Options& options, Backend backend, bool check_outputs);

// Attention over a KV cache (attncore/kvcache.h): q [B, Hq, Lq, D], k [B_cache, Hkv, capacity,
// D], v likewise, out, lse as for dense calls.
Params validate_kvcache_forward(const ForwardArgs& args, const KvCacheSeqs& seqs,
                                const Options& options, Backend backend, bool check_outputs);

}  // namespace attncore::detail
