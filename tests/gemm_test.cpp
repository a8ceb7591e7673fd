// The math backend's GEMMs (src/cpu/gemm.h) on every SIMD target this CPU runs, f32 and f64,
// against fp64 sums: shapes at and around the micro-tile, block and few-rows edges, all four
// transpose combinations, alpha and beta; beta = 0 never reads C (it starts as NaN); each
// product's bits do not depend on how often it runs (no state carried between calls). And the
// widening of 16-bit rows (GemmTarget::widen): every bit pattern's exact value.
#include "cpu/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr: rounding under DAZ and FTZ
#endif

#include "attncore/dtype.h"
#include "attncore/info.h"
#include "cpu/flash.h"
#include "testing/problem.h"
#include "testing/random.h"

namespace attncore {
namespace {

using detail::gemm_pack_elements;
using detail::gemm_target_chosen;
using detail::GemmMatrix;
using detail::NarrowFn;

struct Shape {
  std::int64_t m, n, k;
};

// C = alpha * op(A) op(B) + beta * C through the chosen target, against fp64; returns the
// largest error in units of the bound k * eps * sum |a b| + eps * |C| (per element).
template <class T>
double worst_error(const Shape& s, bool trans_a, bool trans_b, T alpha, T beta,
                   std::uint64_t seed) {
  const std::vector<double> a64 = test::random_vector(s.m * s.k, seed);
  const std::vector<double> b64 = test::random_vector(s.k * s.n, seed + 1);
  const std::vector<double> c64 = test::random_vector(s.m * s.n, seed + 2);
  // A is [m, k] (trans_a: stored [k, m]), B is [k, n] (trans_b: stored [n, k]); one padding
  // column in every stored row.
  const std::int64_t lda = (trans_a ? s.m : s.k) + 1, ldb = (trans_b ? s.k : s.n) + 1,
                     ldc = s.n + 1;
  std::vector<T> a(static_cast<std::size_t>((trans_a ? s.k : s.m) * lda)),
      b(static_cast<std::size_t>((trans_b ? s.n : s.k) * ldb));
  std::vector<T> c(static_cast<std::size_t>(s.m * ldc), std::numeric_limits<T>::quiet_NaN());
  auto at_a = [&](std::int64_t i, std::int64_t p) -> T& {
    return trans_a ? a[p * lda + i] : a[i * lda + p];
  };
  auto at_b = [&](std::int64_t p, std::int64_t j) -> T& {
    return trans_b ? b[j * ldb + p] : b[p * ldb + j];
  };
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t p = 0; p < s.k; ++p) at_a(i, p) = static_cast<T>(a64[i * s.k + p]);
  }
  for (std::int64_t p = 0; p < s.k; ++p) {
    for (std::int64_t j = 0; j < s.n; ++j) at_b(p, j) = static_cast<T>(b64[p * s.n + j]);
  }
  if (beta != T(0)) {
    for (std::int64_t i = 0; i < s.m; ++i) {
      for (std::int64_t j = 0; j < s.n; ++j) c[i * ldc + j] = static_cast<T>(c64[i * s.n + j]);
    }
  }
  const std::vector<T> c_in = c;
  const GemmMatrix<T> ma =
      trans_a ? GemmMatrix<T>{a.data(), 1, lda} : GemmMatrix<T>{a.data(), lda, 1};
  const GemmMatrix<T> mb =
      trans_b ? GemmMatrix<T>{b.data(), 1, ldb} : GemmMatrix<T>{b.data(), ldb, 1};
  std::vector<T> pack(static_cast<std::size_t>(gemm_pack_elements(s.m, s.n, s.k)));
  auto run = [&](std::vector<T>& out) {
    if constexpr (sizeof(T) == 4) {
      gemm_target_chosen().sgemm(s.m, s.n, s.k, alpha, ma, mb, beta, out.data(), ldc, pack.data());
    } else {
      gemm_target_chosen().dgemm(s.m, s.n, s.k, alpha, ma, mb, beta, out.data(), ldc, pack.data());
    }
  };
  run(c);
  std::vector<T> again = c_in;
  run(again);
  EXPECT_EQ(std::memcmp(c.data(), again.data(), c.size() * sizeof(T)), 0) << "not repeatable";
  const double eps = std::numeric_limits<T>::epsilon();
  double worst = 0;
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      double exact = 0, magnitude = 0;
      for (std::int64_t p = 0; p < s.k; ++p) {
        const double x = static_cast<double>(at_a(i, p)) * static_cast<double>(at_b(p, j));
        exact += x;
        magnitude += std::fabs(x);
      }
      const double old = beta == T(0) ? 0.0 : static_cast<double>(c_in[i * ldc + j]);
      const double want = static_cast<double>(alpha) * exact + static_cast<double>(beta) * old;
      const double bound = (static_cast<double>(s.k) + 2) * eps *
                               (std::fabs(static_cast<double>(alpha)) * magnitude) +
                           2 * eps * std::fabs(static_cast<double>(beta) * old) + 1e-300;
      const double err = std::fabs(static_cast<double>(c[i * ldc + j]) - want) / bound;
      if (!(err <= worst)) worst = err;  // NaN (C read under beta = 0) becomes the worst
    }
    // The padding column of C is never written.
    if (s.n < ldc) {
      const T pad = c[i * ldc + s.n];
      EXPECT_EQ(std::memcmp(&pad, &c_in[i * ldc + s.n], sizeof(T)), 0) << "padding written";
    }
  }
  return worst;
}

class Gemm : public ::testing::TestWithParam<std::string> {};

TEST_P(Gemm, MatchesFp64SumsOnEveryShape) {
  const test::ScopedTarget target(GetParam());
  // Micro-tiles are 6 or 8 rows and 8-32 columns; A blocks 144 rows, B blocks 1024 columns,
  // k chunks 256; 1-2 rows take the in-place path (x K^T: dot products; x V: row updates).
  const Shape shapes[] = {{1, 1, 1},     {1, 37, 64},  {2, 130, 128}, {1, 1030, 257},
                          {3, 33, 17},   {8, 32, 256}, {9, 31, 255},  {128, 129, 64},
                          {145, 17, 40}, {7, 1025, 9}, {50, 40, 513}, {6, 16, 1}};
  std::uint64_t seed = 1;
  for (const Shape& s : shapes) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
      SCOPED_TRACE("m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                   " k=" + std::to_string(s.k) + " trans_a=" + std::to_string(ta) +
                   " trans_b=" + std::to_string(tb));
      EXPECT_LE(worst_error<float>(s, ta, tb, 1.0f, 0.0f, seed), 1.0);
      EXPECT_LE(worst_error<float>(s, ta, tb, 0.125f, 1.0f, seed + 7), 1.0);
      EXPECT_LE(worst_error<double>(s, ta, tb, 1.0, 0.0, seed + 11), 1.0);
      EXPECT_LE(worst_error<double>(s, ta, tb, -0.7, 0.5, seed + 13), 1.0);
      seed += 17;
    }
  }
}

// k = 0: C = beta * C (beta = 0: zeros, C not read).
TEST_P(Gemm, EmptyProductScalesC) {
  const test::ScopedTarget target(GetParam());
  std::vector<float> c = {std::numeric_limits<float>::quiet_NaN(), 2.0f};
  float pack[1];
  const GemmMatrix<float> none{nullptr, 0, 1};
  gemm_target_chosen().sgemm(1, 2, 0, 1.0f, none, none, 0.0f, c.data(), 2, pack);
  EXPECT_EQ(c[0], 0.0f);
  EXPECT_EQ(c[1], 0.0f);
  c = {3.0f, 2.0f};
  gemm_target_chosen().sgemm(1, 2, 0, 1.0f, none, none, 0.5f, c.data(), 2, pack);
  EXPECT_EQ(c[0], 1.5f);
  EXPECT_EQ(c[1], 1.0f);
}

// widen: every bf16 and f16 bit pattern, in rows of lengths around whole vectors (short rows
// starting at offsets spread over every pattern), gives the scalar conversion's value (a NaN for a
// NaN: the vector conversion may quiet a signalling one), and nothing past the row is written.
TEST_P(Gemm, WidensEvery16BitPatternExactly) {
  const test::ScopedTarget target(GetParam());
  // Every pattern once, then again in a scattered order (i * 40503, odd: a permutation), so
  // that the short rows below start at many different patterns.
  std::vector<std::uint16_t> all(2 * 65536 + 40);
  for (std::size_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  for (std::size_t i = 65536; i < all.size(); ++i) {
    all[i] = static_cast<std::uint16_t>(i * 40503u);
  }
  for (const DType dtype : {DType::bf16, DType::f16}) {
    for (const std::int64_t n : {std::int64_t{65536}, std::int64_t{1}, std::int64_t{7},
                                 std::int64_t{16}, std::int64_t{17}, std::int64_t{33}}) {
      // Short rows (tails) at offsets spread over the whole table, long ones at a few.
      std::vector<std::int64_t> offsets = {0, 1, 3, 9};
      if (n < 64) {
        for (std::int64_t o = 0; o < 2 * 65536; o += 37) offsets.push_back(o);
      }
      for (const std::int64_t offset : offsets) {
        std::vector<float> out(static_cast<std::size_t>(n) + 1, 1234.5f);
        gemm_target_chosen().widen(all.data() + offset, dtype, n, out.data());
        for (std::int64_t e = 0; e < n; ++e) {
          const std::uint16_t h = all[static_cast<std::size_t>(offset + e)];
          const float want = dtype == DType::bf16 ? bf16::to_float(h) : f16::to_float(h);
          const float got = out[static_cast<std::size_t>(e)];
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(got)) << "bits " << h;
          } else {
            ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0)
                << (dtype == DType::bf16 ? "bf16" : "f16") << " bits " << h << ": " << got
                << " against " << want;
          }
        }
        EXPECT_EQ(out[static_cast<std::size_t>(n)], 1234.5f) << "written past the row";
      }
    }
  }
}

// f32 -> bf16 / f16 by the target's vector rounding (GemmTarget::narrow, and FlashTarget::narrow,
// the flash kernels' 16-bit outputs, its own compiled copy): the bits of bf16::from_float and
// f16::from_float, for every high half of a float with low halves at and around each rounding
// boundary (f16 rounds at bit 13 for normal halves, up to bit 23 for subnormal ones, with the
// bits above in the high half; bf16 at bit 16), NaNs with payloads, infinities and zeros; rows
// of every length class (tails), nothing written past them; and under the caller's
// floating-point mode, with denormals-are-zero and flush-to-zero set, and in each other
// rounding direction, which must change nothing.
TEST_P(Gemm, NarrowsAsFromFloat) {
  const test::ScopedTarget target(GetParam());
  std::vector<float> in;
  for (std::uint32_t high = 0; high <= 0xffffu; ++high) {
    for (const std::uint32_t low :
         {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu, 0x2000u, 0x2fffu,
          0x3000u, 0x3001u, 0x3fffu, 0x4000u, 0x4001u, 0x6000u, 0x7fffu, 0x8000u,
          0x8001u, 0x9000u, 0xafffu, 0xc000u, 0xf000u, 0xffffu}) {
      const std::uint32_t u = high << 16 | low;
      float f;
      std::memcpy(&f, &u, sizeof f);
      in.push_back(f);
    }
  }
  const std::int64_t total = static_cast<std::int64_t>(in.size());
#if defined(__x86_64__) || defined(__i386__)
  const unsigned saved = _mm_getcsr();
  // As the caller's; DAZ and FTZ; rounding down, up, towards zero.
  const unsigned modes[] = {saved, saved | 0x8040u, (saved & ~0x6000u) | 0x2000u,
                            (saved & ~0x6000u) | 0x4000u, saved | 0x6000u};
#else
  const unsigned modes[] = {0u};
#endif
  const NarrowFn narrows[] = {gemm_target_chosen().narrow, detail::flash_target_chosen().narrow};
  for (const NarrowFn narrow : narrows) {
    for (const unsigned mode : modes) {
      for (const DType dtype : {DType::bf16, DType::f16}) {
        for (const std::int64_t n : {total, std::int64_t{1}, std::int64_t{7}, std::int64_t{16},
                                     std::int64_t{17}, std::int64_t{33}}) {
          std::vector<std::int64_t> offsets = {0, 3};
          if (n < 64) {
            for (std::int64_t o = 0; o + n <= total; o += 4099) offsets.push_back(o);
          }
          for (const std::int64_t offset : offsets) {
            if (offset + n > total) continue;
            std::vector<std::uint16_t> out(static_cast<std::size_t>(n) + 1, 0x1234u);
#if defined(__x86_64__) || defined(__i386__)
            _mm_setcsr(mode);
#endif
            narrow(in.data() + offset, dtype, n, out.data());
#if defined(__x86_64__) || defined(__i386__)
            _mm_setcsr(saved);
#endif
            for (std::int64_t e = 0; e < n; ++e) {
              const float x = in[static_cast<std::size_t>(offset + e)];
              const std::uint16_t want =
                  dtype == DType::bf16 ? bf16::from_float(x) : f16::from_float(x);
              std::uint32_t bits;
              std::memcpy(&bits, &x, sizeof bits);
              ASSERT_EQ(out[static_cast<std::size_t>(e)], want)
                  << (dtype == DType::bf16 ? "bf16" : "f16") << " of bits " << std::hex << bits
                  << " mode " << mode;
            }
            ASSERT_EQ(out[static_cast<std::size_t>(n)], 0x1234u) << "written past the row";
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, Gemm, ::testing::ValuesIn(simd_targets_supported()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The GEMM target follows the flash target's ISA.
TEST(GemmTarget, FollowsTheSimdTarget) {
  for (const std::string& name : simd_targets_supported()) {
    const test::ScopedTarget target(name);
    const std::string gemm = gemm_target_chosen().name;
    EXPECT_EQ(name.rfind(gemm, 0), 0u) << name << " ran GEMM target " << gemm;
  }
}

}  // namespace
}  // namespace attncore
