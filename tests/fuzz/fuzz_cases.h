// The fuzzer's cases, one per kind of call, and what they share: shapes, layouts and options
// decoded from the input's bytes (fuzz_decode.cpp), and the checks of forward results and
// gradients against the reference's (fuzz_check.cpp). Each choice is sometimes made invalid.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "attncore/attncore.h"
#include "fuzz_check.h"
#include "fuzz_input.h"

namespace attncore::fuzz {

inline constexpr double kMaxFlops = 1e7;  // per input: keeps a run near 200 inputs/s/core
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// A sequence length: mostly up to 80, short ones (<= 9) now and then.
std::int64_t length(Reader& r);
std::int64_t head_dim(Reader& r);
DType value_dtype(Reader& r);
// Mostly the good layouts; overlapping and bad ones now and then.
Layout layout(Reader& r);
Layout output_layout(Reader& r);

// Sizes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv].
struct Dims {
  std::int64_t b, hq, hkv, lq, lk, d, dv;
};
Dims dims(Reader& r);
// The forward's flops over `pairs` (query, key) pairs.
double flops(const Dims& s, double pairs);

// The score options and threads, each sometimes invalid; the arrays it points to.
struct Decoded {
  Options options;
  std::optional<Array> alibi, mask;
  std::atomic<bool> cancel{true};
};
// Masks and dropout mostly only where the call takes them (dense calls).
void decode_options(Reader& r, const Dims& s, bool mask_and_dropout, Decoded& o);

// With ATTNCORE_FUZZ_VERBOSE set, what an input decoded to (to read a crash's input).
void describe(const char* mode, const Dims& s, DType dtype, const Options& o,
              const std::vector<const Array*>& arrays);

// i32 [n] holding `values`.
Array index_array(const std::vector<std::int64_t>& values);

// max |v| of the values a row averages, as dropout scales them.
double value_bound(const Array& v, const Options& o);

// out and lse (results 0 and 1) of every successful run against the reference's; lse is
// [B, Hq, Lq], or [Hq, total] (head_major_lse: varlen).
void check_forward(const std::vector<Run>& runs, DType dtype, double vmax, std::int64_t heads,
                   std::int64_t dim_v, bool head_major_lse);

// The gradients (results dq, dk, dv and, when asked for, dbias, in that order) of every
// successful run against the reference's, for f32 and f64 (16-bit gradients have no bound
// without the oracle's naive run). rows_q: the most query rows one key's (or one mask element's)
// gradient sums over.
struct GradientCall {
  DType dtype;
  std::int64_t d, dv, rows_q;
  const Options* options;
  const Array *q, *k, *v, *dout;
  const Array* dbias;  // null unless asked for
};
void check_gradients(const std::vector<Run>& grads, const GradientCall& call);

void fuzz_dense(Reader& r);
void fuzz_absurd(Reader& r);
void fuzz_varlen(Reader& r);
void fuzz_kvcache(Reader& r);
void fuzz_paged(Reader& r);
void fuzz_merge(Reader& r);

}  // namespace attncore::fuzz
