// The configuration of one attention call (RunConfig), filled in by the flag table (flags.cpp)
// or by the sweeps of `attncore` and `attncore bench`, and what it produces: the library's
// Options and the tensor views of the call. A call is dense ([B, H, L, D] tensors) or, with
// --varlen, a packed variable-length batch (attncore/varlen.h), or, with --cache-len, new tokens
// attending to a dense or paged KV cache (attncore/kvcache.h). BenchConfig adds bench's sweep
// to a RunConfig.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attncore/attncore.h"

namespace attncore_tools {

class JsonObject;

// The attention mask `run --mask` adds: none, random boolean or random additive, [Lq, Lk].
enum class MaskKind { none, boolean, additive };
std::string_view name_of(MaskKind m);
using attncore::name_of;

// The pages `slots` slots take at `page_size` slots a page (0 for page_size 0: a dense cache),
// rounded up without overflow at any int64 size.
inline std::int64_t pages_per_sequence(std::int64_t slots, std::int64_t page_size) {
  return page_size > 0 ? slots / page_size + (slots % page_size != 0) : 0;
}

// A sliding window; -1 = unbounded on that side.
struct Window {
  std::int64_t left = -1;
  std::int64_t right = -1;
};

// The views of a configured call's inputs and outputs over one `data` pointer; the ALiBi slopes
// and the mask have rank 0 when the call has none. A packed batch's q, k, v, out are
// [total, H, D] and its lse [Hq, total_q].
struct CallViews {
  attncore::TensorView q, k, v, out, lse, alibi, mask;
};

struct RunConfig {
  std::int64_t batch = 1;
  std::int64_t heads_q = 8;      // a typical small model (GPT-2 has 12, BERT-base 12, Llama 32)
  std::int64_t heads_kv = -1;    // -1: = heads_q
  std::int64_t seqlen_q = 1024;  // a common context length: long enough to be compute-bound
  std::int64_t seqlen_k = -1;    // -1: = seqlen_q
  std::int64_t head_dim = 64;    // the most common head dim with 128
  std::int64_t head_dim_v = -1;  // -1: = head_dim
  attncore::DType dtype = attncore::DType::f32;
  attncore::Causal causal = attncore::Causal::none;
  Window window;
  double softcap = 0.0;
  bool alibi = false;
  MaskKind mask = MaskKind::none;
  double dropout = 0.0;
  std::uint64_t seed = 0;
  attncore::Backend backend = attncore::Backend::automatic;
  bool backward = false;
  int threads = 0;     // 0: the library's default (ATTNCORE_NUM_THREADS, else the allowed CPUs)
  int num_splits = 0;  // Options::num_splits: 0 = flash's planner, 1 = no split
  std::string simd;    // the flash SIMD target; "": the automatic choice
  int repeat = 3;      // best of 3: enough to skip the first call's page faults
  bool check = false;
  bool json = false;
  // A packed variable-length batch: the query lengths of its sequences (B = their count), the
  // key lengths (empty: the query lengths) and the keys each sequence uses (empty: all).
  // Empty `varlen`: a dense call.
  std::vector<std::int64_t> varlen;
  std::vector<std::int64_t> varlen_k;
  std::vector<std::int64_t> seqused_k;

  // A KV-cache call: each sequence has cache_len keys in the cache and new_tokens new rows
  // (queries, and keys and values appended before attending: decode at 1, chunked prefill
  // above); page_size 0: a dense cache [B, capacity, Hkv, D], else pages of page_size in a
  // shuffled pool (pages_in_order: each sequence's pages one after the other in the pool). A
  // packed batch with page_size > 0 has its keys in such pools (VarlenSeqs::block_table).
  // finish() sets seqlen_q = new_tokens, seqlen_k = cache_len + new_tokens: the dense call the
  // cache call equals (what --check compares and the FLOPs count).
  std::int64_t cache_len = -1;  // -1: not a cache call
  std::int64_t page_size = 0;
  bool pages_in_order = false;
  std::int64_t new_tokens = 1;

  bool is_varlen() const { return !varlen.empty(); }
  bool is_cache() const { return cache_len >= 0; }
  // Resolves the "same as" defaults (heads_kv, seqlen_k, head_dim_v); for a packed batch also
  // varlen_k, batch (the number of sequences) and seqlen_q / seqlen_k (the longest of varlen and
  // varlen_k: the call's max_seqlen_q / max_seqlen_k, which also address its dropout).
  void finish();
  // Key lengths a packed batch's sequences attend to: seqused_k, else varlen_k.
  const std::vector<std::int64_t>& used_k() const {
    return seqused_k.empty() ? varlen_k : seqused_k;
  }
  // Rows of a packed batch's query and key tensors (the sums of varlen and varlen_k).
  std::int64_t total_q() const;
  std::int64_t total_k() const;
  int resolved_threads() const;

  // The call's options; `alibi` and `mask` are the views of its slopes and mask (used when the
  // configuration asks for them).
  attncore::Options options(const attncore::TensorView& alibi,
                            const attncore::TensorView& mask) const;
  // Contiguous views of the call's tensors, all over `data`: `attncore explain` and check_call
  // pass one f64 (the library validates their shapes and reads none of q, k, v, out, lse and the
  // mask), check_call and prepare_call take the shapes of the tensors they make.
  CallViews views(void* data) const;

  // "B=1 Hq=8 Hkv=8 Lq=1024 Lk=1024 D=64 Dv=64"; packed: "B=2 Hq=8 Hkv=8 Lq=300,2 Lk=1,2 ..."
  std::string shape_text() const;
  // The call's dtype, shape and causal kind, as `run --json` and `explain --json` report them;
  // a packed batch reports its lengths, totals and longest sequences instead of seqlen_q/k.
  void add_shape(JsonObject& j) const;
};

// What `attncore bench` sweeps over, and the files it writes.
struct BenchSweep {
  std::vector<std::int64_t> seqlens = {512, 1024, 2048, 4096};  // Lq = Lk
  std::vector<attncore::DType> dtypes = {attncore::DType::f32, attncore::DType::bf16};
  std::vector<attncore::Causal> causals = {attncore::Causal::none, attncore::Causal::lower_right};
  int passes = 3;  // bench --select: interleaved passes per shape
  bool select = false;
  bool varlen = false;  // bench --varlen: packed against dense and padded (cmd_bench.cpp)
  bool decode = false;  // bench --decode: K/V GB/s against the read probe (cmd_bench_decode.cpp)
  bool quick = false;   // bench --decode: B = 1, Lk 4096 and 16384 only
  int max_kv_gib = 8;   // bench --decode: points with more K/V bytes are skipped and listed
  std::string points;  // bench --decode: "dtype:layout:Hkv,..." kept ("" all; cmd_bench_decode.cpp)
  std::string csv, json, png;  // "": not written; json "-": standard output
};

// bench's defaults for the flags it shares with run: larger heads than run's, so that the
// kernels are compared where they are compute-bound.
inline RunConfig bench_run_defaults() {
  RunConfig c;
  c.heads_q = 16;
  c.head_dim = 128;
  return c;
}

// `attncore bench`: the flags it shares with run land in `run` (B, Hq, Hkv, D, threads, SIMD
// target, repeat, backward), its own in `sweep`.
struct BenchConfig {
  RunConfig run = bench_run_defaults();
  BenchSweep sweep;
};

}  // namespace attncore_tools
