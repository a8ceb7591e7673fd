// Variant construction (oracle Spec + attncore::Options), operands, comparisons, tolerances.
#include "testing/problem.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "testing/random.h"

namespace attncore::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Fills an oracle mask and the library tensor of `shape` (rank 2 or 4) with the same values.
void set_mask(Problem& p, bool is_bool, const std::vector<std::int64_t>& shape, DType dtype,
              Random& rng, double hidden_fraction) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  std::vector<double> values(static_cast<std::size_t>(n));
  for (double& x : values) {
    if (is_bool) {
      x = rng.coin(hidden_fraction) ? 0.0 : 1.0;
    } else {
      x = rng.coin(hidden_fraction) ? -kInf : rng.uniform(-2.0, 2.0);
    }
  }
  p.mask_tensor = make_tensor(is_bool ? DType::b8 : dtype, shape, values);
  DenseMask m;
  m.is_bool = is_bool;
  m.shape = shape.size() == 2 ? std::array<std::int64_t, 4>{1, 1, shape[0], shape[1]}
                              : std::array<std::int64_t, 4>{shape[0], shape[1], shape[2], shape[3]};
  m.values = read_view(p.mask_tensor.view());  // the values after rounding to the mask dtype
  p.spec.mask = m;
  p.options.mask = p.mask_tensor.view();
}

void set_alibi(Problem& p, bool per_batch, Random& rng) {
  const Dims& d = p.dims;
  std::vector<std::int64_t> shape = per_batch ? std::vector<std::int64_t>{d.batch, d.heads_q}
                                              : std::vector<std::int64_t>{d.heads_q};
  std::vector<double> slopes(static_cast<std::size_t>(per_batch ? d.batch * d.heads_q : d.heads_q));
  for (double& s : slopes) s = rng.uniform(0.0, 0.3);
  p.alibi_tensor = make_tensor(DType::f32, shape, slopes);
  p.spec.alibi = read_view(p.alibi_tensor.view());
  p.spec.alibi_per_batch = per_batch;
  p.options.alibi_slopes = p.alibi_tensor.view();
}

void set_causal(Problem& p, CausalMode mode) {
  p.spec.causal = mode;
  p.options.causal = mode == CausalMode::upper_left    ? Causal::upper_left
                     : mode == CausalMode::lower_right ? Causal::lower_right
                                                       : Causal::none;
}

void set_window(Problem& p, std::int64_t left, std::int64_t right) {
  p.spec.window_left = p.options.window_left = left;
  p.spec.window_right = p.options.window_right = right;
}

void set_softcap(Problem& p, double cap) { p.spec.softcap = p.options.softcap = cap; }

void set_dropout(Problem& p, double prob, std::uint64_t seed, std::uint64_t offset) {
  p.spec.dropout_p = p.options.dropout_p = prob;
  p.spec.seed = p.options.seed = seed;
  p.spec.offset = p.options.offset = offset;
}

}  // namespace

std::string name_of_variant(Variant v) {
  switch (v) {
    case Variant::plain:
      return "plain";
    case Variant::causal_upper_left:
      return "causal_ul";
    case Variant::causal_lower_right:
      return "causal_lr";
    case Variant::window:
      return "window";
    case Variant::window_left:
      return "window_left";
    case Variant::window_right:
      return "window_right";
    case Variant::softcap:
      return "softcap";
    case Variant::alibi_heads:
      return "alibi_h";
    case Variant::alibi_batch_heads:
      return "alibi_bh";
    case Variant::bool_mask:
      return "bool_bhqk";
    case Variant::bool_mask_keys:
      return "bool_b11k";
    case Variant::bool_mask_rank2:
      return "bool_qk";
    case Variant::additive_full:
      return "add_bhqk";
    case Variant::additive_11qk:
      return "add_11qk";
    case Variant::additive_b11k:
      return "add_b11k";
    case Variant::additive_1hq1:
      return "add_1hq1";
    case Variant::additive_rank2:
      return "add_qk";
    case Variant::additive_rank2_row:
      return "add_1k";
    case Variant::masked_rows:
      return "masked_rows";
    case Variant::combo:
      return "combo";
    case Variant::dropout:
      return "dropout";
    case Variant::dropout_combo:
      return "dropout_combo";
  }
  return "?";
}

void for_each_backend_and_target(const std::function<void(Backend)>& f) {
  const std::vector<std::string> targets = simd_targets_supported();
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (const std::string& target : targets) {
      if (backend != Backend::flash && target != targets.front()) continue;
      const ScopedTarget scope(target);
      SCOPED_TRACE(std::string(name_of(backend)) + " " + target);
      f(backend);
    }
  }
}

std::vector<Variant> deterministic_variants() {
  return {Variant::plain,
          Variant::causal_upper_left,
          Variant::causal_lower_right,
          Variant::window,
          Variant::window_left,
          Variant::window_right,
          Variant::softcap,
          Variant::alibi_heads,
          Variant::alibi_batch_heads,
          Variant::bool_mask,
          Variant::bool_mask_keys,
          Variant::bool_mask_rank2,
          Variant::additive_full,
          Variant::additive_11qk,
          Variant::additive_b11k,
          Variant::additive_1hq1,
          Variant::additive_rank2,
          Variant::additive_rank2_row,
          Variant::masked_rows,
          Variant::combo};
}

std::vector<Variant> backward_variants() {
  std::vector<Variant> v = deterministic_variants();
  v.push_back(Variant::dropout);
  v.push_back(Variant::dropout_combo);
  return v;
}

bool is_additive(const Problem& p) { return p.spec.mask.has_value() && !p.spec.mask->is_bool; }

Options forward_options(Options o) {
  o.compute_dbias = false;
  return o;
}

Problem make_problem(const Dims& dims, const ProblemConfig& config) {
  Problem p;
  p.dims = dims;
  Random rng(config.seed * 7919 + 17);
  const Dims& d = dims;
  if (config.given_scale) {
    p.options.scale = 0.5 / std::sqrt(static_cast<double>(d.dim)) + 0.125;
    p.spec.scale = *p.options.scale;
  } else {
    p.spec.scale = 1.0 / std::sqrt(static_cast<double>(d.dim));
  }
  const DType mdt = config.mask_dtype;
  switch (config.variant) {
    case Variant::plain:
      break;
    case Variant::causal_upper_left:
      set_causal(p, CausalMode::upper_left);
      break;
    case Variant::causal_lower_right:
      set_causal(p, CausalMode::lower_right);
      break;
    case Variant::window:
      set_window(p, 3, 2);
      break;
    case Variant::window_left:
      set_window(p, 5, -1);
      break;
    case Variant::window_right:
      set_window(p, -1, 1);
      break;
    case Variant::softcap:
      // A cap below the typical |score| so tanh bends; a larger scale makes the scores big.
      if (!config.given_scale) p.options.scale = p.spec.scale = 2.0;
      set_softcap(p, 1.5);
      break;
    case Variant::alibi_heads:
      set_alibi(p, false, rng);
      break;
    case Variant::alibi_batch_heads:
      set_alibi(p, true, rng);
      break;
    case Variant::bool_mask:
      set_mask(p, true, {d.batch, d.heads_q, d.len_q, d.len_k}, mdt, rng, 0.3);
      break;
    case Variant::bool_mask_keys:
      set_mask(p, true, {d.batch, 1, 1, d.len_k}, mdt, rng, 0.3);
      break;
    case Variant::bool_mask_rank2:
      set_mask(p, true, {d.len_q, d.len_k}, mdt, rng, 0.3);
      break;
    case Variant::additive_full:
      set_mask(p, false, {d.batch, d.heads_q, d.len_q, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::additive_11qk:
      set_mask(p, false, {1, 1, d.len_q, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::additive_b11k:
      set_mask(p, false, {d.batch, 1, 1, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::additive_1hq1:
      set_mask(p, false, {1, d.heads_q, d.len_q, 1}, mdt, rng, 0.0);
      break;
    case Variant::additive_rank2:
      set_mask(p, false, {d.len_q, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::additive_rank2_row:
      set_mask(p, false, {1, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::masked_rows: {
      set_mask(p, true, {d.batch, d.heads_q, d.len_q, d.len_k}, mdt, rng, 0.2);
      // Hide every key of every third row; the others keep their random pattern.
      std::vector<double>& values = p.spec.mask->values;
      for (std::int64_t r = 0; r < d.batch * d.heads_q * d.len_q; ++r) {
        if (r % 3 != 1) continue;
        for (std::int64_t j = 0; j < d.len_k; ++j)
          values[static_cast<std::size_t>(r * d.len_k + j)] = 0.0;
      }
      write_view(p.mask_tensor.view(), values);
      break;
    }
    case Variant::combo:
      set_causal(p, CausalMode::lower_right);
      set_window(p, 6, -1);
      set_softcap(p, 2.5);
      set_alibi(p, false, rng);
      set_mask(p, false, {d.batch, 1, d.len_q, d.len_k}, mdt, rng, 0.05);
      break;
    case Variant::dropout:
      set_dropout(p, 0.25, 0x1234'5678'9abcull + config.seed, 1000 * config.seed);
      break;
    case Variant::dropout_combo:
      set_dropout(p, 0.5, 42 + config.seed, 7);
      set_causal(p, CausalMode::upper_left);
      set_mask(p, false, {1, 1, d.len_q, d.len_k}, mdt, rng, 0.05);
      break;
  }
  return p;
}

Operands make_operands(const Dims& d, DType dtype, std::uint64_t seed) {
  Operands o;
  o.q = rounded(random_vector(numel_of(d.q_shape()), seed * 4 + 0), dtype);
  o.k = rounded(random_vector(numel_of(d.k_shape()), seed * 4 + 1), dtype);
  o.v = rounded(random_vector(numel_of(d.v_shape()), seed * 4 + 2), dtype);
  o.dout = rounded(random_vector(numel_of(d.out_shape()), seed * 4 + 3), dtype);
  return o;
}

::testing::AssertionResult all_close(const std::vector<double>& got,
                                     const std::vector<double>& want, double atol,
                                     const std::string& what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " elements, expected " << want.size();
  }
  double worst = 0.0;
  std::size_t worst_at = 0;
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t n = 0; n < got.size(); ++n) {
    const double g = got[n], w = want[n];
    bool ok;
    if (std::isnan(w)) {
      ok = std::isnan(g);
    } else if (std::isinf(w)) {
      ok = g == w;
    } else {
      const double err = std::fabs(g - w);
      ok = err <= atol;  // false for NaN or inf got
      if (ok && err > worst) {
        worst = err;
        worst_at = n;
      }
      if (!ok && std::isfinite(g) && err > worst) {
        worst = err;
        worst_at = n;
      }
    }
    if (!ok && bad++ == 0) first_bad = n;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(10);
  os << what << ": " << bad << " of " << got.size() << " elements off (atol " << atol
     << "); first at " << first_bad << ": got " << got[first_bad] << ", expected "
     << want[first_bad] << "; max finite error " << worst << " at " << worst_at;
  return ::testing::AssertionFailure() << os.str();
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t n = 0; n < a.size() && n < b.size(); ++n) {
    if (std::isfinite(a[n]) && std::isfinite(b[n])) m = std::max(m, std::fabs(a[n] - b[n]));
  }
  return m;
}

double out_tolerance(DType dtype, const std::vector<double>& v, const std::vector<double>& exact,
                     const std::vector<double>& naive_out, double dropout_p) {
  const double vmax = max_abs(v) / (1.0 - dropout_p);
  switch (dtype) {
    case DType::f64:
      return 1e-12 * (1.0 + vmax);
    case DType::f32:
      return 1e-5 * vmax + 1e-30;
    default:
      return 2.0 * max_abs_diff(naive_out, exact) + 0x1.0p-20 * vmax;
  }
}

double grad_tolerance(DType dtype, const std::vector<double>& exact,
                      const std::vector<double>& naive, double scale) {
  const double gmax = max_abs(exact);
  switch (dtype) {
    case DType::f64:
      return 1e-11 * (1.0 + gmax + scale);
    case DType::f32:
      return 3e-5 * gmax + 3e-6 * scale;
    default:
      return 2.0 * max_abs_diff(naive, exact) + 0x1.0p-20 * (gmax + scale);
  }
}

double lse_tolerance(DType dtype, double lse) {
  return (dtype == DType::f64 ? 1e-12 : 5e-5) * (1.0 + std::fabs(lse));
}

::testing::AssertionResult masked_rows_exact(const Dims& d, const std::vector<double>& out,
                                             const std::vector<double>& lse,
                                             const std::vector<double>& oracle_lse) {
  for (std::size_t r = 0; r < oracle_lse.size(); ++r) {
    if (oracle_lse[r] != -kInf) continue;
    if (lse[r] != -kInf) {
      return ::testing::AssertionFailure()
             << "row " << r << " has no visible key but lse = " << lse[r] << ", expected -inf";
    }
    for (std::int64_t c = 0; c < d.dim_v; ++c) {
      const double o = out[r * static_cast<std::size_t>(d.dim_v) + static_cast<std::size_t>(c)];
      if (o != 0.0) {
        return ::testing::AssertionFailure() << "row " << r << " has no visible key but out[" << c
                                             << "] = " << o << ", expected exactly 0";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace attncore::test
