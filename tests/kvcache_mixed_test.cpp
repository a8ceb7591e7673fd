// An f32 query over a bf16 or f16 KV cache (attncore/kvcache.h, docs/design.md section 1.10):
// on every backend (flash on every SIMD target), dense and paged (page sizes 1 and 16), decode
// and chunked prefill, GQA, leftpad, the result is bitwise the same call over an f32 cache
// holding the widened values, and within the f32 rule of the fp64 reference; appends of f32 or
// 16-bit new rows (with rotary) are rounded once into the cache; other dtype mixes are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Cache values [B, capacity, H, width] (flash layout) rounded to `dtype`; NaN outside each
// sequence's slots [leftpad[b], seqlens[b]).
std::vector<double> cache_values(DType dtype, std::int64_t capacity, std::int64_t heads,
                                 std::int64_t width, const std::vector<double>& leftpad,
                                 const std::vector<double>& seqlens, std::uint64_t seed) {
  Random rng(seed);
  const std::int64_t row = heads * width;
  std::vector<double> x;
  for (std::size_t b = 0; b < seqlens.size(); ++b)
    for (std::int64_t s = 0; s < capacity; ++s)
      for (std::int64_t e = 0; e < row; ++e)
        x.push_back(s >= leftpad[b] && s < seqlens[b] ? round_to(rng.uniform(-1, 1), dtype) : kNaN);
  return x;
}

TEST(KvCacheMixed, EqualsTheWidenedF32CacheAndTheReference) {
  const std::int64_t hq = 4, d = 72, capacity = 160;
  const std::vector<double> seqlens = {150, 37}, leftpad = {3, 0};
  const Tensor lens_t = make_tensor(DType::i32, {2}, seqlens);
  const Tensor pad_t = make_tensor(DType::i32, {2}, leftpad);
  for (DType kv : {DType::bf16, DType::f16}) {
    for (std::int64_t hkv : {4, 2}) {
      const std::vector<double> k = cache_values(kv, capacity, hkv, d, leftpad, seqlens, 1);
      const std::vector<double> v = cache_values(kv, capacity, hkv, d, leftpad, seqlens, 2);
      for (std::int64_t page_size : {0, 1, 16}) {  // 0: dense
        // The cache in its 16-bit dtype and widened to f32, as [B or pages, Hkv, slots, D].
        Tensor k16, v16, k32, v32;
        PagedPool kp, vp;
        KvCacheSeqs seqs;
        seqs.cache_seqlens = lens_t.view();
        seqs.cache_leftpad = pad_t.view();
        if (page_size == 0) {
          k16 = make_tensor(kv, {2, capacity, hkv, d}, k);
          v16 = make_tensor(kv, {2, capacity, hkv, d}, v);
          k32 = make_tensor(DType::f32, {2, capacity, hkv, d}, k);
          v32 = make_tensor(DType::f32, {2, capacity, hkv, d}, v);
        } else {
          kp = paged_values(k, 2, capacity, hkv * d, page_size);
          vp = paged_values(v, 2, capacity, hkv * d, page_size);
          const std::vector<std::int64_t> shape = {kp.num_pages, page_size, hkv, d};
          k16 = make_tensor(kv, shape, kp.values);
          v16 = make_tensor(kv, shape, vp.values);
          k32 = make_tensor(DType::f32, shape, kp.values);
          v32 = make_tensor(DType::f32, shape, vp.values);
          seqs.block_table = kp.block_table.view();
        }
        for (std::int64_t lq : {1, 5, 20}) {
          const Tensor q =
              make_tensor(DType::f32, {2, hq, lq, d}, random_vector(2 * hq * lq * d, 3 + lq));
          Options o;
          o.causal = lq > 1 ? Causal::lower_right : Causal::none;
          o.enable_gqa = true;
          auto run = [&](const Tensor& kc, const Tensor& vc, Backend backend) {
            return forward_kvcache(q, kc.view().transposed(1, 2), vc.view().transposed(1, 2), seqs,
                                   o, backend);
          };
          const ForwardResult want = run(k16, v16, Backend::reference);
          const std::vector<double> want_out = read_view(want.out.view());
          const double tol = out_tolerance(DType::f32, v, want_out, {}, 0.0);
          for_each_backend_and_target([&](Backend backend) {
            SCOPED_TRACE(std::string(name_of(kv)) + " Hkv=" + std::to_string(hkv) +
                         " page_size=" + std::to_string(page_size) + " Lq=" + std::to_string(lq));
            const ForwardResult got = run(k16, v16, backend);
            ASSERT_EQ(got.out.dtype(), DType::f32);
            ASSERT_EQ(got.lse.dtype(), DType::f32);
            const ForwardResult wide = run(k32, v32, backend);
            const std::vector<double> out = read_view(got.out.view());
            EXPECT_TRUE(same_bits(out, read_view(wide.out.view()), "out vs the f32 cache"));
            EXPECT_TRUE(same_bits(read_view(got.lse.view()), read_view(wide.lse.view()),
                                  "lse vs the f32 cache"));
            EXPECT_TRUE(all_close(out, want_out, tol, "out vs the reference"));
            const std::vector<double> lse = read_view(got.lse.view());
            const std::vector<double> want_lse = read_view(want.lse.view());
            for (std::size_t i = 0; i < lse.size(); ++i)
              ASSERT_NEAR(lse[i], want_lse[i], lse_tolerance(DType::f32, want_lse[i])) << i;
          });
        }
      }
    }
  }
}

// Rotary tables f32 [positions, half] for angle pos * 100^(-i / half).
struct RotaryTables {
  Tensor cos, sin;
};
RotaryTables rotary_tables(std::int64_t positions, std::int64_t half) {
  std::vector<double> c, s;
  for (std::int64_t p = 0; p < positions; ++p)
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * std::pow(100.0, -static_cast<double>(i) / half);
      c.push_back(std::cos(angle));
      s.push_back(std::sin(angle));
    }
  return {make_tensor(DType::f32, {positions, half}, c),
          make_tensor(DType::f32, {positions, half}, s)};
}

// New rows in f32 (the query's dtype) or in the cache's: written rounded once (after rotary)
// into the 16-bit cache, which then holds exactly what an f32 cache given the same append holds,
// rounded; the attention that follows agrees with the reference's.
TEST(KvCacheMixed, AppendRoundsNewRowsOnceAfterRotary) {
  const std::int64_t hq = 4, hkv = 2, d = 24, capacity = 40, lq = 3, l_new = 3, half = 7;
  const std::vector<double> seqlens = {20, 9}, leftpad = {2, 0};
  const Tensor lens_t = make_tensor(DType::i32, {2}, seqlens);
  const Tensor pad_t = make_tensor(DType::i32, {2}, leftpad);
  const RotaryTables rot = rotary_tables(capacity, half);
  const Tensor q = make_tensor(DType::f32, {2, hq, lq, d}, random_vector(2 * hq * lq * d, 21));
  for (DType kv : {DType::bf16, DType::f16}) {
    const std::vector<double> k = cache_values(kv, capacity, hkv, d, leftpad, seqlens, 22);
    const std::vector<double> v = cache_values(kv, capacity, hkv, d, leftpad, seqlens, 23);
    for (DType new_dtype : {DType::f32, kv}) {
      const std::vector<double> kn = rounded(random_vector(2 * hkv * l_new * d, 24), new_dtype);
      const std::vector<double> vn = rounded(random_vector(2 * hkv * l_new * d, 25), new_dtype);
      const Tensor k_new = make_tensor(new_dtype, {2, hkv, l_new, d}, kn);
      const Tensor v_new = make_tensor(new_dtype, {2, hkv, l_new, d}, vn);
      // The same rows widened, for the f32 cache (which takes f32 rows only).
      const Tensor k_new32 = make_tensor(DType::f32, {2, hkv, l_new, d}, kn);
      const Tensor v_new32 = make_tensor(DType::f32, {2, hkv, l_new, d}, vn);
      for (std::int64_t page_size : {0, 16}) {
        for (bool rotary : {false, true}) {
          SCOPED_TRACE(std::string(name_of(kv)) + " new rows " + std::string(name_of(new_dtype)) +
                       " page_size=" + std::to_string(page_size) + (rotary ? " rotary" : ""));
          KvCacheSeqs seqs;
          seqs.cache_seqlens = lens_t.view();
          seqs.cache_leftpad = pad_t.view();
          PagedPool kp, vp;
          if (page_size > 0) {
            kp = paged_values(k, 2, capacity, hkv * d, page_size);
            vp = paged_values(v, 2, capacity, hkv * d, page_size);
            seqs.block_table = kp.block_table.view();
          }
          const std::vector<std::int64_t> shape =
              page_size > 0 ? std::vector<std::int64_t>{kp.num_pages, page_size, hkv, d}
                            : std::vector<std::int64_t>{2, capacity, hkv, d};
          const std::optional<TensorView> cos =
              rotary ? std::optional(rot.cos.view()) : std::nullopt;
          const std::optional<TensorView> sin =
              rotary ? std::optional(rot.sin.view()) : std::nullopt;
          Options o;
          o.causal = Causal::lower_right;
          o.enable_gqa = true;
          // The same append into fresh caches: 16-bit on each backend, f32 on the reference.
          struct Caches {
            Tensor k, v;
          };
          auto fresh = [&](DType dtype) {
            return Caches{make_tensor(dtype, shape, page_size > 0 ? kp.values : k),
                          make_tensor(dtype, shape, page_size > 0 ? vp.values : v)};
          };
          auto run = [&](const Caches& c, Backend backend) {
            const bool f32 = c.k.dtype() == DType::f32;
            return forward_kvcache(
                q, c.k.view().transposed(1, 2), c.v.view().transposed(1, 2), seqs,
                KvAppend{f32 ? k_new32 : k_new, f32 ? v_new32 : v_new, cos, sin}, o, backend);
          };
          const Caches wide = fresh(DType::f32);
          run(wide, Backend::reference);
          const Caches want = fresh(kv);
          const ForwardResult want_r = run(want, Backend::reference);
          // The 16-bit cache holds the f32 cache's values rounded (new rows rounded once).
          EXPECT_TRUE(same_bits(read_view(want.k.view()), rounded(read_view(wide.k.view()), kv),
                                "k_cache after the append"));
          EXPECT_TRUE(same_bits(read_view(want.v.view()), rounded(read_view(wide.v.view()), kv),
                                "v_cache after the append"));
          if (new_dtype == kv && !rotary && page_size == 0) {
            // Rows in the cache's dtype are copied exactly: sequence 0 (20 slots), head 1, new
            // row j.
            const std::vector<double> cache = read_view(want.k.view());
            for (std::int64_t j = 0; j < l_new; ++j)
              for (std::int64_t e = 0; e < d; ++e)
                ASSERT_EQ(cache[static_cast<std::size_t>(((20 + j) * hkv + 1) * d + e)],
                          kn[static_cast<std::size_t>((l_new + j) * d + e)]);
          }
          const std::vector<double> want_out = read_view(want_r.out.view());
          const double tol = out_tolerance(DType::f32, v, want_out, {}, 0.0) +
                             out_tolerance(DType::f32, vn, want_out, {}, 0.0);
          for_each_backend_and_target([&](Backend backend) {
            const Caches c = fresh(kv);
            const ForwardResult r = run(c, backend);
            EXPECT_TRUE(same_bits(read_view(c.k.view()), read_view(want.k.view()), "k_cache"));
            EXPECT_TRUE(same_bits(read_view(c.v.view()), read_view(want.v.view()), "v_cache"));
            EXPECT_TRUE(all_close(read_view(r.out.view()), want_out, tol, "out"));
          });
        }
      }
    }
  }
}

TEST(KvCacheMixed, OtherMixesAreRefused) {
  const Tensor lens = make_tensor(DType::i32, {1}, {3});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  auto message = [&](DType q_dtype, DType k_dtype, DType v_dtype) {
    const Tensor q(q_dtype, {1, 2, 1, 8});
    const Tensor k(k_dtype, {1, 2, 6, 8}), v(v_dtype, {1, 2, 6, 8});
    return error_message([&] { forward_kvcache(q, k, v, seqs); });
  };
  for (DType kv : {DType::bf16, DType::f16}) EXPECT_EQ(message(DType::f32, kv, kv), "");
  // (query, cache) dtypes refused: "k_cache has the wrong dtype for the query".
  const DType refused[][2] = {{DType::f16, DType::bf16},
                              {DType::bf16, DType::f32},
                              {DType::f64, DType::bf16},
                              {DType::f32, DType::f64}};
  for (const auto& [q_dtype, kv] : refused) {
    EXPECT_EQ(message(q_dtype, kv, kv),
              "forward: k_cache has the wrong dtype for the query (k_cache=" +
                  std::string(name_of(kv)) + ", query=" + std::string(name_of(q_dtype)) +
                  ", expected k_cache like query, or bf16 or f16 under "
                  "an f32 query)");
  }
  EXPECT_EQ(message(DType::f32, DType::bf16, DType::f16),
            "forward: v_cache has the wrong dtype (dtype=f16, expected bf16 like k_cache)");
  EXPECT_EQ(message(DType::f32, DType::f32, DType::bf16),
            "forward: v_cache has the wrong dtype (dtype=bf16, expected f32 like k_cache)");
  // A k_cache of no dtype the query takes is named itself, not through v_cache.
  EXPECT_EQ(message(DType::f32, DType::b8, DType::f32),
            "forward: k_cache has the wrong dtype for the query (k_cache=bool, query=f32, expected "
            "k_cache like query, or bf16 or f16 under an f32 query)");
  EXPECT_EQ(message(DType::i32, DType::bf16, DType::bf16),
            "forward: query has an unsupported dtype (dtype=i32, expected f32, f64, bf16 or f16)");
  // A paged cache takes the same rule.
  const Tensor table = make_tensor(DType::i32, {1, 2}, {1, 0});
  KvCacheSeqs paged = seqs;
  paged.block_table = table.view();
  const Tensor q(DType::f16, {1, 2, 1, 8}), pool(DType::bf16, {2, 2, 4, 8});
  EXPECT_EQ(error_message([&] { forward_kvcache(q, pool, pool, paged); }),
            "forward: k_cache has the wrong dtype for the query (k_cache=bf16, query=f16, "
            "expected k_cache like query, or bf16 or f16 under an f32 query)");
  // out and lse are f32 (the query's dtype), not the cache's.
  const Tensor q32(DType::f32, {1, 2, 1, 8}), k16(DType::bf16, {1, 2, 6, 8});
  const Tensor out16(DType::bf16, {1, 2, 1, 8}), out32(DType::f32, {1, 2, 1, 8});
  const Tensor lse16(DType::bf16, {1, 2, 1});
  EXPECT_EQ(error_message([&] { forward_kvcache_into(q32, k16, k16, seqs, out16, std::nullopt); }),
            "forward: out has the wrong dtype (dtype=bf16, expected f32)");
  EXPECT_EQ(error_message([&] { forward_kvcache_into(q32, k16, k16, seqs, out32, lse16.view()); }),
            "forward: lse has the wrong dtype (dtype=bf16, expected f32 (f64 only for f64 "
            "inputs))");
  // New rows: the cache's dtype or the query's, k_new and v_new alike.
  const Tensor k_cache(DType::bf16, {1, 2, 6, 8}), v_cache(DType::bf16, {1, 2, 6, 8});
  auto append_message = [&](DType k_new_dtype, DType v_new_dtype) {
    const Tensor kn(k_new_dtype, {1, 2, 1, 8}), vn(v_new_dtype, {1, 2, 1, 8});
    return error_message([&] {
      forward_kvcache(q32, k_cache, v_cache, seqs, KvAppend{kn, vn, std::nullopt, std::nullopt});
    });
  };
  EXPECT_EQ(append_message(DType::f32, DType::f32), "");
  EXPECT_EQ(append_message(DType::bf16, DType::bf16), "");
  EXPECT_EQ(append_message(DType::f16, DType::f16),
            "forward: k_new has the wrong dtype (dtype=f16, expected bf16 like k_cache or f32 "
            "like query)");
  EXPECT_EQ(append_message(DType::f32, DType::bf16),
            "forward: v_new has the wrong dtype (dtype=bf16, expected f32 like k_new)");
  EXPECT_EQ(append_message(DType::f64, DType::f64),
            "forward: k_new has the wrong dtype (dtype=f64, expected bf16 like k_cache or f32 "
            "like query)");
}

// The cache's dtype reaches flash's cost term through the public path: a decode over a bf16
// cache is estimated faster than over an f32 one (half the bytes). By how much depends on this
// machine's SIMD target (the fixed constants of AVX2 make the per-element work bind for bf16,
// where AVX-512's let the read bind): SelectCostModel.FlashPricesTheCacheDtype checks the
// ratio on a fixed model.
TEST(KvCacheMixed, CostPricesTheCacheDtype) {
  static float no_data;
  const std::int64_t hkv = 8, lk = 16384, d = 128;
  const Tensor lens = make_tensor(DType::i32, {1}, {static_cast<double>(lk)});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  const TensorView q = TensorView::contiguous(&no_data, DType::f32, {1, 32, 1, d});
  auto estimate = [&](DType kv, Backend backend) {  // seconds, -1 when not estimated
    const TensorView k = TensorView::contiguous(&no_data, kv, {1, hkv, lk, d});
    Options o;
    o.enable_gqa = true;
    const Explanation e = explain_forward_kvcache(q, k, k, seqs, o);
    for (const BackendVerdict& v : e.verdicts)
      if (v.backend == backend) return v.estimated_seconds;
    return -1.0;
  };
  const double f32 = estimate(DType::f32, Backend::flash);
  const double bf16 = estimate(DType::bf16, Backend::flash);
  EXPECT_GT(bf16, 0);
  EXPECT_LT(bf16, f32);
}

}  // namespace
}  // namespace attncore::test
