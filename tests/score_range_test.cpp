// Flash across the range of softcaps and scales, on every SIMD target, against the fp64 oracle by
// the rule of docs/design.md section 6: large caps put s / cap where 1 - 2 / (e^(2y) + 1) has no
// digits left (tanh near 0), and scales outside f32's normal range round to 0 (scale < 2^-149)
// or give scores whose log2 products lose their units digit (scale 1e30).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

std::string str(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}

struct Outputs {
  std::vector<double> out, lse, dq, dk, dv;
};

// Runs a backend's forward (and backward when asked) on a problem's operands in `dtype`.
Outputs run(Backend backend, const Problem& p, const Operands& x, DType dtype, bool backward_too) {
  const Dims& d = p.dims;
  const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);  // [B, Hq, Lq, D]
  const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);  // [B, Hkv, Lk, D]
  const Buffer v =
      make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);  // [B, Hkv, Lk, Dv]
  const Buffer dout =
      make_buffer(dtype, to_shape(d.out_shape()), Layout::bhsd, x.dout);  // [B, Hq, Lq, Dv]
  Outputs r;
  const ForwardResult f = forward(q.view, k.view, v.view, p.options, backend);
  r.out = read_view(f.out);
  r.lse = read_view(f.lse);
  if (backward_too) {
    const BackwardResult g =
        backward(dout.view, q.view, k.view, v.view, f.out, f.lse, p.options, backend);
    r.dq = read_view(g.dq);
    r.dk = read_view(g.dk);
    r.dv = read_view(g.dv);
  }
  return r;
}

// Checks flash against the oracle on `p` (forward, and backward when asked) on every target:
// within the rule of docs/design.md section 6, or at most twice as far from the oracle as math
// (the unfused computation in the same dtype) where the rule's f32 bound is below what f32
// scores allow (scores of tens and more: their own rounding).
void check_against_oracle(const Problem& p, bool backward_too, const std::string& what) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Operands x = make_operands(p.dims, dtype, 5);
    const OracleForward exact = oracle_forward(p.dims, p.spec, x.q, x.k, x.v);
    OracleForward naive;
    OracleBackward exact_grad, naive_grad;
    if (dtype == DType::bf16) {
      naive = oracle_forward(p.dims, p.spec, x.q, x.k, x.v, rounder_for(dtype));
    }
    if (backward_too) {
      exact_grad = oracle_backward(p.dims, p.spec, x.q, x.k, x.v, x.dout);
      if (dtype == DType::bf16) {
        naive_grad = oracle_backward(p.dims, p.spec, x.q, x.k, x.v, x.dout, rounder_for(dtype));
      }
    }
    const Outputs math = run(Backend::math, p, x, dtype, backward_too);
    auto tolerance = [](double rule, const std::vector<double>& math_got,
                        const std::vector<double>& want) {
      return std::max(rule, 2.0 * max_abs_diff(math_got, want));
    };
    const double out_tol =
        tolerance(out_tolerance(dtype, x.v, exact.out, naive.out, 0.0), math.out, exact.out);
    const double lse_tol = tolerance(lse_tolerance(dtype, max_abs(exact.lse)), math.lse, exact.lse);
    const double scale =
        std::max({max_abs(exact_grad.dq), max_abs(exact_grad.dk), max_abs(exact_grad.dv)});
    for (const std::string& target : simd_targets_supported()) {
      const ScopedTarget scoped(target);
      const std::string label =
          what + " " + target + (dtype == DType::f32 ? " f32" : " bf16") + " ";
      const Outputs got = run(Backend::flash, p, x, dtype, backward_too);
      EXPECT_TRUE(all_close(got.out, exact.out, out_tol, label + "out"));
      EXPECT_TRUE(all_close(got.lse, exact.lse, lse_tol, label + "lse"));
      if (!backward_too) continue;
      const auto grad_tol = [&](const std::vector<double>& want, const std::vector<double>& naive,
                                const std::vector<double>& math_got) {
        return tolerance(grad_tolerance(dtype, want, naive, scale), math_got, want);
      };
      EXPECT_TRUE(all_close(got.dq, exact_grad.dq, grad_tol(exact_grad.dq, naive_grad.dq, math.dq),
                            label + "dq"));
      EXPECT_TRUE(all_close(got.dk, exact_grad.dk, grad_tol(exact_grad.dk, naive_grad.dk, math.dk),
                            label + "dk"));
      EXPECT_TRUE(all_close(got.dv, exact_grad.dv, grad_tol(exact_grad.dv, naive_grad.dv, math.dv),
                            label + "dv"));
    }
  }
}

// Lk 300: full key tiles and a short last one; causal lower-right cuts some.
const Dims kDims = {1, 2, 1, 150, 300, 64, 64};

// Softcap from caps that bend every score (1) to caps far above them (1e30), forward and
// backward (the derivative 1 - tanh^2).
TEST(ScoreRange, SoftcapAtEveryCap) {
  for (double cap : {1.0, 30.0, 1e3, 1e5, 1e8, 1e30}) {
    for (Variant variant : {Variant::plain, Variant::causal_lower_right}) {
      Problem p = make_problem(kDims, {variant, DType::f32, false, 3});
      p.spec.scale = 2.0;  // scores of a few units, so that softcap 1 and 30 matter
      p.options.scale = 2.0;
      p.spec.softcap = p.options.softcap = cap;
      check_against_oracle(p, true, "softcap " + str(cap) + " " + name_of_variant(variant));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Scales from below f32's smallest subnormal to 1e30: the forward at every one; the backward up
// to 10 (at 1e3 f32 scores keep three bits below the point and flash's dV, from P recomputed
// against the LSE in log2 units, was 3.3 times as far from the oracle as math's; from 1e8 on
// math's f32 gradients overflow).
TEST(ScoreRange, ScalesOutsideF32sNormalRange) {
  const Dims decode = {1, 4, 1, 1, 300, 64, 64};  // K and V read in place
  for (double scale : {1e-46, 1e-40, 1e-20, 1e-3, 1.0, 10.0, 1e3, 1e8, 1e30}) {
    for (Variant variant : {Variant::plain, Variant::causal_lower_right, Variant::window}) {
      Problem p = make_problem(variant == Variant::window ? decode : kDims,
                               {variant, DType::f32, false, 4});
      p.spec.scale = scale;
      p.options.scale = scale;
      check_against_oracle(p, scale <= 10.0,
                           "scale " + str(scale) + " " + name_of_variant(variant));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Rows of huge, exactly representable scores S_j = base - d_j (d_j multiples of the f32 spacing
// of 8 base, over 8): P's exponents must keep the differences d_j whatever the base, also as
// the row's max grows from tile to tile (d_j falls by one unit every 128 keys). f32 inputs, D
// = 64, q = e_0 and K[j][0] = 8 S_j (scale 1/8): out = sum_j softmax(-d)_j v_j, which the fp64
// oracle gives to 1e-12; naive f32 (exp(s - max), all exact here) is as close. On every target,
// unsplit and split (the parts' LSEs merged): within 2e-6.
TEST(ScoreRange, HugeScoresKeepTheirDifferences) {
  const std::int64_t d = 64;
  for (const std::int64_t lk : {std::int64_t{8}, std::int64_t{4096}}) {
    for (const double base : {1e5, 1e6, -1e6, 1e7, 1e8}) {
      std::vector<double> q(static_cast<std::size_t>(d)), k(static_cast<std::size_t>(lk * d));
      std::vector<double> v(static_cast<std::size_t>(lk * d)), want(static_cast<std::size_t>(d));
      q[0] = 1.0;
      const double unit = std::ldexp(1.0, std::ilogb(8.0 * std::fabs(base)) - 23) / 8.0;
      double sum = 0.0;
      for (std::int64_t j = 0; j < lk; ++j) {
        const double diff = static_cast<double>((lk - 1 - j) * 7 % 13 + (lk - 1 - j) / 128) * unit;
        k[static_cast<std::size_t>(j * d)] = 8.0 * (base - diff);
        for (std::int64_t e = 0; e < d; ++e) {
          v[static_cast<std::size_t>(j * d + e)] = std::sin(static_cast<double>(j * d + e));
        }
        sum += std::exp(-diff);
      }
      for (std::int64_t j = 0; j < lk; ++j) {
        const double diff = static_cast<double>((lk - 1 - j) * 7 % 13 + (lk - 1 - j) / 128) * unit;
        for (std::int64_t e = 0; e < d; ++e) {
          want[static_cast<std::size_t>(e)] +=
              std::exp(-diff) / sum * v[static_cast<std::size_t>(j * d + e)];
        }
      }
      const Tensor tq = make_tensor(DType::f32, {1, 1, 1, d}, q);
      const Tensor tk = make_tensor(DType::f32, {1, 1, lk, d}, k);
      const Tensor tv = make_tensor(DType::f32, {1, 1, lk, d}, v);
      for (const std::string& target : simd_targets_supported()) {
        const ScopedTarget scope(target);
        for (const int splits : {1, 2, 5, 0}) {
          Options o;
          o.num_splits = splits;
          const std::vector<double> out = read_view(forward(tq, tk, tv, o, Backend::flash).out);
          EXPECT_TRUE(all_close(out, want, 2e-6,
                                target + " base " + str(base) + " Lk " + std::to_string(lk) +
                                    " num_splits " + std::to_string(splits)));
        }
      }
    }
  }
}

// The backward's P at huge scores: one query row, dO all ones, so dV's row j is P_j (times the
// one factor the f32 LSE's rounding gives the row): the ratios dV_j / dV_0 must be
// e^((S_j - S_0) scale) however large S. Scale 0.1 rounds each S * scale (S ~ 1e8, scaled
// ~1e7, ulp 1); taken unrounded, the ratios are right to 1e-5 on every target.
TEST(ScoreRange, BackwardAtHugeScoresKeepsTheirDifferences) {
  const std::int64_t d = 64, lk = 8;
  std::vector<double> q(static_cast<std::size_t>(d)), k(static_cast<std::size_t>(lk * d));
  std::vector<double> v(static_cast<std::size_t>(lk * d), 1.0),
      dout(static_cast<std::size_t>(d), 1.0);
  q[0] = 1.0;
  for (std::int64_t j = 0; j < lk; ++j)
    k[static_cast<std::size_t>(j * d)] = 1e8 - 8.0 * ((j * 5) % 7);
  const Tensor tq = make_tensor(DType::f32, {1, 1, 1, d}, q);
  const Tensor tk = make_tensor(DType::f32, {1, 1, lk, d}, k);
  const Tensor tv = make_tensor(DType::f32, {1, 1, lk, d}, v);
  const Tensor tdout = make_tensor(DType::f32, {1, 1, 1, d}, dout);
  Options o;
  o.scale = 0.1;
  const double scale = static_cast<double>(static_cast<float>(0.1));  // flash's f32 scale
  for (const std::string& target : simd_targets_supported()) {
    const ScopedTarget scope(target);
    const ForwardResult f = forward(tq, tk, tv, o, Backend::flash);
    const BackwardResult g = backward(tdout, tq, tk, tv, f.out, f.lse, o, Backend::flash);
    const std::vector<double> dv = read_view(g.dv);
    for (std::int64_t j = 1; j < lk; ++j) {
      const double want = std::exp((k[static_cast<std::size_t>(j * d)] - k[0]) * scale);
      EXPECT_NEAR(dv[static_cast<std::size_t>(j * d)] / dv[0], want, 1e-5 * want)
          << target << " key " << j;
    }
  }
}

// Additive masks of f32's extreme values (PyTorch users mask padding with
// torch.finfo(dtype).min): scores past FLT_MAX / log2 e, which once became infinities in log2
// units (read as keys masked out: a row masked with them alone gave 0 and LSE -inf). Flash now
// gives what f32 softmax gives, as math does: a row masked entirely averages V; keys masked so
// beside visible ones get nothing; keys at +3e38 share the row. Lk = 300: a row's key tiles
// (two of 128 and a short one) all masked, or masked in some. On every target, split or not
// (split: a row whose every score passes the limit averages each part's keys, then the parts
// alike, their LSEs equal where f64 holds no ln(keys) beside 2.36e38: README's Known limits).
TEST(ScoreRange, MasksOfF32sExtremeValues) {
  const std::int64_t lq = 4, lk = 300, d = 16;
  const Dims dims = {1, 1, 1, lq, lk, d, d};
  const Operands x = make_operands(dims, DType::f32, 9);
  const Tensor q = make_tensor(DType::f32, {1, 1, lq, d}, x.q);
  const Tensor k = make_tensor(DType::f32, {1, 1, lk, d}, x.k);
  const Tensor v = make_tensor(DType::f32, {1, 1, lk, d}, x.v);
  std::vector<double> mask(static_cast<std::size_t>(lq * lk), 0.0);
  for (std::int64_t j = 0; j < lk; ++j) {
    mask[static_cast<std::size_t>(j)] = -FLT_MAX;                          // row 0: every key
    mask[static_cast<std::size_t>(lk + j)] = j % 3 == 0 ? 0.0 : -FLT_MAX;  // row 1: 2 in 3 keys
    mask[static_cast<std::size_t>(2 * lk + j)] = j == 7 || j == 250 ? 3e38 : 0.0;  // row 2
    mask[static_cast<std::size_t>(3 * lk + j)] = j < 200 ? -FLT_MAX : 0.0;  // row 3: tiles 1-2
  }
  const Tensor m = make_tensor(DType::f32, {lq, lk}, mask);
  Options o;
  o.mask = m.view();
  const ForwardResult math = forward(q, k, v, o, Backend::math);
  const std::vector<double> want = read_view(math.out), want_lse = read_view(math.lse);
  std::vector<double> mean(static_cast<std::size_t>(d)), pair(static_cast<std::size_t>(d));
  for (std::int64_t e = 0; e < d; ++e) {
    for (std::int64_t j = 0; j < lk; ++j) mean[e] += x.v[static_cast<std::size_t>(j * d + e)];
    mean[e] /= static_cast<double>(lk);
    pair[e] =
        (x.v[static_cast<std::size_t>(7 * d + e)] + x.v[static_cast<std::size_t>(250 * d + e)]) / 2;
  }
  ASSERT_TRUE(all_close(std::vector<double>(want.begin(), want.begin() + d), mean, 1e-6, "math"));
  ASSERT_TRUE(all_close(std::vector<double>(want.begin() + 2 * d, want.begin() + 3 * d), pair, 1e-6,
                        "math"));
  for (const std::string& target : simd_targets_supported()) {
    const ScopedTarget scope(target);
    for (const int splits : {1, 3}) {
      o.num_splits = splits;
      const ForwardResult got = forward(q, k, v, o, Backend::flash);
      const std::string label = target + " num_splits " + std::to_string(splits);
      const std::vector<double> out = read_view(got.out);
      const std::size_t from = splits == 1 ? 0 : static_cast<std::size_t>(d);  // (row 0: above)
      EXPECT_TRUE(all_close(std::vector<double>(out.begin() + from, out.end()),
                            std::vector<double>(want.begin() + from, want.end()), 1e-5,
                            label + " out"));
      // LSEs: rows with visible keys as math's; a row of such scores alone at most FLT_MAX in
      // log2 units (its largest score held there), finite.
      const std::vector<double> lse = read_view(got.lse);
      EXPECT_NEAR(lse[1], want_lse[1], 1e-5 * (1 + std::fabs(want_lse[1]))) << label;
      EXPECT_NEAR(lse[3], want_lse[3], 1e-5 * (1 + std::fabs(want_lse[3]))) << label;
      EXPECT_NEAR(lse[0], -FLT_MAX / std::log2(std::exp(1.0)), 1e33) << label;
      EXPECT_NEAR(lse[2], FLT_MAX / std::log2(std::exp(1.0)), 1e33) << label;
    }
  }
}

// Scores that overflow f32 from finite terms (scale 1e38 times q.k of 10, or an additive mask
// of 3e38 on a score of 1e38) are held at FLT_MAX on the unfused backends, as flash holds its
// own: the row's weight goes to them, where an infinity once gave math inf - inf = NaN in every
// output. Keys' q.k: 10, 1, 2, -10 (scaled: 1e39 past f32, 1e38, 2e38, -1e39 held at -FLT_MAX,
// weight 0). The f64 oracle gives the row to key 0, and with key 0 masked out to key 2; with
// an additive 3e38 on key 1 (4e38, past f32) keys 0 and 1 share it where scores are held (the
// oracle, in f64, gives it to key 0: distinct scores past the limit count as equal).
TEST(ScoreRange, ScoresThatOverflowF32AreHeld) {
  const std::int64_t lk = 4, d = 8;
  const std::vector<double> dots = {10, 1, 2, -10};
  std::vector<double> q(static_cast<std::size_t>(d)), k(static_cast<std::size_t>(lk * d));
  std::vector<double> v(static_cast<std::size_t>(lk * d));
  q[0] = 1.0;
  for (std::int64_t j = 0; j < lk; ++j) {
    k[static_cast<std::size_t>(j * d)] = dots[static_cast<std::size_t>(j)];
    for (std::int64_t e = 0; e < d; ++e)
      v[static_cast<std::size_t>(j * d + e)] = static_cast<double>(1 + j * d + e);
  }
  auto row = [&](std::int64_t j) {
    return std::vector<double>(v.begin() + j * d, v.begin() + (j + 1) * d);
  };
  std::vector<double> shared(static_cast<std::size_t>(d));
  for (std::int64_t e = 0; e < d; ++e) shared[e] = (row(0)[e] + row(1)[e]) / 2;
  const Tensor tq = make_tensor(DType::f32, {1, 1, 1, d}, q);
  const Tensor tk = make_tensor(DType::f32, {1, 1, lk, d}, k);
  const Tensor tv = make_tensor(DType::f32, {1, 1, lk, d}, v);
  const Tensor masked = make_tensor(DType::f32, {1, lk}, {-INFINITY, 0, 0, 0});
  const Tensor raised = make_tensor(DType::f32, {1, lk}, {0, 3e38, 0, 0});
  struct Case {
    const char* name;
    const Tensor* mask;
    std::vector<double> want;
  };
  const Case cases[] = {{"no mask", nullptr, row(0)},
                        {"key 0 masked", &masked, row(2)},
                        {"key 1 raised by 3e38", &raised, shared}};
  for (const Case& c : cases) {
    Options o;
    o.scale = 1e38;
    if (c.mask != nullptr) o.mask = c.mask->view();
    for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
      if (backend == Backend::reference && c.mask == &raised) continue;  // (f64: no overflow)
      const ForwardResult f = forward(tq, tk, tv, o, backend);
      const std::string label = std::string(name_of(backend)) + ", " + c.name;
      EXPECT_TRUE(all_close(read_view(f.out), c.want, 1e-6, label));
      const double lse = read_view(f.lse)[0];
      EXPECT_TRUE(std::isfinite(lse) || backend == Backend::reference) << label << ": " << lse;
    }
  }
}

// ALiBi slopes whose bias -slope * distance could pass f32's range are refused (f32, bf16 and
// f16 inputs: distances up to Lq + Lk); one within it gives every backend the oracle's row,
// where a slope of -2e38 gave math and flash NaN. Lq = Lk = 3, D = 1, q = k = 1, v_j = j + 1:
// a slope of -5e37 adds 0, 5e37 and 1e38 by distance, so row i's weight goes to the key
// farthest from it (the last for row 0, the first for row 2; row 1's two tie).
TEST(ScoreRange, AlibiSlopesPastF32AreRefused) {
  const Tensor q = make_tensor(DType::f32, {1, 1, 3, 1}, {1, 1, 1});
  const Tensor v = make_tensor(DType::f32, {1, 1, 3, 1}, {1, 2, 3});
  const Tensor huge = make_tensor(DType::f32, {1}, {-2e38});
  const Tensor large = make_tensor(DType::f32, {1}, {-5e37});
  Options o;
  o.alibi_slopes = huge.view();
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    try {
      (void)forward(q, q, v, o, backend);
      ADD_FAILURE() << name_of(backend) << ": no exception";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "forward: alibi_slopes holds a slope too large for f32 arithmetic "
                "(alibi_slopes[0]=-2e+38, expected |slope| <= 5.67137e+37 = FLT_MAX / (Lq + Lk) "
                "with f32 inputs: the bias slope * distance must be finite)");
    }
  }
  o.alibi_slopes = large.view();
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    const ForwardResult f = forward(q, q, v, o, backend);
    EXPECT_TRUE(all_close(read_view(f.out), {3, 2, 1}, 1e-6, std::string(name_of(backend))));
    for (double lse : read_view(f.lse)) EXPECT_TRUE(std::isfinite(lse)) << name_of(backend);
  }
}

}  // namespace
}  // namespace attncore::test
