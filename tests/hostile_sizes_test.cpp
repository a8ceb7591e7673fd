// Sizes that broadcast views make free for the caller and ruinous for the library: a KV-cache
// append's rotary width or new rows at int64's limit (their sums overflowed, and the append then
// wrote out of bounds), a paged append of more rows than the pool holds (its slot check
// allocated B * L_new pairs: 64 GB for broadcast views), a merge of rows of 2^29 columns (its
// scratch took 3 * Dv per thread) — each refused by a check, or run in bounded memory; and the
// minor errors found with them (an out-of-range dropout_p with a cache, an invalid dtype's value; a
// merge cancelled before it starts: merge_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "attncore/merge.h"
#include "attncore/paged.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

// Views of any size over a few bytes (strides 0 where the size is large): checks read shapes.
float g_floats[64];
std::int32_t g_ints[64];
TensorView broadcast(DType dtype, std::initializer_list<std::int64_t> shape,
                     std::initializer_list<std::int64_t> stride) {
  return TensorView::strided(dtype == DType::i32 ? static_cast<void*>(g_ints) : g_floats, dtype,
                             shape, stride);
}

struct Cache {
  explicit Cache(std::int64_t d = 4) : k(DType::f32, {1, 8, 1, d}), v(DType::f32, {1, 8, 1, d}) {}
  Tensor k, v;  // [B, capacity, Hkv, D]
  Tensor lens{DType::i32, {1}};
  KvCacheSeqs seqs() const {
    KvCacheSeqs s;
    s.cache_seqlens = lens.view();
    return s;
  }
  TensorView kc() const { return k.view().transposed(1, 2); }
  TensorView vc() const { return v.view().transposed(1, 2); }
};

// Rotary tables at int64's limits: widths past any head dim, and rows whose byte offsets pass
// int64 (refused as such before the overlap check measures their bytes, which computed the
// overflowing offset first: UBSan).
TEST(HostileSizes, RotaryTablesAtInt64sLimit) {
  Cache c;
  const TensorView q = broadcast(DType::f32, {1, 1, 1, 4}, {0, 0, 0, 1});
  KvAppend a;
  a.k_new = a.v_new = broadcast(DType::f32, {1, 1, 1, 4}, {0, 0, 0, 1});
  const TensorView wide = broadcast(DType::f32, {1, std::int64_t{1} << 62}, {0, 0});
  const TensorView widest = broadcast(DType::f32, {1, INT64_MAX}, {0, 0});
  const TensorView far = broadcast(DType::f32, {16, 2}, {INT64_MAX / 4, 1});
  const TensorView near = broadcast(DType::f32, {16, 2}, {2, 1});
  const struct {
    TensorView cos, sin;
    const char* want;
  } cases[] = {{wide, wide, "rotary_cos has the wrong width"},
               {widest, widest, "rotary_cos has the wrong width"},
               {far, near, "rotary_cos spans too much memory"}};
  for (const auto& t : cases) {
    a.rotary_cos = t.cos;
    a.rotary_sin = t.sin;
    EXPECT_NE(invalid_argument_message([&] {
                forward_kvcache(q, c.kc(), c.vc(), c.seqs(), a);
              }).find(t.want),
              std::string::npos);
    EXPECT_NE(invalid_argument_message([&] {
                explain_forward_kvcache(q, c.kc(), c.vc(), c.seqs(), a);
              }).find(t.want),
              std::string::npos);
  }
}

TEST(HostileSizes, NewRowsAtInt64sLimit) {
  Cache c(1);  // D = 1: k_new's element count fits in int64 at any length
  static_cast<std::int32_t*>(c.lens.data())[0] = 3;
  const TensorView q = broadcast(DType::f32, {1, 1, 1, 1}, {0, 0, 0, 1});
  for (const std::int64_t rows : {INT64_MAX, INT64_MAX - 1, std::int64_t{6}}) {
    KvAppend a;
    a.k_new = a.v_new = broadcast(DType::f32, {1, 1, rows, 1}, {0, 0, 0, 1});
    const std::string got =
        invalid_argument_message([&] { forward_kvcache(q, c.kc(), c.vc(), c.seqs(), a); });
    EXPECT_NE(got.find("k_new does not fit in the cache (cache_seqlens[0]=3 + L_new=" +
                       std::to_string(rows) + ", expected <= capacity=8)"),
              std::string::npos)
        << got;
    EXPECT_NE(invalid_argument_message([&] {
                explain_forward_kvcache(q, c.kc(), c.vc(), c.seqs(), a);
              }).find("k_new does not fit"),
              std::string::npos);
  }
}

// 2^16 sequences appending 64 rows each (broadcast views) into a pool of 64 slots: more rows
// than the pool holds, scanned until two land on one slot (their slots were once gathered and
// sorted: B * L_new pairs, 64 GB for 2^16 rows each).
TEST(HostileSizes, PagedAppendOfMoreRowsThanThePool) {
  const std::int64_t batch = 1 << 16, pages_per_seq = 64;
  Tensor k(DType::f32, {64, 1, 1, 4}), v(DType::f32, {64, 1, 1, 4});  // pages of 1 slot
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages_per_seq));
  for (std::size_t n = 0; n < table.size(); ++n) table[n] = static_cast<std::int32_t>(n);
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), 0);
  KvCacheSeqs s;
  s.cache_seqlens = TensorView::contiguous(lens.data(), DType::i32, {batch});
  s.block_table = TensorView::strided(table.data(), DType::i32, {batch, pages_per_seq}, {0, 1});
  KvAppend a;
  a.k_new = a.v_new = broadcast(DType::f32, {batch, 1, pages_per_seq, 4}, {0, 0, 0, 1});
  const TensorView q = broadcast(DType::f32, {batch, 1, 1, 4}, {0, 0, 0, 1});
  const std::string want =
      "k_new writes one pool slot twice (slot 0 of sequence 0 and slot 0 of sequence 1 are both "
      "row 0 of page 0";
  const TensorView kc = k.view().transposed(1, 2), vc = v.view().transposed(1, 2);
  const std::string got = invalid_argument_message([&] { forward_kvcache(q, kc, vc, s, a); });
  EXPECT_NE(got.find(want), std::string::npos) << got;
  EXPECT_NE(invalid_argument_message([&] { explain_forward_kvcache(q, kc, vc, s, a); }).find(want),
            std::string::npos);
}

// Rows of 2500 columns (several of the merge's chunks) merge as the formula says, each column
// by itself: out = (e^la a + e^lb b) / (e^la + e^lb).
TEST(HostileSizes, MergeOfLongRows) {
  const std::int64_t dv = 2500;
  Tensor a(DType::f32, {2, dv}), b(DType::f32, {2, dv}), la(DType::f32, {2}), lb(DType::f32, {2});
  for (std::int64_t e = 0; e < 2 * dv; ++e) {
    static_cast<float*>(a.data())[e] = static_cast<float>(std::sin(0.1 * static_cast<double>(e)));
    static_cast<float*>(b.data())[e] = static_cast<float>(std::cos(0.1 * static_cast<double>(e)));
  }
  const float lses[2][2] = {{0.5f, -1.0f}, {3.0f, 3.0f}};
  for (int r = 0; r < 2; ++r) {
    static_cast<float*>(la.data())[r] = lses[r][0];
    static_cast<float*>(lb.data())[r] = lses[r][1];
  }
  const MergeResult m = merge_attention_states(a.view(), la.view(), b.view(), lb.view());
  for (int r = 0; r < 2; ++r) {
    const double wa = std::exp(lses[r][0]), wb = std::exp(lses[r][1]);
    for (std::int64_t e = 0; e < dv; ++e) {
      const double want = (wa * static_cast<float*>(a.data())[r * dv + e] +
                           wb * static_cast<float*>(b.data())[r * dv + e]) /
                          (wa + wb);
      ASSERT_NEAR(static_cast<float*>(m.out.data())[r * dv + e], want, 1e-6) << r << " " << e;
    }
    EXPECT_NEAR(static_cast<float*>(m.lse.data())[r], std::log(wa + wb), 1e-6);
  }
}

TEST(HostileSizes, MinorErrors) {
  Cache c;
  const TensorView q = broadcast(DType::f32, {1, 1, 1, 4}, {0, 0, 0, 1});
  Options o;
  o.dropout_p = 2.0;  // out of range: invalid, before "not supported with a cache"
  EXPECT_NE(invalid_argument_message([&] {
              forward_kvcache(q, c.kc(), c.vc(), c.seqs(), o);
            }).find("dropout_p is out of range"),
            std::string::npos);
  EXPECT_NE(invalid_argument_message([&] {
              PagedKvCache(4, 1, 1, 4, 4, static_cast<DType>(99), 1);
            }).find("dtype=99"),
            std::string::npos);
}

}  // namespace
}  // namespace attncore::test
