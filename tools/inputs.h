// The data of a configured call: element access by dtype, a portable random generator, and
// PreparedCall (a RunConfig with its random inputs and the Options that view them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "attncore/varlen.h"
#include "run_config.h"

namespace attncore_tools {

// splitmix64 (Steele et al. 2014), so the data is the same on every platform (std::
// distributions are implementation-defined).
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  std::uint64_t state_;
};

// Element `offset` (in elements from t.data) of a view of any dtype, converted to or from double
// (the 16-bit types through float; bool: 0 or 1; i32 truncated toward zero).
void store(const attncore::TensorView& t, std::int64_t offset, double value);
double load(const attncore::TensorView& t, std::int64_t offset);

// Calls f(offset) for every element of a strided view, in row-major order.
template <class F>
void for_each_offset(const attncore::TensorView& t, F&& f) {
  constexpr int kDims = attncore::kMaxRank;
  std::int64_t n[kDims] = {1, 1, 1, 1}, st[kDims] = {0, 0, 0, 0};
  for (int d = 0; d < t.rank; ++d) {
    n[kDims - t.rank + d] = t.size(d);
    st[kDims - t.rank + d] = t.stride_of(d);
  }
  for (std::int64_t a = 0; a < n[0]; ++a)
    for (std::int64_t b = 0; b < n[1]; ++b)
      for (std::int64_t c = 0; c < n[2]; ++c)
        for (std::int64_t d = 0; d < n[3]; ++d) f(a * st[0] + b * st[1] + c * st[2] + d * st[3]);
}

// Refuses, before anything is allocated, `bytes` the program would allocate for `what` (plural:
// "the KV cache and the call's tensors") when they pass the memory this process may use
// (attncore::memory_limit): attncore::OutOfMemory "<op>: <what> need more memory than this
// process may use (bytes=..., expected <= ..., <limit>); ...". Bytes in double: sizes from flags
// can overflow int64.
void require_memory(const char* op, const std::string& what, double bytes);

// The bytes of a view's elements (0 for a rank-0 view), in double.
double bytes_of(const attncore::TensorView& t);

// A new zero-filled tensor of `shape`'s dtype and shape; an empty tensor for a rank-0 view.
attncore::Tensor allocate_like(const attncore::TensorView& shape);

// Pool pages 0 .. count - 1 in the order a run hands them out: shuffled (Fisher-Yates on the
// run's seed), as an engine's pool ends up, or in order with --pages-in-order.
std::vector<std::int32_t> page_order(std::int64_t count, const RunConfig& c);

// A configured call ready to run: q, k, v uniform in [-1, 1) (dout too with --backward), the
// ALiBi slopes and the mask when configured, and the options viewing them. A packed batch
// (cfg.is_varlen()) also has its int32 offsets and the VarlenSeqs viewing them; with
// cfg.page_size > 0 also its used keys copied into page pools [pages, page_size, Hkv, D] (in a
// shuffled order, or in order) and the VarlenSeqs over them (the timed call's; the check's
// reference runs on the packed keys). A KV-cache call (cfg.is_cache()) also has its lengths and,
// paged, its block table (add_cache_seqs); run_cache makes the caches.
struct PreparedCall {
  RunConfig cfg;
  attncore::Tensor q, k, v, dout, mask, alibi;
  attncore::Options options;
  attncore::Tensor cu_seqlens_q, cu_seqlens_k, seqused_k;
  attncore::VarlenSeqs seqs;
  attncore::Tensor k_pages, v_pages;
  attncore::Tensor block_table;  // int32 [B, pages per sequence]: the packed batch's or the cache's
  attncore::VarlenSeqs paged_seqs;
  attncore::Tensor cache_seqlens;
  attncore::KvCacheSeqs cache_seqs;
  // The timed call's k, v and sequences: the pools where there are, else k, v and seqs.
  bool paged() const { return paged_seqs.block_table.has_value(); }
  const attncore::Tensor& call_k() const { return paged() ? k_pages : k; }
  const attncore::Tensor& call_v() const { return paged() ? v_pages : v; }
  const attncore::VarlenSeqs& call_seqs() const { return paged() ? paged_seqs : seqs; }
};

// A configured call checked before any of its large tensors (q, k, v, dout, the mask, a packed
// batch's page pools, a cache call's caches, the outputs) is made; `c` must be finished
// (RunConfig::finish). First refuses (require_memory, naming `op`: "run", "bench") a call whose
// tensors the program allocates (its inputs, the outputs run_once allocates, a KV-cache call's
// caches: cache_bytes) pass the memory this process may use. Then makes the small arrays the
// library reads when it validates the call (the ALiBi slopes, a packed batch's offsets, used
// keys and block table, a cache call's lengths and block table) and has the library validate
// the call on them and on views of the large tensors that point at no data (explain_forward and
// its kin, with cfg.backend; the backward too with cfg.backward): a call the library refuses
// fails here, with the library's message, before anything large is made. Returns the call with
// those arrays only.
PreparedCall check_call(const RunConfig& c, const char* op);

// The call's ALiBi slopes (f32 [Hq] with --alibi, else no tensor), which the library reads when
// it validates the call.
attncore::Tensor alibi_slopes(const RunConfig& c);

// check_call, then the rest of the call: its inputs, mask and page pools.
PreparedCall prepare_call(const RunConfig& c, const char* op);

}  // namespace attncore_tools
