// Entry-point steps shared by the files of the public API (api.cpp, kvcache_append.cpp).
#pragma once

#include <functional>

#include "attncore/kvcache.h"

namespace attncore::detail {

// forward_kvcache's allocating form, running `before_run` after every check (validation, the
// backend's verdict, memory, the cancel flag) and every allocation, just before the backend:
// where an append writes into the cache, so that a refused call writes nothing.
ForwardResult forward_kvcache_with(const TensorView& q, const TensorView& k_cache,
                                   const TensorView& v_cache, const KvCacheSeqs& seqs,
                                   const Options& options, Backend backend,
                                   const std::function<void()>& before_run);

// forward_kvcache_into, running `before_run` likewise: after every check of the call with its
// outputs, just before the backend.
void forward_kvcache_into_with(const TensorView& q, const TensorView& k_cache,
                               const TensorView& v_cache, const KvCacheSeqs& seqs,
                               const TensorView& out, const std::optional<TensorView>& lse,
                               const Options& options, Backend backend,
                               const std::function<void()>& before_run);

}  // namespace attncore::detail
