// Backward of the reference and math backends: dq, dk, dv and dbias against the oracle's
// backward over a seeded grid (every variant, dropout replay, GQA summing, dbias reduced over
// broadcast mask dims), zero gradients for rows without visible keys and for empty sizes, and
// thread-count invariance. (Against central finite differences: backward_fd_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

// The largest gradient magnitude of a problem (the noise scale of gradients that are exactly 0).
double gradient_scale(const OracleBackward& g) {
  return std::max({max_abs(g.dq), max_abs(g.dk), max_abs(g.dv), max_abs(g.dbias)});
}

struct BackwardCase {
  std::string name;
  Dims dims;
  Variant variant = Variant::plain;
  DType dtype = DType::f32;
  Backend backend = Backend::reference;
  Layout layout = Layout::bhsd;
  bool into = false;  // backward_into with caller-provided gradient views
  bool given_scale = false;
  DType mask_dtype = DType::f32;
  std::uint64_t seed = 1;
  std::string target;  // SIMD target forced for flash or math ("" = automatic)
};

void PrintTo(const BackwardCase& c, std::ostream* os) { *os << c.name; }

std::string case_name(const BackwardCase& c) {
  const Dims& d = c.dims;
  std::string s = std::string(name_of(c.backend)) + "_" + std::string(name_of(c.dtype)) + "_" +
                  name_of_variant(c.variant) + "_b" + std::to_string(d.batch) + "h" +
                  std::to_string(d.heads_q) + "kv" + std::to_string(d.heads_kv) + "_q" +
                  std::to_string(d.len_q) + "k" + std::to_string(d.len_k) + "_d" +
                  std::to_string(d.dim) + "v" + std::to_string(d.dim_v) + "_" +
                  name_of_layout(c.layout);
  if (c.into) s += "_into";
  if (c.given_scale) s += "_scale";
  if (!c.target.empty()) s += "_" + c.target;
  return s;
}

std::vector<BackwardCase> backward_grid() {
  struct Len {
    std::int64_t q, k;
  };
  const Len lens[] = {{1, 1},  {7, 7},  {16, 17}, {17, 16}, {33, 33},
                      {7, 33}, {33, 7}, {1, 20},  {20, 1}};
  struct HeadDim {
    std::int64_t d, dv;
  };
  const HeadDim head_dims[] = {{40, 40},   {59, 59},   {64, 64}, {80, 80},
                               {111, 111}, {128, 128}, {64, 40}, {40, 72}};
  struct Heads {
    std::int64_t b, hq, hkv;
  };
  const Heads heads[] = {{1, 1, 1}, {2, 2, 2}, {1, 4, 2}, {2, 3, 1}, {2, 4, 1}};
  std::vector<BackwardCase> cases;
  Random rng(777);
  std::uint64_t n = 0;
  for (Backend backend : {Backend::reference, Backend::math}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (Variant variant : backward_variants()) {
        for (int pick = 0; pick < 2; ++pick) {
          BackwardCase c;
          const Len len = lens[rng.below(std::size(lens))];
          const HeadDim hd = head_dims[rng.below(std::size(head_dims))];
          const Heads h = heads[rng.below(std::size(heads))];
          c.dims = {h.b, h.hq, h.hkv, len.q, len.k, hd.d, hd.dv};
          c.variant = variant;
          c.dtype = dtype;
          c.backend = backend;
          c.layout = static_cast<Layout>(n % 3);
          c.into = n % 3 == 1;
          c.given_scale = n % 2 == 1;
          c.mask_dtype = n % 4 < 2 ? dtype : DType::f32;
          // math's GEMMs on every SIMD target this CPU runs, in turn.
          if (backend == Backend::math) {
            const std::vector<std::string> targets = simd_targets_supported();
            c.target = targets[n % targets.size()];
          }
          c.seed = 5000 + n;
          c.name = case_name(c);
          cases.push_back(c);
          ++n;
        }
      }
    }
  }
  // The flash backend on every SIMD target this CPU runs (tiles of 128 keys, blocks of 48-64
  // rows: lengths around both), every variant, f32 / bf16 / f16.
  const Len flash_lens[] = {{1, 1},    {7, 9},    {47, 49},   {64, 65}, {65, 63},
                            {17, 130}, {130, 17}, {129, 128}, {1, 200}};
  for (const std::string& target : simd_targets_supported()) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (Variant variant : backward_variants()) {
        BackwardCase c;
        const Len len = flash_lens[rng.below(std::size(flash_lens))];
        const HeadDim hd = head_dims[rng.below(std::size(head_dims))];
        const Heads h = heads[rng.below(std::size(heads))];
        c.dims = {h.b, h.hq, h.hkv, len.q, len.k, hd.d, hd.dv};
        c.variant = variant;
        c.dtype = dtype;
        c.backend = Backend::flash;
        c.layout = static_cast<Layout>(n % 3);
        c.into = n % 3 == 1;
        c.given_scale = n % 2 == 1;
        c.mask_dtype = n % 4 < 2 ? dtype : DType::f32;
        c.seed = 5000 + n;
        c.target = target;
        c.name = case_name(c);
        cases.push_back(c);
        ++n;
      }
    }
  }
  // Empty sizes: zero gradients of the right shapes.
  const Dims empties[] = {
      {1, 2, 1, 6, 0, 32, 16}, {2, 2, 2, 0, 6, 32, 16}, {0, 2, 2, 4, 4, 16, 16}};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (const Dims& d : empties) {
        for (Variant variant : {Variant::plain, Variant::additive_full, Variant::dropout}) {
          BackwardCase c;
          c.dims = d;
          c.variant = variant;
          c.dtype = dtype;
          c.backend = backend;
          c.into = n % 2 == 0;
          c.mask_dtype = dtype;
          c.seed = 5000 + n;
          c.name = case_name(c);
          cases.push_back(c);
          ++n;
        }
      }
    }
  }
  return cases;
}

// The gradients as the library returns them, read back to fp64 (dbias empty without one).
struct Gradients {
  std::vector<double> dq, dk, dv, dbias;
};

// Library forward, then backward (or backward_into) with the same options.
Gradients run_backward(const BackwardCase& c, const Problem& p, const Operands& x) {
  const Dims& d = c.dims;
  const Buffer q = make_buffer(c.dtype, to_shape(d.q_shape()), c.layout, x.q);  // [B, Hq, Lq, D]
  const Buffer k = make_buffer(c.dtype, to_shape(d.k_shape()), c.layout, x.k);  // [B, Hkv, Lk, D]
  const Buffer v = make_buffer(c.dtype, to_shape(d.v_shape()), c.layout, x.v);  // [B, Hkv, Lk, Dv]
  const Buffer dout =
      make_buffer(c.dtype, to_shape(d.out_shape()), c.layout, x.dout);  // [B, Hq, Lq, Dv]
  Options options = p.options;
  options.compute_dbias = is_additive(p);
  const ForwardResult f = forward(q.view, k.view, v.view, forward_options(options), c.backend);
  Gradients g;
  if (c.into) {
    // Gradient views with padded rows (NaN filler), poisoned so unwritten elements show up.
    const Buffer dq = make_buffer(c.dtype, to_shape(d.q_shape()), Layout::padded);
    const Buffer dk = make_buffer(c.dtype, to_shape(d.k_shape()), Layout::padded);
    const Buffer dv = make_buffer(c.dtype, to_shape(d.v_shape()), Layout::padded);
    for (const Buffer* b : {&dq, &dk, &dv}) {
      std::int64_t n = 1;
      for (int i = 0; i < 4; ++i) n *= b->view.size(i);
      write_view(b->view, std::vector<double>(static_cast<std::size_t>(n), 4321.0));
    }
    std::optional<TensorView> dbias_view;
    Tensor dbias;
    if (options.compute_dbias) {
      const TensorView& m = p.mask_tensor.view();
      dbias = Tensor(m.dtype, m.shape.data(), m.rank);  // shaped like the mask
      dbias_view = dbias.view();
    }
    backward_into(dout.view, q.view, k.view, v.view, f.out, f.lse, dq.view, dk.view, dv.view,
                  dbias_view, options, c.backend);
    EXPECT_TRUE(padding_intact(dq) && padding_intact(dk) && padding_intact(dv))
        << "a gradient was written outside its view";
    g.dq = read_view(dq.view);
    g.dk = read_view(dk.view);
    g.dv = read_view(dv.view);
    if (dbias_view) g.dbias = read_view(*dbias_view);
  } else {
    const BackwardResult r =
        backward(dout.view, q.view, k.view, v.view, f.out, f.lse, options, c.backend);
    EXPECT_EQ(r.dq.dtype(), c.dtype);
    EXPECT_EQ(r.dk.dtype(), c.dtype);
    EXPECT_EQ(r.dv.dtype(), c.dtype);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(r.dq.size(i), d.q_shape()[static_cast<std::size_t>(i)]);
      EXPECT_EQ(r.dk.size(i), d.k_shape()[static_cast<std::size_t>(i)]);
      EXPECT_EQ(r.dv.size(i), d.v_shape()[static_cast<std::size_t>(i)]);
    }
    g.dq = read_view(r.dq);
    g.dk = read_view(r.dk);
    g.dv = read_view(r.dv);
    if (options.compute_dbias) {
      EXPECT_TRUE(r.dbias.defined());
      EXPECT_EQ(r.dbias.rank(), p.mask_tensor.rank());
      for (int i = 0; i < p.mask_tensor.rank(); ++i)
        EXPECT_EQ(r.dbias.size(i), p.mask_tensor.size(i));
      g.dbias = read_view(r.dbias);
    } else {
      EXPECT_FALSE(r.dbias.defined());
    }
  }
  return g;
}

class BackwardGrid : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(BackwardGrid, MatchesOracle) {
  const BackwardCase& c = GetParam();
  const ScopedTarget target(c.target);
  const Problem p = make_problem(c.dims, {c.variant, c.mask_dtype, c.given_scale, c.seed});
  const Operands x = make_operands(c.dims, c.dtype, c.seed);
  const Gradients got = run_backward(c, p, x);
  const OracleBackward exact = oracle_backward(c.dims, p.spec, x.q, x.k, x.v, x.dout);
  OracleBackward naive;
  if (c.dtype == DType::bf16 || c.dtype == DType::f16) {
    naive = oracle_backward(c.dims, p.spec, x.q, x.k, x.v, x.dout, rounder_for(c.dtype));
  }
  const double scale = gradient_scale(exact);
  EXPECT_TRUE(
      all_close(got.dq, exact.dq, grad_tolerance(c.dtype, exact.dq, naive.dq, scale), "dq"));
  EXPECT_TRUE(
      all_close(got.dk, exact.dk, grad_tolerance(c.dtype, exact.dk, naive.dk, scale), "dk"));
  EXPECT_TRUE(
      all_close(got.dv, exact.dv, grad_tolerance(c.dtype, exact.dv, naive.dv, scale), "dv"));
  if (is_additive(p)) {
    // dbias is stored in the mask's dtype: allow its rounding when that is coarser than the
    // query dtype (an f32 mask of f64 inputs, a bf16 mask of f32 inputs).
    const DType mdt = p.mask_tensor.dtype();
    double tol = grad_tolerance(c.dtype, exact.dbias, naive.dbias, scale);
    if (mdt != c.dtype && mdt != DType::f64) {
      tol = std::max(tol, 2.0 * max_abs_diff(rounded(exact.dbias, mdt), exact.dbias) +
                              grad_tolerance(DType::f32, exact.dbias, {}, scale));
    }
    EXPECT_TRUE(all_close(got.dbias, exact.dbias, tol, "dbias"));
  }
  for (const auto* g : {&got.dq, &got.dk, &got.dv, &got.dbias}) {
    for (double e : *g) ASSERT_FALSE(std::isnan(e)) << "NaN gradient";
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, BackwardGrid, ::testing::ValuesIn(backward_grid()),
                         [](const ::testing::TestParamInfo<BackwardCase>& info) {
                           return info.param.name;
                         });

// dbias reduced over every broadcast mask shape, checked against the oracle in f64 and f32.
TEST(Backward, DbiasReducesOverBroadcastDims) {
  const Dims d{2, 3, 3, 11, 13, 24, 20};  // B = 2, Hq = 3, Lq = 11, Lk = 13
  const std::vector<std::vector<std::int64_t>> shapes = {
      {2, 3, 11, 13}, {1, 1, 11, 13}, {2, 1, 1, 13}, {1, 3, 11, 1}, {2, 3, 1, 1},
      {1, 1, 1, 1},   {11, 13},       {1, 13},       {11, 1}};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f64, DType::f32}) {
      if (backend == Backend::flash && dtype == DType::f64) continue;  // flash: no f64
      for (const auto& shape : shapes) {
        std::string shape_str;
        for (std::int64_t s : shape) shape_str += std::to_string(s) + ",";
        SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)) + " mask [" +
                     shape_str + "]");
        std::int64_t n = 1;
        for (std::int64_t s : shape) n *= s;
        const std::vector<double> values = rounded(random_vector(n, 90 + n, -1.5, 1.5), dtype);
        const Tensor mask = make_tensor(dtype, shape, values);
        Spec spec;
        spec.scale = 1.0 / std::sqrt(24.0);
        spec.mask = DenseMask{
            false,
            shape.size() == 2 ? std::array<std::int64_t, 4>{1, 1, shape[0], shape[1]}
                              : std::array<std::int64_t, 4>{shape[0], shape[1], shape[2], shape[3]},
            values};
        spec.causal = CausalMode::lower_right;
        Options options;
        options.mask = mask.view();
        options.causal = Causal::lower_right;
        options.compute_dbias = true;
        const Operands x = make_operands(d, dtype, 61);
        const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
        const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
        const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
        const Buffer dout = make_buffer(dtype, to_shape(d.out_shape()), Layout::bhsd, x.dout);
        const ForwardResult f = forward(q.view, k.view, v.view, forward_options(options), backend);
        const BackwardResult r =
            backward(dout.view, q.view, k.view, v.view, f.out, f.lse, options, backend);
        const OracleBackward want = oracle_backward(d, spec, x.q, x.k, x.v, x.dout);
        ASSERT_EQ(r.dbias.rank(), static_cast<int>(shape.size()));
        for (int i = 0; i < r.dbias.rank(); ++i)
          EXPECT_EQ(r.dbias.size(i), shape[static_cast<std::size_t>(i)]);
        const double scale = gradient_scale(want);
        EXPECT_TRUE(all_close(read_view(r.dbias), want.dbias,
                              grad_tolerance(dtype, want.dbias, {}, scale), "dbias"));
        EXPECT_TRUE(
            all_close(read_view(r.dq), want.dq, grad_tolerance(dtype, want.dq, {}, scale), "dq"));
      }
    }
  }
}

// GQA: dK and dV of a shared head are the sums over its query heads, i.e. equal to the
// repeated-heads gradients summed per group.
TEST(Backward, GqaSumsOverQueryHeads) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    // flash has no f64: f32, where summing per-head gradients reorders f32 additions.
    const DType dtype = backend == Backend::flash ? DType::f32 : DType::f64;
    const double tol = backend == Backend::flash ? 1e-5 : 1e-12;
    for (std::int64_t hkv : {2, 1}) {
      SCOPED_TRACE(std::string(name_of(backend)) + " Hkv=" + std::to_string(hkv));
      const std::int64_t group = 4 / hkv;
      const Dims d{2, 4, hkv, 9, 14, 32, 24};
      const Operands x = make_operands(d, dtype, 71);
      std::vector<double> k_rep, v_rep;  // [B, Hq, Lk, D] and [B, Hq, Lk, Dv]
      for (std::int64_t b = 0; b < 2; ++b) {
        for (std::int64_t h = 0; h < 4; ++h) {
          const std::int64_t src = b * hkv + h / group;
          k_rep.insert(k_rep.end(), x.k.begin() + src * 14 * 32, x.k.begin() + (src + 1) * 14 * 32);
          v_rep.insert(v_rep.end(), x.v.begin() + src * 14 * 24, x.v.begin() + (src + 1) * 14 * 24);
        }
      }
      Options options;
      options.causal = Causal::upper_left;
      const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
      const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
      const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
      const Buffer kr = make_buffer(dtype, {2, 4, 14, 32}, Layout::bhsd, k_rep);
      const Buffer vr = make_buffer(dtype, {2, 4, 14, 24}, Layout::bhsd, v_rep);
      const Buffer dout = make_buffer(dtype, to_shape(d.out_shape()), Layout::bhsd, x.dout);
      const ForwardResult fa = forward(q.view, k.view, v.view, options, backend);
      const ForwardResult fb = forward(q.view, kr.view, vr.view, options, backend);
      const BackwardResult a =
          backward(dout.view, q.view, k.view, v.view, fa.out, fa.lse, options, backend);
      const BackwardResult b =
          backward(dout.view, q.view, kr.view, vr.view, fb.out, fb.lse, options, backend);
      const std::vector<double> dk_rep = read_view(b.dk), dv_rep = read_view(b.dv);
      std::vector<double> dk_sum(x.k.size(), 0.0), dv_sum(x.v.size(), 0.0);
      for (std::int64_t bb = 0; bb < 2; ++bb) {
        for (std::int64_t h = 0; h < 4; ++h) {
          const std::int64_t dst = bb * hkv + h / group, src = bb * 4 + h;
          for (std::int64_t e = 0; e < 14 * 32; ++e)
            dk_sum[static_cast<std::size_t>(dst * 14 * 32 + e)] +=
                dk_rep[static_cast<std::size_t>(src * 14 * 32 + e)];
          for (std::int64_t e = 0; e < 14 * 24; ++e)
            dv_sum[static_cast<std::size_t>(dst * 14 * 24 + e)] +=
                dv_rep[static_cast<std::size_t>(src * 14 * 24 + e)];
        }
      }
      EXPECT_TRUE(all_close(read_view(a.dk), dk_sum, tol * (1 + max_abs(dk_sum)), "dk"));
      EXPECT_TRUE(all_close(read_view(a.dv), dv_sum, tol * (1 + max_abs(dv_sum)), "dv"));
      EXPECT_TRUE(
          all_close(read_view(a.dq), read_view(b.dq), tol * (1 + max_abs(read_view(b.dq))), "dq"));
    }
  }
}

// Rows without a visible key contribute nothing: zero dq rows, no NaN anywhere.
TEST(Backward, FullyMaskedRowsGiveZeroGradients) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      if (backend == Backend::flash && dtype == DType::f64) continue;  // flash: no f64
      SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)));
      const Dims d{1, 2, 1, 10, 4, 16, 16};  // lower-right causal hides rows 0..5 entirely
      const Operands x = make_operands(d, dtype, 81);
      Options options;
      options.causal = Causal::lower_right;
      const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
      const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
      const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
      const Buffer dout = make_buffer(dtype, to_shape(d.out_shape()), Layout::bhsd, x.dout);
      const ForwardResult f = forward(q.view, k.view, v.view, options, backend);
      const BackwardResult r =
          backward(dout.view, q.view, k.view, v.view, f.out, f.lse, options, backend);
      const std::vector<double> dq = read_view(r.dq);
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t i = 0; i < 6; ++i) {
          for (std::int64_t c = 0; c < 16; ++c) {
            EXPECT_EQ(dq[static_cast<std::size_t>((h * 10 + i) * 16 + c)], 0.0) << h << " " << i;
          }
        }
      }
      for (const auto& g : {dq, read_view(r.dk), read_view(r.dv)}) {
        for (double e : g) ASSERT_TRUE(std::isfinite(e));
      }
      // Every row hidden: all gradients are exactly zero.
      std::vector<double> none(10 * 4, 0.0);  // bool [Lq, Lk], all false
      const Tensor mask = make_tensor(DType::b8, {10, 4}, none);
      Options hidden;
      hidden.mask = mask.view();
      const ForwardResult f2 = forward(q.view, k.view, v.view, hidden, backend);
      const BackwardResult r2 =
          backward(dout.view, q.view, k.view, v.view, f2.out, f2.lse, hidden, backend);
      for (const auto& g : {read_view(r2.dq), read_view(r2.dk), read_view(r2.dv)}) {
        for (double e : g) ASSERT_EQ(e, 0.0);
      }
    }
  }
}

// Thread count never changes the gradients' bits.
// dq, dk, dv (and dbias) of one result, one after the other.
std::vector<double> all_gradients(const BackwardResult& r, bool with_dbias) {
  std::vector<double> all = read_view(r.dq);
  for (const Tensor* t : {&r.dk, &r.dv, &r.dbias}) {
    if (t == &r.dbias && !with_dbias) continue;
    const std::vector<double> e = read_view(*t);
    all.insert(all.end(), e.begin(), e.end());
  }
  return all;
}

// Whether every run equals the first bit for bit.
::testing::AssertionResult bitwise_equal_runs(const std::vector<std::vector<double>>& runs) {
  for (std::size_t t = 1; t < runs.size(); ++t) {
    if (runs[t].size() != runs[0].size() ||
        std::memcmp(runs[0].data(), runs[t].data(), runs[0].size() * sizeof(double)) != 0) {
      return ::testing::AssertionFailure() << "gradients of run " << t << " differ from run 0's";
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(Backward, ThreadCountDoesNotChangeBits) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (Variant variant : {Variant::combo, Variant::dropout_combo}) {
      SCOPED_TRACE(std::string(name_of(backend)) + " " + name_of_variant(variant));
      const Dims d{2, 4, 2, 37, 45, 40, 40};
      Problem p = make_problem(d, {variant, DType::f32, false, 12});
      p.options.compute_dbias = true;
      const Operands x = make_operands(d, DType::f32, 12);
      const Buffer q = make_buffer(DType::f32, to_shape(d.q_shape()), Layout::bhsd, x.q);
      const Buffer k = make_buffer(DType::f32, to_shape(d.k_shape()), Layout::bhsd, x.k);
      const Buffer v = make_buffer(DType::f32, to_shape(d.v_shape()), Layout::bhsd, x.v);
      const Buffer dout = make_buffer(DType::f32, to_shape(d.out_shape()), Layout::bhsd, x.dout);
      std::vector<std::vector<double>> runs;
      for (int threads : {1, 2, 3}) {
        p.options.num_threads = threads;
        const ForwardResult f =
            forward(q.view, k.view, v.view, forward_options(p.options), backend);
        const BackwardResult r =
            backward(dout.view, q.view, k.view, v.view, f.out, f.lse, p.options, backend);
        runs.push_back(all_gradients(r, /*with_dbias=*/true));
      }
      EXPECT_TRUE(bitwise_equal_runs(runs));  // 1, 2, 3 threads
    }
  }
}

// Grouped heads without dBias run on every thread: the query heads of a kv head add their dK,
// dV tiles in head order (into the f32 outputs, or an f32 sum beside bf16 / f16 outputs), so
// the gradients are bitwise the same for 1, 2, 3 and 5 threads.
TEST(Backward, GroupedHeadsSumInHeadOrderOnAnyThreadCount) {
  // 4 query heads per kv head, 3 key tiles; Lq = 150: an item per head, Lq = 100: items of 2
  // heads, Lq = 20: one item of 4 heads per kv head (short rows share the packed K/V tiles).
  for (std::int64_t lq : {150, 100, 20}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (Variant variant : {Variant::plain, Variant::causal_lower_right, Variant::dropout}) {
        const Dims d{2, 8, 2, lq, 300, 40, 24};
        SCOPED_TRACE(std::string(name_of(dtype)) + " " + name_of_variant(variant) +
                     " Lq=" + std::to_string(lq));
        Problem p = make_problem(d, {variant, dtype, false, 33});
        const Operands x = make_operands(d, dtype, 33);
        const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
        const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bshd, x.k);
        const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
        const Buffer dout = make_buffer(dtype, to_shape(d.out_shape()), Layout::bhsd, x.dout);
        p.options.num_threads = 1;
        const ForwardResult f = forward(q.view, k.view, v.view, p.options, Backend::flash);
        std::vector<std::vector<double>> runs;
        for (int threads : {1, 2, 3, 5}) {
          p.options.num_threads = threads;
          const BackwardResult r =
              backward(dout.view, q.view, k.view, v.view, f.out, f.lse, p.options, Backend::flash);
          runs.push_back(all_gradients(r, /*with_dbias=*/false));
        }
        EXPECT_TRUE(bitwise_equal_runs(runs));
      }
    }
  }
}

// Fewer than 4 heads: the fused backward cuts each head's key tiles into parts (separate items
// with their own dQ parts, summed in order), and the two query heads of the one kv head add
// their dK, dV tiles in head order. The gradients match the oracle and do not depend on the
// thread count.
TEST(Backward, FewHeadsSplitKeyTiles) {
  const Dims d{1, 2, 1, 70, 600, 48, 40};  // two query heads on one kv head, 5 key tiles
  for (Variant variant : {Variant::plain, Variant::causal_lower_right, Variant::dropout}) {
    SCOPED_TRACE(name_of_variant(variant));
    Problem p = make_problem(d, {variant, DType::f32, false, 21});
    const Operands x = make_operands(d, DType::f32, 21);
    const Buffer q = make_buffer(DType::f32, to_shape(d.q_shape()), Layout::bhsd, x.q);
    const Buffer k = make_buffer(DType::f32, to_shape(d.k_shape()), Layout::bhsd, x.k);
    const Buffer v = make_buffer(DType::f32, to_shape(d.v_shape()), Layout::bhsd, x.v);
    const Buffer dout = make_buffer(DType::f32, to_shape(d.out_shape()), Layout::bhsd, x.dout);
    const OracleBackward exact = oracle_backward(d, p.spec, x.q, x.k, x.v, x.dout);
    const double scale = gradient_scale(exact);
    std::vector<std::vector<double>> runs;
    for (int threads : {1, 2, 3}) {
      p.options.num_threads = threads;
      const ForwardResult f = forward(q.view, k.view, v.view, p.options, Backend::flash);
      const BackwardResult r =
          backward(dout.view, q.view, k.view, v.view, f.out, f.lse, p.options, Backend::flash);
      EXPECT_TRUE(all_close(read_view(r.dq), exact.dq,
                            grad_tolerance(DType::f32, exact.dq, {}, scale), "dq"));
      EXPECT_TRUE(all_close(read_view(r.dk), exact.dk,
                            grad_tolerance(DType::f32, exact.dk, {}, scale), "dk"));
      EXPECT_TRUE(all_close(read_view(r.dv), exact.dv,
                            grad_tolerance(DType::f32, exact.dv, {}, scale), "dv"));
      runs.push_back(all_gradients(r, /*with_dbias=*/false));
    }
    EXPECT_TRUE(bitwise_equal_runs(runs));  // 1, 2, 3 threads
  }
}

// attncore.h: backward takes "the forward call with the same q, k, v and options", so the
// options of a backward with compute_dbias must be accepted by forward too.
TEST(Backward, ForwardAcceptsTheBackwardOptions) {
  const Dims d{1, 2, 2, 5, 6, 8, 8};
  const Operands x = make_operands(d, DType::f32, 14);
  const Tensor q = make_tensor(DType::f32, to_shape(d.q_shape()), x.q);
  const Tensor k = make_tensor(DType::f32, to_shape(d.k_shape()), x.k);
  const Tensor v = make_tensor(DType::f32, to_shape(d.v_shape()), x.v);
  const Tensor mask = make_tensor(DType::f32, {5, 6}, random_vector(30, 15));
  Options options;
  options.mask = mask.view();
  options.compute_dbias = true;
  for (Backend backend : {Backend::reference, Backend::math, Backend::automatic}) {
    EXPECT_NO_THROW((void)forward(q, k, v, options, backend)) << name_of(backend);
  }
}

}  // namespace
}  // namespace attncore::test
