// Forward of the reference and math backends against the fp64 oracle: a seeded grid over the
// sizes of docs/design.md section 6 (tile edges, Lq above / equal / below Lk, empty sizes, odd head
// dims, Dv != D, GQA / MQA), every variant, dtypes f32 / bf16 / f16 / f64, layouts BHSD, BSHD
// and padded rows, new outputs and caller-provided ones; then NaN propagation, GQA == repeated
// heads, thread-count invariance and strided / broadcast mask views.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct ForwardCase {
  std::string name;
  Dims dims;
  Variant variant = Variant::plain;
  DType dtype = DType::f32;
  Backend backend = Backend::reference;
  Layout layout = Layout::bhsd;
  bool into = false;  // forward_into with caller-provided (padded) out and lse
  bool given_scale = false;
  DType mask_dtype = DType::f32;
  std::uint64_t seed = 1;
  std::string target;  // SIMD target forced for flash or math ("" = automatic)
};

void PrintTo(const ForwardCase& c, std::ostream* os) { *os << c.name; }

DType lse_dtype_for(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

std::string case_name(const ForwardCase& c) {
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

// The seeded grid: every (backend, dtype, variant) three times, with sizes, head dims, head counts,
// layouts and output modes drawn so that each value of each list appears many times.
std::vector<ForwardCase> forward_grid() {
  struct Len {
    std::int64_t q, k;
  };
  const Len lens[] = {{1, 1},   {7, 7},  {16, 16}, {17, 17}, {7, 16},    {17, 7},    {16, 17},
                      {97, 97}, {1, 97}, {97, 17}, {17, 97}, {128, 129}, {129, 128}, {33, 1}};
  struct HeadDim {
    std::int64_t d, dv;
  };
  const HeadDim head_dims[] = {{40, 40},   {59, 59},   {64, 64}, {80, 80},  {111, 111},
                               {128, 128}, {256, 256}, {64, 40}, {40, 111}, {59, 17}};
  struct Heads {
    std::int64_t b, hq, hkv;
  };
  const Heads heads[] = {{1, 1, 1}, {2, 2, 2}, {1, 4, 2}, {2, 3, 1}, {2, 2, 1}};
  std::vector<Variant> variants = deterministic_variants();
  variants.push_back(Variant::dropout);
  variants.push_back(Variant::dropout_combo);

  std::vector<ForwardCase> cases;
  Random rng(20240611);
  std::uint64_t n = 0;
  for (Backend backend : {Backend::reference, Backend::math}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      for (Variant variant : variants) {
        for (int pick = 0; pick < 3; ++pick) {
          ForwardCase c;
          const Len len = lens[rng.below(std::size(lens))];
          HeadDim hd = head_dims[rng.below(std::size(head_dims))];
          const Heads h = heads[rng.below(std::size(heads))];
          // Keep the work small: the largest head dims only with moderate lengths.
          if (len.q * len.k > 5000 && hd.d > 128) hd = {80, 80};
          c.dims = {h.b, h.hq, h.hkv, len.q, len.k, hd.d, hd.dv};
          c.variant = variant;
          c.dtype = dtype;
          c.backend = backend;
          c.layout = static_cast<Layout>(n % 3);
          c.into = n % 4 == 1;
          c.given_scale = n % 2 == 0;
          c.mask_dtype = n % 5 < 3 ? dtype : DType::f32;  // f64 masks: AdditiveMaskDtypes
          // math's GEMMs on every SIMD target this CPU runs, in turn.
          if (backend == Backend::math) {
            const std::vector<std::string> targets = simd_targets_supported();
            c.target = targets[n % targets.size()];
          }
          c.seed = 1000 + n;
          c.name = case_name(c);
          cases.push_back(c);
          ++n;
        }
      }
    }
  }
  // The flash backend on every SIMD target this CPU runs, every variant, f32 / bf16 / f16.
  // Tile edges: its blocks are 64 (AVX-512) or 48 query rows and its key tiles 128 keys.
  const Len flash_lens[] = {{1, 1},    {7, 7},     {47, 49},   {48, 48}, {63, 64},
                            {64, 65},  {65, 63},   {97, 97},   {1, 130}, {130, 17},
                            {17, 130}, {129, 128}, {128, 129}, {33, 1}};
  for (const std::string& target : simd_targets_supported()) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (Variant variant : variants) {
        for (int pick = 0; pick < 2; ++pick) {
          ForwardCase c;
          const Len len = flash_lens[rng.below(std::size(flash_lens))];
          HeadDim hd = head_dims[rng.below(std::size(head_dims))];
          const Heads h = heads[rng.below(std::size(heads))];
          if (len.q * len.k > 5000 && hd.d > 128) hd = {80, 80};
          c.dims = {h.b, h.hq, h.hkv, len.q, len.k, hd.d, hd.dv};
          c.variant = variant;
          c.dtype = dtype;
          c.backend = Backend::flash;
          c.layout = static_cast<Layout>(n % 3);
          c.into = n % 4 == 1;
          c.given_scale = n % 2 == 0;
          c.mask_dtype = n % 5 < 3 ? dtype : DType::f32;
          c.seed = 1000 + n;
          c.target = target;
          c.name = case_name(c);
          cases.push_back(c);
          ++n;
        }
      }
    }
  }
  // The flash backend's head-dim extremes (1 and 512) and odd Dv, on the automatic target.
  for (const HeadDim hd : {HeadDim{1, 1}, HeadDim{512, 512}, HeadDim{3, 130}, HeadDim{257, 33}}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      ForwardCase c;
      c.dims = {1, 2, 1, 65, 70, hd.d, hd.dv};
      c.variant = n % 2 == 0 ? Variant::plain : Variant::causal_lower_right;
      c.dtype = dtype;
      c.backend = Backend::flash;
      c.layout = static_cast<Layout>(n % 3);
      c.mask_dtype = dtype;
      c.seed = 1000 + n;
      c.name = case_name(c);
      cases.push_back(c);
      ++n;
    }
  }
  // Empty sizes: Lk = 0 (out 0, LSE -inf), Lq = 0 and B = 0 (empty outputs).
  const Dims empties[] = {
      {1, 2, 2, 7, 0, 64, 64}, {2, 4, 2, 0, 7, 40, 40}, {0, 2, 1, 5, 5, 64, 32}};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash, Backend::automatic}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      if ((backend == Backend::automatic || backend == Backend::flash) && dtype == DType::f64)
        continue;
      for (const Dims& d : empties) {
        for (Variant variant : {Variant::plain, Variant::causal_lower_right, Variant::additive_11qk,
                                Variant::alibi_heads, Variant::dropout}) {
          ForwardCase c;
          c.dims = d;
          c.variant = variant;
          c.dtype = dtype;
          c.backend = backend;
          c.layout = static_cast<Layout>(n % 3);
          c.into = n % 2 == 0;
          c.mask_dtype = dtype;
          c.seed = 1000 + n;
          c.name = case_name(c);
          cases.push_back(c);
          ++n;
        }
      }
    }
  }
  // The automatic backend on the plain float paths.
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (Variant variant : {Variant::plain, Variant::causal_upper_left, Variant::causal_lower_right,
                            Variant::window, Variant::additive_b11k, Variant::combo}) {
      ForwardCase c;
      c.dims = {2, 4, 2, 33, 47, 64, 64};
      c.variant = variant;
      c.dtype = dtype;
      c.backend = Backend::automatic;
      c.layout = static_cast<Layout>(n % 3);
      c.mask_dtype = dtype;
      c.seed = 1000 + n;
      c.name = case_name(c);
      cases.push_back(c);
      ++n;
    }
  }
  // One long case per backend (1025 breaks every power-of-two tile).
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    ForwardCase c;
    c.dims = {1, 1, 1, 1025, 1025, 64, 64};
    c.variant = Variant::combo;
    c.dtype = backend == Backend::reference ? DType::f32 : DType::bf16;
    c.backend = backend;
    c.layout = Layout::bshd;
    c.mask_dtype = DType::f32;
    c.seed = 77;
    c.name = case_name(c);
    cases.push_back(c);
  }
  return cases;
}

// Runs the library on a case, returning out [B, Hq, Lq, Dv] and lse [B, Hq, Lq].
struct LibraryResult {
  std::vector<double> out;  // [B, Hq, Lq, Dv]
  std::vector<double> lse;  // [B, Hq, Lq]; empty when forward_into was given no lse view
};

LibraryResult run_forward(const ForwardCase& c, const Problem& p, const Operands& x) {
  const Dims& d = c.dims;
  const Buffer q = make_buffer(c.dtype, to_shape(d.q_shape()), c.layout, x.q);  // [B, Hq, Lq, D]
  const Buffer k = make_buffer(c.dtype, to_shape(d.k_shape()), c.layout, x.k);  // [B, Hkv, Lk, D]
  const Buffer v = make_buffer(c.dtype, to_shape(d.v_shape()), c.layout, x.v);  // [B, Hkv, Lk, Dv]
  LibraryResult r;
  if (c.into) {
    // out [B, Hq, Lq, Dv] and lse [B, Hq, Lq] with padded rows full of NaN.
    const Buffer out = make_buffer(c.dtype, to_shape(d.out_shape()),
                                   c.layout == Layout::bshd ? Layout::bshd : Layout::padded);
    const Buffer lse = make_buffer(lse_dtype_for(c.dtype), to_shape(d.lse_shape()), Layout::padded);
    // Poison the outputs so that an element left unwritten shows up.
    write_view(out.view,
               std::vector<double>(static_cast<std::size_t>(numel_of(d.out_shape())), 12345.0));
    write_view(lse.view,
               std::vector<double>(static_cast<std::size_t>(numel_of(d.lse_shape())), 12345.0));
    // Every third caller-provided case asks for no LSE at all.
    const bool want_lse = c.seed % 3 != 0;
    forward_into(q.view, k.view, v.view, out.view,
                 want_lse ? std::optional<TensorView>(lse.view) : std::nullopt, p.options,
                 c.backend);
    EXPECT_TRUE(padding_intact(out)) << "out written outside its view";
    EXPECT_TRUE(padding_intact(lse)) << "lse written outside its view";
    r.out = read_view(out.view);
    if (want_lse) r.lse = read_view(lse.view);
  } else {
    const ForwardResult f = forward(q.view, k.view, v.view, p.options, c.backend);
    EXPECT_EQ(f.out.dtype(), c.dtype);
    EXPECT_EQ(f.lse.dtype(), lse_dtype_for(c.dtype));
    EXPECT_EQ(f.out.rank(), 4);
    EXPECT_EQ(f.lse.rank(), 3);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(f.out.size(i), d.out_shape()[static_cast<std::size_t>(i)]);
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(f.lse.size(i), d.lse_shape()[static_cast<std::size_t>(i)]);
    r.out = read_view(f.out);
    r.lse = read_view(f.lse);
  }
  return r;
}

class ForwardGrid : public ::testing::TestWithParam<ForwardCase> {};

TEST_P(ForwardGrid, MatchesOracle) {
  const ForwardCase& c = GetParam();
  const ScopedTarget target(c.target);
  const Problem p = make_problem(c.dims, {c.variant, c.mask_dtype, c.given_scale, c.seed});
  const Operands x = make_operands(c.dims, c.dtype, c.seed);
  const LibraryResult got = run_forward(c, p, x);

  const OracleForward exact = oracle_forward(c.dims, p.spec, x.q, x.k, x.v);
  OracleForward naive;
  if (c.dtype == DType::bf16 || c.dtype == DType::f16) {
    naive = oracle_forward(c.dims, p.spec, x.q, x.k, x.v, rounder_for(c.dtype));
  }
  const double tol = out_tolerance(c.dtype, x.v, exact.out, naive.out, p.spec.dropout_p);
  EXPECT_TRUE(all_close(got.out, exact.out, tol, "out"));
  if (got.lse.size() != exact.lse.size()) {  // forward_into without an LSE
    EXPECT_TRUE(masked_rows_exact(c.dims, got.out, exact.lse, exact.lse));
    return;
  }
  EXPECT_TRUE(all_close(got.lse, exact.lse, lse_tolerance(c.dtype, max_abs(exact.lse)), "lse"));
  EXPECT_TRUE(masked_rows_exact(c.dims, got.out, got.lse, exact.lse));
}

INSTANTIATE_TEST_SUITE_P(Grid, ForwardGrid, ::testing::ValuesIn(forward_grid()),
                         [](const ::testing::TestParamInfo<ForwardCase>& info) {
                           return info.param.name;
                         });

// A row with no visible key gives out 0 and LSE -inf, never NaN, for every way of hiding keys.
TEST(Forward, FullyMaskedRowsAreZero) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::automatic, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      const Dims d{1, 2, 2, 9, 4, 32, 32};
      const Operands x = make_operands(d, dtype, 5);
      const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
      const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
      const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
      // Lower-right causal with Lq > Lk hides every key from rows i < Lq - Lk; below, an
      // additive mask whose row 8 is all -inf hides row 8.
      Options options;
      options.causal = Causal::lower_right;
      const ForwardResult a = forward(q.view, k.view, v.view, options, backend);
      const std::vector<double> out = read_view(a.out), lse = read_view(a.lse);
      for (std::int64_t h = 0; h < 2; ++h) {
        for (std::int64_t i = 0; i < 5; ++i) {
          EXPECT_EQ(lse[static_cast<std::size_t>(h * 9 + i)], -INFINITY) << name_of(backend);
          for (std::int64_t c = 0; c < 32; ++c) {
            EXPECT_EQ(out[static_cast<std::size_t>((h * 9 + i) * 32 + c)], 0.0) << name_of(backend);
          }
        }
        EXPECT_TRUE(std::isfinite(lse[static_cast<std::size_t>(h * 9 + 5)]));
      }
      std::vector<double> additive(9 * 4, 0.0);  // [Lq, Lk]
      for (int j = 0; j < 4; ++j) additive[8 * 4 + static_cast<std::size_t>(j)] = -INFINITY;
      const Tensor mask = make_tensor(DType::f32, {9, 4}, additive);
      Options masked;
      masked.mask = mask.view();
      const ForwardResult b = forward(q.view, k.view, v.view, masked, backend);
      const std::vector<double> out_b = read_view(b.out), lse_b = read_view(b.lse);
      EXPECT_EQ(lse_b[8], -INFINITY);
      for (std::int64_t c = 0; c < 32; ++c)
        EXPECT_EQ(out_b[static_cast<std::size_t>(8 * 32 + c)], 0.0);
      for (double o : out_b) EXPECT_FALSE(std::isnan(o));
    }
  }
}

// NaN in q, k or v propagates as NaN to exactly the outputs that depend on it.
TEST(Forward, NaNPropagates) {
  const Dims d{1, 2, 1, 6, 5, 16, 8};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f64}) {
      if (backend == Backend::flash && dtype == DType::f64) continue;  // flash: no f64
      for (int which = 0; which < 3; ++which) {
        SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)) +
                     " operand " + std::to_string(which));
        Operands x = make_operands(d, dtype, 11);
        if (which == 0) x.q[(1 * 6 + 2) * 16 + 3] = kNaN;  // q[0, 1, 2, 3]: row (1, 2) of out
        if (which == 1) x.k[3 * 16 + 7] = kNaN;            // k[0, 0, 3, 7]: every row
        if (which == 2) x.v[4 * 8 + 5] = kNaN;             // v[0, 0, 4, 5]: column 5 of every row
        const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
        const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
        const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
        const ForwardResult r = forward(q.view, k.view, v.view, {}, backend);
        Spec spec;
        spec.scale = 0.25;
        const OracleForward want = oracle_forward(d, spec, x.q, x.k, x.v);
        const std::vector<double> out = read_view(r.out), lse = read_view(r.lse);
        std::size_t nan_expected = 0;
        for (std::size_t n = 0; n < out.size(); ++n) {
          nan_expected += std::isnan(want.out[n]);
          EXPECT_EQ(std::isnan(out[n]), std::isnan(want.out[n])) << "out element " << n;
        }
        EXPECT_GT(nan_expected, 0u);
        for (std::size_t n = 0; n < lse.size(); ++n) {
          EXPECT_EQ(std::isnan(lse[n]), std::isnan(want.lse[n])) << "lse element " << n;
        }
      }
    }
  }
}

// Repeats K/V heads [B, Hkv, L, D] to [B, Hkv * group, L, D] (head h uses head h / group).
std::vector<double> repeat_heads(const std::vector<double>& x, std::int64_t b, std::int64_t hkv,
                                 std::int64_t group, std::int64_t rows) {
  std::vector<double> out;
  for (std::int64_t bb = 0; bb < b; ++bb) {
    for (std::int64_t h = 0; h < hkv * group; ++h) {
      const auto begin = x.begin() + static_cast<std::ptrdiff_t>((bb * hkv + h / group) * rows);
      out.insert(out.end(), begin, begin + static_cast<std::ptrdiff_t>(rows));
    }
  }
  return out;
}

TEST(Forward, GqaEqualsRepeatedHeads) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (std::int64_t hkv : {2, 1}) {  // GQA (Hq = 4, Hkv = 2) and MQA (Hkv = 1)
        for (Variant variant : {Variant::plain, Variant::alibi_heads, Variant::causal_upper_left,
                                Variant::additive_1hq1, Variant::dropout}) {
          SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)) +
                       " Hkv=" + std::to_string(hkv) + " " + name_of_variant(variant));
          const Dims d{2, 4, hkv, 19, 23, 48, 40};
          const Dims rep{2, 4, 4, 19, 23, 48, 40};
          const Problem p = make_problem(d, {variant, DType::f32, false, 3});
          const Operands x = make_operands(d, dtype, 21);
          const std::int64_t group = 4 / hkv;
          const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
          const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
          const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
          const Buffer k_rep = make_buffer(dtype, to_shape(rep.k_shape()), Layout::bhsd,
                                           repeat_heads(x.k, 2, hkv, group, 23 * 48));
          const Buffer v_rep = make_buffer(dtype, to_shape(rep.v_shape()), Layout::bhsd,
                                           repeat_heads(x.v, 2, hkv, group, 23 * 40));
          const ForwardResult a = forward(q.view, k.view, v.view, p.options, backend);
          const ForwardResult b = forward(q.view, k_rep.view, v_rep.view, p.options, backend);
          const std::vector<double> out_a = read_view(a.out), out_b = read_view(b.out);
          const std::vector<double> lse_a = read_view(a.lse), lse_b = read_view(b.lse);
          if (backend == Backend::reference) {  // the same loops on the same numbers: bitwise
            EXPECT_TRUE(all_close(out_a, out_b, 0.0, "out"));
            EXPECT_TRUE(all_close(lse_a, lse_b, 0.0, "lse"));
          } else {  // GEMM blocking may differ with the head grouping
            EXPECT_TRUE(all_close(out_a, out_b, 2e-6 * (1.0 + max_abs(out_b)), "out"));
            EXPECT_TRUE(all_close(lse_a, lse_b, 2e-6 * (1.0 + max_abs(lse_b)), "lse"));
          }
        }
      }
    }
  }
}

// num_threads changes the schedule, never the result: bitwise-equal outputs.
TEST(Forward, ThreadCountDoesNotChangeBits) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::automatic, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      // Prefill, and decode with one kv head (fewer groups than threads: it must not switch
      // between reading K and V in place and packing them).
      for (const Dims& d : {Dims{2, 4, 2, 97, 129, 64, 64}, Dims{1, 4, 1, 1, 300, 64, 64}}) {
        for (Variant variant : {Variant::plain, Variant::combo, Variant::dropout_combo}) {
          SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)) + " " +
                       name_of_variant(variant) + " Lq=" + std::to_string(d.len_q));
          Problem p = make_problem(d, {variant, DType::f32, true, 8});
          const Operands x = make_operands(d, dtype, 8);
          const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bshd, x.q);
          const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bshd, x.k);
          const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bshd, x.v);
          std::vector<std::vector<double>> outs, lses;
          for (int threads : {1, 2, 3}) {
            p.options.num_threads = threads;
            const ForwardResult r = forward(q.view, k.view, v.view, p.options, backend);
            outs.push_back(read_view(r.out));
            lses.push_back(read_view(r.lse));
          }
          for (std::size_t t = 1; t < outs.size(); ++t) {
            EXPECT_EQ(std::memcmp(outs[0].data(), outs[t].data(), outs[0].size() * sizeof(double)),
                      0)
                << "out differs between 1 and " << t + 1 << " threads (max |diff| "
                << max_abs_diff(outs[0], outs[t]) << ")";
            EXPECT_EQ(std::memcmp(lses[0].data(), lses[t].data(), lses[0].size() * sizeof(double)),
                      0)
                << "lse differs between 1 and " << t + 1 << " threads (max |diff| "
                << max_abs_diff(lses[0], lses[t]) << ")";
          }
        }
      }
    }
  }
}

// Masks given through strided views: padded rows, and a [B, Hq, Lq, Lk] view broadcasting a
// [Lq, Lk] buffer with stride-0 batch and head dims.
TEST(Forward, StridedAndBroadcastMaskViews) {
  const Dims d{2, 3, 3, 13, 21, 32, 24};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (bool is_bool : {false, true}) {
      Random rng(4);
      std::vector<double> values(13 * 21);  // [Lq, Lk]
      for (double& m : values) m = is_bool ? (rng.coin(0.3) ? 0.0 : 1.0) : rng.uniform(-2, 2);
      const DType mdt = is_bool ? DType::b8 : DType::f32;
      const Buffer padded =
          make_buffer(mdt, {13, 21}, Layout::padded, values);  // [Lq, Lk], row stride 24
      const Tensor dense = make_tensor(mdt, {13, 21}, values);
      const TensorView broadcast =
          TensorView::strided(dense.data(), mdt, {2, 3, 13, 21}, {0, 0, 21, 1});
      Spec spec;
      spec.scale = 1.0 / std::sqrt(32.0);
      spec.mask = DenseMask{is_bool, {1, 1, 13, 21}, values};
      const Operands x = make_operands(d, DType::f32, 31);
      const Buffer q = make_buffer(DType::f32, to_shape(d.q_shape()), Layout::bhsd, x.q);
      const Buffer k = make_buffer(DType::f32, to_shape(d.k_shape()), Layout::bhsd, x.k);
      const Buffer v = make_buffer(DType::f32, to_shape(d.v_shape()), Layout::bhsd, x.v);
      const OracleForward want = oracle_forward(d, spec, x.q, x.k, x.v);
      for (const TensorView& mask : {padded.view, broadcast}) {
        Options options;
        options.mask = mask;
        const ForwardResult r = forward(q.view, k.view, v.view, options, backend);
        EXPECT_TRUE(all_close(read_view(r.out), want.out, 1e-5 * max_abs(x.v), "out"))
            << name_of(backend) << " mask " << mask.shape_string();
        EXPECT_TRUE(all_close(read_view(r.lse), want.lse,
                              lse_tolerance(DType::f32, max_abs(want.lse)), "lse"));
      }
    }
  }
}

// An additive mask may be f32, f64 or the query dtype (Options::mask), for every query dtype.
TEST(Forward, AdditiveMaskDtypes) {
  const Dims d{1, 2, 1, 12, 15, 24, 16};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
      if (backend == Backend::flash && dtype == DType::f64) continue;  // flash: no f64
      for (DType mask_dtype : {DType::f32, DType::f64, dtype}) {
        SCOPED_TRACE(std::string(name_of(backend)) + " query " + std::string(name_of(dtype)) +
                     " mask " + std::string(name_of(mask_dtype)));
        const Problem p = make_problem(d, {Variant::additive_full, mask_dtype, false, 6});
        const Operands x = make_operands(d, dtype, 6);
        const Tensor q = make_tensor(dtype, to_shape(d.q_shape()), x.q);
        const Tensor k = make_tensor(dtype, to_shape(d.k_shape()), x.k);
        const Tensor v = make_tensor(dtype, to_shape(d.v_shape()), x.v);
        ForwardResult r;
        try {
          r = forward(q, k, v, p.options, backend);
        } catch (const Error& e) {
          ADD_FAILURE() << "rejected: " << e.what();
          continue;
        }
        const OracleForward exact = oracle_forward(d, p.spec, x.q, x.k, x.v);
        const OracleForward naive = oracle_forward(d, p.spec, x.q, x.k, x.v, rounder_for(dtype));
        EXPECT_TRUE(all_close(read_view(r.out), exact.out,
                              out_tolerance(dtype, x.v, exact.out, naive.out, 0.0), "out"));
      }
    }
  }
}

// A mask view needs no unit stride: a transposed [Lk, Lq] buffer is a valid [Lq, Lk] mask.
TEST(Forward, TransposedMaskView) {
  const Dims d{1, 2, 2, 10, 14, 16, 16};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    const std::vector<double> kq = random_vector(14 * 10, 12, -2.0, 2.0);  // [Lk, Lq]
    std::vector<double> qk(14 * 10);                                       // [Lq, Lk]
    for (int i = 0; i < 10; ++i) {
      for (int j = 0; j < 14; ++j)
        qk[static_cast<std::size_t>(i * 14 + j)] =
            round_to(kq[static_cast<std::size_t>(j * 10 + i)], DType::f32);
    }
    const Tensor storage = make_tensor(DType::f32, {14, 10}, kq);
    Spec spec;
    spec.scale = 0.25;
    spec.mask = DenseMask{false, {1, 1, 10, 14}, qk};
    Options options;
    options.scale = 0.25;
    options.mask = storage.view().transposed(0, 1);
    const Operands x = make_operands(d, DType::f32, 13);
    const Tensor q = make_tensor(DType::f32, to_shape(d.q_shape()), x.q);
    const Tensor k = make_tensor(DType::f32, to_shape(d.k_shape()), x.k);
    const Tensor v = make_tensor(DType::f32, to_shape(d.v_shape()), x.v);
    const ForwardResult r = forward(q, k, v, options, backend);
    const OracleForward want = oracle_forward(d, spec, x.q, x.k, x.v);
    EXPECT_TRUE(all_close(read_view(r.out), want.out, 1e-5 * max_abs(x.v), "out"))
        << name_of(backend);
  }
}

// The default scale is 1/sqrt(D).
TEST(Forward, DefaultScaleIsInverseSqrtHeadDim) {
  const Dims d{1, 2, 2, 9, 11, 59, 59};
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    const DType dtype = backend == Backend::flash ? DType::f32 : DType::f64;  // flash: no f64
    const Operands x = make_operands(d, dtype, 2);
    const Buffer q = make_buffer(dtype, to_shape(d.q_shape()), Layout::bhsd, x.q);
    const Buffer k = make_buffer(dtype, to_shape(d.k_shape()), Layout::bhsd, x.k);
    const Buffer v = make_buffer(dtype, to_shape(d.v_shape()), Layout::bhsd, x.v);
    Options explicit_scale;
    explicit_scale.scale = 1.0 / std::sqrt(59.0);
    const ForwardResult a = forward(q.view, k.view, v.view, {}, backend);
    const ForwardResult b = forward(q.view, k.view, v.view, explicit_scale, backend);
    EXPECT_TRUE(all_close(read_view(a.out), read_view(b.out), 1e-14, "out"));
    Options other_scale;
    other_scale.scale = 0.5;
    const ForwardResult c = forward(q.view, k.view, v.view, other_scale, backend);
    EXPECT_GT(max_abs_diff(read_view(a.out), read_view(c.out)), 1e-6);
  }
}

// Many key tiles with one unchanging row max: the online softmax's rescale must stay exactly 1
// (a rescale of 1 + 2^-23 per tile, or an FMA-rounded exponent, skews the weights towards early
// keys). Every score is 47.1, so out is the mean of v and lse = 47.1 + log(Lk).
TEST(Forward, LongRowsKeepUniformWeights) {
  const std::int64_t lk = 1 << 17;  // 1024 tiles of 128 keys
  const Dims d{1, 1, 1, 1, lk, 1, 1};
  std::vector<double> q = {1.0}, k(static_cast<std::size_t>(lk), 1.0),
                      v(static_cast<std::size_t>(lk));
  for (std::int64_t j = 0; j < lk; ++j)
    v[static_cast<std::size_t>(j)] = static_cast<double>(j) / lk;
  const Tensor tq = make_tensor(DType::f32, to_shape(d.q_shape()), q);
  const Tensor tk = make_tensor(DType::f32, to_shape(d.k_shape()), k);
  const Tensor tv = make_tensor(DType::f32, to_shape(d.v_shape()), v);
  Options options;
  options.scale = 47.1;
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    const ForwardResult r = forward(tq, tk, tv, options, backend);
    const double out = read_view(r.out)[0], lse = read_view(r.lse)[0];
    const double want_out = static_cast<double>(lk - 1) / (2.0 * static_cast<double>(lk));
    const double want_lse =
        static_cast<double>(static_cast<float>(47.1)) + std::log(static_cast<double>(lk));
    EXPECT_NEAR(out, want_out, 1e-5 * want_out) << name_of(backend);
    EXPECT_NEAR(lse, want_lse, 2e-5 * want_lse) << name_of(backend);
  }
}

// A row that sees no key gives exactly 0 even when the hidden keys' values are inf or NaN
// (which a 0 weight times inf would otherwise turn into NaN).
TEST(Forward, HiddenNonFiniteValuesLeaveMaskedRowsZero) {
  const Dims d{1, 1, 1, 2, 2, 1, 1};
  const Tensor q = make_tensor(DType::f32, to_shape(d.q_shape()), {0.5, -0.25});
  const Tensor k = make_tensor(DType::f32, to_shape(d.k_shape()), {1.0, 2.0});
  const Tensor v = make_tensor(DType::f32, to_shape(d.v_shape()), {kInf, kNaN});
  const Tensor mask = make_tensor(DType::b8, {2, 2}, {0.0, 0.0, 1.0, 1.0});  // row 0 sees nothing
  Options options;
  options.mask = mask.view();
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    const ForwardResult r = forward(q, k, v, options, backend);
    EXPECT_EQ(read_view(r.out)[0], 0.0) << name_of(backend);
    EXPECT_EQ(read_view(r.lse)[0], -kInf) << name_of(backend);
    EXPECT_TRUE(std::isnan(read_view(r.out)[1])) << name_of(backend);  // row 1 sees the NaN
  }
}

}  // namespace
}  // namespace attncore::test
