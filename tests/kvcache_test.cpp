// Attention over a KV cache (attncore/kvcache.h): each sequence equals the dense call on its
// cache slots [leftpad, cache_seqlens) of its cache row, bitwise, on every backend and SIMD
// target, in both cache layouts; slots outside the range (NaN here) are never read; bad inputs.
#include "attncore/kvcache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Tensor int_tensor(const std::vector<int>& values) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int));
  return t;
}

// A cache [B_cache, capacity, Hkv, D] (flash layout) whose slots outside each used range hold
// NaN; `ranges[r]` = {start, end} of cache row r ({0, 0}: unused row).
Tensor make_cache(DType dtype, std::int64_t rows, std::int64_t capacity, std::int64_t heads,
                  std::int64_t dim, const std::vector<std::pair<int, int>>& ranges,
                  std::uint64_t seed) {
  Random rng(seed);
  std::vector<double> x(static_cast<std::size_t>(rows * capacity * heads * dim));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t s = 0; s < capacity; ++s)
      for (std::int64_t e = 0; e < heads * dim; ++e) {
        const bool used = s >= ranges[static_cast<std::size_t>(r)].first &&
                          s < ranges[static_cast<std::size_t>(r)].second;
        x[static_cast<std::size_t>((r * capacity + s) * heads * dim + e)] =
            used ? round_to(rng.uniform(-1, 1), dtype) : kNaN;
      }
  return make_tensor(dtype, {rows, capacity, heads, dim}, x);
}

// Slots [start, end) of cache row r as a dense [1, H, end - start, D] view.
TensorView slots(const Tensor& cache, std::int64_t r, std::int64_t start, std::int64_t end) {
  const TensorView v = cache.view().transposed(1, 2);  // [B_cache, H, capacity, D]
  TensorView s = v;
  s.data = static_cast<char*>(v.data) + (r * v.stride_of(0) + start * v.stride_of(2)) *
                                            static_cast<std::int64_t>(size_of(v.dtype));
  s.shape[0] = 1;
  s.shape[2] = end - start;
  return s;
}

TEST(KvCache, EachSequenceEqualsItsDenseCallBitwise) {
  const std::int64_t heads_q = 4, heads_kv = 2, dim = 40, capacity = 150;
  // Cache rows: 0 holds slots [3, 140), 1 nothing, 2 slots [0, 9); sequences use rows 2, 0, 0.
  const std::vector<std::pair<int, int>> ranges = {{3, 140}, {0, 0}, {0, 9}};
  const std::vector<int> seqlens = {9, 140, 140}, leftpad = {0, 3, 3}, batch_idx = {2, 0, 0};
  const Tensor seqlens_t = int_tensor(seqlens), leftpad_t = int_tensor(leftpad);
  const Tensor batch_t = int_tensor(batch_idx);
  KvCacheSeqs seqs;
  seqs.cache_seqlens = seqlens_t.view();
  seqs.cache_leftpad = leftpad_t.view();
  seqs.cache_batch_idx = batch_t.view();
  struct Variant {
    const char* name;
    Causal causal;
    std::int64_t window_left;
    double softcap;
    bool alibi;
  };
  const Variant variants[] = {{"plain", Causal::none, -1, 0.0, false},
                              {"causal", Causal::lower_right, -1, 0.0, false},
                              {"window", Causal::lower_right, 20, 0.0, false},
                              {"softcap_alibi", Causal::none, -1, 5.0, true}};
  const std::vector<std::string> targets = simd_targets_supported();
  for (const std::string& target : targets) {
    const ScopedTarget scope(target);
    for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
      for (DType dtype : {DType::f32, DType::bf16}) {
        if (backend != Backend::flash && target != targets.front()) continue;
        for (std::int64_t lq : {1, 3, 70}) {
          const Tensor k = make_cache(dtype, 3, capacity, heads_kv, dim, ranges, 1);
          const Tensor v = make_cache(dtype, 3, capacity, heads_kv, dim, ranges, 2);
          const Tensor q = make_tensor(dtype, {3, heads_q, lq, dim},
                                       rounded(random_vector(3 * heads_q * lq * dim, 3), dtype));
          const Tensor slopes =
              make_tensor(DType::f32, {3, heads_q}, random_vector(3 * heads_q, 4, 0.01, 0.2));
          for (const Variant& variant : variants) {
            SCOPED_TRACE(target + " " + std::string(name_of(backend)) + " " +
                         std::string(name_of(dtype)) + " Lq=" + std::to_string(lq) + " " +
                         variant.name);
            Options o;
            o.causal = variant.causal;
            o.window_left = variant.window_left;
            o.softcap = variant.softcap;
            if (variant.alibi) o.alibi_slopes = slopes.view();
            const ForwardResult r = forward_kvcache(q, k.view().transposed(1, 2),
                                                    v.view().transposed(1, 2), seqs, o, backend);
            for (std::int64_t b = 0; b < 3; ++b) {
              Options ob = o;
              if (variant.alibi) {
                TensorView row = slopes.view();
                row.data = static_cast<float*>(row.data) + b * heads_q;
                row.rank = 1;
                row.shape[0] = heads_q;
                row.stride[0] = 1;
                ob.alibi_slopes = row;
              }
              const std::int64_t start = leftpad[static_cast<std::size_t>(b)];
              const std::int64_t end = seqlens[static_cast<std::size_t>(b)];
              const std::int64_t row = batch_idx[static_cast<std::size_t>(b)];
              const ForwardResult one =
                  forward(index_of_dim(q.view(), 0, b), slots(k, row, start, end),
                          slots(v, row, start, end), ob, backend);
              ASSERT_TRUE(same_bits(read_view(index_of_dim(r.out.view(), 0, b)),
                                    read_view(one.out.view()), "out " + std::to_string(b)));
              ASSERT_TRUE(same_bits(read_view(index_of_dim(r.lse.view(), 0, b)),
                                    read_view(one.lse.view()), "lse " + std::to_string(b)));
            }
          }
        }
      }
    }
  }
}

TEST(KvCache, BadInputs) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor cache(DType::f32, {3, 2, 10, 8});
  auto message = [&](const KvCacheSeqs& s, Options o = {}) -> std::string {
    try {
      forward_kvcache(q, cache, cache, s, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const Tensor seqlens = int_tensor({4, 5}), idx = int_tensor({2, 0});
  KvCacheSeqs s;
  s.cache_seqlens = seqlens.view();
  EXPECT_NE(message(s).find("forward: k_cache has shape [3, 2, 10, 8], expected a batch of 2"),
            std::string::npos);
  s.cache_batch_idx = idx.view();
  EXPECT_EQ(message(s), "");
  const Tensor past = int_tensor({4, 11});
  s.cache_seqlens = past.view();
  EXPECT_EQ(message(s),
            "forward: cache_seqlens is out of range (cache_seqlens[1]=11, expected "
            "0 <= cache_seqlens[b] <= capacity=10)");
  s.cache_seqlens = seqlens.view();
  const Tensor bad_idx = int_tensor({3, 0});
  s.cache_batch_idx = bad_idx.view();
  EXPECT_EQ(message(s),
            "forward: cache_batch_idx is out of range (cache_batch_idx[0]=3, "
            "expected 0 <= idx < B_cache=3)");
  s.cache_batch_idx = idx.view();
  const Tensor pad = int_tensor({0, 6});
  s.cache_leftpad = pad.view();
  EXPECT_EQ(message(s),
            "forward: cache_leftpad is out of range (cache_leftpad[1]=6, expected "
            "0 <= cache_leftpad[b] <= cache_seqlens[b]=5)");
  s.cache_leftpad.reset();
  const Tensor f32_lens = make_tensor(DType::f32, {2}, {4, 5});
  s.cache_seqlens = f32_lens.view();
  EXPECT_EQ(message(s), "forward: cache_seqlens has the wrong dtype (dtype=f32, expected i32)");
  s.cache_seqlens = seqlens.view();
  Options dropout;
  dropout.dropout_p = 0.1;
  EXPECT_NE(message(s, dropout).find("forward: dropout is not supported with a KV cache"),
            std::string::npos);
  Tensor mask(DType::b8, {1, 10});
  Options masked;
  masked.mask = mask.view();
  EXPECT_NE(message(s, masked).find("forward: mask is not supported with a KV cache"),
            std::string::npos);
}

// Rotary by the plain formula: dims (a, b) of x rotated by angle pos * freq[i] (the tables hold
// cos and sin of it).
std::vector<double> rotate_plain(std::vector<double> x, std::int64_t pos, std::int64_t half,
                                 bool interleaved, const std::vector<double>& freq) {
  for (std::int64_t i = 0; i < half; ++i) {
    const double angle =
        static_cast<double>(static_cast<float>(pos * freq[static_cast<std::size_t>(i)]));
    const double c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
    const std::size_t a = static_cast<std::size_t>(interleaved ? 2 * i : i);
    const std::size_t b = static_cast<std::size_t>(interleaved ? 2 * i + 1 : i + half);
    const double x1 = x[a], x2 = x[b];
    x[a] = x1 * c - x2 * s;
    x[b] = x2 * c + x1 * s;
  }
  return x;
}

TEST(KvCache, AppendWritesRotatedKeysThenAttends) {
  const std::int64_t hq = 4, hkv = 2, d = 16, cap = 24, lq = 2, l_new = 3, half = 5;
  const std::vector<int> seqlens = {5, 9}, leftpad = {0, 2};
  const Tensor lens_t = int_tensor(seqlens), pad_t = int_tensor(leftpad);
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens_t.view();
  seqs.cache_leftpad = pad_t.view();
  std::vector<double> freq(half), cos_t(static_cast<std::size_t>(cap * half)), sin_t(cos_t);
  for (std::int64_t i = 0; i < half; ++i) freq[i] = std::pow(100.0, -static_cast<double>(i) / half);
  for (std::int64_t p = 0; p < cap; ++p)
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<float>(p * freq[i]);
      cos_t[p * half + i] = std::cos(angle);
      sin_t[p * half + i] = std::sin(angle);
    }
  const Tensor cos = make_tensor(DType::f32, {cap, half}, cos_t);
  const Tensor sin = make_tensor(DType::f32, {cap, half}, sin_t);
  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "half-split");
    const Tensor k = make_cache(DType::f32, 2, cap, hkv, d, {{0, 5}, {2, 9}}, 11);
    const Tensor v = make_cache(DType::f32, 2, cap, hkv, d, {{0, 5}, {2, 9}}, 12);
    const std::vector<double> q_values = random_vector(2 * hq * lq * d, 13);
    const Tensor q = make_tensor(DType::f32, {2, hq, lq, d}, q_values);
    const std::vector<double> kn = random_vector(2 * hkv * l_new * d, 14);
    const std::vector<double> vn = random_vector(2 * hkv * l_new * d, 15);
    const Tensor k_new = make_tensor(DType::f32, {2, hkv, l_new, d}, kn);
    const Tensor v_new = make_tensor(DType::f32, {2, hkv, l_new, d}, vn);
    KvAppend append{k_new, v_new, cos.view(), sin.view(), interleaved};
    Options o;
    o.causal = Causal::lower_right;
    const ForwardResult r = forward_kvcache(q, k.view().transposed(1, 2), v.view().transposed(1, 2),
                                            seqs, append, o, Backend::flash);
    // The cache holds the rotated keys and the values at slots [seqlens, seqlens + 3).
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t base = seqlens[b] - leftpad[b];
      for (std::int64_t h = 0; h < hkv; ++h)
        for (std::int64_t j = 0; j < l_new; ++j) {
          const std::size_t at = static_cast<std::size_t>(((b * hkv + h) * l_new + j) * d);
          const std::vector<double> want =
              rotate_plain(std::vector<double>(kn.begin() + at, kn.begin() + at + d), base + j,
                           half, interleaved, freq);
          const std::vector<double> got = read_view(slots(k, b, seqlens[b] + j, seqlens[b] + j + 1)
                                                        .transposed(0, 1));  // [H, 1, D] -> rows
          for (std::int64_t e = 0; e < d; ++e)
            EXPECT_NEAR(got[static_cast<std::size_t>(h * d + e)], want[static_cast<std::size_t>(e)],
                        1e-6);
          const std::vector<double> got_v =
              read_view(slots(v, b, seqlens[b] + j, seqlens[b] + j + 1));
          for (std::int64_t e = 0; e < d; ++e)
            EXPECT_EQ(got_v[static_cast<std::size_t>(h * d + e)],
                      static_cast<float>(vn[at + static_cast<std::size_t>(e)]));
        }
    }
    // The attention: the rotated query (row i at base + i: causal) over the lengths after the
    // append, with the cache as the append left it.
    std::vector<double> q_rot(q_values.size());
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < hq; ++h)
        for (std::int64_t i = 0; i < lq; ++i) {
          const std::size_t at = static_cast<std::size_t>(((b * hq + h) * lq + i) * d);
          const std::vector<double> x =
              rotate_plain(std::vector<double>(q_values.begin() + at, q_values.begin() + at + d),
                           seqlens[b] - leftpad[b] + i, half, interleaved, freq);
          std::copy(x.begin(), x.end(), q_rot.begin() + at);
        }
    const Tensor q2 = make_tensor(DType::f32, {2, hq, lq, d}, q_rot);
    const Tensor after = int_tensor({8, 12});
    KvCacheSeqs seqs_after = seqs;
    seqs_after.cache_seqlens = after.view();
    const ForwardResult want =
        forward_kvcache(q2, k.view().transposed(1, 2), v.view().transposed(1, 2), seqs_after, o,
                        Backend::reference);
    EXPECT_TRUE(all_close(read_view(r.out.view()), read_view(want.out.view()), 1e-5, "out"));
  }
}

// A row repeated anywhere in cache_batch_idx is refused when appending (rows sorted, so a batch
// of any size is checked at once), by the call and by its check-only entry alike, which
// writes nothing.
TEST(KvCache, AppendRefusesRepeatedRowsAndItsCheckEntryWritesNothing) {
  const Tensor q(DType::f32, {5, 1, 1, 8});
  const Tensor cache = make_tensor(DType::f32, {6, 1, 4, 8}, std::vector<double>(6 * 32, 0.0));
  const Tensor v_cache = make_tensor(DType::f32, {6, 1, 4, 8}, std::vector<double>(6 * 32, 0.0));
  const Tensor k_new = make_tensor(DType::f32, {5, 1, 1, 8}, std::vector<double>(40, 1.0));
  const Tensor lens = int_tensor({0, 1, 2, 0, 1}), idx = int_tensor({3, 0, 5, 1, 3});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  s.cache_batch_idx = idx.view();
  const KvAppend a{k_new, k_new, std::nullopt, std::nullopt, false};
  const std::string want =
      "forward: cache_batch_idx repeats a row when appending (cache_batch_idx[0]="
      "cache_batch_idx[4]=3, expected distinct rows)";
  for (bool check_only : {false, true}) {
    try {
      if (check_only) {
        (void)explain_forward_kvcache(q, cache, v_cache, s, a);
      } else {
        (void)forward_kvcache(q, cache, v_cache, s, a);
      }
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
  }
  const Tensor distinct = int_tensor({3, 0, 5, 1, 2});
  s.cache_batch_idx = distinct.view();
  (void)explain_forward_kvcache(q, cache, v_cache, s, a);
  for (double x : read_view(cache.view())) ASSERT_EQ(x, 0.0);  // checked, nothing written
  (void)forward_kvcache(q, cache, v_cache, s, a);
  EXPECT_EQ(read_view(cache.view())[(3 * 4 + 0) * 8], 1.0);  // sequence 0: row 3, slot 0
}

TEST(KvCache, AppendBadInputs) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor cache(DType::f32, {2, 2, 10, 8}), v_cache(DType::f32, {2, 2, 10, 8});
  const Tensor k_new(DType::f32, {2, 2, 3, 8});
  const Tensor lens = int_tensor({4, 8});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  auto message = [&](const KvCacheSeqs& seqs, const KvAppend& a) -> std::string {
    try {
      forward_kvcache(q, cache, v_cache, seqs, a);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  KvAppend a{k_new, k_new, std::nullopt, std::nullopt, false};
  EXPECT_EQ(message(s, a),
            "forward: k_new does not fit in the cache (cache_seqlens[1]=8 + "
            "L_new=3, expected <= capacity=10)");
  const Tensor short_lens = int_tensor({4, 5}), idx = int_tensor({1, 1});
  s.cache_seqlens = short_lens.view();
  s.cache_batch_idx = idx.view();
  EXPECT_EQ(message(s, a),
            "forward: cache_batch_idx repeats a row when appending "
            "(cache_batch_idx[0]=cache_batch_idx[1]=1, expected distinct rows)");
  s.cache_batch_idx.reset();
  const Tensor cos(DType::f32, {10, 5});
  a.rotary_cos = cos.view();
  EXPECT_NE(message(s, a).find("rotary_cos and rotary_sin go together"), std::string::npos);
  a.rotary_sin = cos.view();
  EXPECT_EQ(message(s, a),
            "forward: rotary_cos has the wrong width (rotary_dim / 2=5, expected "
            "1 <= rotary_dim / 2 <= D / 2=4: tables [positions, rotary_dim / 2] "
            "with an even rotary_dim <= D)");
  const Tensor few(DType::f32, {6, 4});
  a.rotary_cos = a.rotary_sin = few.view();
  EXPECT_EQ(message(s, a),
            "forward: rotary_cos has too few positions (positions=6, expected > 7, "
            "the largest position rotated)");
  // Nothing was written: the cache is still zero.
  for (double x : read_view(cache.view())) ASSERT_EQ(x, 0.0);
}

// Every check comes before the append writes the cache (found by the fuzzer: a call with its
// cancel flag set threw Cancelled after writing the new rows): the cancel flag, the memory the
// attending call needs, and new rows that share bytes with the cache.
TEST(KvCache, AppendChecksEverythingBeforeWriting) {
  const Tensor q(DType::f32, {2, 2, 1, 8});
  const Tensor k_cache(DType::f32, {2, 2, 10, 8}), v_cache(DType::f32, {2, 2, 10, 8});
  const Tensor k_new = make_tensor(DType::f32, {2, 2, 3, 8}, std::vector<double>(96, 0.5));
  const Tensor lens = int_tensor({4, 5});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  const KvAppend a{k_new, k_new, std::nullopt, std::nullopt, false};
  const std::atomic<bool> cancel{true};
  Options cancelled;
  cancelled.cancel = &cancel;
  EXPECT_THROW(forward_kvcache(q, k_cache, v_cache, s, a, cancelled), Cancelled);
  // q broadcast (stride 0) to [2, 2^22, 2^20, 8]: an output of 2^48 bytes.
  const TensorView huge_q = TensorView::strided(
      q.data(), DType::f32, {2, std::int64_t{1} << 22, std::int64_t{1} << 20, 8}, {0, 0, 0, 1});
  EXPECT_THROW(forward_kvcache(huge_q, k_cache, v_cache, s, a), OutOfMemory);
  auto message = [&](const TensorView& kc, const TensorView& vc, const KvAppend& app) {
    try {
      forward_kvcache(q, kc, vc, s, app);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const TensorView new_in_cache = TensorView::contiguous(k_cache.data(), DType::f32, {2, 2, 3, 8});
  const KvAppend from_cache{new_in_cache, k_new, std::nullopt, std::nullopt, false};
  EXPECT_EQ(message(k_cache, v_cache, from_cache).rfind("forward: k_cache overlaps k_new (", 0),
            0u);
  for (const Tensor* c : {&k_cache, &v_cache})
    for (double x : read_view(c->view())) ASSERT_EQ(x, 0.0);
}

// An index array inside a cache it appends to would change under the append, which then writes
// where it no longer checked (an out-of-bounds write): refused before anything is written, in
// either cache, dense or paged.
TEST(KvCache, AppendRefusesIndexArraysInsideTheCache) {
  const Tensor q(DType::f32, {2, 1, 1, 4});
  const Tensor k_new = make_tensor(DType::f32, {2, 1, 1, 4}, std::vector<double>(8, 1e30));
  const KvAppend a{k_new, k_new, std::nullopt, std::nullopt, false};
  const Tensor lens = int_tensor({0, 0}), rows = int_tensor({0, 1});
  Tensor table(DType::i32, {2, 2});  // [B, pages per sequence]
  for (int i = 0; i < 4; ++i) static_cast<std::int32_t*>(table.data())[i] = i;
  for (const bool paged : {false, true}) {
    // dense [B=2, L=8, Hkv=1, D=4] (as [B, Hkv, L, D] views), or 4 pages of 2 slots
    const Tensor k_cache(DType::f32, {paged ? 4 : 2, paged ? 2 : 8, 1, 4});
    const Tensor v_cache(DType::f32, {paged ? 4 : 2, paged ? 2 : 8, 1, 4});
    const TensorView kc = k_cache.view().transposed(1, 2), vc = v_cache.view().transposed(1, 2);
    for (const Tensor* host : {&k_cache, &v_cache}) {
      auto* words = static_cast<std::int32_t*>(host->data());
      for (const std::string which : {"cache_seqlens", "cache_batch_idx", "cache_leftpad",
                                      "block_table"}) {
        if (paged != (which == "block_table") && which != "cache_seqlens") continue;
        for (const Tensor* c : {&k_cache, &v_cache}) {
          std::fill_n(static_cast<float*>(c->data()), 32, 0.0f);
        }
        KvCacheSeqs s;
        s.cache_seqlens = lens.view();
        if (paged) s.block_table = table.view();
        // the array's values, copied into the cache's first words and read from there
        const Tensor& source =
            which == "block_table" ? table : which == "cache_batch_idx" ? rows : lens;
        const int count = which == "block_table" ? 4 : 2;
        std::copy_n(static_cast<const std::int32_t*>(source.data()), count, words);
        const TensorView inside =
            which == "block_table" ? TensorView::contiguous(words, DType::i32, {2, 2})
                                   : TensorView::contiguous(words, DType::i32, {2});
        if (which == "cache_seqlens") s.cache_seqlens = inside;
        if (which == "cache_batch_idx") s.cache_batch_idx = inside;
        if (which == "cache_leftpad") s.cache_leftpad = inside;
        if (which == "block_table") s.block_table = inside;
        std::string message;
        try {
          forward_kvcache(q, kc, vc, s, a);
        } catch (const InvalidArgument& e) {
          message = e.what();
        }
        const std::string cache = host == &k_cache ? "k_cache" : "v_cache";
        EXPECT_EQ(message.rfind("forward: " + cache + " overlaps " + which + " (", 0), 0u)
            << which << (paged ? " paged: " : " dense: ") << message;
        // nothing written: the array's words are intact, the rest zero
        for (int i = 0; i < count; ++i) {
          ASSERT_EQ(words[i], static_cast<const std::int32_t*>(source.data())[i]) << which;
        }
        std::fill_n(words, count, 0);
        for (const Tensor* c : {&k_cache, &v_cache})
          for (double x : read_view(c->view())) ASSERT_EQ(x, 0.0) << which;
      }
    }
  }
}

TEST(KvCache, AppendKeepsF64Exact) {
  // An f64 cache takes the new rows without rounding through f32.
  const Tensor q(DType::f64, {1, 1, 1, 4});
  const Tensor k(DType::f64, {1, 1, 6, 4}), v(DType::f64, {1, 1, 6, 4});
  const std::vector<double> values = {0.1, 1.0 / 3, 2.0 / 7, 1e-300, 5.0 / 9, 0.7, 0.9, 1.1};
  const Tensor k_new = make_tensor(DType::f64, {1, 1, 2, 4}, values);
  const Tensor lens = int_tensor({3});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  forward_kvcache(q, k, v, seqs, KvAppend{k_new, k_new, std::nullopt, std::nullopt, false}, {},
                  Backend::reference);
  const std::vector<double> cache = read_view(k.view());
  for (std::size_t e = 0; e < values.size(); ++e) EXPECT_EQ(cache[3 * 4 + e], values[e]);
}

// An append to a batch of nothing writes nothing and allocates nothing, whatever D: it used to
// take a buffer of one row (2^40 floats here) before looking at the batch.
TEST(KvCache, AppendToNoSequencesAllocatesNothing) {
  const std::int64_t d = std::int64_t{1} << 40;
  float cell = 0;
  const TensorView q = TensorView::contiguous(&cell, DType::f32, {0, 1, 1, d});
  const TensorView cache = TensorView::contiguous(&cell, DType::f32, {0, 1, 16, d});
  const TensorView k_new = TensorView::contiguous(&cell, DType::f32, {0, 1, 1, d});
  Tensor lens(DType::i32, {0});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  for (Backend backend : {Backend::flash, Backend::reference}) {  // (math: D past 32 bits)
    const ForwardResult r =
        forward_kvcache(q, cache, cache, seqs,
                        KvAppend{k_new, k_new, std::nullopt, std::nullopt, false}, {}, backend);
    EXPECT_EQ(r.out.view().numel(), 0) << name_of(backend);
  }
}

// With rotary, a named backend that cannot run the call refuses it before the rotated query's
// copy is made: here that copy (a broadcast query of 2^28 rows, 128 GiB) would be refused
// for its size first.
TEST(KvCache, AppendRefusesTheBackendBeforeCopyingTheQuery) {
  double cell = 0;
  const std::int64_t rows = std::int64_t{1} << 28;
  const TensorView q = TensorView::strided(&cell, DType::f64, {1, 1, rows, 64}, {0, 0, 0, 1});
  const Tensor cache(DType::f64, {1, 1, 4, 64}), v_cache(DType::f64, {1, 1, 4, 64});
  const Tensor k_new(DType::f64, {1, 1, 1, 64});
  const Tensor lens = int_tensor({2});
  const Tensor cos(DType::f32, {4, 32}), sin(DType::f32, {4, 32});
  KvCacheSeqs s;
  s.cache_seqlens = lens.view();
  const KvAppend a{k_new, k_new, cos.view(), sin.view(), false};
  const std::string message =
      error_message([&] { forward_kvcache(q, cache, v_cache, s, a, {}, Backend::flash); });
  EXPECT_EQ(message.rfind("forward: backend flash cannot run this call", 0), 0u) << message;
  EXPECT_NE(error_message([&] {
              forward_kvcache(q, cache, v_cache, s, a, {}, Backend::math);
            }).find("the query rotated for the append, a copy,"),
            std::string::npos);
  // The into form checks its outputs first: an out the call cannot write is InvalidArgument
  // on every backend, flash too (which refused such a call as Unsupported for f64: the fuzzer).
  const TensorView q1 = TensorView::strided(&cell, DType::f64, {1, 1, 1, 64}, {0, 0, 0, 1});
  const Tensor wide(DType::f64, {1, 1, 1, 128});
  const TensorView out =
      TensorView::strided(wide.data(), DType::f64, {1, 1, 1, 64}, {128, 128, 128, 2});
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    EXPECT_EQ(invalid_argument_message([&] {
                forward_kvcache_into(q1, cache, v_cache, s, a, out, std::nullopt, {}, backend);
              }).rfind("forward: out has a non-unit last stride", 0),
              0u)
        << name_of(backend);
  }
}

// The append's into form: the allocating form's cache, out and lse, bitwise (with rotary, over
// a dense cache); outputs that share bytes with an array only the append reads, and every
// other refusal, before anything is written.
TEST(KvCache, AppendIntoEqualsTheAllocatingForm) {
  const std::int64_t hq = 4, hkv = 2, d = 8, cap = 12, l_new = 2, half = 3;
  const Tensor lens = int_tensor({3, 7});
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  const Tensor cos = make_tensor(DType::f32, {cap, half}, random_vector(cap * half, 1));
  const Tensor sin = make_tensor(DType::f32, {cap, half}, random_vector(cap * half, 2));
  const Tensor q = make_tensor(DType::f32, {2, hq, 1, d}, random_vector(2 * hq * d, 3));
  const Tensor k_new = make_tensor(DType::f32, {2, hkv, l_new, d}, random_vector(64, 4));
  const Tensor v_new = make_tensor(DType::f32, {2, hkv, l_new, d}, random_vector(64, 5));
  for (const bool rotary : {false, true}) {
    SCOPED_TRACE(rotary ? "rotary" : "no rotary");
    KvAppend append{k_new, v_new, std::nullopt, std::nullopt, false};
    if (rotary) {
      append.rotary_cos = cos.view();
      append.rotary_sin = sin.view();
    }
    // Two equal caches [B, cap, Hkv, D]: one for each form.
    const Tensor k1 = make_cache(DType::f32, 2, cap, hkv, d, {{0, 3}, {0, 7}}, 6);
    const Tensor v1 = make_cache(DType::f32, 2, cap, hkv, d, {{0, 3}, {0, 7}}, 7);
    const Tensor k2 = make_cache(DType::f32, 2, cap, hkv, d, {{0, 3}, {0, 7}}, 6);
    const Tensor v2 = make_cache(DType::f32, 2, cap, hkv, d, {{0, 3}, {0, 7}}, 7);
    const ForwardResult want =
        forward_kvcache(q, k1.view().transposed(1, 2), v1.view().transposed(1, 2), seqs, append);
    const Tensor out(DType::f32, {2, hq, 1, d}), lse(DType::f32, {2, hq, 1});
    auto into = [&](const TensorView& o, const std::optional<TensorView>& l,
                    const Options& options = {}) {
      forward_kvcache_into(q, k2.view().transposed(1, 2), v2.view().transposed(1, 2), seqs, append,
                           o, l, options);
    };
    auto refusal = [&](const TensorView& o, const Options& options = {}) -> std::string {
      try {
        into(o, std::nullopt, options);
      } catch (const Error& e) {
        return e.what();
      }
      return "";
    };
    // Refused, the cache unwritten: out inside k_new, out of the wrong shape, cancelled.
    const TensorView in_k_new = TensorView::contiguous(k_new.data(), DType::f32, {2, hq, 1, d});
    EXPECT_EQ(refusal(in_k_new).rfind("forward: out overlaps k_new (", 0), 0u) << refusal(in_k_new);
    // (Rotary: the call attends to a rotated copy of q, and the append reads q itself.)
    const TensorView in_q = TensorView::contiguous(q.data(), DType::f32, {2, hq, 1, d});
    EXPECT_EQ(refusal(in_q).rfind("forward: out overlaps query (", 0), 0u) << refusal(in_q);
    EXPECT_EQ(refusal(lse.view()).rfind("forward: out has the wrong rank (", 0), 0u)
        << refusal(lse.view());
    const std::atomic<bool> cancel{true};
    Options cancelled;
    cancelled.cancel = &cancel;
    EXPECT_THROW(into(out, lse.view(), cancelled), Cancelled);
    for (const Tensor* cache : {&k2, &v2}) {
      const std::vector<double> before = read_view(cache->view());
      for (std::size_t i = 0; i < before.size(); ++i) {
        const std::int64_t slot = static_cast<std::int64_t>(i) / (hkv * d) % cap;
        const std::int64_t start = static_cast<std::int64_t>(i) / (cap * hkv * d) == 0 ? 3 : 7;
        if (slot >= start && slot < start + l_new) {
          ASSERT_TRUE(std::isnan(before[i])) << i;  // the slots the append writes: untouched
        }
      }
    }
    into(out, lse.view());
    EXPECT_TRUE(same_bits(read_view(k2.view()), read_view(k1.view()), "k_cache"));
    EXPECT_TRUE(same_bits(read_view(v2.view()), read_view(v1.view()), "v_cache"));
    EXPECT_TRUE(same_bits(read_view(out.view()), read_view(want.out.view()), "out"));
    EXPECT_TRUE(same_bits(read_view(lse.view()), read_view(want.lse.view()), "lse"));
  }
}

}  // namespace
}  // namespace attncore::test
