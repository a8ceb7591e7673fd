// The decode kernels' plans (src/cpu/decode_plan.h): chosen by the core, and every
// plan giving the same bits (a prefetch changes no value; the plans' other branches also run
// here, under the sanitizers, on a machine that would never choose them).
#include "cpu/decode_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "testing/problem.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore::test {
namespace {

using detail::DecodePlan;

TEST(DecodePlan, ChosenByTheCore) {
  EXPECT_STREQ(detail::decode_plan_for("AuthenticAMD", 0x19).name, "zen4");
  EXPECT_STREQ(detail::decode_plan_for("AuthenticAMD", 0x1A).name, "zen5");
  EXPECT_STREQ(detail::decode_plan_for("GenuineIntel", 6).name, "intel");
  EXPECT_STREQ(detail::decode_plan_for("", 0).name, "zen4");  // the default
  int count = 0;
  const DecodePlan* plans = detail::decode_plans(&count);
  ASSERT_EQ(count, 3);
  const CpuInfo cpu = cpu_info();
  EXPECT_EQ(&detail::decode_plan(), &detail::decode_plan_for(cpu.vendor, cpu.family));
  {
    const detail::ScopedDecodePlan scope(plans[1]);
    EXPECT_EQ(&detail::decode_plan(), &plans[1]);
  }
  EXPECT_EQ(&detail::decode_plan(), &detail::decode_plan_for(cpu.vendor, cpu.family));
}

// Each plan of `plans` against the first, on every SIMD target this CPU runs, `hkv` kv heads of
// `dim` (K) and `dim_v` (V), query groups of each size of `groups`, over the cache in three
// layouts: [B, Hkv, L, D], [B, L, Hkv, D] and pages of 16 keys ([pages, 16, Hkv, D], handed out
// in reverse). Sequence 0 holds 3 whole tiles (a tile whose P . V runs with the next one's
// scores, twice, and after the last), sequence 1 ends in part of one.
void expect_same_bits(const std::vector<DecodePlan>& plans, std::int64_t dim, std::int64_t dim_v,
                      std::int64_t hkv, const std::vector<std::int64_t>& groups) {
  const int count = static_cast<int>(plans.size());
  const std::int64_t batch = 2, capacity = 384, page = 16;
  const std::vector<int> lens = {384, 301};
  Tensor seqlens(DType::i32, {batch});
  for (std::int64_t b = 0; b < batch; ++b) seqlens.data_as<std::int32_t>()[b] = lens[b];
  struct Types {
    DType q, kv;
  };
  for (const Types types : {Types{DType::f32, DType::f32}, Types{DType::bf16, DType::bf16},
                            Types{DType::f16, DType::f16}, Types{DType::f32, DType::bf16}}) {
    const auto values = [&](std::int64_t n, std::uint64_t seed) {
      return rounded(random_vector(n, seed), types.kv);
    };
    // [B, Hkv, L, D], [B, L, Hkv, D] and paged caches holding the same values.
    const Tensor k_outer =
        make_tensor(types.kv, {batch, hkv, capacity, dim}, values(batch * hkv * capacity * dim, 1));
    const Tensor v_outer = make_tensor(types.kv, {batch, hkv, capacity, dim_v},
                                       values(batch * hkv * capacity * dim_v, 2));
    const auto heads_inner = [&](const Tensor& t, std::int64_t width) {
      return make_tensor(types.kv, {batch, capacity, hkv, width},
                         read_view(t.view().transposed(1, 2)));
    };
    const Tensor k_inner = heads_inner(k_outer, dim), v_inner = heads_inner(v_outer, dim_v);
    const PagedPool k_pool =
        paged_values(read_view(k_inner.view()), batch, capacity, hkv * dim, page);
    const PagedPool v_pool =
        paged_values(read_view(v_inner.view()), batch, capacity, hkv * dim_v, page);
    const Tensor k_pages = make_tensor(types.kv, {k_pool.num_pages, page, hkv, dim}, k_pool.values);
    const Tensor v_pages =
        make_tensor(types.kv, {v_pool.num_pages, page, hkv, dim_v}, v_pool.values);
    for (std::int64_t group : groups) {
      for (std::int64_t lq : {1, 3}) {
        const Tensor q =
            make_tensor(types.q, {batch, hkv * group, lq, dim},
                        rounded(random_vector(batch * hkv * group * lq * dim, 3), types.q));
        Options o;
        o.num_threads = 1;
        if (lq > 1) o.causal = Causal::lower_right;
        for (const std::string& target : simd_targets_supported()) {
          const ScopedTarget scope(target);
          std::vector<double> want;
          for (int n = 0; n < count; ++n) {
            const detail::ScopedDecodePlan plan(plans[n]);
            for (const char* layout : {"[B, Hkv, L, D]", "[B, L, Hkv, D]", "pages"}) {
              SCOPED_TRACE(std::string(name_of(types.q)) + " over " +
                           std::string(name_of(types.kv)) + " " + target + " plan " +
                           plans[n].name + " group " + std::to_string(group) + " lq " +
                           std::to_string(lq) + " " + layout);
              const bool paged = layout[0] == 'p', inner = layout[4] == 'L';
              KvCacheSeqs seqs;
              seqs.cache_seqlens = seqlens.view();
              if (paged) seqs.block_table = k_pool.block_table.view();
              const TensorView kc = paged   ? k_pages.view().transposed(1, 2)
                                    : inner ? k_inner.view().transposed(1, 2)
                                            : k_outer.view();
              const TensorView vc = paged   ? v_pages.view().transposed(1, 2)
                                    : inner ? v_inner.view().transposed(1, 2)
                                            : v_outer.view();
              const ForwardResult got = forward_kvcache(q, kc, vc, seqs, o, Backend::flash);
              std::vector<double> bits = read_view(got.out.view());
              const std::vector<double> lse = read_view(got.lse.view());
              bits.insert(bits.end(), lse.begin(), lse.end());
              if (want.empty()) {
                want = bits;
              } else {
                ASSERT_TRUE(same_bits(bits, want, "out and lse"));
              }
            }
          }
        }
      }
    }
  }
}

// Decode and a 3-row chunk over a cache whose one head's keys lie together ([B, Hkv, L, D]),
// with a key's heads together ([B, L, Hkv, D]) and in pages, the plans' prefetches and schemes
// differing in each (one row's streams or its key-by-key order, several heads' key groups and
// one pass); MHA and GQA (groups of 2 and 4: each of the group kernels' row counts, 3 rows padded
// to 4 among them), f32, bf16, f16 and an f32 query over a bf16 cache; Lk a multiple of a tile and
// not of a block. Besides the machines' plans, plans whose distances reach far past a tile's
// rows: a prefetch address taken from past the rows a tile resolved would read past them (the
// sanitizers' builds); a plan with none of the schemes; and one with only the key-by-key order.
TEST(DecodePlan, EveryPlanGivesTheSameBits) {
  int machines = 0;
  const DecodePlan* known = detail::decode_plans(&machines);
  std::vector<DecodePlan> plans(known, known + machines);
  plans.push_back({.name = "far",
                   .near_k_into_l1 = true,
                   .near_k_f32_also_bytes = 1 << 30,
                   .near_k_f32_also_interleaved = true,
                   .f32_row_v_lead = 1000,
                   .v_far = 100000,
                   .v_into_l1 = true,
                   .one_row_streams = true,
                   .one_row_paired = false,
                   .heads_key_groups_f32 = true,
                   .heads_key_groups_16bit = true,
                   .heads_key_groups_pairs = true,
                   .heads_one_pass = true,
                   .heads_f32_k_lead = 1 << 30,
                   .heads_16bit_lead = 1 << 30,
                   .heads_16bit_into_l1 = true,
                   .heads_v_by_key = true,
                   .rows_streams = true,
                   .rows_overlap = true,
                   .heads_overlap = true,
                   .group_v_next_chunk = true,
                   .group_k_ahead_bytes = 1 << 30,
                   .group_k_spread = true,
                   .group_f32_near_spread = true,
                   .group_k_into_l1 = true,
                   .group_16bit_v_next_at_jumps = true,
                   .group_f32_next_v_into_l1 = true,
                   .group_by_key = true,
                   .group_widened_by_key_small_pages = true});
  // (far_l2 scores f32 rows over several heads by key groups, so that their K lead, far past a
  // tile's rows, runs here too.)
  DecodePlan far_l2{};  // (every field not set here false or 0)
  far_l2.name = "far_l2";
  far_l2.near_k_f32_also_bytes = 1 << 30;
  far_l2.f32_row_v_lead = 100000;
  far_l2.v_far = 1000;
  far_l2.heads_key_groups_f32 = true;
  far_l2.heads_f32_k_lead = 100000;
  far_l2.heads_16bit_lead = 100000;
  far_l2.group_k_ahead_bytes = 1;
  plans.push_back(far_l2);
  // None of AVX-512's schemes, no prefetch a plan can turn off (every field but the name false
  // or 0): the paths no machine's plan takes (f32 rows over several heads key by key among
  // them).
  DecodePlan none{};
  none.name = "none";
  plans.push_back(none);
  // One row's tiles read key by key, K and V at once (AVX-512; no machine's plan but Zen 5's).
  DecodePlan paired{};
  paired.name = "paired";
  paired.one_row_paired = true;
  plans.push_back(paired);
  // D = 128: a whole 8-vector column slice on AVX-512 (the heads' one pass, heads_one_pass), and
  // the only Dv one row's key-by-key order takes (one_row_paired), also under D = 64.
  for (const auto& [dim, dim_v] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{64, 128}}) {
    expect_same_bits(plans, dim, dim_v, 2, {1, 2, 4});
  }
  // 5 kv heads: the widened 16-bit scores over several heads take 4 heads' products at a time,
  // and a group's rows key by key 8 / R heads' (a whole group, then a part of one); groups of 3
  // rows (computed as 4) and of 8.
  expect_same_bits(plans, 128, 128, 5, {1, 3, 8});
}

// A spec names a machine's plan and sets any of its fields; an unknown plan or field, or a value
// out of range, is refused with the spec in the message.
TEST(DecodePlan, SpecsSetFieldsAndRefuseWhatTheyDoNotName) {
  const DecodePlan zen5 = detail::decode_plan_from_spec("zen5");
  EXPECT_STREQ(zen5.name, "zen5");
  EXPECT_TRUE(zen5.one_row_paired);
  const DecodePlan changed = detail::decode_plan_from_spec("zen5,one_row_paired=0,v_far=64");
  EXPECT_FALSE(changed.one_row_paired);
  EXPECT_EQ(changed.v_far, 64);
  EXPECT_EQ(changed.group_k_ahead_bytes, zen5.group_k_ahead_bytes);
  // Every field a spec may set, once each (all of DecodePlan's but its name: their count,
  // EachSpecFieldSetsItsOwnMember).
  std::vector<std::string> fields = detail::decode_plan_field_names();
  for (const std::string& field : fields) {
    EXPECT_NO_THROW(detail::decode_plan_from_spec("zen4," + field + "=1")) << field;
  }
  std::sort(fields.begin(), fields.end());
  EXPECT_EQ(std::adjacent_find(fields.begin(), fields.end()), fields.end());
  for (const char* bad :
       {"zen9", "", "zen5,no_such_field=1", "zen5,v_far", "zen5,v_far=", "zen5,v_far=-1",
        "zen5,v_far=1x", "zen5,one_row_paired=2", "zen5,v_far=99999999999"}) {
    try {
      detail::decode_plan_from_spec(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("decode_plan_from_spec: "), std::string::npos) << bad;
    }
  }
}

// Each field a spec may set sets the member of its own name and no other: this test's own map
// from DecodePlan's members to their names against decode_plan.cpp's table (a name there tied
// to another member of the same type would set the wrong one).
TEST(DecodePlan, EachSpecFieldSetsItsOwnMember) {
  struct Member {
    const char* name;
    bool DecodePlan::*flag;
    int DecodePlan::*number;
  };
  const Member members[] = {
      {"near_k_into_l1", &DecodePlan::near_k_into_l1, nullptr},
      {"near_k_f32_also_bytes", nullptr, &DecodePlan::near_k_f32_also_bytes},
      {"near_k_f32_also_interleaved", &DecodePlan::near_k_f32_also_interleaved, nullptr},
      {"f32_row_v_lead", nullptr, &DecodePlan::f32_row_v_lead},
      {"v_far", nullptr, &DecodePlan::v_far},
      {"v_into_l1", &DecodePlan::v_into_l1, nullptr},
      {"one_row_streams", &DecodePlan::one_row_streams, nullptr},
      {"one_row_paired", &DecodePlan::one_row_paired, nullptr},
      {"heads_key_groups_f32", &DecodePlan::heads_key_groups_f32, nullptr},
      {"heads_key_groups_16bit", &DecodePlan::heads_key_groups_16bit, nullptr},
      {"heads_key_groups_pairs", &DecodePlan::heads_key_groups_pairs, nullptr},
      {"heads_one_pass", &DecodePlan::heads_one_pass, nullptr},
      {"heads_f32_k_lead", nullptr, &DecodePlan::heads_f32_k_lead},
      {"heads_16bit_lead", nullptr, &DecodePlan::heads_16bit_lead},
      {"heads_16bit_into_l1", &DecodePlan::heads_16bit_into_l1, nullptr},
      {"heads_v_by_key", &DecodePlan::heads_v_by_key, nullptr},
      {"rows_streams", &DecodePlan::rows_streams, nullptr},
      {"rows_overlap", &DecodePlan::rows_overlap, nullptr},
      {"heads_overlap", &DecodePlan::heads_overlap, nullptr},
      {"group_v_next_chunk", &DecodePlan::group_v_next_chunk, nullptr},
      {"group_k_ahead_bytes", nullptr, &DecodePlan::group_k_ahead_bytes},
      {"group_k_spread", &DecodePlan::group_k_spread, nullptr},
      {"group_f32_near_spread", &DecodePlan::group_f32_near_spread, nullptr},
      {"group_k_into_l1", &DecodePlan::group_k_into_l1, nullptr},
      {"group_16bit_v_next_at_jumps", &DecodePlan::group_16bit_v_next_at_jumps, nullptr},
      {"group_f32_next_v_into_l1", &DecodePlan::group_f32_next_v_into_l1, nullptr},
      {"group_by_key", &DecodePlan::group_by_key, nullptr},
      {"group_widened_by_key_small_pages", &DecodePlan::group_widened_by_key_small_pages, nullptr},
  };
  ASSERT_EQ(std::size(members), detail::decode_plan_field_names().size());
  const auto values = [&](const DecodePlan& plan) {
    std::vector<long> out;
    for (const Member& m : members) {
      out.push_back(m.flag != nullptr ? plan.*(m.flag) : plan.*(m.number));
    }
    return out;
  };
  for (const char* base_name : {"zen4", "zen5"}) {
    const DecodePlan base = detail::decode_plan_from_spec(base_name);
    const std::vector<long> before = values(base);
    for (std::size_t i = 0; i < std::size(members); ++i) {
      const long want = members[i].flag != nullptr ? !before[i] : before[i] + 1;
      const std::string spec =
          std::string(base_name) + "," + members[i].name + "=" + std::to_string(want);
      const std::vector<long> after = values(detail::decode_plan_from_spec(spec));
      for (std::size_t j = 0; j < std::size(members); ++j) {
        EXPECT_EQ(after[j], j == i ? want : before[j]) << spec << " set " << members[j].name;
      }
    }
  }
}

}  // namespace
}  // namespace attncore::test
