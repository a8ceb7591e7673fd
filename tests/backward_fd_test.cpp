// Backward against central finite differences in fp64 on tiny problems: the oracle's backward
// against finite differences of the oracle's forward, and the library's f64 backward
// (reference and math) against finite differences of the library's own f64 forward, for every
// variant.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <functional>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

// Tiny sizes with Lq < Lk so that causal and windows hide some keys but no whole row.
const Dims kTiny{2, 2, 1, 4, 7, 3, 2};

// L(q, k, v, bias) = sum(dout * out) for a forward function and the numerical gradient of each
// input element by central differences with step h.
using ForwardFn = std::function<std::vector<double>(
    const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
    const std::vector<double>& mask)>;

double loss(const ForwardFn& fwd, const std::vector<double>& dout, const std::vector<double>& q,
            const std::vector<double>& k, const std::vector<double>& v,
            const std::vector<double>& mask) {
  const std::vector<double> out = fwd(q, k, v, mask);
  double l = 0.0;
  for (std::size_t n = 0; n < out.size(); ++n) l += dout[n] * out[n];
  return l;
}

struct NumericalGradients {
  std::vector<double> dq, dk, dv, dbias;
};

NumericalGradients finite_differences(const ForwardFn& fwd, const Operands& x,
                                      const std::vector<double>& mask) {
  constexpr double h = 1e-6;
  NumericalGradients g;
  std::vector<double> q = x.q, k = x.k, v = x.v, m = mask;
  auto diff = [&](std::vector<double>& t, std::vector<double>& grad) {
    grad.assign(t.size(), 0.0);
    for (std::size_t n = 0; n < t.size(); ++n) {
      const double keep = t[n];
      if (!std::isfinite(keep)) continue;  // a -inf mask entry has no gradient
      t[n] = keep + h;
      const double up = loss(fwd, x.dout, q, k, v, m);
      t[n] = keep - h;
      const double down = loss(fwd, x.dout, q, k, v, m);
      t[n] = keep;
      grad[n] = (up - down) / (2 * h);
    }
  };
  diff(q, g.dq);
  diff(k, g.dk);
  diff(v, g.dv);
  if (!m.empty()) diff(m, g.dbias);
  return g;
}

class FiniteDifferences : public ::testing::TestWithParam<Variant> {};

TEST_P(FiniteDifferences, OracleBackward) {
  const Variant variant = GetParam();
  const Problem p = make_problem(kTiny, {variant, DType::f64, variant != Variant::softcap, 3});
  const Operands x = make_operands(kTiny, DType::f64, 3);
  const std::vector<double> mask = is_additive(p) ? p.spec.mask->values : std::vector<double>{};
  const ForwardFn fwd = [&](const std::vector<double>& q, const std::vector<double>& k,
                            const std::vector<double>& v, const std::vector<double>& m) {
    Spec spec = p.spec;
    if (!m.empty()) spec.mask->values = m;
    return oracle_forward(kTiny, spec, q, k, v).out;
  };
  const NumericalGradients num = finite_differences(fwd, x, mask);
  const OracleBackward g = oracle_backward(kTiny, p.spec, x.q, x.k, x.v, x.dout);
  EXPECT_TRUE(all_close(g.dq, num.dq, 1e-7, "dq"));
  EXPECT_TRUE(all_close(g.dk, num.dk, 1e-7, "dk"));
  EXPECT_TRUE(all_close(g.dv, num.dv, 1e-7, "dv"));
  // -inf mask entries have no numerical gradient (left 0); the oracle's is 0 there too.
  if (!mask.empty()) {
    EXPECT_TRUE(all_close(g.dbias, num.dbias, 1e-7, "dbias"));
  }
}

// The library's f64 backward against finite differences of the library's own f64 forward.
TEST_P(FiniteDifferences, LibraryBackward) {
  const Variant variant = GetParam();
  const Problem p = make_problem(kTiny, {variant, DType::f64, variant != Variant::softcap, 3});
  const Operands x = make_operands(kTiny, DType::f64, 3);
  const bool additive = is_additive(p);
  const std::vector<double> mask = additive ? p.spec.mask->values : std::vector<double>{};
  for (Backend backend : {Backend::reference, Backend::math}) {
    SCOPED_TRACE(name_of(backend));
    const ForwardFn fwd = [&](const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, const std::vector<double>& m) {
      const Tensor qt = make_tensor(DType::f64, to_shape(kTiny.q_shape()), q);
      const Tensor kt = make_tensor(DType::f64, to_shape(kTiny.k_shape()), k);
      const Tensor vt = make_tensor(DType::f64, to_shape(kTiny.v_shape()), v);
      Options options = p.options;
      options.num_threads = 1;
      Tensor mt;
      if (!m.empty()) {
        const TensorView& shape = p.mask_tensor.view();
        mt = Tensor(DType::f64, shape.shape.data(), shape.rank);
        write_view(mt.view(), m);
        options.mask = mt.view();
      }
      return read_view(forward(qt, kt, vt, options, backend).out);
    };
    const NumericalGradients num = finite_differences(fwd, x, mask);
    const Tensor qt = make_tensor(DType::f64, to_shape(kTiny.q_shape()), x.q);
    const Tensor kt = make_tensor(DType::f64, to_shape(kTiny.k_shape()), x.k);
    const Tensor vt = make_tensor(DType::f64, to_shape(kTiny.v_shape()), x.v);
    const Tensor dout = make_tensor(DType::f64, to_shape(kTiny.out_shape()), x.dout);
    Options options = p.options;
    options.compute_dbias = additive;
    const ForwardResult f = forward(qt, kt, vt, forward_options(options), backend);
    const BackwardResult g = backward(dout, qt, kt, vt, f.out, f.lse, options, backend);
    EXPECT_TRUE(all_close(read_view(g.dq), num.dq, 1e-7, "dq"));
    EXPECT_TRUE(all_close(read_view(g.dk), num.dk, 1e-7, "dk"));
    EXPECT_TRUE(all_close(read_view(g.dv), num.dv, 1e-7, "dv"));
    if (additive) {
      EXPECT_TRUE(all_close(read_view(g.dbias), num.dbias, 1e-7, "dbias"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, FiniteDifferences, ::testing::ValuesIn(backward_variants()),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return name_of_variant(info.param);
                         });

}  // namespace
}  // namespace attncore::test
