// Attention over a paged KV cache (attncore/kvcache.h, KvCacheSeqs::block_table): the cache
// cut into pages of any size and scattered over the pool in a random order gives the same bits
// as the dense cache, on every backend (flash on every SIMD target), for decode and chunked
// prefill, every variant the dense cache
// supports, appends with rotary; unfilled slots, keys past cache_seqlens and unused pages hold
// NaN and change nothing; every bad block table is refused before any work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
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

Tensor i32(const std::vector<std::int64_t>& shape, const std::vector<int>& values) {
  Tensor t(DType::i32, shape.data(), static_cast<int>(shape.size()));
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int));
  return t;
}

// A dense cache [B, capacity, H, width] (flash layout) whose slots outside
// [leftpad[b], seqlens[b]) hold NaN.
Tensor dense_cache(DType dtype, std::int64_t capacity, std::int64_t heads, std::int64_t width,
                   const std::vector<int>& leftpad, const std::vector<int>& seqlens,
                   std::uint64_t seed) {
  const auto batch = static_cast<std::int64_t>(seqlens.size());
  Random rng(seed);
  std::vector<double> x(static_cast<std::size_t>(batch * capacity * heads * width));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < capacity; ++s)
      for (std::int64_t e = 0; e < heads * width; ++e) {
        const bool used =
            s >= leftpad[static_cast<std::size_t>(b)] && s < seqlens[static_cast<std::size_t>(b)];
        x[static_cast<std::size_t>((b * capacity + s) * heads * width + e)] =
            used ? round_to(rng.uniform(-1, 1), dtype) : kNaN;
      }
  return make_tensor(dtype, {batch, capacity, heads, width}, x);
}

// A dense cache cut into pages: sequence b's page i is pool page
// block_table[b][i], the pages in a random order with `spare` extra pages; every slot not
// copied from the dense cache holds NaN. Entries of pages wholly past `mapped[b]` slots are -1.
struct Paged {
  Tensor pool;         // [num_pages, page_size, H, width]
  Tensor block_table;  // i32 [B, pages_per_seq]
};

Paged to_pages(const Tensor& dense, std::int64_t page_size, const std::vector<int>& mapped,
               std::int64_t spare, std::uint64_t seed) {
  const std::int64_t batch = dense.size(0), capacity = dense.size(1);
  const std::int64_t heads = dense.size(2), width = dense.size(3);
  const std::int64_t per_seq = (capacity + page_size - 1) / page_size;
  const std::int64_t num_pages = batch * per_seq + spare;
  std::vector<int> perm(static_cast<std::size_t>(num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  Random rng(seed);
  for (std::int64_t i = num_pages - 1; i > 0; --i) {
    std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(rng.below(i + 1))]);
  }
  const std::vector<double> src = read_view(dense.view());
  const std::int64_t row = heads * width;
  std::vector<double> pool(static_cast<std::size_t>(num_pages * page_size * row), kNaN);
  std::vector<int> table(static_cast<std::size_t>(batch * per_seq));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t i = 0; i < per_seq; ++i) {
      const int page = perm[static_cast<std::size_t>(b * per_seq + i)];
      table[static_cast<std::size_t>(b * per_seq + i)] =
          i * page_size < mapped[static_cast<std::size_t>(b)] ? page : -1;
    }
    for (std::int64_t s = 0; s < capacity; ++s) {
      const int page = perm[static_cast<std::size_t>(b * per_seq + s / page_size)];
      std::copy_n(src.begin() + (b * capacity + s) * row, row,
                  pool.begin() + (page * page_size + s % page_size) * row);
    }
  }
  return {make_tensor(dense.dtype(), {num_pages, page_size, heads, width}, pool),
          i32({batch, per_seq}, table)};
}

// Slots [0, count) of sequence b of a paged pool, in the order of the dense cache's row.
std::vector<double> paged_slots(const Paged& paged, std::int64_t b, std::int64_t count) {
  const std::vector<double> pool = read_view(paged.pool.view());
  const std::int64_t page_size = paged.pool.size(1);
  const std::int64_t row = paged.pool.size(2) * paged.pool.size(3);
  const std::int64_t per_seq = paged.block_table.size(1);
  const auto* table = paged.block_table.data_as<const std::int32_t>();
  std::vector<double> out;
  for (std::int64_t s = 0; s < count; ++s) {
    const std::int64_t page = table[b * per_seq + s / page_size];
    const auto at = pool.begin() + (page * page_size + s % page_size) * row;
    out.insert(out.end(), at, at + row);
  }
  return out;
}

// The same bits, none of them NaN (a NaN slot read would show in both results).
::testing::AssertionResult same_finite_bits(const std::vector<double>& got,
                                            const std::vector<double>& want,
                                            const std::string& what) {
  for (double x : want) {
    if (std::isnan(x)) return ::testing::AssertionFailure() << what << ": NaN in the result";
  }
  return same_bits(got, want, what);
}

// Runs f(backend) on every backend, flash on every SIMD target; the one refusal allowed is
// flash's of f64.
template <class F>
void for_each_paged_backend(F&& f) {
  for_each_backend_and_target([&](Backend backend) {
    try {
      f(backend);
    } catch (const Unsupported& e) {
      const std::string what = e.what();
      ASSERT_TRUE(backend == Backend::flash && what.find("dtype f64") != std::string::npos)
          << what;
    }
  });
}

struct Variant {
  const char* name;
  Causal causal;
  std::int64_t window_left;
  double softcap;
  bool alibi;
  bool leftpad;
};
const Variant kVariants[] = {{"plain", Causal::none, -1, 0.0, false, false},
                             {"causal", Causal::lower_right, -1, 0.0, false, false},
                             {"window_leftpad", Causal::lower_right, 7, 0.0, false, true},
                             {"softcap_alibi_leftpad", Causal::none, -1, 5.0, true, true}};

TEST(Paged, ShuffledPagesEqualTheDenseCacheBitwise) {
  const std::int64_t batch = 3, hq = 4, hkv = 2, dim = 40, dim_v = 24, capacity = 300;
  const std::vector<int> seqlens = {300, 0, 131}, pads = {17, 0, 2}, none = {0, 0, 0};
  const Tensor seqlens_t = i32({batch}, seqlens);
  const Tensor slopes =
      make_tensor(DType::f32, {batch, hq}, random_vector(batch * hq, 4, 0.01, 0.2));
  for (DType dtype : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (const Variant& variant : kVariants) {
      const std::vector<int>& leftpad = variant.leftpad ? pads : none;
      const Tensor pad_t = i32({batch}, leftpad);
      const Tensor k = dense_cache(dtype, capacity, hkv, dim, leftpad, seqlens, 1);
      const Tensor v = dense_cache(dtype, capacity, hkv, dim_v, leftpad, seqlens, 2);
      Options o;
      o.causal = variant.causal;
      o.window_left = variant.window_left;
      o.softcap = variant.softcap;
      if (variant.alibi) o.alibi_slopes = slopes.view();
      for (std::int64_t lq : {1, 5}) {
        const Tensor q = make_tensor(dtype, {batch, hq, lq, dim},
                                     rounded(random_vector(batch * hq * lq * dim, 3), dtype));
        KvCacheSeqs dense_seqs;
        dense_seqs.cache_seqlens = seqlens_t.view();
        if (variant.leftpad) dense_seqs.cache_leftpad = pad_t.view();
        for (std::int64_t page_size : {1, 3, 16, 256}) {
          const Paged pk = to_pages(k, page_size, seqlens, 5, 7);
          const Paged pv = to_pages(v, page_size, seqlens, 5, 7);
          KvCacheSeqs paged_seqs = dense_seqs;
          paged_seqs.block_table = pk.block_table.view();
          for_each_paged_backend([&](Backend backend) {
            SCOPED_TRACE(std::string(name_of(dtype)) + " " + variant.name +
                         " Lq=" + std::to_string(lq) + " page_size=" + std::to_string(page_size));
            const ForwardResult want = forward_kvcache(
                q, k.view().transposed(1, 2), v.view().transposed(1, 2), dense_seqs, o, backend);
            const ForwardResult got =
                forward_kvcache(q, pk.pool.view().transposed(1, 2), pv.pool.view().transposed(1, 2),
                                paged_seqs, o, backend);
            ASSERT_TRUE(
                same_finite_bits(read_view(got.out.view()), read_view(want.out.view()), "out"));
            ASSERT_TRUE(
                same_finite_bits(read_view(got.lse.view()), read_view(want.lse.view()), "lse"));
          });
        }
      }
    }
  }
}

TEST(Paged, AppendWithRotaryEqualsTheDenseCacheBitwise) {
  const std::int64_t batch = 2, hq = 4, hkv = 2, dim = 16, capacity = 40, half = 3;
  const std::vector<int> seqlens = {11, 30}, leftpad = {0, 4};
  const std::int64_t l_new = 4;
  const std::vector<int> after = {15, 34};
  const Tensor seqlens_t = i32({batch}, seqlens), pad_t = i32({batch}, leftpad);
  const Tensor cos = make_tensor(DType::f32, {capacity, half}, random_vector(capacity * half, 5));
  const Tensor sin = make_tensor(DType::f32, {capacity, half}, random_vector(capacity * half, 6));
  for (std::int64_t lq : {1, 4}) {
    for (std::int64_t page_size : {1, 3, 16}) {
      for_each_paged_backend([&](Backend backend) {
        SCOPED_TRACE("Lq=" + std::to_string(lq) + " page_size=" + std::to_string(page_size));
        const Tensor k = dense_cache(DType::f32, capacity, hkv, dim, leftpad, seqlens, 1);
        const Tensor v = dense_cache(DType::f32, capacity, hkv, dim, leftpad, seqlens, 2);
        // Pages are mapped up to the lengths after the append; the rest are -1.
        const Paged pk = to_pages(k, page_size, after, 2, 9);
        const Paged pv = to_pages(v, page_size, after, 2, 9);
        const Tensor q =
            make_tensor(DType::f32, {batch, hq, lq, dim}, random_vector(batch * hq * lq * dim, 3));
        const Tensor k_new = make_tensor(DType::f32, {batch, hkv, l_new, dim},
                                         random_vector(batch * hkv * l_new * dim, 4));
        const Tensor v_new = make_tensor(DType::f32, {batch, hkv, l_new, dim},
                                         random_vector(batch * hkv * l_new * dim, 8));
        const KvAppend append{k_new, v_new, cos.view(), sin.view(), false};
        Options o;
        o.causal = Causal::lower_right;
        KvCacheSeqs seqs;
        seqs.cache_seqlens = seqlens_t.view();
        seqs.cache_leftpad = pad_t.view();
        const ForwardResult want = forward_kvcache(
            q, k.view().transposed(1, 2), v.view().transposed(1, 2), seqs, append, o, backend);
        seqs.block_table = pk.block_table.view();
        const ForwardResult got =
            forward_kvcache(q, pk.pool.view().transposed(1, 2), pv.pool.view().transposed(1, 2),
                            seqs, append, o, backend);
        ASSERT_TRUE(same_finite_bits(read_view(got.out.view()), read_view(want.out.view()), "out"));
        ASSERT_TRUE(same_finite_bits(read_view(got.lse.view()), read_view(want.lse.view()), "lse"));
        // The appended rows sit in the pages where the dense cache has them.
        const std::vector<double> dense_k = read_view(k.view()), dense_v = read_view(v.view());
        for (std::int64_t b = 0; b < batch; ++b) {
          const std::int64_t row = hkv * dim, from = leftpad[static_cast<std::size_t>(b)] * row;
          const std::int64_t to = after[static_cast<std::size_t>(b)] * row;
          const std::vector<double> pk_b = paged_slots(pk, b, after[static_cast<std::size_t>(b)]);
          const std::vector<double> pv_b = paged_slots(pv, b, after[static_cast<std::size_t>(b)]);
          const auto base = dense_k.begin() + b * capacity * row;
          ASSERT_TRUE(same_finite_bits(std::vector<double>(pk_b.begin() + from, pk_b.end()),
                                       std::vector<double>(base + from, base + to), "k rows"));
          const auto base_v = dense_v.begin() + b * capacity * row;
          ASSERT_TRUE(same_finite_bits(std::vector<double>(pv_b.begin() + from, pv_b.end()),
                                       std::vector<double>(base_v + from, base_v + to), "v rows"));
        }
      });
    }
  }
}

// Every page outside the sequences' slots may hold anything: NaN, inf, or -1 in the table.
TEST(Paged, PagesOutsideTheSlotsAreNeverRead) {
  const std::vector<int> seqlens = {5, 9};
  const Tensor q = make_tensor(DType::f32, {2, 2, 1, 8}, random_vector(32, 1));
  const Tensor pool = make_tensor(DType::f32, {6, 4, 1, 8}, random_vector(6 * 4 * 8, 2));
  std::vector<double> poisoned = read_view(pool.view());
  // Sequence 0: pages 3, 1 (slots [0, 5): page 1 rows 0..0); sequence 1: pages 0, 5, 2 with
  // leftpad 6 (page 0 unused, -1 would do too).
  const Tensor table = i32({2, 4}, {3, 1, -1, 7, -1, 5, 2, 99});
  const Tensor lens = i32({2}, seqlens), pad = i32({2}, {0, 6});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  seqs.cache_leftpad = pad.view();
  seqs.block_table = table.view();
  const TensorView kv = pool.view().transposed(1, 2);
  for (Backend backend : {Backend::reference, Backend::math}) {
    const ForwardResult clean = forward_kvcache(q, kv, kv, seqs, {}, backend);
    // Poison every row no sequence uses: pages 0 and 4 whole, page 1 rows 1..3, page 5 rows
    // 0..1, page 2 row 1..3.
    Tensor dirty = make_tensor(DType::f32, {6, 4, 1, 8}, poisoned);
    std::vector<double> x = read_view(dirty.view());
    auto poison = [&](int page, int row0, int row1, double value) {
      for (int r = row0; r < row1; ++r)
        for (int e = 0; e < 8; ++e) x[static_cast<std::size_t>((page * 4 + r) * 8 + e)] = value;
    };
    poison(0, 0, 4, kNaN);
    poison(4, 0, 4, INFINITY);
    poison(1, 1, 4, kNaN);
    poison(5, 0, 2, -INFINITY);
    poison(2, 1, 4, kNaN);
    write_view(dirty.view(), x);
    const TensorView dkv = dirty.view().transposed(1, 2);
    const ForwardResult got = forward_kvcache(q, dkv, dkv, seqs, {}, backend);
    EXPECT_TRUE(same_finite_bits(read_view(got.out.view()), read_view(clean.out.view()), "out"));
    EXPECT_TRUE(same_finite_bits(read_view(got.lse.view()), read_view(clean.lse.view()), "lse"));
  }
}

TEST(Paged, BadBlockTables) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor pool(DType::f32, {5, 2, 4, 8});  // [num_pages, Hkv, page_size, D]
  const Tensor lens = i32({2}, {6, 3});
  const Tensor table = i32({2, 3}, {4, 0, -1, 2, -1, -1});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  s.block_table = table.view();
  auto message = [&](const KvCacheSeqs& seqs, const TensorView& k) {
    return error_message([&] { forward_kvcache(q, k, k, seqs, {}, Backend::reference); });
  };
  EXPECT_EQ(message(s, pool), "");
  const Tensor minus = i32({2, 3}, {4, -1, -1, 2, -1, -1});
  s.block_table = minus.view();
  EXPECT_EQ(message(s, pool),
            "forward: block_table names no page of the cache for slots in use (block_table[0][1]"
            "=-1, expected 0 <= page < num_pages=5 for sequence 0's slots [0, 6))");
  const Tensor past = i32({2, 3}, {4, 0, -1, 5, -1, -1});
  s.block_table = past.view();
  EXPECT_EQ(message(s, pool),
            "forward: block_table names no page of the cache for slots in use (block_table[1][0]"
            "=5, expected 0 <= page < num_pages=5 for sequence 1's slots [0, 3))");
  s.block_table = table.view();
  const Tensor long_lens = i32({2}, {13, 3});
  s.cache_seqlens = long_lens.view();
  EXPECT_EQ(message(s, pool),
            "forward: cache_seqlens is out of range (cache_seqlens[0]=13, expected 0 <= "
            "cache_seqlens[b] <= capacity=max_pages_per_seq * page_size=12)");
  s.cache_seqlens = lens.view();
  const Tensor f32_table(DType::f32, {2, 3});
  s.block_table = f32_table.view();
  EXPECT_EQ(message(s, pool), "forward: block_table has the wrong dtype (dtype=f32, expected i32)");
  const Tensor flat = i32({6}, {4, 0, -1, 2, -1, -1});
  s.block_table = flat.view();
  EXPECT_EQ(message(s, pool),
            "forward: block_table has shape [6], expected [2, "
            "max_pages_per_seq] ([B, max_pages_per_seq])");
  const Tensor three = i32({3, 3}, std::vector<int>(9, 0));
  s.block_table = three.view();
  EXPECT_NE(message(s, pool).find("block_table has shape [3, 3], expected [2, max_pages_per_seq]"),
            std::string::npos);
  const Tensor wide = i32({2, 6}, {4, 9, 0, 9, -1, 9, 2, 9, -1, 9, -1, 9});
  TensorView strided = wide.view();
  strided.shape[1] = 3;
  strided.stride[1] = 2;
  s.block_table = strided;
  EXPECT_EQ(message(s, pool),
            "forward: block_table has a non-unit last stride (stride[1]=2, expected 1); pass a "
            "contiguous copy");
  s.block_table = table.view();
  const Tensor empty_pages(DType::f32, {5, 2, 0, 8});
  EXPECT_NE(message(s, empty_pages).find("with page_size >= 1 (page_size=0)"), std::string::npos);
  const Tensor idx = i32({2}, {0, 1});
  s.cache_batch_idx = idx.view();
  const std::string unsupported =
      error_message([&] { forward_kvcache(q, pool, pool, s, {}, Backend::reference); });
  EXPECT_EQ(unsupported,
            "forward: cache_batch_idx is not supported with a paged cache "
            "(cache_batch_idx=given, expected none with block_table); flash-attn "
            "refuses it too");
  EXPECT_THROW(forward_kvcache(q, pool, pool, s, {}, Backend::reference), Unsupported);
  s.cache_batch_idx.reset();
  // Leftpad past a -1 entry: the page before the first used slot is not read.
  const Tensor pad = i32({2}, {4, 0});
  const Tensor skip = i32({2, 3}, {-1, 0, -1, 2, -1, -1});
  s.block_table = skip.view();
  s.cache_leftpad = pad.view();
  EXPECT_EQ(message(s, pool), "");
  // The block table is an input: an output over it is refused.
  s.cache_leftpad.reset();
  s.block_table = table.view();
  Tensor out_over(DType::i32, {2, 2, 1, 8});
  TensorView over = out_over.view();
  over.dtype = DType::f32;
  KvCacheSeqs aliased = s;
  aliased.block_table = TensorView::strided(out_over.data(), DType::i32, {2, 3}, {3, 1});
  EXPECT_NE(error_message([&] {
              forward_kvcache_into(q, pool, pool, aliased, over, std::nullopt, {},
                                   Backend::reference);
            }).find("block_table"),
            std::string::npos);
}

TEST(Paged, ExplainSaysEveryBackendRunsPagedCalls) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor pool(DType::f32, {5, 2, 4, 8});
  const Tensor lens = i32({2}, {6, 3});
  const Tensor table = i32({2, 3}, {4, 0, -1, 2, -1, -1});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  s.block_table = table.view();
  const Explanation e = explain_forward_kvcache(q, pool, pool, s);
  EXPECT_NE(e.chosen, Backend::automatic);
  for (const BackendVerdict& v : e.verdicts) {
    EXPECT_TRUE(v.reasons.empty()) << name_of(v.backend) << ": " << v.reasons.front();
  }
  const Tensor bad = i32({2, 3}, {4, -1, -1, 2, -1, -1});
  s.block_table = bad.view();
  EXPECT_THROW(explain_forward_kvcache(q, pool, pool, s), InvalidArgument);
}

TEST(Paged, AppendsCheckTheirPagesBeforeWriting) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor pool(DType::f32, {5, 2, 4, 8}), v_pool(DType::f32, {5, 2, 4, 8});
  const Tensor k_new = make_tensor(DType::f32, {2, 2, 3, 8}, random_vector(96, 1));
  const Tensor lens = i32({2}, {4, 3});
  // Sequence 0 appends slots [4, 7): page 1 of its row is -1.
  const Tensor table = i32({2, 3}, {4, -1, -1, 2, 3, -1});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  s.block_table = table.view();
  const KvAppend append{k_new, k_new, std::nullopt, std::nullopt, false};
  EXPECT_EQ(
      error_message([&] { forward_kvcache(q, pool, v_pool, s, append, {}, Backend::reference); }),
      "forward: block_table names no page of the cache for slots in use (block_table[0][1]"
      "=-1, expected 0 <= page < num_pages=5 for sequence 0's slots [0, 7))");
  const Tensor full = i32({2}, {12, 3});
  s.cache_seqlens = full.view();
  const Tensor all = i32({2, 3}, {4, 0, 1, 2, 3, -1});
  s.block_table = all.view();
  EXPECT_EQ(
      error_message([&] { forward_kvcache(q, pool, v_pool, s, append, {}, Backend::reference); }),
      "forward: k_new does not fit in the cache (cache_seqlens[0]=12 + L_new=3, expected <= "
      "capacity=12)");
  // A backend that cannot run the call (flash: f64) is refused before the append too.
  const Tensor q64(DType::f64, {2, 2, 1, 8}), pool64(DType::f64, {5, 2, 4, 8});
  const Tensor v_pool64(DType::f64, {5, 2, 4, 8});
  const Tensor new64 = make_tensor(DType::f64, {2, 2, 3, 8}, random_vector(96, 1));
  s.cache_seqlens = lens.view();
  EXPECT_THROW(forward_kvcache(q64, pool64, v_pool64, s,
                               KvAppend{new64, new64, std::nullopt, std::nullopt, false}, {},
                               Backend::flash),
               Unsupported);
  for (double x : read_view(pool.view())) ASSERT_EQ(x, 0.0);  // nothing was written
  for (double x : read_view(pool64.view())) ASSERT_EQ(x, 0.0);
  for (double x : read_view(v_pool.view())) ASSERT_EQ(x, 0.0);
  for (double x : read_view(v_pool64.view())) ASSERT_EQ(x, 0.0);
}

// An append that would write one pool slot twice, or overwrite keys of its own sequence, and an
// append whose K and V caches share memory, are refused before anything is written.
TEST(Paged, AppendsRefuseSlotsWrittenTwice) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor k_pool(DType::f32, {5, 2, 4, 8}), v_pool(DType::f32, {5, 2, 4, 8});
  const Tensor k_new = make_tensor(DType::f32, {2, 2, 1, 8}, random_vector(32, 1));
  const KvAppend append{k_new, k_new, std::nullopt, std::nullopt, false};
  KvCacheSeqs s;
  // Both sequences append their slot 5 (row 1 of logical page 1): page 3 in both rows.
  const Tensor lens = i32({2}, {5, 5});
  const Tensor shared = i32({2, 3}, {4, 3, -1, 2, 3, -1});
  s.cache_seqlens = lens.view();
  s.block_table = shared.view();
  EXPECT_EQ(
      error_message([&] { forward_kvcache(q, k_pool, v_pool, s, append, {}, Backend::reference); }),
      "forward: k_new writes one pool slot twice (slot 5 of sequence 0 and slot 5 of sequence 1 "
      "are both row 1 of page 3, expected distinct slots); map distinct pages where sequences "
      "append (a paged cache's assign copies a shared page first; appends write pages as mapped)");
  // Sequence 0 maps page 4 at logical pages 0 and 1: its new slot 5 is its own key 1.
  const Tensor twice = i32({2, 3}, {4, 4, -1, 2, 3, -1});
  s.block_table = twice.view();
  EXPECT_EQ(
      error_message([&] { forward_kvcache(q, k_pool, v_pool, s, append, {}, Backend::reference); }),
      "forward: block_table maps one page twice in a sequence that appends (block_table[0][0]="
      "block_table[0][1]=4, expected distinct pages); the append would overwrite the sequence's "
      "own keys");
  for (double x : read_view(k_pool.view())) ASSERT_EQ(x, 0.0);  // nothing was written
  for (double x : read_view(v_pool.view())) ASSERT_EQ(x, 0.0);
  // One pool for keys and values: the values would overwrite the keys.
  s.block_table = shared.view();
  const Tensor lens_apart = i32({2}, {1, 5});
  s.cache_seqlens = lens_apart.view();
  EXPECT_NE(error_message([&] {
              forward_kvcache(q, k_pool, k_pool, s, append, {}, Backend::reference);
            }).find("forward: v_cache overlaps k_cache"),
            std::string::npos);
  for (double x : read_view(k_pool.view())) ASSERT_EQ(x, 0.0);
  // A page mapped twice past the slots a sequence uses is never written: the append runs.
  const Tensor fine = i32({2, 3}, {4, 1, 1, 0, 3, -1});
  s.block_table = fine.view();
  const Tensor lens_fine = i32({2}, {3, 5});
  s.cache_seqlens = lens_fine.view();
  EXPECT_NO_THROW(forward_kvcache(q, k_pool, v_pool, s, append, {}, Backend::reference));
}

// Decode over a cache whose kv heads lie inside each key's row ([B, L, Hkv, D], as pages) runs
// items of several kv heads, cut by the thread count; over [B, Hkv, L, D] one head an item.
// Each head's result must not depend on either: the same bits for 1, 2 and 3 threads and both
// layouts (the slots outside the sequences hold NaN). Two shapes: 5 heads of odd widths, and 20
// heads of D = 64, where one row per head is scored key by key across the heads on every SIMD
// target (AVX-512: f32, bf16 pairs, widened f16 and bf16, 20 heads a full and a partial group
// of the widened path's 16; AVX2: several keys at once, every dtype, and over [B, Hkv, L, D]
// each whole tile's keys as 4 streams), and Dv = 128 (AVX2: P . V of every head in one pass,
// two column slices).
TEST(Paged, ItemsOfSeveralKvHeadsEqualOneHeadItemsBitwise) {
  struct Shape {
    std::int64_t hkv, dim, dim_v;
  };
  const std::int64_t batch = 2, capacity = 300;
  const std::vector<int> seqlens = {300, 197}, pads = {17, 2}, none = {0, 0};
  const Tensor seqlens_t = i32({batch}, seqlens);
  for (const Shape& shape : {Shape{5, 40, 24}, Shape{20, 64, 128}}) {
    const std::int64_t hkv = shape.hkv, dim = shape.dim, dim_v = shape.dim_v;
    // [B, capacity, H, width] -> the same values as [B, H, capacity, width], contiguous.
    auto heads_outer = [&](const Tensor& t) {
      return make_tensor(t.dtype(), {batch, hkv, capacity, t.size(3)},
                         read_view(t.view().transposed(1, 2)));
    };
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (const Variant& variant : kVariants) {
        for (std::int64_t group : {1, 3}) {
          const std::int64_t hq = hkv * group;
          const std::vector<int>& leftpad = variant.leftpad ? pads : none;
          const Tensor pad_t = i32({batch}, leftpad);
          const Tensor k = dense_cache(dtype, capacity, hkv, dim, leftpad, seqlens, 1);
          const Tensor v = dense_cache(dtype, capacity, hkv, dim_v, leftpad, seqlens, 2);
          const Tensor k_outer = heads_outer(k), v_outer = heads_outer(v);
          const Tensor slopes =
              make_tensor(DType::f32, {batch, hq}, random_vector(batch * hq, 4, 0.01, 0.2));
          const Tensor q = make_tensor(dtype, {batch, hq, 1, dim},
                                       rounded(random_vector(batch * hq * dim, 3), dtype));
          KvCacheSeqs seqs;
          seqs.cache_seqlens = seqlens_t.view();
          if (variant.leftpad) seqs.cache_leftpad = pad_t.view();
          for (const std::string& target : simd_targets_supported()) {
            const ScopedTarget scope(target);
            Options o;
            o.causal = variant.causal;
            o.window_left = variant.window_left;
            o.softcap = variant.softcap;
            if (variant.alibi) o.alibi_slopes = slopes.view();
            o.num_threads = 1;
            const ForwardResult want =
                forward_kvcache(q, k_outer.view(), v_outer.view(), seqs, o, Backend::flash);
            for (int threads : {1, 2, 3}) {
              SCOPED_TRACE(std::string(name_of(dtype)) + " " + variant.name + " " + target +
                           " hkv=" + std::to_string(hkv) + " group=" + std::to_string(group) +
                           " threads=" + std::to_string(threads));
              o.num_threads = threads;
              const ForwardResult got =
                  forward_kvcache(q, k.view().transposed(1, 2), v.view().transposed(1, 2), seqs,
                                  o, Backend::flash);
              ASSERT_TRUE(
                  same_finite_bits(read_view(got.out.view()), read_view(want.out.view()), "out"));
              ASSERT_TRUE(
                  same_finite_bits(read_view(got.lse.view()), read_view(want.lse.view()), "lse"));
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
