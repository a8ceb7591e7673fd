// Attention problems shared by the forward, backward and dropout tests: one variant described
// twice, as an oracle Spec and as attncore::Options (with the mask / ALiBi tensors it points
// to), plus the comparisons and tolerances of docs/design.md section 6.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/tensors.h"

namespace attncore::test {

// The masks and score modifiers a case runs with.
enum class Variant {
  plain,
  causal_upper_left,
  causal_lower_right,
  window,        // (wl, wr) both bounded
  window_left,   // wl bounded, wr = -1
  window_right,  // wl = -1, wr bounded
  softcap,
  alibi_heads,         // slopes [Hq]
  alibi_batch_heads,   // slopes [B, Hq]
  bool_mask,           // bool [B, Hq, Lq, Lk]
  bool_mask_keys,      // bool [B, 1, 1, Lk] (key padding)
  bool_mask_rank2,     // bool [Lq, Lk]
  additive_full,       // additive [B, Hq, Lq, Lk]
  additive_11qk,       // additive [1, 1, Lq, Lk]
  additive_b11k,       // additive [B, 1, 1, Lk]
  additive_1hq1,       // additive [1, Hq, Lq, 1]
  additive_rank2,      // additive [Lq, Lk]
  additive_rank2_row,  // additive [1, Lk]
  masked_rows,         // bool [B, Hq, Lq, Lk] with whole rows false (no visible key)
  combo,               // lower-right causal + window + softcap + ALiBi + additive [B, 1, Lq, Lk]
  dropout,             // dropout p = 0.25
  dropout_combo,       // dropout + causal upper-left + additive [1, 1, Lq, Lk]
};
std::string name_of_variant(Variant v);

// Every variant without dropout.
std::vector<Variant> deterministic_variants();

// Every variant without dropout, and both dropout variants: the backward's grid.
std::vector<Variant> backward_variants();

// Forces a SIMD target of the fused kernels for its scope ("" = the automatic choice).
class ScopedTarget {
 public:
  explicit ScopedTarget(const std::string& target) : previous_(set_simd_target(target)) {}
  ~ScopedTarget() { set_simd_target(previous_); }

 private:
  std::string previous_;
};

// Runs f(backend) for reference, math and flash, flash on every SIMD target this CPU runs
// (each call inside a SCOPED_TRACE naming backend and target).
void for_each_backend_and_target(const std::function<void(Backend)>& f);

// One problem: the oracle's spec and the library's options for the same call.
struct Problem {
  Dims dims;
  Spec spec;
  Options options;      // mask / alibi_slopes view the tensors below
  Tensor mask_tensor;   // the mask as the library sees it
  Tensor alibi_tensor;  // f32 [Hq] or [B, Hq]
};

struct ProblemConfig {
  Variant variant = Variant::plain;
  DType mask_dtype = DType::f32;  // dtype of an additive mask (bool masks are b8)
  bool given_scale = false;       // pass Options::scale, else the default 1/sqrt(D)
  std::uint64_t seed = 1;
};

Problem make_problem(const Dims& dims, const ProblemConfig& config);

// Whether a problem has an additive (float) mask, whose gradient is dbias.
bool is_additive(const Problem& p);

// The options of the forward call that precedes a backward with `o`: compute_dbias is a
// backward-only option, which forward rejects.
Options forward_options(Options o);

// q, k, v (and dout) of a problem, drawn uniform in [-1, 1) and rounded to `dtype`.
struct Operands {
  std::vector<double> q;     // [B, Hq, Lq, D]
  std::vector<double> k;     // [B, Hkv, Lk, D]
  std::vector<double> v;     // [B, Hkv, Lk, Dv]
  std::vector<double> dout;  // [B, Hq, Lq, Dv]
};
Operands make_operands(const Dims& dims, DType dtype, std::uint64_t seed);

// got == want within atol elementwise; -inf must match -inf exactly and NaN must match NaN.
::testing::AssertionResult all_close(const std::vector<double>& got,
                                     const std::vector<double>& want, double atol,
                                     const std::string& what);
// max |a - b| over elements where both are finite.
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);

// The forward tolerance on `out` for inputs of `dtype` (docs/design.md section 6): f64 and f32 are
// tight and absolute, relative to max |v|; bf16 and f16 follow the FlashAttention rule
// 2 * max|naive_same_dtype - oracle| + tiny with `naive_out` the oracle's rounded run.
double out_tolerance(DType dtype, const std::vector<double>& v, const std::vector<double>& exact,
                     const std::vector<double>& naive_out, double dropout_p);
// The tolerance on a gradient of `exact` against its naive same-dtype run; `scale` is the
// largest gradient magnitude of the whole problem (max over dq, dk, dv, dbias), which bounds
// the rounding noise of a gradient that is exactly 0 (e.g. dq with a single key).
double grad_tolerance(DType dtype, const std::vector<double>& exact,
                      const std::vector<double>& naive, double scale);
// The tolerance on an LSE value.
double lse_tolerance(DType dtype, double lse);

// Rows [B, Hq, Lq] whose oracle LSE is -inf must have out exactly 0 and LSE -inf.
::testing::AssertionResult masked_rows_exact(const Dims& dims, const std::vector<double>& out,
                                             const std::vector<double>& lse,
                                             const std::vector<double>& oracle_lse);

}  // namespace attncore::test
