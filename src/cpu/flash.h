// The fused `flash` backend on CPUs: forward (one tiled loop with the online softmax, never
// materialising Lq x Lk) and backward, compiled once per SIMD target, dispatched once per call.
//
// Work is split into blocks of query rows of one head. K and V of one (batch, kv head) are
// packed once (K transposed into [D][key_tile] panels, V into rows padded to the vector width,
// both in f32) and shared by every block of every query head of the group.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend_table.h"
#include "core/convert.h"  // NarrowFn
#include "core/dbias.h"
#include "policy/softmax_state.h"

namespace attncore::detail {

// The shapes one SIMD target's kernel works in.
struct FlashLayout {
  int lanes;       // f32 lanes per vector
  int block_rows;  // query rows per work item (a multiple of the micro-tile's rows)
  int key_tile;    // keys per tile (a multiple of the QK micro-tile's width)
  int dv_align;    // Dv is padded to a multiple of this (the PV micro-tile's width)
  int tile_rows;   // rows of the micro-tiles
  bool bf16_dot;   // bf16 inputs run on native bf16 dot products (operands in bf16 pairs)
};

// K and V of one (batch, kv head), packed, as the kernel reads them; null tiles: the kernel
// packs each tile into its scratch when it needs it (for a group's only item).
struct FlashPanel {
  const float* k_tiles;  // [tiles][D][key_tile], zero past Lk
  const float* v_rows;   // [tiles * key_tile][dv_pad], zero past Lk and past Dv
  std::int64_t dv_pad;
};

// One thread's scratch for one work item, 64-byte aligned, sized by the dispatcher.
struct FlashScratch {
  float* q;               // [block_rows / tile rows][D][tile rows]: the queries times `scale`
  float* scores;          // [block_rows][key_tile]: S, then P
  float* out;             // [block_rows][dv_pad]: the unnormalised output accumulator
  SoftmaxState* softmax;  // [block_rows]: each row's online softmax (two floats' worth each)
  float* alpha;           // [block_rows]: the rescale of the accumulator for the current tile
  float* k_tile;          // [D][key_tile]: a tile packed on the fly (panel without tiles)
  float* v_tile;          // [key_tile][dv_pad]; also a V tile with keys left out (careful path)
  float* probs16;         // [block_rows][key_tile / 2]: P rounded to bf16 pairs (bf16 dots)
  // Items reading K/V in place (DirectKv): each kv head x of the item has its own q, S, O,
  // softmax states and alpha for its rows at heads + x * head_floats (direct_head_floats: room
  // for flash_direct_rows rows; an item spaces its heads by its own rows' floats).
  float* heads;
  std::int64_t head_floats;
  // The call's launch, whose cancel flag an item also reads between its key tiles (a decode
  // item over a long cache is one work item: 2^31 keys took 20 s to see Ctrl-C between items).
  const Launch* launch = nullptr;
};

// The most rows one work item reads K and V in place for (DirectKv): the micro-tile's, and at
// least 8, so that a GQA group of 7 or 8 query heads per kv head (AVX2's tiles are 6 rows) reads
// K and V once, not as two items of half its rows that read them twice (flash.cpp gives the
// measurements).
constexpr int flash_direct_rows(int tile_rows) { return tile_rows < 8 ? 8 : tile_rows; }
// Floats between the q, S and O of a DirectKv item's kv head (one cache line), so that a row's
// q, S and O do not lie a multiple of 4 KiB apart (as 8 rows of D = 128 put them).
constexpr std::int64_t kDirectSkew = 16;
// The floats of one kv head's scratch of a DirectKv item of `rows` computed rows, 64-byte
// aligned: q [rows][D], S [rows][key_tile], O [rows][dv_pad], softmax [rows] (two floats each),
// alpha [rows], with kDirectSkew floats after q and after S. Sized per item (its rows), not for
// the most rows an item takes, so that an item of 32 one-row heads (MHA) keeps its heads'
// scratch in 55 KiB (D = 128) rather than 400. (Sized for 8 rows, MHA bf16 [B, L, Hkv, D] decode,
// Hkv 32, 16384 keys, 1 thread, read 0.89-1.12x the time of the 6-row scratch before it in
// rounds of 5-9 calls in turn: this hour's noise, which hid any effect of either form.)
inline std::int64_t direct_head_floats(std::int64_t rows, std::int64_t key_tile, std::int64_t d,
                                       std::int64_t dv_pad) {
  return (rows * (d + key_tile + dv_pad + 3) + 2 * kDirectSkew + 15) / 16 * 16;
}

// One work item: `rows` (<= block_rows) consecutive query rows of the heads of one kv group.
// The group's rows are numbered n = (h - kv_head * group) * Lq + i; the item covers
// n in [first, first + rows). Long sequences get items inside one head; short ones (decode)
// put the rows of several heads of the group into one item, so K/V tiles serve them all.
// A split-KV item (cpu/flash_split_kv.h) visits only the key tiles inside [key_begin, key_end)
// (multiples of the key tile); masks and positions stay the sequence's own. An item reading
// K/V in place (decode) may cover `heads` consecutive kv heads from kv_head (the same rows and
// keys of each): its tiles are read for every head in turn (flash_tile_loop-inl.h), each head
// computed exactly as in an item of its own.
struct FlashItem {
  std::int64_t b, kv_head, first, rows;
  std::int64_t key_begin = 0, key_end = INT64_MAX;
  std::int64_t heads = 1;
};

// One thread's scratch for the backward of a run of query heads of one kv head (sizes set by
// flash_backward for the longest run).
struct FlashBackwardScratch {
  std::int64_t d_pad, dv_pad;         // head dims padded to the micro-tile width
  std::int64_t lq_pad;                // Lq padded to whole micro-tiles
  std::int64_t tile_begin, tile_end;  // the key tiles this call covers
  bool store_dq;  // write dQ to the output (else leave it in `dq` for the caller)
  // Takes the head's dK [key rows][d_pad] and dV [key rows][dv_pad] of key tile t.
  void (*put_kv_tile)(void* context, std::int64_t t, const float* dk, const float* dv);
  void* put_context;
  // The call's launch, whose cancel flag the item reads between its key tiles (null: never).
  // An item that stops there (or fails) marks every tile's turn abandoned, so that the runs
  // waiting for tiles stop too (KvTileReducer::abandon, flash_backward_driver.cpp).
  const Launch* launch;
  float* dq;     // [heads][lq_pad][d_pad]: the heads' dQ, fp32
  float* delta;  // [heads][Lq]: <dO_i, O_i>
  // Tiles in the forward's layouts (F32Dot, flash_dot_f32-inl.h; Bf16Dot, flash_dot_bf16-inl.h),
  // K packed as both keys and values:
  float* k_t;     // K's k-layout: for S
  float* k_rows;  // K's v-layout (bf16: pairs along keys): for dQ
  float* v_t;     // V's k-layout: for dP
  float* dk;      // [key rows][d_pad]: the tile's dK
  float* dv;      // [key rows][dv_pad]: the tile's dV
  // The heads' rows, packed once; blocks of block_rows rows, each in its own layout:
  float* q_rows;   // [heads][lq_pad][d_pad] ([d_pad / cols][rows][cols] per block, cols = dv_align;
                   // bf16: pairs of rows): q for dK, and for S in f32
  float* do_rows;  // [heads][lq_pad][dv_pad] (likewise): dO for dV, and for dP in f32
  float* q_t;      // bf16 only: [heads][lq_pad / tile rows][(D + 1) / 2][tile rows] pairs along D
                   // (q for S)
  float* do_t;     // bf16 only: likewise for dO: for dP
  float* lse;      // [heads][Lq]
  float* s;        // [block_rows][key_tile] (+ tile rows): S, P, then P * M
  float* ds;       // [block_rows][key_tile] (+ tile rows): dP, then dS
  float* dcap;     // [key_tile]: the softcap derivative of one row
  float* pairs;    // [3][block_rows / 2][key_tile]: P M and dS as bf16 pairs (bf16 products)
};

using FlashBlockFn = void (*)(const Params& p, const ForwardArgs& a, const FlashPanel& panel,
                              const FlashItem& item, const FlashScratch& scratch);
// Packs the K/V tiles [t_begin, t_end) of (b, kv_head) into the panel's layout.
using FlashPackFn = void (*)(const Params& p, const ForwardArgs& a, std::int64_t b,
                             std::int64_t kv_head, std::int64_t t_begin, std::int64_t t_end,
                             float* k_tiles, float* v_rows, std::int64_t dv_pad);

// The backward of query heads [h_begin, h_end) of batch b, all of one kv head; dbias is null
// unless it is asked for.
using FlashBackwardFn = void (*)(const Params& p, const BackwardArgs& a, std::int64_t b,
                                 std::int64_t h_begin, std::int64_t h_end,
                                 const FlashBackwardScratch& scratch, DbiasAccumulator* dbias);

struct FlashTarget {
  const char* name;      // "avx512bf16", "avx512", "avx2", "generic"
  const char* features;  // CPU features it needs, space-separated as CpuInfo names them
  FlashLayout layout;
  FlashBlockFn run_block;
  FlashPackFn pack_tiles;
  FlashBackwardFn run_backward_heads;
  NarrowFn narrow;  // 16-bit dK and dV rounded from their f32 sums (flash_simd-inl.h's narrow_row)
};

// The targets this build compiled, best first, and whether this CPU can run each.
std::vector<FlashTarget> flash_targets_compiled();
bool flash_target_supported(const FlashTarget& t);

// The target the next calls use: the best supported one, or the one set_simd_target chose.
const FlashTarget& flash_target_chosen();

void flash_forward(const Params& p, const Launch& launch, const ForwardArgs& args);

// The next of `count` work items handed out by `next`, or -1 when none is left. The call's
// cancel flag is read before an item is taken; an item then reads it between its key tiles
// (FlashScratch::launch, FlashBackwardScratch::launch). A backward run waits on the runs of its kv
// head taken before it; one that stops abandons its tiles, and its waiters stop too.
std::int64_t take_item(std::atomic<std::int64_t>& next, std::int64_t count, const Launch& launch);

// How flash_forward runs a call on `threads` threads: kv groups (b, kv head) spread over the
// threads, each thread taking the next group in `order` (else the groups go one after the
// other, their items shared by all threads), and whether tiles are packed on the fly.
struct FlashForwardPlan {
  bool spread = false;
  bool on_the_fly = false;
  std::vector<std::int64_t> order;  // group b * Hkv + kv_head, in the order they are taken
  std::int64_t panel_floats = 0;    // one panel: the longest sequence's K and V tiles
  // In place with the kv heads inside a key's row ([B, L, Hkv, D], pages): kv heads per item
  // (FlashItem::heads), else 1.
  std::int64_t item_heads = 1;
  // Split-KV parts of each group's keys (plan_kv_splits; 1: no split).
  std::int64_t splits = 1;
  int tile_rows = 0;  // the layout's (which rows read K and V in place)
  // The threads given scratch (and a panel each where spread): the call's threads, but no more
  // than its groups (times split parts and the two items of a group's halves), or than one
  // group's items where groups go one after the other.
  int workers = 1;
  // Kv heads per item of sequence b's groups: item_heads where its rows read K and V in place,
  // else 1 (a varlen batch's prefill chunks among its decode rows).
  std::int64_t heads_of(const Params& call, std::int64_t b) const;
};
// heads_in_rows: K's and V's kv heads lie inside a key's row (stride over heads below the
// stride over keys), so that items of several heads read memory in order.
FlashForwardPlan plan_flash_forward(const Params& p, int threads, const FlashLayout& layout,
                                    bool heads_in_rows);
// The plan's runs of kv heads (plan.heads_of each sequence), each by its first group, in the
// plan's order.
std::vector<std::int64_t> run_order(const FlashForwardPlan& plan, const Params& call);

// Most kv heads in one item reading K/V in place (FlashItem::heads): a key's row of 32 f32
// heads of D = 128 (16 KiB) read in order, the heads' scratch (q, S, O: 1.5 KiB a head for
// one row) within L2.
constexpr std::int64_t kMaxItemHeads = 32;

// Whether the forward reads K and V in place instead of packing tiles: decode, each kv group's
// rows (group * Lq) within flash_direct_rows(tile_rows), on f32 products for every dtype
// (DirectKv, flash_direct_kv-inl.h), as one work item. flash_forward gives such a problem no
// panel whatever the thread count.
bool flash_reads_kv_in_place(const Params& p, int tile_rows);
// The work items, each of at most flash_direct_rows(tile_rows) rows reading K and V in place,
// that a kv group's rows are cut into (1 where flash_reads_kv_in_place; 2 for up to twice that
// many rows, the rows halved: GQA decode of 9 to 16 rows), else 0 (the group's tiles are
// packed).
std::int64_t flash_in_place_items(const Params& p, int tile_rows);
void flash_backward(const Params& p, const Launch& launch, const BackwardArgs& args);

// How flash_backward cuts a problem into work items: runs of `run_heads` query heads of one kv
// head (`runs` per kv head), each run's key tiles in `parts` parts.
struct FlashBackwardPlan {
  std::int64_t run_heads, runs, parts;
};
FlashBackwardPlan plan_flash_backward(const Params& p, std::int64_t key_tile, bool dbias);
// The order flash_backward's threads take its items (kv_run * parts + part): in order for dense
// calls, the longest sequences first for varlen ones.
std::vector<std::int64_t> flash_backward_order(const Params& p, std::int64_t runs,
                                               std::int64_t parts);

// Its entry in the backend table (flash_cost.cpp).
void flash_can_use(Pass pass, const Params& p, std::vector<std::string>& reasons);
double flash_estimate(Pass pass, const Params& p, const Launch& launch, const CostModel& model);
// Bytes flash_forward / flash_backward allocate for the call (flash.cpp).
double flash_workspace_bytes(Pass pass, const Params& p, const Launch& launch);
// The backward's part of it (flash_backward_driver.cpp).
double flash_backward_workspace_bytes(const Params& p, const Launch& launch);
void flash_describe(CostModel& model);

}  // namespace attncore::detail
