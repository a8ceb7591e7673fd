// PagedKvCache (attncore/paged.h): reserve / erase in torch PagedAttention's page order, assign
// writing rows where attention reads them (checked against the reference on dense K/V), fork
// sharing pages and copy-on-write leaving the source's bits unchanged, running out of pages, and
// every bad argument refused before anything changes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/paged.h"
#include "core/large_memory.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

Tensor positions_of(const std::vector<int>& p) {
  Tensor t(DType::i32, {static_cast<std::int64_t>(p.size())});
  std::memcpy(t.data(), p.data(), p.size() * sizeof(int));
  return t;
}

std::vector<int> row_of(const PagedKvCache& c, std::int64_t b) {
  const auto* t = static_cast<const std::int32_t*>(c.page_table().data);
  return {t + b * c.max_pages_per_seq(), t + (b + 1) * c.max_pages_per_seq()};
}

std::int32_t length_of(const PagedKvCache& c, std::int64_t b) {
  return static_cast<const std::int32_t*>(c.seqlens().data)[b];
}

TEST(PagedCache, ReserveAndEraseTakePagesInTorchsOrder) {
  PagedKvCache c(4, 2, 1, 8, 8, DType::f32, 3);
  EXPECT_EQ(c.max_pages_per_seq(), 4);
  EXPECT_EQ(row_of(c, 0), (std::vector<int>{-1, -1, -1, -1}));
  c.reserve(0, 3);  // 2 pages: the last two of the free list [3, 2, 1, 0]
  EXPECT_EQ(row_of(c, 0), (std::vector<int>{1, 0, -1, -1}));
  EXPECT_EQ(c.capacity(0), 4);
  EXPECT_EQ(c.free_pages(), 2);
  c.reserve(0, 4);  // within the capacity: nothing changes
  c.reserve(0, 0);
  EXPECT_EQ(c.free_pages(), 2);
  c.reserve(1, 1);
  EXPECT_EQ(row_of(c, 1), (std::vector<int>{2, -1, -1, -1}));
  c.erase(0);  // free list [3, 1, 0]
  EXPECT_EQ(row_of(c, 0), (std::vector<int>{-1, -1, -1, -1}));
  EXPECT_EQ(c.capacity(0), 0);
  EXPECT_EQ(c.free_pages(), 3);
  c.reserve(2, 5);
  EXPECT_EQ(row_of(c, 2), (std::vector<int>{3, 1, 0, -1}));
  EXPECT_EQ(c.free_pages(), 0);
  EXPECT_EQ(c.references(3), 1);
  c.erase(1);
  c.reserve(2, 8);  // grows by one page
  EXPECT_EQ(row_of(c, 2), (std::vector<int>{3, 1, 0, 2}));
}

// Attention over sequences of the cache equals attention over their K/V laid out densely.
TEST(PagedCache, AssignWritesWhereAttentionReads) {
  const std::int64_t hkv = 2, hq = 4, d = 8, dv = 6, ps = 3, batch = 2;
  PagedKvCache c(9, ps, hkv, d, dv, DType::bf16, batch);
  const std::vector<int> lengths = {7, 11};
  std::vector<std::vector<double>> k_rows(2), v_rows(2);  // [L, Hkv, D], [L, Hkv, Dv]
  for (std::int64_t b = 0; b < batch; ++b) {
    const int n = lengths[static_cast<std::size_t>(b)];
    c.reserve(b, n);
    k_rows[b] = rounded(random_vector(n * hkv * d, 10 + b), DType::bf16);
    v_rows[b] = rounded(random_vector(n * hkv * dv, 20 + b), DType::bf16);
    // Written in two pieces, the second one out of order.
    std::vector<int> first, second;
    for (int p = 0; p < n; ++p) (p < 4 ? first : second).push_back(p < 4 ? p : n + 3 - p);
    for (const std::vector<int>* part : {&first, &second}) {
      std::vector<double> kp, vp;
      for (int p : *part) {
        kp.insert(kp.end(), k_rows[b].begin() + p * hkv * d, k_rows[b].begin() + (p + 1) * hkv * d);
        vp.insert(vp.end(), v_rows[b].begin() + p * hkv * dv,
                  v_rows[b].begin() + (p + 1) * hkv * dv);
      }
      const auto s = static_cast<std::int64_t>(part->size());
      const Tensor kt = make_tensor(DType::f32, {s, hkv, d}, kp);
      const Tensor vt = make_tensor(DType::f32, {s, hkv, dv}, vp);
      c.assign(b, positions_of(*part), kt, vt);
    }
    EXPECT_EQ(length_of(c, b), n);
  }
  const Tensor q = make_tensor(DType::bf16, {batch, hq, 2, d},
                               rounded(random_vector(batch * hq * 2 * d, 5), DType::bf16));
  KvCacheSeqs seqs;
  seqs.cache_seqlens = c.seqlens();
  seqs.block_table = c.page_table();
  Options o;
  o.causal = Causal::lower_right;
  const ForwardResult got = forward_kvcache(
      q, c.k_pages().transposed(1, 2), c.v_pages().transposed(1, 2), seqs, o, Backend::reference);
  const std::vector<double> out = read_view(got.out.view());
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = lengths[static_cast<std::size_t>(b)];
    const Tensor k = make_tensor(DType::bf16, {1, n, hkv, d}, k_rows[b]);
    const Tensor v = make_tensor(DType::bf16, {1, n, hkv, dv}, v_rows[b]);
    TensorView qb = q.view();
    qb.data = static_cast<char*>(qb.data) + b * qb.stride_of(0) * 2;
    qb.shape[0] = 1;
    const ForwardResult want =
        forward(qb, k.view().transposed(1, 2), v.view().transposed(1, 2), o, Backend::reference);
    const std::vector<double> w = read_view(want.out.view());
    for (std::size_t e = 0; e < w.size(); ++e) {
      ASSERT_EQ(out[static_cast<std::size_t>(b) * w.size() + e], w[e]) << "b=" << b << " e=" << e;
    }
  }
}

// k and v through any strides (here every other element of their head dim, and v's heads and
// slots swapped in memory) write what contiguous copies of them write.
TEST(PagedCache, AssignReadsAnyStrides) {
  const std::int64_t hkv = 2, d = 4, dv = 3, s = 5;
  PagedKvCache strided_cache(4, 2, hkv, d, dv, DType::f16, 1),
      copied_cache(strided_cache.num_pages(), 2, hkv, d, dv, DType::f16, 1);
  const Tensor k_wide =
      make_tensor(DType::f32, {s, hkv, 2 * d}, random_vector(s * hkv * 2 * d, 30));
  TensorView k = k_wide.view();
  k.shape[2] = d;
  k.stride[2] = 2;
  const Tensor v_heads_first =
      make_tensor(DType::f64, {hkv, s, dv}, random_vector(hkv * s * dv, 31));
  const TensorView v = v_heads_first.view().transposed(0, 1);  // [S, Hkv, Dv]
  const Tensor k_copy = make_tensor(DType::f32, {s, hkv, d}, read_view(k));
  const Tensor v_copy = make_tensor(DType::f64, {s, hkv, dv}, read_view(v));
  const Tensor pos = positions_of({4, 0, 2, 1, 3});
  for (PagedKvCache* c : {&strided_cache, &copied_cache}) c->reserve(0, s);
  strided_cache.assign(0, pos, k, v);
  copied_cache.assign(0, pos, k_copy, v_copy);
  EXPECT_EQ(read_view(strided_cache.k_pages()), read_view(copied_cache.k_pages()));
  EXPECT_EQ(read_view(strided_cache.v_pages()), read_view(copied_cache.v_pages()));
  EXPECT_EQ(length_of(strided_cache, 0), s);
}

// f64 rows into a 16-bit cache round once, to the cache's nearest even: through a float
// rounded to nearest first, a value just past a tie fell on it and went the even way.
TEST(PagedCache, AssignRoundsDoublesOnceTo16Bits) {
  struct Case {
    DType dtype;
    double value, nearest;
  };
  for (const Case& c : {Case{DType::bf16, 1 + 0x1p-8 + 0x1p-40, 1 + 0x1p-7},
                        Case{DType::bf16, -(1 + 0x1p-8 + 0x1p-40), -(1 + 0x1p-7)},
                        Case{DType::bf16, 1 + 0x1p-8 - 0x1p-40, 1.0},
                        Case{DType::f16, 1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-10},
                        Case{DType::f16, 0x1p-25 + 0x1p-60, 0x1p-24},  // past half a subnormal
                        Case{DType::f16, 65520 - 0x1p-30, 65504}}) {   // below the tie to inf
    SCOPED_TRACE(std::string(name_of(c.dtype)) + " " + std::to_string(c.value));
    PagedKvCache cache(1, 1, 1, 1, 1, c.dtype, 1);
    cache.reserve(0, 1);
    const Tensor row = make_tensor(DType::f64, {1, 1, 1}, {c.value});
    cache.assign(0, positions_of({0}), row, row);
    EXPECT_EQ(read_view(cache.k_pages()), std::vector<double>{c.nearest});
    EXPECT_EQ(read_view(cache.v_pages()), std::vector<double>{c.nearest});
  }
}

TEST(PagedCache, ForkSharesPagesAndCopiesOnWrite) {
  const std::int64_t hkv = 1, d = 4, ps = 4;
  PagedKvCache c(6, ps, hkv, d, d, DType::f32, 3);
  c.reserve(0, 10);  // pages [2, 1, 0]... of the free list [5, 4, 3, 2, 1, 0]: [2, 1, 0]
  std::vector<int> all(10);
  for (int p = 0; p < 10; ++p) all[static_cast<std::size_t>(p)] = p;
  const std::vector<double> src_k = random_vector(10 * d, 1), src_v = random_vector(10 * d, 2);
  c.assign(0, positions_of(all), make_tensor(DType::f32, {10, hkv, d}, src_k),
           make_tensor(DType::f32, {10, hkv, d}, src_v));
  const std::vector<double> before_k = read_view(c.k_pages()), before_v = read_view(c.v_pages());
  const std::vector<int> src_row = row_of(c, 0);
  c.fork(0, 1, 6);  // logical pages 0 and 1 shared
  EXPECT_EQ(length_of(c, 1), 6);
  EXPECT_EQ(c.capacity(1), 8);
  EXPECT_EQ(row_of(c, 1)[0], src_row[0]);
  EXPECT_EQ(row_of(c, 1)[1], src_row[1]);
  EXPECT_EQ(c.references(src_row[0]), 2);
  EXPECT_EQ(c.free_pages(), 3);
  // dst writes slots 6, 7 (logical page 1: shared, copied first) and 8 (a page of its own).
  c.reserve(1, 9);
  EXPECT_EQ(c.free_pages(), 2);
  const std::vector<double> new_k = random_vector(3 * d, 3), new_v = random_vector(3 * d, 4);
  c.assign(1, positions_of({6, 7, 8}), make_tensor(DType::f32, {3, hkv, d}, new_k),
           make_tensor(DType::f32, {3, hkv, d}, new_v));
  EXPECT_EQ(c.free_pages(), 1);
  EXPECT_EQ(row_of(c, 0), src_row);  // src keeps its pages and bits
  EXPECT_EQ(row_of(c, 1)[0], src_row[0]);
  EXPECT_NE(row_of(c, 1)[1], src_row[1]);
  EXPECT_EQ(c.references(src_row[0]), 2);
  EXPECT_EQ(c.references(src_row[1]), 1);
  const std::vector<double> after_k = read_view(c.k_pages()), after_v = read_view(c.v_pages());
  for (int page : src_row) {
    if (page < 0) continue;
    for (std::int64_t e = page * ps * d; e < (page + 1) * ps * d; ++e) {
      ASSERT_EQ(after_k[static_cast<std::size_t>(e)], before_k[static_cast<std::size_t>(e)]);
      ASSERT_EQ(after_v[static_cast<std::size_t>(e)], before_v[static_cast<std::size_t>(e)]);
    }
  }
  // dst reads src's first 6 rows, then its own 3.
  const int copy = row_of(c, 1)[1], own = row_of(c, 1)[2];
  for (std::int64_t e = 0; e < 2 * d; ++e) {  // slots 4, 5: copied
    EXPECT_EQ(after_k[static_cast<std::size_t>(copy * ps * d + e)],
              static_cast<float>(src_k[static_cast<std::size_t>(4 * d + e)]));
  }
  for (std::int64_t e = 0; e < d; ++e) {
    EXPECT_EQ(after_k[static_cast<std::size_t>((copy * ps + 2) * d + e)],
              static_cast<float>(new_k[static_cast<std::size_t>(e)]));
    EXPECT_EQ(after_v[static_cast<std::size_t>((own * ps + 0) * d + e)],
              static_cast<float>(new_v[static_cast<std::size_t>(2 * d + e)]));
  }
  EXPECT_EQ(length_of(c, 1), 9);
  // Erasing src keeps the page dst still shares.
  c.erase(0);
  EXPECT_EQ(c.references(src_row[0]), 1);
  EXPECT_EQ(c.free_pages(), 3);
  c.erase(1);
  EXPECT_EQ(c.free_pages(), 6);
  for (std::int64_t p = 0; p < 6; ++p) EXPECT_EQ(c.references(p), 0);
}

// The pools are zeroed, all writable, and (of 2 MiB or more, where StreamedMemory maps them)
// start on a huge-page boundary.
TEST(PagedCache, PoolsAreZeroedAndLargeOnesStartOnHugePageBoundaries) {
  for (const std::int64_t pages : {1, 64, 160}) {  // 16 KiB, 2 MiB and 5 MiB per pool
    attncore::PagedKvCache cache(pages, 16, 8, 64, 64, attncore::DType::f32, 2);
    for (const attncore::TensorView* pool : {&cache.k_pages(), &cache.v_pages()}) {
      const std::size_t bytes = static_cast<std::size_t>(pool->numel()) * 4;
      const bool huge = attncore::detail::kStreamedOnHugePages &&
                        bytes >= attncore::detail::kHugePageBytes;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pool->data) %
                    (huge ? attncore::detail::kHugePageBytes : 64),
                0u)
          << pages << " pages";
      const auto* at = static_cast<const unsigned char*>(pool->data);
      std::size_t nonzero = 0;
      for (std::size_t i = 0; i < bytes; ++i) nonzero += at[i] != 0;
      EXPECT_EQ(nonzero, 0u) << pages << " pages";
      std::memset(pool->data, 0x5a, bytes);  // all of it writable (ASan: the heap's bounds)
    }
  }
}

TEST(PagedCache, OutOfPages) {
  PagedKvCache c(3, 16, 1, 4, 4, DType::f32, 2);
  EXPECT_EQ(error_message([&] { c.reserve(0, 5 * 16); }),
            "PagedKvCache::reserve: seq_len is out of range (seq_len=80, expected 0 <= seq_len "
            "<= max_pages_per_seq * page_size=48)");
  PagedKvCache big(8, 16, 1, 4, 4, DType::f32, 2);
  big.reserve(1, 5 * 16);
  EXPECT_THROW(big.reserve(0, 5 * 16), OutOfMemory);
  EXPECT_EQ(error_message([&] { big.reserve(0, 5 * 16); }),
            "PagedKvCache::reserve: requested 5 pages but only 3 are free (batch_idx=0, "
            "seq_len=80, capacity=0, expected at most free_pages()=3 pages); erase sequences "
            "first");
  EXPECT_EQ(big.capacity(0), 0);  // nothing taken
  // Copy-on-write needs a page too.
  const Tensor kv(DType::f32, {1, 1, 4});
  big.assign(1, positions_of({0}), kv, kv);
  big.reserve(0, 3 * 16);
  EXPECT_EQ(big.free_pages(), 0);
  EXPECT_THROW(big.reserve(0, 3 * 16 + 1), OutOfMemory);
}

// A cache moved from answers every method with InvalidArgument (it held a null state: a null
// dereference), and works again once a cache is assigned to it.
TEST(PagedCache, MovedFromThrowsUntilAssigned) {
  PagedKvCache c(4, 16, 1, 4, 4, DType::f32, 2);
  c.reserve(0, 20);
  PagedKvCache d(std::move(c));
  EXPECT_EQ(d.capacity(0), 32);
  EXPECT_EQ(error_message([&] { (void)c.free_pages(); }),
            "PagedKvCache::free_pages: this cache was moved from (expected a PagedKvCache that "
            "holds its pages; assign one to it first)");
  EXPECT_THROW((void)c.num_pages(), InvalidArgument);
  EXPECT_THROW((void)c.page_table(), InvalidArgument);
  EXPECT_THROW((void)c.capacity(0), InvalidArgument);
  EXPECT_THROW((void)c.references(0), InvalidArgument);
  EXPECT_THROW(c.reserve(0, 1), InvalidArgument);
  EXPECT_THROW(c.erase(0), InvalidArgument);
  EXPECT_THROW(c.fork(0, 1, 0), InvalidArgument);
  const Tensor kv(DType::f32, {1, 1, 4});
  EXPECT_THROW(c.assign(0, positions_of({0}), kv, kv), InvalidArgument);
  c = PagedKvCache(2, 16, 1, 4, 4, DType::f32, 1);
  EXPECT_EQ(c.free_pages(), 2);
}

TEST(PagedCache, CopyOnWriteOutOfPages) {
  PagedKvCache c(2, 4, 1, 4, 4, DType::f32, 2);
  const Tensor kv(DType::f32, {1, 1, 4});
  c.reserve(0, 8);
  c.assign(0, positions_of({5}), kv, kv);
  c.fork(0, 1, 6);
  EXPECT_EQ(error_message([&] { c.assign(1, positions_of({1}), kv, kv); }),
            "PagedKvCache::assign: requested 1 pages but only 0 are free (copies of shared pages "
            "before writing, batch_idx=1, expected at most free_pages()=0 pages); erase "
            "sequences first");
  EXPECT_EQ(c.references(0), 2);
  EXPECT_EQ(length_of(c, 1), 6);
}

TEST(PagedCache, BadArguments) {
  auto make = [](std::int64_t n, std::int64_t ps, std::int64_t h, std::int64_t d, DType t,
                 std::int64_t b, std::int64_t per) {
    return error_message([&] { PagedKvCache c(n, ps, h, d, d, t, b, per); });
  };
  EXPECT_EQ(make(0, 4, 1, 4, DType::f32, 1, 0),
            "PagedKvCache: num_pages is out of range (num_pages=0, expected >= 1)");
  EXPECT_EQ(make(4, 0, 1, 4, DType::f32, 1, 0),
            "PagedKvCache: page_size is out of range (page_size=0, expected >= 1)");
  EXPECT_NE(make(4, 4, 0, 4, DType::f32, 1, 0).find("heads_kv is out of range"), std::string::npos);
  EXPECT_NE(make(4, 4, 1, -1, DType::f32, 1, 0).find("head_dim is out of range"),
            std::string::npos);
  EXPECT_NE(make(4, 4, 1, 4, DType::f32, 0, 0).find("max_batch is out of range"),
            std::string::npos);
  EXPECT_EQ(make(4, 4, 1, 4, DType::f32, 1, 5),
            "PagedKvCache: max_pages_per_seq is out of range (max_pages_per_seq=5, expected 1 <= "
            "max_pages_per_seq <= num_pages=4; 0 = num_pages)");
  EXPECT_EQ(make(4, 4, 1, 4, DType::i32, 1, 0),
            "PagedKvCache: dtype is not a cache dtype (dtype=i32, expected f32, bf16, f16 or "
            "f64)");
  EXPECT_NE(make(1 << 20, 1 << 12, 1, 4, DType::f32, 1, 0).find("capacity per sequence"),
            std::string::npos);
  const std::string huge = make(std::int64_t{1} << 30, 1 << 10, 64, 128, DType::f32, 1, 1);
  EXPECT_NE(huge.find("exceeds the memory this process may use"), std::string::npos) << huge;
  // The estimate counts the page table twice (its view and the cache's own copy), the lengths,
  // and the pages' bookkeeping: a table of 2^44 entries over 8 MiB of pages.
  const std::int64_t pages = std::int64_t{1} << 20, batch = std::int64_t{1} << 24;
  char bytes[32];
  std::snprintf(bytes, sizeof bytes, "(bytes=%.4g,",
                8.0 * pages + 4.0 * batch * (2.0 * pages + 1) + 8.0 * pages);
  const std::string table = make(pages, 1, 1, 1, DType::f32, batch, pages);
  EXPECT_NE(table.find(std::string("the cache exceeds the memory this process may use ") + bytes),
            std::string::npos)
      << table << " " << bytes;

  PagedKvCache c(4, 4, 2, 4, 3, DType::f32, 2);
  c.reserve(0, 5);
  EXPECT_EQ(error_message([&] { c.reserve(2, 1); }),
            "PagedKvCache::reserve: batch_idx is out of range (batch_idx=2, expected 0 <= "
            "batch_idx < max_batch=2)");
  EXPECT_NE(error_message([&] { c.reserve(0, -1); }).find("seq_len is out of range"),
            std::string::npos);
  EXPECT_NE(error_message([&] { c.erase(-1); }).find("batch_idx is out of range"),
            std::string::npos);
  EXPECT_NE(error_message([&] { (void)c.capacity(5); }).find("batch_idx is out of range"),
            std::string::npos);
  EXPECT_NE(error_message([&] { (void)c.references(4); }).find("page is out of range"),
            std::string::npos);
  const Tensor k = make_tensor(DType::f32, {2, 2, 4}, random_vector(16, 1));
  const Tensor v = make_tensor(DType::f32, {2, 2, 3}, random_vector(12, 2));
  const Tensor pos = positions_of({0, 7});
  EXPECT_EQ(error_message([&] {
              c.assign(0, positions_of({0, 8}), k, v);
            }),
            "PagedKvCache::assign: positions is out of what batch_idx=0 reserved (positions[1]=8, "
            "expected 0 <= position < capacity=8); reserve first");
  EXPECT_NE(error_message([&] { c.assign(1, pos, k, v); }).find("capacity=0); reserve first"),
            std::string::npos);
  EXPECT_NE(error_message([&] {
              c.assign(0, positions_of({-1, 2}), k, v);
            }).find("positions[0]=-1"),
            std::string::npos);
  EXPECT_EQ(error_message([&] {
              c.assign(0, positions_of({3, 3}), k, v);
            }),
            "PagedKvCache::assign: positions repeats a position (position=3, expected distinct "
            "positions)");
  EXPECT_NE(error_message([&] { c.assign(0, pos, v, v); }).find("k has shape [2, 2, 3]"),
            std::string::npos);
  EXPECT_NE(error_message([&] { c.assign(0, pos, k, k); }).find("v has shape [2, 2, 4]"),
            std::string::npos);
  const Tensor k3(DType::f32, {3, 2, 4});
  EXPECT_NE(error_message([&] { c.assign(0, pos, k3, v); }).find("with S = len(positions)"),
            std::string::npos);
  const Tensor k_int(DType::i32, {2, 2, 4});
  EXPECT_NE(error_message([&] { c.assign(0, pos, k_int, v); }).find("k has the wrong dtype"),
            std::string::npos);
  const Tensor f32_pos(DType::f32, {2});
  EXPECT_NE(
      error_message([&] { c.assign(0, f32_pos, k, v); }).find("positions has the wrong dtype"),
      std::string::npos);
  const Tensor k4(DType::f32, {1, 2, 2, 4});
  EXPECT_NE(error_message([&] { c.assign(0, pos, k4, v); }).find("k has the wrong rank"),
            std::string::npos);
  // Nothing was written by any refused call.
  for (double x : read_view(c.k_pages())) ASSERT_EQ(x, 0.0);
  EXPECT_EQ(length_of(c, 0), 0);
  c.assign(0, pos, k, v);
  EXPECT_EQ(length_of(c, 0), 8);
  EXPECT_EQ(error_message([&] { c.fork(0, 0, 1); }),
            "PagedKvCache::fork: src and dst are the same sequence (src=dst=0, expected two "
            "sequences)");
  EXPECT_EQ(error_message([&] { c.fork(0, 1, 9); }),
            "PagedKvCache::fork: prefix_len is out of range (prefix_len=9, expected 0 <= "
            "prefix_len <= the length of src=8)");
  EXPECT_NE(error_message([&] { c.fork(0, 2, 1); }).find("dst is out of range"), std::string::npos);
  EXPECT_NE(error_message([&] { c.fork(-1, 1, 1); }).find("src is out of range"),
            std::string::npos);
  c.reserve(1, 1);
  EXPECT_EQ(error_message([&] { c.fork(0, 1, 1); }),
            "PagedKvCache::fork: dst is not empty (capacity=4, length=0, expected 0 and 0); "
            "erase it first");
  // src's live length written over by the caller: named as such, whatever prefix_len is.
  c.erase(1);
  auto* lengths = static_cast<std::int32_t*>(c.seqlens().data);
  for (const std::int32_t bad : {-7, 9}) {
    lengths[0] = bad;
    EXPECT_EQ(error_message([&] { c.fork(0, 1, 0); }),
              "PagedKvCache::fork: src's length is out of range (length=" + std::to_string(bad) +
                  ", expected 0 <= length <= its capacity=8)");
  }
  lengths[0] = 8;
  c.fork(0, 1, 8);
  EXPECT_EQ(length_of(c, 1), 8);
}


// k and v that lie in the cache's own pages are refused (rows would be read after being
// overwritten), before anything changes.
TEST(PagedCache, AssignRefusesRowsInTheCachesMemory) {
  PagedKvCache c(3, 4, 1, 2, 2, DType::f32, 2);
  c.reserve(0, 4);
  const Tensor k = make_tensor(DType::f32, {4, 1, 2}, random_vector(8, 1));
  c.assign(0, positions_of({0, 1, 2, 3}), k, k);
  const std::vector<double> before = read_view(c.k_pages());
  TensorView page = c.k_pages();  // page row 0's slots [0, 4) as [S=4, Hkv=1, D=2]
  page.rank = 3;
  page.shape = {4, 1, 2};
  page.stride = {2, 2, 1};
  page.data = static_cast<char*>(c.k_pages().data) + row_of(c, 0)[0] * 8 * sizeof(float);
  EXPECT_NE(error_message([&] { c.assign(0, positions_of({1, 2, 3, 0}), page, k); })
                .find("PagedKvCache::assign: k_pages overlaps k"),
            std::string::npos);
  TensorView v_page = page;
  v_page.data = static_cast<char*>(c.v_pages().data) + row_of(c, 0)[0] * 8 * sizeof(float);
  EXPECT_NE(error_message([&] { c.assign(0, positions_of({1, 2, 3, 0}), k, v_page); })
                .find("v_pages overlaps v"),
            std::string::npos);
  EXPECT_EQ(read_view(c.k_pages()), before);
}

// The page table view is a copy: a caller that writes it (which it must not) cannot make the
// cache free a page another sequence holds.
TEST(PagedCache, WritesToThePageTableViewLeaveTheBookkeeping) {
  PagedKvCache c(4, 2, 1, 2, 2, DType::f32, 2);
  c.reserve(0, 2);
  const int held = row_of(c, 0)[0];
  static_cast<std::int32_t*>(c.page_table().data)[c.max_pages_per_seq()] = held;  // row 1
  c.erase(1);  // row 1 holds nothing as the cache sees it
  EXPECT_EQ(c.references(held), 1);
  EXPECT_EQ(c.free_pages(), 3);
  EXPECT_EQ(row_of(c, 1), (std::vector<int>{-1, -1, -1, -1}));  // rewritten by erase
  c.reserve(1, 6);
  for (int page : row_of(c, 1)) EXPECT_NE(page, held);
  EXPECT_EQ(c.free_pages(), 0);
}

}  // namespace
}  // namespace attncore::test
