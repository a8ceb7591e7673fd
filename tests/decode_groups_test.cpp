// GQA decode groups (src/cpu/flash_tile_loop-inl.h, DirectKv): a kv group's query rows read K
// and V in place as one work item of up to flash_direct_rows rows (8 on every target: more
// than AVX2's 6-row micro-tiles), or two items of half the rows up to twice that. Whatever the
// group size, each query head gets the bits it gets alone (a group of one), on every SIMD
// target, dtype and layout; and the group's item reads each key's K and V row once.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "core/params.h"
#include "cpu/flash.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

// Decode of `group` query heads over one kv head of `keys` keys, K and V [1, 1, L, D] (rows
// together) or views of [1, L, 3, D] (a key's row holding other heads too), against each head
// alone: the same bits, out and LSE.
void check_group(DType dtype, std::int64_t group, std::int64_t keys, bool heads_in_rows) {
  const std::int64_t d = 64;
  const Tensor q =
      make_tensor(dtype, {1, group, 1, d}, rounded(random_vector(group * d, 5 + group), dtype));
  // [1, L, 3, D]: kv head 1 of three, so that rows lie 3 * D apart.
  const std::int64_t kv_heads = heads_in_rows ? 3 : 1;
  const Tensor k_all = make_tensor(dtype, {1, keys, kv_heads, d},
                                   rounded(random_vector(keys * kv_heads * d, 7), dtype));
  const Tensor v_all = make_tensor(dtype, {1, keys, kv_heads, d},
                                   rounded(random_vector(keys * kv_heads * d, 9), dtype));
  auto one_head = [&](const Tensor& t) {
    TensorView s = t.view().transposed(1, 2);  // [1, Hkv, L, D]
    s.data = static_cast<char*>(s.data) +
             (kv_heads - 1) * s.stride_of(1) * static_cast<std::int64_t>(size_of(dtype));
    s.shape[1] = 1;
    return s;
  };
  const TensorView k = one_head(k_all), v = one_head(v_all);
  Options o;
  o.num_splits = 1;
  const ForwardResult all = forward(q.view(), k, v, o, Backend::flash);
  for (std::int64_t h = 0; h < group; ++h) {
    const ForwardResult alone = forward(index_of_dim(q.view(), 1, h), k, v, o, Backend::flash);
    const std::string what = "head " + std::to_string(h);
    ASSERT_TRUE(same_bits(read_view(index_of_dim(all.out.view(), 1, h)),
                          read_view(alone.out.view()), "out, " + what));
    ASSERT_TRUE(same_bits(read_view(index_of_dim(all.lse.view(), 1, h)),
                          read_view(alone.lse.view()), "lse, " + what));
  }
}

TEST(DecodeGroups, EachHeadHasItsBitsAloneInEveryGroupSize) {
  const std::int64_t most = 2 * detail::flash_direct_rows(8);
  for (const std::string& target : simd_targets_supported()) {
    const ScopedTarget scope(target);
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (bool heads_in_rows : {false, true}) {
        for (std::int64_t group = 2; group <= most; ++group) {
          SCOPED_TRACE(target + " " + std::string(name_of(dtype)) + " group " +
                       std::to_string(group) +
                       (heads_in_rows ? " [B, L, Hkv, D]" : " [B, Hkv, L, D]"));
          // Two tiles and a part of one: whole tiles read as streams, and a cut last one.
          check_group(dtype, group, 300, heads_in_rows);
        }
      }
    }
  }
}

// How many in-place items a kv group's rows make: one up to 8 rows on 6-row tiles (AVX2, generic)
// as on 8-row ones (AVX-512), two up to 16, none past (its tiles are packed).
TEST(DecodeGroups, OneItemUpToEightRowsTwoUpToSixteen) {
  detail::Params p;
  p.seq.lq = 1;
  for (int tile_rows : {6, 8}) {
    for (std::int64_t group : {1, 4, 6, 7, 8, 9, 12, 16, 17, 64}) {
      p.group = group;
      const std::int64_t items = group <= 8 ? 1 : group <= 16 ? 2 : 0;
      EXPECT_EQ(detail::flash_in_place_items(p, tile_rows), items)
          << "group " << group << ", tile rows " << tile_rows;
    }
  }
}

}  // namespace
}  // namespace attncore::test
