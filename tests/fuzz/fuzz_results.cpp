// The numeric checks of a call's results against the reference backend's (fuzz_cases.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fuzz_cases.h"
#include "testing/problem.h"
#include "testing/tensors.h"

namespace attncore::fuzz {

namespace {

// lse [B, Hq, Lq] or (varlen) [Hq, total]: LSE values in out's row order.
std::vector<double> lse_in_row_order(const std::vector<double>& lse, std::int64_t heads,
                                     bool head_major) {
  if (!head_major) return lse;
  const std::size_t total = lse.size() / static_cast<std::size_t>(heads);
  std::vector<double> rows(lse.size());
  for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h)
    for (std::size_t t = 0; t < total; ++t) rows[t * heads + h] = lse[h * total + t];
  return rows;
}

}  // namespace

void check_forward(const std::vector<Run>& runs, DType dtype, double vmax, std::int64_t heads,
                   std::int64_t dim_v, bool head_major_lse) {
  const Run& ref = runs.front();
  if (ref.outcome != Outcome::ok) return;
  const std::vector<double> ref_rows = lse_in_row_order(ref.results[1], heads, head_major_lse);
  for (const Run& run : runs) {
    if (run.outcome != Outcome::ok) continue;
    check_close(ref, run, 0, output_tolerance(dtype, vmax), "out");
    for (std::size_t j = 0; j < ref.results[1].size(); ++j) {
      const double want = ref.results[1][j];
      if (std::isfinite(want) &&
          !(std::fabs(run.results[1][j] - want) <= test::lse_tolerance(dtype, want)))
        fail(std::string(name_of(run.backend)) + ": lse element " + std::to_string(j) + " is " +
             std::to_string(run.results[1][j]) + ", reference " + std::to_string(want));
    }
    check_masked_rows(ref_rows, run.results[0],
                      lse_in_row_order(run.results[1], heads, head_major_lse), dim_v,
                      std::string(name_of(run.backend)));
  }
}

void check_gradients(const std::vector<Run>& grads, const GradientCall& call) {
  const DType dtype = call.dtype;
  if (grads.front().outcome != Outcome::ok || (dtype != DType::f32 && dtype != DType::f64)) return;
  double scale = 0;
  for (const auto& g : grads.front().results) scale = std::max(scale, max_finite(g));
  // The rounding of dP - Delta (dot products of Dv terms), which the gradients' own magnitudes
  // do not bound when they cancel (P near uniform makes dq tiny): each dS_ij errs up to about
  // 4 eps Dv max|dO| max|V| / (1 - p) times P_ij, so dq (P summing to 1 over j) up to that times
  // scale max|K|, dk and dbias (P summed over up to rows_q rows) up to rows_q times scale max|Q|
  // or 1.
  const Options& o = *call.options;
  const double eps = dtype == DType::f64 ? 0x1p-53 : 0x1p-24;
  const double sm_scale = std::fabs(o.scale.value_or(1.0 / std::sqrt(double(call.d))));
  const double ds_error = 4.0 * eps * double(call.dv) *
                          max_finite(test::read_view(call.dout->view)) *
                          max_finite(test::read_view(call.v->view)) / (1.0 - o.dropout_p);
  const double cancel =
      ds_error *
      std::max({1.0, sm_scale * max_finite(test::read_view(call.k->view)),
                double(call.rows_q) *
                    std::max(1.0, sm_scale * max_finite(test::read_view(call.q->view)))});
  // dbias has the mask's dtype: a 16-bit mask's gradient is rounded to it (its unit, doubled).
  const double mask_unit = call.dbias == nullptr                   ? 0.0
                           : call.dbias->view.dtype == DType::bf16 ? 0x1p-8
                           : call.dbias->view.dtype == DType::f16  ? 0x1p-11
                                                                   : 0.0;
  for (const Run& run : grads) {
    if (run.outcome != Outcome::ok) continue;
    for (std::size_t i = 0; i < run.results.size(); ++i) {
      const auto& exact = grads.front().results[i];
      const double rounding = i == 3 ? 2.0 * mask_unit * max_finite(exact) : 0.0;
      check_close(grads.front(), run, i,
                  test::grad_tolerance(dtype, exact, exact, scale) + cancel + rounding,
                  "gradient " + std::to_string(i));
    }
  }
}

}  // namespace attncore::fuzz
