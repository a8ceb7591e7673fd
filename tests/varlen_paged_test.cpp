// Variable-length batches over page pools (attncore/varlen.h, VarlenSeqs::block_table): the
// keys of each sequence scattered over pages of any size in a random order give the same bits as
// the packed call over the same keys, on every backend (flash on every SIMD target), for
// batches that mix decode rows and prefill chunks, with every variant and split-KV; for any
// thread count; under an f32 query over 16-bit pools; unused slots hold NaN and change nothing;
// every bad input is refused before any work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/paged.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"
#include "varlen_batch.h"

namespace attncore::test {
namespace {

// A packed batch's used keys moved into page pools: sequence b's slot s is row s % page_size of
// page block_table[b][s / page_size], the pages in a random order among `spare` more; every
// other slot holds NaN, and the table's columns past a sequence's pages are -1 (one more column
// than the longest sequence needs).
struct Pools {
  Tensor k, v;         // [num_pages, page_size, Hkv, D], [.., Dv]
  Tensor block_table;  // i32 [B, pages_per_seq]
  VarlenSeqs seqs;     // the batch's, with block_table
};

Pools to_pools(const Packed& p, std::int64_t page_size, DType pool_dtype, std::uint64_t seed) {
  const std::int64_t batch = p.count();
  std::int64_t per_seq = 1, num_pages = 2;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t pages = (p.used(b) + page_size - 1) / page_size;
    per_seq = std::max(per_seq, pages + 1);
    num_pages += pages;
  }
  std::vector<int> order(static_cast<std::size_t>(num_pages));
  std::iota(order.begin(), order.end(), 0);
  Random rng(seed);
  for (std::int64_t i = num_pages - 1; i > 0; --i) {
    std::swap(order[static_cast<std::size_t>(i)],
              order[static_cast<std::size_t>(rng.below(i + 1))]);
  }
  std::vector<int> table(static_cast<std::size_t>(batch * per_seq), -1);
  auto move = [&](const Tensor& packed) {
    const std::vector<double> src = read_view(packed.view());
    const std::int64_t row = packed.size(1) * packed.size(2);  // Hkv * width
    std::vector<double> pool(static_cast<std::size_t>(num_pages * page_size * row), kNaN);
    std::size_t next = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t k0 = p.cu_k[static_cast<std::size_t>(b)];
      for (std::int64_t s = 0; s < p.used(b); ++s) {
        if (s % page_size == 0)
          table[static_cast<std::size_t>(b * per_seq + s / page_size)] = order[next++];
        const std::int64_t page = table[static_cast<std::size_t>(b * per_seq + s / page_size)];
        std::copy_n(src.begin() + (k0 + s) * row, row,
                    pool.begin() + (page * page_size + s % page_size) * row);
      }
    }
    return make_tensor(pool_dtype, {num_pages, page_size, packed.size(1), packed.size(2)}, pool);
  };
  Pools r{move(p.k), move(p.v), Tensor(DType::i32, {batch, per_seq}), p.seqs};
  std::copy(table.begin(), table.end(), r.block_table.data_as<std::int32_t>());
  r.seqs.block_table = r.block_table.view();
  return r;
}

TEST(VarlenPaged, EqualsThePackedCallBitwise) {
  ASSERT_TRUE(all_packed_cases(batches(), [](const Packed& p, Backend backend, std::uint64_t seed) {
    const std::int64_t page_size = std::vector<std::int64_t>{1, 3, 16}[seed % 3];
    const Pools pools = to_pools(p, page_size, p.dtype, seed);
    const ForwardResult want = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
    const ForwardResult got = forward_varlen(p.q, pools.k, pools.v, pools.seqs, p.options, backend);
    const std::string at = " at page size " + std::to_string(page_size);
    auto same = same_bits(read_view(got.out.view()), read_view(want.out.view()), "out" + at);
    if (same) same = same_bits(read_view(got.lse.view()), read_view(want.lse.view()), "lse" + at);
    for (double x : read_view(got.out.view())) {
      if (same && std::isnan(x)) same = ::testing::AssertionFailure() << "NaN in out" << at;
    }
    return same;
  }));
}

TEST(VarlenPaged, ResultsDoNotDependOnTheThreadCount) {
  const Packed p = make_packed(mixed_batch(), DType::bf16, varlen_variants()[1], 7);
  const Pools pools = to_pools(p, 16, DType::bf16, 8);
  std::vector<double> first;
  for (int threads : {1, 2, 3}) {
    Options o = p.options;
    o.num_threads = threads;
    const ForwardResult r = forward_varlen(p.q, pools.k, pools.v, pools.seqs, o, Backend::flash);
    std::vector<double> out = read_view(r.out.view());
    for (double x : read_view(r.lse.view())) out.push_back(x);
    if (threads == 1) {
      first = out;
    } else {
      EXPECT_TRUE(same_bits(out, first, std::to_string(threads) + " threads"));
    }
  }
}

// An f32 query over bf16 or f16 pools (the pools' values converted exactly): flash and math
// against the reference backend in f64 on the same call.
TEST(VarlenPaged, F32QueryOverSixteenBitPools) {
  for (DType pool_dtype : {DType::bf16, DType::f16}) {
    // The values rounded to the pools' dtype first, so that the f32 copy holds them exactly.
    const Packed rounded = make_packed(mixed_batch(), pool_dtype, varlen_variants()[6], 11);
    Packed p = make_packed(mixed_batch(), DType::f32, varlen_variants()[6], 11);
    p.k = make_tensor(DType::f32, {p.rows_k, p.batch.heads_kv, p.batch.dim},
                      read_view(rounded.k.view()));
    p.v = make_tensor(DType::f32, {p.rows_k, p.batch.heads_kv, p.batch.dim_v},
                      read_view(rounded.v.view()));
    const Pools pools = to_pools(p, 5, pool_dtype, 12);
    const ForwardResult oracle =
        forward_varlen(p.q, p.k, p.v, p.seqs, p.options, Backend::reference);
    for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
      SCOPED_TRACE(std::string(name_of(pool_dtype)) + " " + std::string(name_of(backend)));
      const ForwardResult r = forward_varlen(p.q, pools.k, pools.v, pools.seqs, p.options, backend);
      const std::vector<double> got = read_view(r.out.view()), want = read_view(oracle.out.view());
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5) << i;
    }
  }
}

// A PagedKvCache's own views, as the README passes them: every sequence of the cache in one
// call (one forked from another, sharing its prefix's pages), against the packed keys.
TEST(VarlenPaged, OverAPagedKvCache) {
  const Packed p = make_packed({{1, 4, 0}, {37, 21, 9}, {}, 0, 0, 4, 2, 32, 32}, DType::bf16,
                               varlen_variants()[1], 21);
  PagedKvCache cache(32, 8, 2, 32, 32, DType::bf16, 3);
  for (std::int64_t b = 0; b < p.count(); ++b) {
    if (b == 1) {  // the first 16 keys of sequence 1 are sequence 0's (fork shares 2 pages)
      cache.fork(0, 1, 16);
    }
    cache.reserve(b, p.used(b));
    std::vector<int> positions(static_cast<std::size_t>(p.used(b)));
    std::iota(positions.begin(), positions.end(), 0);
    const Tensor at = int_tensor(positions);
    const std::int64_t k0 = p.cu_k[static_cast<std::size_t>(b)];
    auto rows = [&](const Tensor& t) {
      TensorView r = t.view();
      r.data = static_cast<char*>(r.data) + k0 * r.stride_of(0) * 2;
      r.shape[0] = p.used(b);
      return r;
    };
    cache.assign(b, at.view(), rows(p.k), rows(p.v));  // (sequence 1 writes its own copies)
  }
  VarlenSeqs seqs = p.seqs;
  seqs.block_table = cache.page_table();
  seqs.seqused_k = cache.seqlens();
  for (Backend backend : {Backend::flash, Backend::math}) {
    const ForwardResult want = forward_varlen(p.q, p.k, p.v, p.seqs, p.options, backend);
    const ForwardResult got =
        forward_varlen(p.q, cache.k_pages(), cache.v_pages(), seqs, p.options, backend);
    EXPECT_TRUE(same_bits(read_view(got.out.view()), read_view(want.out.view()), "out"));
    EXPECT_TRUE(same_bits(read_view(got.lse.view()), read_view(want.lse.view()), "lse"));
  }
}

TEST(VarlenPaged, BadInputsAreRefusedBeforeAnyWork) {
  const Packed p = make_packed(mixed_batch(), DType::f32, varlen_variants()[0], 3);
  const Pools good = to_pools(p, 4, DType::f32, 4);
  const std::int64_t num_pages = good.k.size(0), per_seq = good.block_table.size(1);
  auto expect = [&](const std::function<void()>& call, const std::string& part) {
    const std::string message = error_message(call);
    EXPECT_NE(message.find(part), std::string::npos) << "message: " << message;
    EXPECT_EQ(message.rfind("forward: ", 0), 0u) << message;
  };
  auto with_table = [&](const std::vector<int>& values, const std::string& part) {
    Tensor t(DType::i32, {p.count(), per_seq});
    std::copy(values.begin(), values.end(), t.data_as<std::int32_t>());
    VarlenSeqs s = good.seqs;
    s.block_table = t.view();
    expect([&] { forward_varlen(p.q, good.k, good.v, s); }, part);
  };
  std::vector<int> table(good.block_table.data_as<std::int32_t>(),
                         good.block_table.data_as<std::int32_t>() + p.count() * per_seq);
  std::vector<int> bad = table;
  bad[2 * per_seq + 100] = -1;  // inside sequence 2's 2600 keys
  with_table(bad, "block_table names no page of the pool for slots in use (block_table[2][100]=-1");
  bad = table;
  bad[6 * per_seq] = static_cast<int>(num_pages);
  with_table(bad, "block_table[6][0]=" + std::to_string(num_pages) +
                      ", expected 0 <= page < num_pages=" + std::to_string(num_pages));
  // Entries past a sequence's keys are never read: any value passes.
  bad = table;
  bad[per_seq - 1] = -7;
  EXPECT_EQ(error_message([&] {
              VarlenSeqs s = good.seqs;
              Tensor t(DType::i32, {p.count(), per_seq});
              std::copy(bad.begin(), bad.end(), t.data_as<std::int32_t>());
              s.block_table = t.view();
              forward_varlen(p.q, good.k, good.v, s);
            }),
            "");

  VarlenSeqs s = good.seqs;
  Tensor narrow = Tensor(DType::i32, {p.count(), 2});
  std::fill_n(narrow.data_as<std::int32_t>(), p.count() * 2, 0);
  s.block_table = narrow.view();
  expect([&] { forward_varlen(p.q, good.k, good.v, s); },
         "cu_seqlens_k gives sequence 0 more keys than its pages hold (cu_seqlens_k[1] - "
         "cu_seqlens_k[0]=40, expected <= max_pages_per_seq * page_size=8)");
  Tensor f32_table =
      make_tensor(DType::f32, {p.count(), per_seq},
                  std::vector<double>(static_cast<std::size_t>(p.count() * per_seq)));
  s.block_table = f32_table.view();
  expect([&] { forward_varlen(p.q, good.k, good.v, s); },
         "block_table has the wrong dtype (dtype=f32, expected i32)");
  Tensor short_table(DType::i32, {2, per_seq});
  s.block_table = short_table.view();
  expect([&] { forward_varlen(p.q, good.k, good.v, s); }, "block_table has shape [2, " +
                                                              std::to_string(per_seq) +
                                                              "], expected [7, max_pages_per_seq]");

  // The pools: rank, shape, page size, dtype.
  const Tensor no_slots = make_tensor(DType::f32, {num_pages, 0, 2, 32}, {});
  expect([&] { forward_varlen(p.q, no_slots, no_slots, good.seqs); },
         "key has shape [" + std::to_string(num_pages) +
             ", 0, 2, 32], expected [num_pages, page_size, Hkv, D] with page_size >= 1 "
             "(page_size=0)");
  expect([&] { forward_varlen(p.q, p.k, p.v, good.seqs); },
         "key has the wrong rank (rank=3, expected 4: [num_pages, page_size, Hkv, D])");
  const Tensor v_short =
      make_tensor(DType::f32, {num_pages, 3, 2, 32},
                  std::vector<double>(static_cast<std::size_t>(num_pages * 192)));
  expect([&] { forward_varlen(p.q, good.k, v_short, good.seqs); },
         "value has shape [" + std::to_string(num_pages) + ", 3, 2, 32], expected [" +
             std::to_string(num_pages) + ", 4, 2, 32]");
  const Pools f16 =
      to_pools(make_packed(mixed_batch(), DType::f16, varlen_variants()[0], 3), 4, DType::f16, 4);
  const Packed bf16_q = make_packed(mixed_batch(), DType::bf16, varlen_variants()[0], 3);
  expect([&] { forward_varlen(bf16_q.q, f16.k, f16.v, f16.seqs); },
         "key has the wrong dtype for the query (key=f16, query=bf16, expected key like query, "
         "or bf16 or f16 under an f32 query)");

  // Forward only, and no dropout.
  Options dropout = p.options;
  dropout.dropout_p = 0.1;
  EXPECT_NE(error_message([&] {
              forward_varlen(p.q, good.k, good.v, good.seqs, dropout);
            }).find("forward: dropout is not supported over page pools (dropout_p=0.1"),
            std::string::npos);
  EXPECT_THROW(forward_varlen(p.q, good.k, good.v, good.seqs, dropout), Unsupported);
  VarlenSeqs huge = good.seqs;  // (dropout would address more than 2^63 elements: still)
  huge.max_seqlen_q = huge.max_seqlen_k = 2147483647;
  EXPECT_THROW(forward_varlen(p.q, good.k, good.v, huge, dropout), Unsupported);
  const ForwardResult r = forward_varlen(p.q, good.k, good.v, good.seqs);
  EXPECT_THROW(backward_varlen(r.out, p.q, good.k, good.v, r.out, r.lse, good.seqs), Unsupported);
  EXPECT_NE(
      error_message([&] { backward_varlen(r.out, p.q, good.k, good.v, r.out, r.lse, good.seqs); })
          .find("backward: block_table is not supported (block_table=given, expected none); "
                "attention over page pools is forward only"),
      std::string::npos);
}

}  // namespace
}  // namespace attncore::test
