// Where and how far ahead the in-place decode kernels (DirectKv, flash_direct_kv*-inl.h)
// prefetch the K and V rows they stream, and in which order they read them (the schemes AVX2
// always runs, which AVX-512 runs where the plan says): a property of the core's design, chosen
// once from the CPU. A prefetch changes no value, and each scheme forms every score and output
// element as the others do, so every plan gives the same bits.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace attncore::detail {

struct DecodePlan {
  const char* name;
  // (Each field below is also in decode_plan.cpp's table of the fields a spec may set.)
  // K rows of one head lying together ([B, Hkv, L, D]), prefetched 6 KiB ahead into L1 (else
  // L2); f32 rows also this many bytes ahead, into the same level (0: not), those prefetches
  // either each just before the one of the row 6 KiB ahead (interleaved) or all of a block of
  // keys before them.
  bool near_k_into_l1;
  int near_k_f32_also_bytes;
  bool near_k_f32_also_interleaved;
  // V rows of one f32 query row over one head (MHA [B, Hkv, L, D]) prefetched this many keys
  // ahead of P . V, into L1 or L2 as v_into_l1 says (0: not; other one-head items: kVLead,
  // flash_direct_kv_products-inl.h).
  int f32_row_v_lead;
  // V rows of any one-head item ([B, Hkv, L, D]) also prefetched this many keys ahead into L2
  // (0: not; on AVX2 not for a GQA group's rows: flash_direct_kv_products-inl.h).
  int v_far;
  // V rows prefetched f32_row_v_lead or kVLead keys ahead (GQA on AVX-512: also each column
  // slice's 16 keys ahead, except a group's 16-bit rows over one head with v_far) into L1, else
  // into L2.
  bool v_into_l1;
  // One query row over one head whose rows lie together (MHA [B, Hkv, L, D]) scores each whole
  // key tile as 4 sequential streams, with the P . V of the tile before it run between them (K
  // and V read at once: DirectKvStreams::score_tile_streams); AVX2 always does.
  bool one_row_streams;
  // One query row over one head (any layout) has each tile's P . V wait for the next tile's
  // scores, and where that tile's first two rows lie together and Dv = 128 scores it key by
  // key, each key's score followed by the previous tile's P . V of the same key (K and V read
  // as one stream each, at once: DirectKvStreams::score_tile_paired); AVX-512 only, taken
  // before one_row_streams.
  bool one_row_paired;
  // One query row per head over several heads (MHA [B, L, Hkv, D], pages): scores 4 keys at a
  // time head after head (DirectKvHeads::score_heads_key_groups), for f32 K, for 16-bit K
  // widened in registers, and on bf16 pairs (AVX512-BF16: score_heads_key_groups_pairs); and P .
  // V of a chunk of keys for every head in one pass (DirectKv::accumulate_heads); AVX2 always
  // does the first two and the one pass (it has no pairs).
  bool heads_key_groups_f32;
  bool heads_key_groups_16bit;
  bool heads_key_groups_pairs;
  bool heads_one_pass;
  // Those f32 rows' key groups on AVX-512 prefetch K rows this many keys on into L2, line by
  // line as the products read theirs (0: none; AVX2 prefetches none; nor do the key groups
  // that run with P . V, heads_overlap).
  int heads_f32_k_lead;
  // Their 16-bit K rows (scored key by key, by the key groups or on bf16 pairs), and their
  // 16-bit V rows with heads_v_by_key, likewise prefetched this many keys on, line by line (0:
  // none; with heads_overlap its own lead, DirectKv::heads_overlap_lead), key by key into L1
  // where heads_16bit_into_l1 says, else into L2.
  int heads_16bit_lead;
  bool heads_16bit_into_l1;
  // One row per head over several heads (MHA [B, L, Hkv, D], pages), AVX-512: P . V key after
  // key, each key's row of every head in turn with every head's output in L1, V read in address
  // order, f32 rows prefetched only where its rows jump (a page boundary: DirectKvHeads::
  // accumulate_by_key); taken before heads_one_pass, not with heads_overlap.
  bool heads_v_by_key;
  // A group's 2 to 4 query rows over one head whose rows lie together (GQA [B, Hkv, L, D]) score
  // each whole key tile as 4 sequential streams, as one row's streams do
  // (DirectKvStreams::score_tile_streams<R>).
  bool rows_streams;
  // Those rows' P . V of each tile run with the next tile's scores, as one row's do with its
  // streams (K and V read at once: DirectKv::RowsProduct).
  bool rows_overlap;
  // One query row per head over several heads (MHA [B, L, Hkv, D], pages, AVX-512), and a GQA
  // group's 16-bit rows likewise: each tile's P . V run with the next tile's scores, head by
  // head, 4 keys at a time (K and V read at once: DirectKv::heads_with_product); only with
  // the key groups for K's width (the order of those scores), never on bf16 pairs.
  bool heads_overlap;
  // A GQA group's 3 or more rows over several heads (GQA [B, L, Hkv, D], pages, AVX-512): each
  // chunk of P . V also prefetches its head's next chunk of V rows (the far end of the next
  // kHeadVAhead bytes, into L2: DirectKv::tile_accumulate), besides each column slice's lines 16
  // keys on.
  bool group_v_next_chunk;
  // A GQA group's K rows over several heads prefetched this many bytes of each head ahead, into
  // L2 (DirectKvScores::scores): each block's rows before its scores, or, with
  // group_k_spread (AVX-512), each line as the products read the same line of their key's row
  // (DirectKvBlockScores::score_rows, score_rows_pairs; AVX2 always prefetches a group's rows
  // before its products); with it, too, a group's 16-bit rows over one head ([B, Hkv, L, D])
  // prefetch K line by line through the products, 6 KiB (at most kRowLead keys) ahead
  // (DirectKvScores::scores).
  int group_k_ahead_bytes;
  bool group_k_spread;
  // A group's f32 rows over one head whose rows lie together ([B, Hkv, L, D]) spread each
  // block's K prefetches over the rows' scores, not all before the first (AVX2 always does).
  bool group_f32_near_spread;
  // A GQA group's 3 or more rows: their K prefetched line by line through their scores
  // (DirectKvBlockScores::score_rows, score_rows_pairs: group_k_spread) into L1 instead of L2.
  bool group_k_into_l1;
  // Those 16-bit rows over several heads prefetch their next chunk of V (group_v_next_chunk) only
  // where its rows do not go on evenly from the chunk's (a page boundary), each row by one chunk
  // (not kHeadVTimes); their column slices' prefetches take the rest (DirectKvProducts).
  bool group_16bit_v_next_at_jumps;
  // Those f32 rows over several heads prefetch their next chunk of V into L1 instead of L2.
  bool group_f32_next_v_into_l1;
  // A GQA group's f32 rows, and its bf16 rows on pair dot products, over several heads
  // (AVX-512): scored key by key, each key's row of every head in turn, K read in address order
  // (DirectKvHeads::score_rows_by_key); and its widened 16-bit rows so where the tile's rows lie
  // in pages of 32 keys or fewer (DirectKvScores::jumps_often); 16-bit rows in groups of up to 4.
  bool group_by_key;
  bool group_widened_by_key_small_pages;

  // Whether one row per head over several heads scores K of this element size (4: f32, 2:
  // 16-bit widened) by score_heads_key_groups.
  bool heads_key_groups(std::size_t element_bytes) const {
    return element_bytes == 4 ? heads_key_groups_f32 : heads_key_groups_16bit;
  }
};

// The plan for a CPU: `vendor` as cpuid gives it ("AuthenticAMD", ...) and its x86 family
// (CpuInfo::family).
const DecodePlan& decode_plan_for(const std::string& vendor, int family);

// This machine's plan (decode_plan_for of attncore::cpu_info(), looked up once), or the one
// a ScopedDecodePlan holds.
const DecodePlan& decode_plan();

// The plans there are (for tests: every plan must give the same bits).
const DecodePlan* decode_plans(int* count);

// The plan a spec names, for tuning (bench/decode_plans.cpp): a plan of decode_plans() by name,
// then any of its fields set, each as ",field=value" (a flag 0 or 1), e.g.
// "zen5,one_row_paired=0,v_far=64". The plan keeps its base's name. Throws InvalidArgument
// naming an unknown plan or field, or a value out of range.
DecodePlan decode_plan_from_spec(const std::string& spec);

// The fields a spec may set, in the order DecodePlan declares them (all of them but the name).
std::vector<std::string> decode_plan_field_names();

// Makes `plan` (a plan of decode_plans() or any other) the one decode_plan() returns while
// in scope: tests. (A call running meanwhile may mix plans, which changes no value.)
class ScopedDecodePlan {
 public:
  explicit ScopedDecodePlan(const DecodePlan& plan);
  ~ScopedDecodePlan();
  ScopedDecodePlan(const ScopedDecodePlan&) = delete;
  ScopedDecodePlan& operator=(const ScopedDecodePlan&) = delete;

 private:
  const DecodePlan* previous_;
};

}  // namespace attncore::detail
