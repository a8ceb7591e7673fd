// Dropout (docs/design.md section 1.5): the library's keep mask is read back exactly from its
// output and compared with the oracle's element-addressed Philox stream; the kept fraction over
// more than 10^6 elements lies within 4 sigma of 1 - p; the same (seed, offset) replays the same
// mask in forward and backward; a different offset or seed gives a different mask.
//
// Reading the mask back: with q = 0 every score is 0, so P = 1/Lk on every key, and with
// v[j, c] = 2^(j % bits) when j / bits == c (else 0) the output column c of row i is
//   out[i, c] = sum over the keys j of block c of keep[i, j] * 2^(j % bits) / (Lk * (1 - p)),
// an integer code of `bits` keep decisions once multiplied by Lk * (1 - p).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/oracle.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

struct MaskRun {
  Backend backend = Backend::reference;
  DType dtype = DType::f64;
  std::int64_t batch = 1, heads = 1, len_q = 1, len_k = 1;
  int bits = 16;  // keep decisions per output column
  double p = 0.5;
  std::uint64_t seed = 0, offset = 0;
  int num_threads = 0;
};

Dims dims_of(const MaskRun& r) {
  return {r.batch, r.heads, r.heads, r.len_q, r.len_k, 8, r.len_k / r.bits};
}

// The keep mask [B, H, Lq, Lk] the library applied (1 = kept), decoded from its output.
std::vector<std::uint8_t> library_mask(const MaskRun& r) {
  const Dims d = dims_of(r);
  std::vector<double> v(static_cast<std::size_t>(numel_of(d.v_shape())), 0.0);  // [B, H, Lk, Dv]
  for (std::int64_t bh = 0; bh < r.batch * r.heads; ++bh) {
    for (std::int64_t j = 0; j < r.len_k; ++j) {
      v[static_cast<std::size_t>((bh * r.len_k + j) * d.dim_v + j / r.bits)] =
          std::ldexp(1.0, static_cast<int>(j % r.bits));
    }
  }
  const Tensor q(r.dtype, {d.batch, d.heads_q, d.len_q, d.dim});  // [B, H, Lq, 8], zeros
  const Tensor k =
      make_tensor(r.dtype, to_shape(d.k_shape()), random_vector(numel_of(d.k_shape()), 3));
  const Tensor vt = make_tensor(r.dtype, to_shape(d.v_shape()), v);
  Options options;
  options.dropout_p = r.p;
  options.seed = r.seed;
  options.offset = r.offset;
  options.num_threads = r.num_threads;
  const ForwardResult f = forward(q, k, vt, options, r.backend);
  const std::vector<double> out = read_view(f.out);  // [B, H, Lq, Dv]
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(numel_of(d.score_shape())), 0);
  const double unit = static_cast<double>(r.len_k) * (1.0 - r.p);
  double worst = 0.0;
  for (std::int64_t row = 0; row < r.batch * r.heads * r.len_q; ++row) {
    for (std::int64_t c = 0; c < d.dim_v; ++c) {
      const double code = out[static_cast<std::size_t>(row * d.dim_v + c)] * unit;
      const double nearest = std::nearbyint(code);
      worst = std::max(worst, std::fabs(code - nearest));
      const auto bits = static_cast<std::uint64_t>(nearest);
      for (int b = 0; b < r.bits; ++b) {
        keep[static_cast<std::size_t>(row * r.len_k + c * r.bits + b)] = (bits >> b) & 1u;
      }
    }
  }
  EXPECT_LT(worst, 0.05) << "the output is not an exact code of keep decisions";
  return keep;
}

std::vector<std::uint8_t> oracle_mask(const MaskRun& r) {
  Spec spec;
  spec.dropout_p = r.p;
  spec.seed = r.seed;
  spec.offset = r.offset;
  return oracle_dropout_mask(dims_of(r), spec);
}

std::int64_t count_kept(const std::vector<std::uint8_t>& keep) {
  std::int64_t n = 0;
  for (std::uint8_t k : keep) n += k;
  return n;
}

std::int64_t count_differences(const std::vector<std::uint8_t>& a,
                               const std::vector<std::uint8_t>& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// Over 4 * 512 * 512 = 1,048,576 elements the kept fraction is within 4 sigma of 1 - p, and the
// library's mask is the oracle's bit for bit.
TEST(Dropout, KeptFractionWithinFourSigma) {
  struct Run {
    Backend backend;
    double p;
    DType dtype = DType::f64;  // flash runs f32: 8 decisions per column fit its precision
    int bits = 16;
  };
  for (const Run run : {Run{Backend::reference, 0.25}, Run{Backend::math, 0.5},
                        Run{Backend::flash, 0.1, DType::f32, 8}}) {
    SCOPED_TRACE(std::string(name_of(run.backend)) + " p=" + std::to_string(run.p));
    MaskRun r;
    r.backend = run.backend;
    r.dtype = run.dtype;
    r.bits = run.bits;
    r.heads = 4;
    r.len_q = 512;
    r.len_k = 512;
    r.p = run.p;
    r.seed = 0x5eed;
    r.offset = 12345;
    const std::vector<std::uint8_t> keep = library_mask(r);
    const auto n = static_cast<double>(keep.size());
    ASSERT_GE(n, 1e6);
    const double kept = static_cast<double>(count_kept(keep));
    const double sigma = std::sqrt(n * r.p * (1.0 - r.p));
    EXPECT_LE(std::fabs(kept - n * (1.0 - r.p)), 4.0 * sigma)
        << "kept " << kept << " of " << n << ", expected " << n * (1.0 - r.p) << " +- "
        << 4 * sigma;
    EXPECT_EQ(count_differences(keep, oracle_mask(r)), 0) << "mask differs from the oracle's";
  }
}

// The same decisions through f32 and other backends, a threshold p that is not dyadic, several
// batches and heads, and a counter that crosses 2^32 blocks (the second counter word).
TEST(Dropout, MaskMatchesOracleAcrossDtypesAndOffsets) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::automatic, Backend::flash}) {
    // The last offset makes positions pass 2^64: the counter is 128-bit (docs/design.md 1.5).
    for (std::uint64_t offset : {0ull, 7ull, (1ull << 34) - 1000, (1ull << 40) + 3, ~0ull - 999}) {
      MaskRun r;
      r.backend = backend;
      r.dtype = DType::f32;
      r.bits = 8;
      r.batch = 2;
      r.heads = 3;
      r.len_q = 21;
      r.len_k = 64;
      r.p = 0.3;
      r.seed = 0xfedcba9876543210ull;
      r.offset = offset;
      SCOPED_TRACE(std::string(name_of(backend)) + " offset " + std::to_string(offset));
      EXPECT_EQ(count_differences(library_mask(r), oracle_mask(r)), 0);
    }
  }
}

// The mask is addressed by element: moving the offset by Lk moves it by one row; a different
// offset or seed gives a different mask; the thread count changes nothing.
TEST(Dropout, OffsetAndSeedAddressTheStream) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(name_of(backend));
    MaskRun r;
    r.backend = backend;
    if (backend == Backend::flash) {  // f32: 8 decisions per column fit its precision
      r.dtype = DType::f32;
      r.bits = 8;
    }
    r.heads = 2;
    r.len_q = 40;
    r.len_k = 64;
    r.p = 0.5;
    r.seed = 99;
    r.offset = 1000;
    const std::vector<std::uint8_t> base = library_mask(r);
    MaskRun shifted = r;
    shifted.offset = r.offset + static_cast<std::uint64_t>(r.len_k);
    const std::vector<std::uint8_t> next_row = library_mask(shifted);
    // Row t of the shifted run is row t + 1 of the base run (across the head boundary too).
    const std::size_t lk = static_cast<std::size_t>(r.len_k);
    EXPECT_EQ(std::memcmp(next_row.data(), base.data() + lk, base.size() - lk), 0);
    MaskRun other_offset = r;
    other_offset.offset = r.offset + 1;
    const std::int64_t diff_offset = count_differences(base, library_mask(other_offset));
    MaskRun other_seed = r;
    other_seed.seed = r.seed + 1;
    const std::int64_t diff_seed = count_differences(base, library_mask(other_seed));
    const auto n = static_cast<double>(base.size());  // 5120; expected differences 2p(1-p) n
    EXPECT_GT(static_cast<double>(diff_offset), 0.4 * n);
    EXPECT_LT(static_cast<double>(diff_offset), 0.6 * n);
    EXPECT_GT(static_cast<double>(diff_seed), 0.4 * n);
    EXPECT_LT(static_cast<double>(diff_seed), 0.6 * n);
    for (int threads : {1, 2, 4}) {
      MaskRun t = r;
      t.num_threads = threads;
      EXPECT_EQ(count_differences(base, library_mask(t)), 0) << threads << " threads";
    }
  }
}

// p = 0 is no dropout at all.
TEST(Dropout, ZeroProbabilityIsIdentity) {
  const Dims d{1, 2, 2, 17, 23, 32, 32};
  const Operands x = make_operands(d, DType::f32, 4);
  const Tensor q = make_tensor(DType::f32, to_shape(d.q_shape()), x.q);
  const Tensor k = make_tensor(DType::f32, to_shape(d.k_shape()), x.k);
  const Tensor v = make_tensor(DType::f32, to_shape(d.v_shape()), x.v);
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    Options zero;
    zero.dropout_p = 0.0;
    zero.seed = 5;
    zero.offset = 77;
    const ForwardResult a = forward(q, k, v, {}, backend);
    const ForwardResult b = forward(q, k, v, zero, backend);
    EXPECT_TRUE(all_close(read_view(b.out), read_view(a.out), 0.0, "out")) << name_of(backend);
  }
}

// Forward twice with the same (seed, offset) gives the same bits; the backward with the same
// (seed, offset) is the oracle's gradient under that mask, and with another offset or seed it
// is not.
TEST(Dropout, BackwardReplaysTheForwardMask) {
  const Dims d{2, 2, 1, 19, 26, 16, 12};
  for (Backend backend : {Backend::reference, Backend::math}) {
    for (DType dtype : {DType::f64, DType::f32}) {
      SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)));
      const Problem p = make_problem(d, {Variant::dropout, DType::f32, true, 9});
      const Operands x = make_operands(d, dtype, 9);
      const Tensor q = make_tensor(dtype, to_shape(d.q_shape()), x.q);
      const Tensor k = make_tensor(dtype, to_shape(d.k_shape()), x.k);
      const Tensor v = make_tensor(dtype, to_shape(d.v_shape()), x.v);
      const Tensor dout = make_tensor(dtype, to_shape(d.out_shape()), x.dout);
      const ForwardResult f1 = forward(q, k, v, p.options, backend);
      const ForwardResult f2 = forward(q, k, v, p.options, backend);
      EXPECT_TRUE(all_close(read_view(f1.out), read_view(f2.out), 0.0, "replayed out"));
      const OracleForward fo = oracle_forward(d, p.spec, x.q, x.k, x.v);
      EXPECT_TRUE(all_close(read_view(f1.out), fo.out,
                            out_tolerance(dtype, x.v, fo.out, {}, p.spec.dropout_p), "out"));

      const OracleBackward want = oracle_backward(d, p.spec, x.q, x.k, x.v, x.dout);
      const BackwardResult same = backward(dout, q, k, v, f1.out, f1.lse, p.options, backend);
      const double scale = std::max({max_abs(want.dq), max_abs(want.dk), max_abs(want.dv)});
      const double tol_dv = grad_tolerance(dtype, want.dv, {}, scale);
      const double tol_dq = grad_tolerance(dtype, want.dq, {}, scale);
      EXPECT_TRUE(all_close(read_view(same.dv), want.dv, tol_dv, "dv"));
      EXPECT_TRUE(all_close(read_view(same.dq), want.dq, tol_dq, "dq"));
      EXPECT_TRUE(
          all_close(read_view(same.dk), want.dk, grad_tolerance(dtype, want.dk, {}, scale), "dk"));

      for (int change = 0; change < 2; ++change) {
        Options other = p.options;
        if (change == 0) other.offset += 1;
        if (change == 1) other.seed += 1;
        const BackwardResult wrong = backward(dout, q, k, v, f1.out, f1.lse, other, backend);
        EXPECT_GT(max_abs_diff(read_view(wrong.dv), want.dv), 100 * tol_dv)
            << (change == 0 ? "offset" : "seed") << " does not reach the backward's mask";
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
