// Split-KV decode (Options::num_splits, src/cpu/flash_split_kv.h): flash's one-item decode groups
// cut into key parts and merged. Every split count, forced or planned, on every SIMD target,
// over dense and paged caches and dense decode calls, against the fp64 oracle by docs/design.md
// section 6's rule, with the same bits on 1, 2 and 3 threads and through an executor; the
// planner's rule; cancellation between parts; bad num_splits.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "core/params.h"
#include "cpu/flash.h"
#include "cpu/flash_split_kv.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The split counts every case runs: planned, none, forced, and more than any case's tiles.
constexpr int kSplits[] = {0, 1, 2, 3, 7, kMaxSplits};

Tensor i32(const std::vector<std::int64_t>& shape, const std::vector<int>& values) {
  return make_tensor(DType::i32, shape, std::vector<double>(values.begin(), values.end()));
}

// Runs each task on a thread of its own (the executor path of Options::executor).
class ThreadExecutor : public Executor {
 public:
  void parallel_for(int num_tasks, int /*concurrency*/, const Task& task) const override {
    std::vector<std::thread> threads;
    for (int t = 0; t < num_tasks; ++t) threads.emplace_back([&task, t] { task(t, t); });
    for (std::thread& th : threads) th.join();
  }
};

// A KV-cache case: sequence b holds keys [leftpad[b], seqlens[b]) of its cache row.
struct CacheCase {
  const char* name;
  DType dtype = DType::f32;
  std::int64_t hq = 4, hkv = 2, lq = 1, dim = 64, dim_v = 64;
  std::vector<int> seqlens;
  std::vector<int> leftpad = {};  // empty: none
  Causal causal = Causal::none;
  std::int64_t window_left = -1;
  double softcap = 0.0;
  bool alibi = false;
  DType kv_dtype = DType::f32;  // the cache's dtype when the query is f32 (bf16/f16: mixed)
};

DType kv_dtype_of(const CacheCase& c) { return c.dtype == DType::f32 ? c.kv_dtype : c.dtype; }

// Its data in the flash layout, and the oracle's result per sequence (rows [B, Hq, Lq]).
struct CacheData {
  std::int64_t batch = 0, capacity = 0;
  std::vector<double> q;       // [B, Lq, Hq, D]
  std::vector<double> k, v;    // [B, capacity, Hkv, D|Dv]; NaN outside the used slots
  std::vector<double> slopes;  // [Hq]
  std::vector<double> out, lse, naive_out, vmax;  // oracle: [B, Hq, Lq, Dv], [B, Hq, Lq]
  std::vector<double> tolerance;                  // per sequence
};

Spec spec_of(const CacheCase& c, const CacheData& d) {
  Spec s;
  s.scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  s.causal = c.causal == Causal::lower_right ? CausalMode::lower_right : CausalMode::none;
  s.window_left = c.window_left;
  s.softcap = c.softcap;
  if (c.alibi) s.alibi = d.slopes;
  return s;
}

CacheData make_data(const CacheCase& c, std::uint64_t seed) {
  CacheData d;
  d.batch = static_cast<std::int64_t>(c.seqlens.size());
  d.capacity = *std::max_element(c.seqlens.begin(), c.seqlens.end()) + 5;
  Random rng(seed);
  const auto draw = [&](std::vector<double>& x, std::int64_t n, DType dtype) {
    x.resize(static_cast<std::size_t>(n));
    for (double& e : x) e = round_to(rng.uniform(-1, 1), dtype);
  };
  draw(d.q, d.batch * c.lq * c.hq * c.dim, c.dtype);
  draw(d.k, d.batch * d.capacity * c.hkv * c.dim, kv_dtype_of(c));
  draw(d.v, d.batch * d.capacity * c.hkv * c.dim_v, kv_dtype_of(c));
  for (std::int64_t h = 0; h < c.hq; ++h) d.slopes.push_back(std::exp2(-8.0 * (h + 1) / c.hq));
  d.out.assign(static_cast<std::size_t>(d.batch * c.hq * c.lq * c.dim_v), 0.0);
  d.naive_out = d.out;
  d.lse.assign(static_cast<std::size_t>(d.batch * c.hq * c.lq), 0.0);
  const Spec spec = spec_of(c, d);
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const std::int64_t first = c.leftpad.empty() ? 0 : c.leftpad[static_cast<std::size_t>(b)];
    const std::int64_t end = c.seqlens[static_cast<std::size_t>(b)], lk = end - first;
    const Dims dims{1, c.hq, c.hkv, c.lq, lk, c.dim, c.dim_v};
    std::vector<double> q, k, v;
    for (std::int64_t h = 0; h < c.hq; ++h)
      for (std::int64_t i = 0; i < c.lq; ++i)
        for (std::int64_t e = 0; e < c.dim; ++e)
          q.push_back(d.q[static_cast<std::size_t>(((b * c.lq + i) * c.hq + h) * c.dim + e)]);
    for (std::int64_t h = 0; h < c.hkv; ++h)
      for (std::int64_t j = first; j < end; ++j) {
        for (std::int64_t e = 0; e < c.dim; ++e)
          k.push_back(
              d.k[static_cast<std::size_t>(((b * d.capacity + j) * c.hkv + h) * c.dim + e)]);
        for (std::int64_t e = 0; e < c.dim_v; ++e)
          v.push_back(
              d.v[static_cast<std::size_t>(((b * d.capacity + j) * c.hkv + h) * c.dim_v + e)]);
      }
    const OracleForward exact = oracle_forward(dims, spec, q, k, v);
    const OracleForward naive = oracle_forward(dims, spec, q, k, v, rounder_for(c.dtype));
    d.tolerance.push_back(out_tolerance(c.dtype, v, exact.out, naive.out, 0.0));
    const std::size_t out_at = static_cast<std::size_t>(b * c.hq * c.lq * c.dim_v);
    std::copy(exact.out.begin(), exact.out.end(),
              d.out.begin() + static_cast<std::ptrdiff_t>(out_at));
    std::copy(exact.lse.begin(), exact.lse.end(),
              d.lse.begin() + static_cast<std::ptrdiff_t>(b * c.hq * c.lq));
  }
  // Slots outside each sequence's keys hold NaN: they must never be read.
  for (std::int64_t b = 0; b < d.batch; ++b) {
    const std::int64_t first = c.leftpad.empty() ? 0 : c.leftpad[static_cast<std::size_t>(b)];
    for (std::int64_t j = 0; j < d.capacity; ++j) {
      if (j >= first && j < c.seqlens[static_cast<std::size_t>(b)]) continue;
      for (std::int64_t e = 0; e < c.hkv * c.dim; ++e)
        d.k[static_cast<std::size_t>((b * d.capacity + j) * c.hkv * c.dim + e)] = kNaN;
      for (std::int64_t e = 0; e < c.hkv * c.dim_v; ++e)
        d.v[static_cast<std::size_t>((b * d.capacity + j) * c.hkv * c.dim_v + e)] = kNaN;
    }
  }
  return d;
}

// The cache as attncore sees it: dense [B, capacity, Hkv, D], or pages of `page_size` slots
// [pages, page_size, Hkv, D] handed out in shuffled order (unused pages NaN).
struct CacheTensors {
  Tensor q, k, v, seqlens, leftpad, table;
  KvCacheSeqs seqs;
  bool heads_outer = false;  // k, v [B, Hkv, capacity, D] (else [B or pages, L, Hkv, D])
};

CacheTensors make_cache(const CacheCase& c, const CacheData& d, std::int64_t page_size) {
  CacheTensors t;
  t.q = make_tensor(c.dtype, {d.batch, c.lq, c.hq, c.dim}, d.q);
  t.seqlens = i32({d.batch}, c.seqlens);
  t.seqs.cache_seqlens = t.seqlens.view();
  if (!c.leftpad.empty()) {
    t.leftpad = i32({d.batch}, c.leftpad);
    t.seqs.cache_leftpad = t.leftpad.view();
  }
  if (page_size == 0) {
    t.k = make_tensor(kv_dtype_of(c), {d.batch, d.capacity, c.hkv, c.dim}, d.k);
    t.v = make_tensor(kv_dtype_of(c), {d.batch, d.capacity, c.hkv, c.dim_v}, d.v);
    return t;
  }
  const std::int64_t per_seq = (d.capacity + page_size - 1) / page_size;
  const std::int64_t pages = d.batch * per_seq + 1;
  std::vector<int> table(static_cast<std::size_t>(d.batch * per_seq));
  std::iota(table.begin(), table.end(), 1);
  Random rng(static_cast<std::uint64_t>(page_size) * 31 + 7);
  for (std::size_t n = table.size(); n > 1; --n) {
    std::swap(table[n - 1],
              table[static_cast<std::size_t>(rng.uniform() * static_cast<double>(n))]);
  }
  std::vector<double> k(static_cast<std::size_t>(pages * page_size * c.hkv * c.dim), kNaN);
  std::vector<double> v(static_cast<std::size_t>(pages * page_size * c.hkv * c.dim_v), kNaN);
  for (std::int64_t b = 0; b < d.batch; ++b)
    for (std::int64_t s = 0; s < d.capacity; ++s) {
      const std::int64_t page = table[static_cast<std::size_t>(b * per_seq + s / page_size)];
      const std::int64_t row = page * page_size + s % page_size;
      std::copy_n(d.k.begin() + (b * d.capacity + s) * c.hkv * c.dim, c.hkv * c.dim,
                  k.begin() + row * c.hkv * c.dim);
      std::copy_n(d.v.begin() + (b * d.capacity + s) * c.hkv * c.dim_v, c.hkv * c.dim_v,
                  v.begin() + row * c.hkv * c.dim_v);
    }
  t.k = make_tensor(kv_dtype_of(c), {pages, page_size, c.hkv, c.dim}, k);
  t.v = make_tensor(kv_dtype_of(c), {pages, page_size, c.hkv, c.dim_v}, v);
  t.table = i32({d.batch, per_seq}, table);
  t.seqs.block_table = t.table.view();
  return t;
}

// A dense cache's copy with the heads outside the keys ([B, Hkv, L, D]).
CacheTensors heads_outer(const CacheCase& c, const CacheData& d) {
  CacheTensors r = make_cache(c, d, 0);
  auto copy = [&](const Tensor& x) {
    const TensorView v = x.view().transposed(1, 2);
    return make_tensor(kv_dtype_of(c), {v.shape[0], v.shape[1], v.shape[2], v.shape[3]},
                       read_view(v));
  };
  r.k = copy(r.k);
  r.v = copy(r.v);
  r.heads_outer = true;
  return r;
}

struct Result {
  std::vector<double> out, lse;  // [B, Hq, Lq, Dv], [B, Hq, Lq]
};

Result run_cache(const CacheCase& c, const CacheData& d, const CacheTensors& t, int splits,
                 int threads, const Executor* executor = nullptr) {
  Tensor out(c.dtype, {d.batch, c.hq, c.lq, c.dim_v});
  Tensor lse(DType::f32, {d.batch, c.hq, c.lq});
  Options o;
  o.causal = c.causal;
  o.window_left = c.window_left;
  o.softcap = c.softcap;
  Tensor slopes = make_tensor(DType::f32, {c.hq}, d.slopes);
  if (c.alibi) o.alibi_slopes = slopes.view();
  o.num_splits = splits;
  o.num_threads = threads;
  o.executor = executor;
  const TensorView k = t.heads_outer ? t.k.view() : t.k.view().transposed(1, 2);
  const TensorView v = t.heads_outer ? t.v.view() : t.v.view().transposed(1, 2);
  forward_kvcache_into(t.q.view().transposed(1, 2), k, v, t.seqs, out.view(), lse.view(), o,
                       Backend::flash);
  return {read_view(out.view()), read_view(lse.view())};
}

// Checks a case on every SIMD target and every split count; returns whether some split count
// gave other bits than no split (it should, somewhere: the parts round differently).
bool check_cache_case(const CacheCase& c, std::int64_t page_size) {
  SCOPED_TRACE(std::string(c.name) + " page size " + std::to_string(page_size));
  const CacheData d = make_data(c, 11);
  const CacheTensors t = make_cache(c, d, page_size);
  const Dims all{d.batch, c.hq, c.hkv, c.lq, 1, c.dim, c.dim_v};
  bool changed = false;
  for (const std::string& target : simd_targets_supported()) {
    const ScopedTarget scope(target);
    const Result unsplit = run_cache(c, d, t, 1, 1);
    for (int splits : kSplits) {
      SCOPED_TRACE(target + " num_splits " + std::to_string(splits));
      const Result r = run_cache(c, d, t, splits, 1);
      for (std::int64_t b = 0; b < d.batch; ++b) {
        const std::int64_t n = c.hq * c.lq * c.dim_v, at = b * n, rows = c.hq * c.lq;
        const std::vector<double> got(r.out.begin() + at, r.out.begin() + at + n);
        const std::vector<double> want(d.out.begin() + at, d.out.begin() + at + n);
        EXPECT_TRUE(all_close(got, want, d.tolerance[static_cast<std::size_t>(b)],
                              "out of sequence " + std::to_string(b)));
        for (std::int64_t r0 = b * rows; r0 < (b + 1) * rows; ++r0) {
          const double want_lse = d.lse[static_cast<std::size_t>(r0)];
          const double got_lse = r.lse[static_cast<std::size_t>(r0)];
          if (want_lse == -INFINITY) {
            EXPECT_EQ(got_lse, -INFINITY) << "row " << r0;
          } else {
            EXPECT_NEAR(got_lse, want_lse, lse_tolerance(c.dtype, want_lse)) << "row " << r0;
          }
        }
      }
      EXPECT_TRUE(masked_rows_exact(all, r.out, r.lse, d.lse));
      // The same bits on any thread count, and through an executor.
      for (int threads : {2, 3}) {
        const Result more = run_cache(c, d, t, splits, threads);
        EXPECT_TRUE(same_bits(more.out, r.out, "out, threads " + std::to_string(threads)));
        EXPECT_TRUE(same_bits(more.lse, r.lse, "lse, threads " + std::to_string(threads)));
      }
      const ThreadExecutor executor;
      const Result through = run_cache(c, d, t, splits, 3, &executor);
      EXPECT_TRUE(same_bits(through.out, r.out, "out through an executor"));
      // Items of several kv heads ([B, L, Hkv, D]) give each head the bits of its own item.
      if (page_size == 0) {
        const CacheTensors outer = heads_outer(c, d);
        for (int threads : {1, 2}) {
          const Result h = run_cache(c, d, outer, splits, threads);
          EXPECT_TRUE(same_bits(h.out, r.out, "out, [B, Hkv, L, D]"));
          EXPECT_TRUE(same_bits(h.lse, r.lse, "lse, [B, Hkv, L, D]"));
        }
      }
      changed |= !static_cast<bool>(same_bits(r.out, unsplit.out, ""));
    }
  }
  return changed;
}

TEST(SplitKv, DenseCacheEveryVariantAndDtype) {
  const std::vector<CacheCase> cases = {
      // Sequences of 0 keys, shorter than a tile, and long; rows of two heads per kv head.
      {.name = "plain f32", .seqlens = {1500, 0, 77, 1030}},
      // GQA chunked prefill: 3 heads x 2 rows per kv head, causal.
      {.name = "gqa causal prefill bf16",
       .dtype = DType::bf16,
       .hq = 6,
       .lq = 2,
       .dim_v = 48,
       .seqlens = {900, 130},
       .causal = Causal::lower_right},
      // A window of 60 keys: the first parts of the long sequences see no key at all.
      {.name = "window leftpad f16",
       .dtype = DType::f16,
       .hq = 2,
       .hkv = 1,
       .dim = 80,
       .dim_v = 80,
       .seqlens = {1200, 700},
       .leftpad = {5, 100},
       .causal = Causal::lower_right,
       .window_left = 60},
      // 20 query heads on one kv head: one item of 20 rows, packing each tile it reads.
      {.name = "gqa 20 heads bf16",
       .dtype = DType::bf16,
       .hq = 20,
       .hkv = 1,
       .seqlens = {1300, 40}},
      // 16 query heads: two items of 8 rows, each reading K and V in place.
      {.name = "gqa 16 heads two items f16",
       .dtype = DType::f16,
       .hq = 16,
       .hkv = 1,
       .seqlens = {900, 40}},
      // 8 query heads per kv head in decode: one item of 8 rows reading K and V in place, more
      // than AVX2's 6-row micro-tile (its P . V in two halves of the rows), runs of the two kv
      // heads over [B, L, Hkv, D]; 12: two items of 6 rows.
      {.name = "gqa 8 heads one item bf16",
       .dtype = DType::bf16,
       .hq = 16,
       .hkv = 2,
       .dim = 128,
       .dim_v = 128,
       .seqlens = {1300, 90}},
      {.name = "gqa 12 heads two items window f16",
       .dtype = DType::f16,
       .hq = 12,
       .hkv = 1,
       .seqlens = {1100, 30},
       .causal = Causal::lower_right,
       .window_left = 500},
      {.name = "gqa 8 heads chunk f32",
       .hq = 8,
       .hkv = 1,
       .lq = 3,
       .seqlens = {700, 300},
       .causal = Causal::lower_right},
      // MHA with D a multiple of 8: over [B, Hkv, L, D] one row per kv head reads whole tiles
      // in streams, each tile's P . V run with the next tile's scores (AVX2), its bits checked
      // against [B, L, Hkv, D]'s; a window cuts the first tiles (P . V at once), then not.
      {.name = "mha d128 bf16",
       .dtype = DType::bf16,
       .hkv = 4,
       .dim = 128,
       .dim_v = 128,
       .seqlens = {1024, 300}},
      {.name = "mha window f16",
       .dtype = DType::f16,
       .hq = 2,
       .dim = 128,
       .dim_v = 64,
       .seqlens = {1200, 520},
       .causal = Causal::lower_right,
       .window_left = 700},
      {.name = "softcap alibi leftpad f32",
       .hkv = 4,
       .dim = 40,
       .dim_v = 24,
       .seqlens = {1000, 260},
       .leftpad = {3, 0},
       .softcap = 20.0,
       .alibi = true},
  };
  bool changed = false;
  for (const CacheCase& c : cases) changed |= check_cache_case(c, 0);
  EXPECT_TRUE(changed) << "no split count changed a bit: are the parts run at all?";
}

TEST(SplitKv, PagedCacheEveryPageSize) {
  const CacheCase c{.name = "paged causal leftpad",
                    .seqlens = {600, 129, 0},
                    .leftpad = {0, 3, 0},
                    .causal = Causal::lower_right};
  // One kv head and one query head: each page's rows lie together, and whole tiles that
  // start with two rows of one page are read as streams across the pages (AVX2).
  const CacheCase one_head{
      .name = "paged one head", .dtype = DType::f16, .hq = 1, .hkv = 1, .seqlens = {768, 200}};
  // 7 query heads on one kv head: one item of 7 rows (8 computed) on every target; 12: two
  // items of 6 rows.
  const CacheCase seven_heads{.name = "paged 7 heads", .hq = 7, .hkv = 1, .seqlens = {700, 150}};
  const CacheCase twelve_heads{
      .name = "paged 12 heads", .dtype = DType::bf16, .hq = 12, .hkv = 1, .seqlens = {500, 70}};
  for (std::int64_t page_size : {1, 3, 16, 256}) {
    check_cache_case(c, page_size);
    check_cache_case(one_head, page_size);
    check_cache_case(seven_heads, page_size);
    check_cache_case(twelve_heads, page_size);
  }
}

// An f32 query over bf16 and f16 caches (K/V widened in registers), dense and paged.
TEST(SplitKv, F32QueryOver16BitCaches) {
  for (DType kv : {DType::bf16, DType::f16}) {
    for (std::int64_t hq : {4, 2}) {  // rows of two query heads per kv head, and MHA
      CacheCase c{.name = "f32 query, 16-bit cache",
                  .hq = hq,
                  .seqlens = {1400, 90},
                  .leftpad = {2, 0},
                  .causal = Causal::lower_right};
      c.kv_dtype = kv;
      for (std::int64_t page_size : {0, 16}) check_cache_case(c, page_size);
    }
  }
}

// Dense decode calls (no cache) that read K/V in place take the same split path.
TEST(SplitKv, DenseDecodeCalls) {
  for (const Dims& dims : {Dims{2, 4, 1, 1, 1100, 64, 64}, Dims{1, 32, 1, 1, 700, 64, 64},
                           Dims{1, 2, 2, 1, 1100, 64, 64}, Dims{1, 8, 1, 1, 1100, 64, 64}}) {
    for (Variant variant : {Variant::plain, Variant::window, Variant::alibi_heads,
                            Variant::bool_mask, Variant::additive_full, Variant::dropout}) {
      SCOPED_TRACE(name_of_variant(variant));
      for (DType dtype : {DType::f32, DType::bf16}) {
        const Problem p = make_problem(dims, {variant});
        const Operands x = make_operands(dims, dtype, 5);
        const Spec& spec = p.spec;
        const OracleForward exact = oracle_forward(dims, spec, x.q, x.k, x.v);
        const OracleForward naive = oracle_forward(dims, spec, x.q, x.k, x.v, rounder_for(dtype));
        const double tol = out_tolerance(dtype, x.v, exact.out, naive.out, spec.dropout_p);
        const Tensor q = make_tensor(dtype, to_shape(dims.q_shape()), x.q);
        const Tensor k = make_tensor(dtype, to_shape(dims.k_shape()), x.k);
        const Tensor v = make_tensor(dtype, to_shape(dims.v_shape()), x.v);
        for (const std::string& target : simd_targets_supported()) {
          const ScopedTarget scope(target);
          for (int splits : kSplits) {
            SCOPED_TRACE(target + " num_splits " + std::to_string(splits));
            Result first;
            for (int threads : {1, 2, 3}) {
              Options o = p.options;
              o.num_splits = splits;
              o.num_threads = threads;
              const ForwardResult f = forward(q, k, v, o, Backend::flash);
              const Result r{read_view(f.out.view()), read_view(f.lse.view())};
              if (threads == 1) {
                EXPECT_TRUE(all_close(r.out, exact.out, tol, "out"));
                EXPECT_TRUE(masked_rows_exact(dims, r.out, r.lse, exact.lse));
                first = r;
              } else {
                EXPECT_TRUE(same_bits(r.out, first.out, "out, threads " + std::to_string(threads)));
                EXPECT_TRUE(same_bits(r.lse, first.lse, "lse, threads " + std::to_string(threads)));
              }
            }
          }
        }
      }
    }
  }
}

// The planner: a pure function of the problem and the CPU count.
TEST(SplitKv, Planner) {
  const detail::FlashLayout& layout = detail::flash_target_chosen().layout;
  detail::Params p;
  p.batch = 1;
  p.heads_q = 32;
  p.heads_kv = 1;
  p.group = 32;
  p.head_dim = p.head_dim_v = 128;
  p.seq.lq = 1;
  p.seq.lk = 16384;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 2);  // 32 heads' rows: one item, split
  p.heads_q = p.group = 4;                             // decode in place
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 1), 1);  // one CPU: nothing to gain
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 2);  // one part per CPU
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 3), 3);
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 16), 16);  // parts of 1024 keys
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 64), 16);  // never shorter than 1024 keys
  // Decode in place: a sequence's run of up to 32 kv heads is one unit (one item in the
  // [B, L, Hkv, D] layout), whatever the layout.
  p.heads_kv = 2;
  p.heads_q = 8;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 2);
  p.heads_kv = 64;
  p.heads_q = 256;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 1);  // two runs of 32 heads for two CPUs
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 8), 4);
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 6), 3);
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 5), 5);  // 2 x 3 items share 5 CPUs badly: 2 x 5
  // Packed tiles (rows past a micro-tile): each kv group is a unit.
  p.heads_kv = 2;
  p.heads_q = 64;
  p.group = 32;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 1);
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 8), 4);
  p.group = 4;
  p.seq.lk = 1500;  // too short to cut on two CPUs
  p.heads_kv = 1;
  p.heads_q = 4;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 1);
  p.seq.lk = 2048;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 2);
  // Forced: capped to the tiles of the longest sequence, whatever the CPUs.
  p.num_splits = 7;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 1), 7);
  p.num_splits = kMaxSplits;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 1), 16);  // 2048 / 128
  p.num_splits = 1;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 64), 1);
  // Prefill (rows past one work item) is never split, forced or not.
  p.num_splits = 4;
  p.seq.lq = 17;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 64), 1);
  // Planned parts hold at most 2^22 keys, on any CPU count (up to kMaxSplits parts).
  p.num_splits = 0;
  p.seq.lq = 1;
  p.seq.lk = (std::int64_t{5} << 22) + 1;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 1), 6);
  p.heads_kv = p.batch = 64;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), 6);  // (64 units would not split)
  p.seq.lk = INT32_MAX;
  EXPECT_EQ(detail::plan_kv_splits(p, layout, 2), kMaxSplits);
}

// A decode row of 2^26 keys of equal scores, V = 1, on one thread (K and V broadcast rows):
// each planned part sums at most 2^22 keys' P V in f32, so the output is 1, where parts of 2^25
// keys (two CPUs' split) stopped at 2^24 and gave 0.5.
TEST(SplitKv, LongRowsAreCutBelowF32Saturation) {
  const std::int64_t lk = std::int64_t{1} << 26;
  float zero[8] = {}, one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  const TensorView q = TensorView::contiguous(zero, DType::f32, {1, 1, 1, 8});
  const TensorView k = TensorView::strided(zero, DType::f32, {1, 1, lk, 8}, {0, 0, 0, 1});
  const TensorView v = TensorView::strided(one, DType::f32, {1, 1, lk, 8}, {0, 0, 0, 1});
  Options o;
  o.num_threads = 1;
  const ForwardResult r = forward(q, k, v, o, Backend::flash);
  for (double x : read_view(r.out.view())) EXPECT_EQ(x, 1.0);
  EXPECT_NEAR(read_view(r.lse.view())[0], std::log(static_cast<double>(lk)), 1e-5);
}

// Cancellation between parts: the flag set after the first task has run its parts stops the
// call before the merge, so the outputs keep what they held (a split call writes them only in
// the merge), and the call says they are incomplete.
TEST(SplitKv, CancelledBetweenParts) {
  struct CancelAfterFirstTask : Executor {
    std::atomic<bool>* flag;
    explicit CancelAfterFirstTask(std::atomic<bool>* f) : flag(f) {}
    void parallel_for(int num_tasks, int /*concurrency*/, const Task& task) const override {
      for (int t = 0; t < num_tasks; ++t) {
        task(t, 0);
        flag->store(true);
      }
    }
  };
  const CacheCase c{.name = "cancel", .seqlens = {3000}};
  const CacheData d = make_data(c, 3);
  const CacheTensors t = make_cache(c, d, 0);
  std::atomic<bool> cancel{false};
  const CancelAfterFirstTask executor(&cancel);
  Tensor out = make_tensor(DType::f32, {1, c.hq, 1, c.dim_v},
                           std::vector<double>(static_cast<std::size_t>(c.hq * c.dim_v), 7.0));
  Options o;
  o.num_splits = 5;
  o.num_threads = 2;
  o.cancel = &cancel;
  o.executor = &executor;
  const std::string message = error_message([&] {
    forward_kvcache_into(t.q.view().transposed(1, 2), t.k.view().transposed(1, 2),
                         t.v.view().transposed(1, 2), t.seqs, out.view(), std::nullopt, o,
                         Backend::flash);
  });
  EXPECT_NE(message.find("call is cancelled (cancel=true, expected false); the outputs are "
                         "incomplete"),
            std::string::npos)
      << message;
  for (double x : read_view(out.view())) ASSERT_EQ(x, 7.0);
}

// Scores so large that the parts' LSEs are ~1e8: the merge must still weigh the parts by
// e / (sum of e) (a merge through the rounded LSE weighed each equal part 1 and multiplied the
// output by the number of parts). Every key scores the same, so the output is V's mean.
TEST(SplitKv, LargeScoresMergeExactly) {
  const std::int64_t lk = 1024, d = 8;
  std::vector<double> v_values(static_cast<std::size_t>(lk * d));
  for (std::int64_t j = 0; j < lk; ++j) {
    std::fill_n(v_values.begin() + j * d, d, j % 2 == 0 ? 1.0 : 3.0);
  }
  const Tensor q = make_tensor(DType::f32, {1, 1, 1, d}, std::vector<double>(d, 1e4));
  const Tensor k = make_tensor(DType::f32, {1, 1, lk, d}, std::vector<double>(lk * d, 1e4));
  const Tensor v = make_tensor(DType::f32, {1, 1, lk, d}, v_values);
  for (const std::string& target : simd_targets_supported()) {
    const ScopedTarget scope(target);
    for (int splits : kSplits) {
      SCOPED_TRACE(target + " num_splits " + std::to_string(splits));
      Options o;
      o.num_splits = splits;
      const ForwardResult f = forward(q, k, v, o, Backend::flash);
      for (double x : read_view(f.out.view())) EXPECT_NEAR(x, 2.0, 1e-5);
      const double lse = read_view(f.lse.view())[0];
      // (One ulp of f32 there, 32, exceeds log 1024: the output is what tells the weights.)
      EXPECT_NEAR(lse, 1e8 * d / std::sqrt(static_cast<double>(d)) + std::log(1024.0), 32.0);
    }
  }
}

TEST(SplitKv, BadNumSplits) {
  const Tensor q(DType::f32, {1, 2, 1, 16}), k(DType::f32, {1, 2, 8, 16});
  for (int splits : {-1, kMaxSplits + 1}) {
    Options o;
    o.num_splits = splits;
    EXPECT_EQ(error_message([&] { (void)forward(q, k, k, o); }),
              "forward: num_splits is out of range (num_splits=" + std::to_string(splits) +
                  ", expected 0 to 256, attncore::kMaxSplits; 0 = planned, 1 = no split)");
  }
  // Every backend accepts every valid count (reference and math compute without splitting).
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    Options o;
    o.num_splits = 3;
    EXPECT_EQ(error_message([&] { (void)forward(q, k, k, o, backend); }), "");
  }
}

}  // namespace
}  // namespace attncore::test
