// The flash backend's driver: SIMD target choice, and the fused forward's K/V packing, work
// items and threads (the backward's: flash_backward_driver.cpp); the call's cancel flag is read
// between work items (and by each forward item between its key tiles: FlashScratch::launch).
#include "cpu/flash.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "attncore/error.h"
#include "attncore/info.h"
#include "core/convert.h"
#include "core/cpu_info.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "cpu/aligned_floats.h"
#include "cpu/flash_split_kv.h"
#include "policy/mask.h"

namespace attncore::detail {

#if defined(__x86_64__)
// (The AVX-512 ones are not compiled with ATTNCORE_NO_AVX512BF16 / ATTNCORE_NO_AVX512:
// CMakeLists.txt's ATTNCORE_SIMD_TARGETS.)
FlashTarget flash_target_avx512bf16();
FlashTarget flash_target_avx512();
FlashTarget flash_target_avx2();
#endif
FlashTarget flash_target_generic();

namespace {

// The target chosen by set_simd_target ("" = the best supported one). Never destroyed, like
// every static a call reads: a call may be in flight at exit (tests/exit_test.cpp).
std::mutex g_choice_mutex;
std::string& g_choice = *new std::string;

}  // namespace

std::int64_t take_item(std::atomic<std::int64_t>& next, std::int64_t count, const Launch& launch) {
  launch.check_cancel();
  const std::int64_t n = next.fetch_add(1);
  return n < count ? n : -1;
}

std::vector<FlashTarget> flash_targets_compiled() {
#if defined(__x86_64__)
  return {
#if !defined(ATTNCORE_NO_AVX512BF16)
    flash_target_avx512bf16(),
#endif
#if !defined(ATTNCORE_NO_AVX512)
        flash_target_avx512(),
#endif
        flash_target_avx2(), flash_target_generic()
  };
#else
  return {flash_target_generic()};
#endif
}

bool flash_target_supported(const FlashTarget& t) {
  static const CpuInfo& cpu = *new CpuInfo(cpu_info());  // never destroyed: see g_choice
  const std::string features = t.features;
  for (std::size_t at = 0; at < features.size();) {
    std::size_t end = features.find(' ', at);
    if (end == std::string::npos) end = features.size();
    if (end > at && !cpu.has(features.substr(at, end - at))) return false;
    at = end + 1;
  }
  return true;
}

namespace {

// Whether this CPU's bf16 pair dot products (AVX512-BF16's VDPBF16PS) beat widening bf16 to f32
// for FMAs: on AMD's Zen 4 and Zen 5 (the avx512bf16 target's kernels were measured there), not
// on Intel's cores. On an Intel Xeon with AVX512-FP16 and AMX (family 6 model 0xA7 as its
// hypervisor reports it), one VDPBF16PS zmm took 1.94 cycles of throughput and 7.7 of latency
// against 0.48 and 3.8 for VFMADD231PS (16 independent chains, or one), so its 32 products per
// instruction came at half the FMA's rate before any widening; flash on 1 thread, bf16, Hq = 16,
// Lq = Lk = 2048, D = 128, the avx512 target against avx512bf16: forward 132.8-136.5 GFLOP/s
// against 96.6 (two runs each), backward (Hq = 8) 152.9 against 98.7.
bool bf16_dots_pay(const CpuInfo& cpu) { return cpu.vendor != "GenuineIntel"; }

// The compiled targets, best first for this CPU: flash_targets_compiled's order, but avx512
// before avx512bf16 where bf16 dot products do not pay.
const std::vector<FlashTarget>& targets_best_first() {
  static const std::vector<FlashTarget>& targets = *new std::vector<FlashTarget>([] {
    std::vector<FlashTarget> all = flash_targets_compiled();
    if (!bf16_dots_pay(cpu_info())) {
      for (std::size_t i = 0; i + 1 < all.size(); ++i) {
        if (std::string(all[i].name) == "avx512bf16" && std::string(all[i + 1].name) == "avx512") {
          std::swap(all[i], all[i + 1]);
        }
      }
    }
    return all;
  }());  // never destroyed: see g_choice
  return targets;
}

}  // namespace

const FlashTarget& flash_target_chosen() {
  const std::vector<FlashTarget>& targets = targets_best_first();
  std::lock_guard<std::mutex> lock(g_choice_mutex);
  for (const FlashTarget& t : targets) {
    if ((g_choice.empty() || g_choice == t.name) && flash_target_supported(t)) return t;
  }
  return targets.back();  // generic: always compiled, always supported
}

namespace {

// Key tiles packed into a shared panel per parallel_for, a cancel checked between: 64 tiles
// (8192 keys: ~1.4 ms of packing on one core at D = 128, f32, from perf of `attncore run
// --seqlen-q 64 --heads-q 8 --heads-kv 1 --seqlen-k 262144`) against the pool's wake-up of 2-4
// us (`attncore info`). That run, 2 threads, in turns with the version before: 719-728 ms
// against 732-799.
constexpr std::int64_t kPackChunkTiles = 64;

// How one kv group's rows are cut into work items.
struct ItemPlan {
  std::int64_t per_head;  // items per query head (rows stay inside one head); 0: rows of the
                          // whole group are cut into consecutive blocks
  std::int64_t count;     // items per kv group
  std::int64_t block_rows;

  FlashItem item(std::int64_t b, std::int64_t kv_head, std::int64_t n, const Params& p) const {
    if (per_head > 0) {
      const std::int64_t head = n / per_head, row0 = (n % per_head) * block_rows;
      return {b, kv_head, head * p.seq.lq + row0, std::min(block_rows, p.seq.lq - row0)};
    }
    const std::int64_t first = n * block_rows;
    return {b, kv_head, first, std::min(block_rows, p.group * p.seq.lq - first)};
  }
};

// Items of at most `block_rows` rows, or the in-place items of flash_in_place_items.
ItemPlan plan_items(const Params& p, const FlashLayout& layout) {
  const std::int64_t block_rows = layout.block_rows, rows = p.group * p.seq.lq;
  if (const std::int64_t n = flash_in_place_items(p, layout.tile_rows); n > 1) {
    return {0, n, (rows + n - 1) / n};
  }
  if (p.seq.lq >= block_rows) {
    const std::int64_t per_head = (p.seq.lq + block_rows - 1) / block_rows;
    return {per_head, per_head * p.group, block_rows};
  }
  return {0, (rows + block_rows - 1) / block_rows, block_rows};
}

}  // namespace

bool flash_reads_kv_in_place(const Params& p, int tile_rows) {
  return p.group * p.seq.lq <= flash_direct_rows(tile_rows);
}

// Up to flash_direct_rows rows, one item reads K and V in place once (AVX2's 7 or 8 rows were
// two items of half the rows, each reading them: Zen 3, `attncore run --cache-len 16384`, D
// 128, 5 rounds in turn, median time, two items -> one: Hq 64, Hkv 8, 1 thread f32 17.5 -> 13.8
// ms, bf16 13.0 -> 11.4, pages of 16 bf16 13.6 -> 11.8; 2 threads f32 8.4 -> 7.4, bf16 8.6 ->
// 5.9; Hq 56 f32 17.2 -> 13.3, bf16 12.6 -> 11.3; Hq 8, Hkv 1 (split-KV), 2 threads, f32 0.95 ->
// 0.82, bf16 0.76 -> 0.70). Up to twice that many, two items reading K and V in place each read
// them once, where one item over every row packs each tile before its products (the tile
// kernels' rows, packing 16-bit K/V to f32): 8 rows over AVX2's 6-row tiles so, against one
// packing item, K/V GB/s on 1 / 2 threads: Hq 64, Hkv 8, bf16 1.42 -> 4.56 / 1.85 -> 8.21, f32
// 2.46 -> 6.68 / 3.38 -> 14.24; Hq 8, Hkv 1 (split-KV) bf16 2.08 -> 5.98 / 3.61 -> 7.51, f32
// 5.21 -> 5.21 / 9.40 -> 10.72 (Hq 128, Hkv 8, 16 rows, two items of 8 against one packing:
// bf16 13.5 -> 12.7 ms, f32 14.8 -> 13.6 over 8192 keys, 1 thread). More rows pack: three such
// items would read K and V three times.
namespace {

// flash_in_place_items of a group of `rows` rows.
std::int64_t in_place_items(std::int64_t rows, int tile_rows) {
  const std::int64_t most = flash_direct_rows(tile_rows);
  return rows <= most ? 1 : rows <= 2 * most ? 2 : 0;
}

}  // namespace

std::int64_t flash_in_place_items(const Params& p, int tile_rows) {
  return in_place_items(p.group * p.seq.lq, tile_rows);
}

std::int64_t FlashForwardPlan::heads_of(const Params& call, std::int64_t b) const {
  if (item_heads == 1 || !call.seq.varlen()) return item_heads;
  return in_place_items(call.group * call.seq.at(b).lq, tile_rows) > 0 ? item_heads : 1;
}

namespace {

// One thread's FlashScratch of the forward, in floats, for items of up to `item_heads` kv
// heads.
std::int64_t forward_scratch_floats(const FlashLayout& layout, std::int64_t d, std::int64_t dv_pad,
                                    std::int64_t item_heads) {
  return round_up(layout.block_rows * (d + layout.key_tile + dv_pad + 3) +
                      layout.key_tile * (d + dv_pad) + layout.block_rows * layout.key_tile / 2,
                  16) +
         item_heads *
             direct_head_floats(flash_direct_rows(layout.tile_rows), layout.key_tile, d, dv_pad);
}

}  // namespace

FlashForwardPlan plan_flash_forward(const Params& call, int threads, const FlashLayout& layout,
                                    bool heads_in_rows) {
  FlashForwardPlan plan;
  const std::int64_t groups = call.batch * call.heads_kv;
  // Work of a group: its query rows times keys (the cost of a plain, unmasked group).
  std::vector<double> work(static_cast<std::size_t>(call.batch));
  double total = 0;
  for (std::int64_t b = 0; b < call.batch; ++b) {
    const SeqSpan s = call.seq.at(b);
    const double w =
        static_cast<double>(s.lq) * static_cast<double>(s.lk) * static_cast<double>(call.group);
    work[static_cast<std::size_t>(b)] = w;
    total += w * static_cast<double>(call.heads_kv);
  }
  // Threads take whole groups, varlen ones the longest first (ties keep their order): no long
  // group is left to the end while the other threads idle. The order depends only on the
  // problem.
  plan.order.resize(static_cast<std::size_t>(groups));
  for (std::size_t g = 0; g < plan.order.size(); ++g) plan.order[g] = static_cast<std::int64_t>(g);
  if (call.seq.per_sequence()) {
    std::stable_sort(plan.order.begin(), plan.order.end(), [&](std::int64_t x, std::int64_t y) {
      return work[static_cast<std::size_t>(x / call.heads_kv)] >
             work[static_cast<std::size_t>(y / call.heads_kv)];
    });
  }
  // Enough kv groups to keep every thread busy on whole groups (each thread packs its groups
  // into its own panel, no barrier between groups), and panels small next to the operands
  // (at most 1/8 of q, k, v and out together): groups are spread over the threads. Varlen
  // groups of several items are spread only when, handed out in this order to whichever thread
  // is free, no thread gets more than 5% above its share (one sequence of 8192 among 63 of 16
  // with 32 query heads on one kv head is one group: it runs with every thread on its items).
  // Else the groups go one after the other, their packing and their items shared by all
  // threads. Groups of one item (decode; every sequence's, varlen or not) are always spread, and
  // pack each tile just before its use, into scratch: no panel at all.
  const std::int64_t tiles = (call.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  // (Varlen: planned on the longest sequence's rows, not on max_seqlen_q, which may be larger.)
  Params longest = call;
  longest.seq.lq = call.seq.max_q();
  const std::int64_t dv_pad = round_up(call.head_dim_v, layout.dv_align);
  plan.panel_floats = round_up(tiles * layout.key_tile * (call.head_dim + dv_pad), 16);
  // Groups of one item each (decode, GQA decode, short chunks; a KV cache's sequences all have
  // Lq rows, a varlen call's at most max_seqlen_q): K/V read in place, or each tile packed just
  // before its use into scratch (no panel), the groups spread over the threads. (Such a group's
  // K/V packed whole into a shared panel first, by every thread, was read three times instead
  // of once: a cache's GQA decode of more rows than a tile's, 8 on AVX2, took 1 GB of panel for
  // 2^20 keys, and one thread computed while the other waited.)
  plan.on_the_fly =
      plan_items(longest, layout).count == 1 || flash_in_place_items(longest, layout.tile_rows) > 0;
  const double dims = static_cast<double>(call.head_dim + call.head_dim_v);
  const double q_rows = call.seq.varlen() ? static_cast<double>(call.seq.cu_q[call.batch])
                                          : static_cast<double>(call.batch * call.seq.lq);
  // (Over page pools the keys of the sequences, which cu_seqlens_k only bounds.)
  double k_rows = call.seq.varlen() ? static_cast<double>(call.seq.cu_k[call.batch])
                                    : static_cast<double>(call.batch * call.seq.max_k());
  if (call.seq.varlen() && call.seq.paged()) {
    k_rows = 0;
    for (std::int64_t b = 0; b < call.batch; ++b) k_rows += static_cast<double>(call.seq.at(b).lk);
  }
  const double operand_floats = dims * (static_cast<double>(call.heads_q) * q_rows +
                                        static_cast<double>(call.heads_kv) * k_rows);
  const bool enough_groups = groups >= 2 * threads || groups % threads == 0;
  bool even = true;
  if (call.seq.per_sequence()) {
    std::vector<double> load(static_cast<std::size_t>(threads), 0.0);
    for (std::int64_t g : plan.order) {
      *std::min_element(load.begin(), load.end()) +=
          work[static_cast<std::size_t>(g / call.heads_kv)];
    }
    even = *std::max_element(load.begin(), load.end()) <= 1.05 * total / threads;
  }
  plan.spread =
      plan.on_the_fly || (enough_groups && even &&
                          8.0 * threads * static_cast<double>(plan.panel_floats) <= operand_floats);
  plan.splits = plan_kv_splits(call, layout, machine_threads());
  // In place with the heads inside a key's row: an item takes a run of kv heads of one
  // sequence (and of one split part), so that it reads each key's row in order (one head's
  // rows lie Hkv * D apart: no hardware prefetch stream, L1 set conflicts). All of a
  // sequence's heads when there are sequences (times parts) for every thread, else enough runs
  // per sequence for the threads. A head's bits do not depend on its run.
  // (A group cut into two items of its rows: each item a run of heads over half the rows.) A
  // varlen batch spread over the threads whose sequences are not all read in place (prefill
  // chunks among decode rows): the runs of heads of those that are (heads_of). One 256-row
  // chunk over 256 keys and 63 decode rows over 4096 keys (Hq 32, Hkv 8, D 128, bf16, packed
  // [total_k, Hkv, D], 1 thread, 2 runs): 132-149 ms, against 229-297 with one head per item
  // (the decode rows alone 105 ms, the chunk alone 15).
  const std::int64_t in_place = flash_in_place_items(longest, layout.tile_rows);
  plan.tile_rows = layout.tile_rows;
  bool some_in_place = in_place > 0;
  for (std::int64_t b = 0; !some_in_place && call.seq.varlen() && b < call.batch; ++b) {
    const std::int64_t lq = call.seq.at(b).lq;  // (a sequence without queries has no items)
    some_in_place = lq > 0 && in_place_items(call.group * lq, layout.tile_rows) > 0;
  }
  if ((plan.on_the_fly || (plan.spread && call.seq.varlen())) && heads_in_rows && some_in_place) {
    const std::int64_t batch =
        std::max<std::int64_t>(call.batch, 1) * plan.splits * std::max<std::int64_t>(in_place, 1);
    const std::int64_t runs = std::clamp<std::int64_t>((threads + batch - 1) / batch, 1,
                                                       std::max<std::int64_t>(call.heads_kv, 1));
    plan.item_heads = std::clamp<std::int64_t>((call.heads_kv + runs - 1) / runs, 1, kMaxItemHeads);
  }
  const std::int64_t units = plan.spread || plan.splits > 1 ? groups * plan.splits * 2
                                                             : plan_items(longest, layout).count;
  plan.workers = static_cast<int>(std::clamp<std::int64_t>(units, 1, std::max(threads, 1)));
  return plan;
}

std::vector<std::int64_t> run_order(const FlashForwardPlan& plan, const Params& call) {
  std::vector<std::int64_t> runs;
  for (std::int64_t g : plan.order) {
    if (g % call.heads_kv % plan.heads_of(call, g / call.heads_kv) == 0) runs.push_back(g);
  }
  return runs;
}

void flash_forward(const Params& call, const Launch& launch, const ForwardArgs& call_args) {
  if (call.empty_output()) return;
  const FlashTarget& target = flash_target_chosen();
  const FlashLayout& layout = target.layout;
  const std::int64_t d = call.head_dim;
  // Sized for the longest sequence (varlen) or every sequence (dense).
  const std::int64_t tiles = (call.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  const std::int64_t dv_pad = round_up(call.head_dim_v, layout.dv_align);
  const bool heads_in_rows = call_args.k.stride[1] < call_args.k.stride[2] &&
                             call_args.v.stride[1] < call_args.v.stride[2];
  const FlashForwardPlan plan =
      plan_flash_forward(call, std::max(1, launch.threads), layout, heads_in_rows);
  const int threads = plan.workers;
  const std::int64_t scratch_floats = forward_scratch_floats(layout, d, dv_pad, plan.item_heads);
  const std::int64_t panel_floats = plan.panel_floats;
  const bool on_the_fly = plan.on_the_fly;

  auto scratch_of = [&](float* base) {
    const std::int64_t r = layout.block_rows;
    float* tiles_base = base + r * (d + layout.key_tile + dv_pad + 3);
    static_assert(sizeof(SoftmaxState) == 2 * sizeof(float), "a row's state takes two floats");
    float* probs16 = tiles_base + layout.key_tile * (d + dv_pad);
    return FlashScratch{
        base,
        base + r * d,
        base + r * (d + layout.key_tile),
        reinterpret_cast<SoftmaxState*>(base + r * (d + layout.key_tile + dv_pad)),
        base + r * (d + layout.key_tile + dv_pad + 2),
        tiles_base,
        tiles_base + layout.key_tile * d,
        probs16,
        base + round_up(probs16 + r * layout.key_tile / 2 - base, 16),
        direct_head_floats(flash_direct_rows(layout.tile_rows), layout.key_tile, d, dv_pad),
        &launch};
  };
  AlignedFloats scratch(threads * scratch_floats);

  // Split-KV decode (cpu/flash_split_kv.h): kv groups of one work item, cut into key parts.
  if (plan.splits > 1) {
    flash_forward_split(call, launch, call_args, target, plan, [&](int slot) {
      return scratch_of(scratch.get() + slot * scratch_floats);
    });
    return;
  }

  // Modes and order: plan_flash_forward. An item of at most flash_direct_rows rows reads K and
  // V in place, without packing, and so never gets a panel (its bits must not depend on the
  // thread count). Items compute the same in every mode. Each group resolves its sequence once
  // (core/sequence.h).
  if (plan.spread) {
    AlignedFloats panels(on_the_fly ? 1 : threads * panel_floats);
    const std::vector<std::int64_t> runs_order = run_order(plan, call);
    const std::int64_t runs = static_cast<std::int64_t>(runs_order.size());
    std::atomic<std::int64_t> next{0};
    run_tasks(static_cast<int>(std::min<std::int64_t>(threads, runs)), threads, [&](int slot) {
      float* k_tiles = on_the_fly ? nullptr : panels.get() + slot * panel_floats;
      float* v_rows = on_the_fly ? nullptr : k_tiles + tiles * layout.key_tile * d;
      const FlashScratch w = scratch_of(scratch.get() + slot * scratch_floats);
      for (std::int64_t n = take_item(next, runs, launch); n >= 0;
           n = take_item(next, runs, launch)) {
        const std::int64_t g = runs_order[static_cast<std::size_t>(n)];
        const std::int64_t b = g / call.heads_kv, kv_head = g % call.heads_kv;
        const Sequence<ForwardArgs> s = resolve_sequence(call, call_args, b);
        const ItemPlan items = plan_items(s.p, layout);
        if (const std::int64_t heads = plan.heads_of(call, b); heads > 1) {  // a run (in place)
          for (std::int64_t i = 0; i < items.count; ++i) {
            if (i > 0) launch.check_cancel();
            FlashItem item = items.item(b, kv_head, i, s.p);
            item.heads = std::min(heads, call.heads_kv - kv_head);
            target.run_block(s.p, s.a, FlashPanel{nullptr, nullptr, dv_pad}, item, w);
          }
          continue;
        }
        // One item: tiles packed on the fly (the same bits as from a panel); items reading K
        // and V in place never get a panel.
        const bool packed =
            !on_the_fly && items.count > 1 && flash_in_place_items(s.p, layout.tile_rows) == 0;
        const FlashPanel panel{packed ? k_tiles : nullptr, packed ? v_rows : nullptr, dv_pad};
        const std::int64_t seq_tiles = (s.p.seq.lk + layout.key_tile - 1) / layout.key_tile;
        if (packed) target.pack_tiles(s.p, s.a, b, kv_head, 0, seq_tiles, k_tiles, v_rows, dv_pad);
        for (std::int64_t i = 0; i < items.count; ++i) {
          if (i > 0) launch.check_cancel();  // (before the group's first: take)
          target.run_block(s.p, s.a, panel, items.item(b, kv_head, i, s.p), w);
        }
      }
    });
    return;
  }
  AlignedFloats shared(panel_floats);
  float* k_tiles = shared.get();
  float* v_rows = k_tiles + tiles * layout.key_tile * d;
  for (std::int64_t g : plan.order) {
    launch.check_cancel();
    const std::int64_t b = g / call.heads_kv, kv_head = g % call.heads_kv;
    const Sequence<ForwardArgs> s = resolve_sequence(call, call_args, b);
    const ItemPlan items = plan_items(s.p, layout);
    if (items.count == 0) continue;
    // An item that reads K and V in place never gets a panel (see above).
    const bool packed = flash_in_place_items(s.p, layout.tile_rows) == 0;
    const FlashPanel panel{packed ? k_tiles : nullptr, packed ? v_rows : nullptr, dv_pad};
    const std::int64_t seq_tiles = (s.p.seq.lk + layout.key_tile - 1) / layout.key_tile;
    // Packed by all threads, kPackChunkTiles tiles at a time, so that a cancel is seen between
    // chunks (a group's keys may be millions).
    for (std::int64_t t0 = 0; packed && t0 < seq_tiles; t0 += kPackChunkTiles) {
      if (t0 > 0) launch.check_cancel();
      const std::int64_t t1 = std::min(seq_tiles, t0 + kPackChunkTiles);
      parallel_for(t1 - t0, threads, [&](std::int64_t begin, std::int64_t end) {
        target.pack_tiles(s.p, s.a, b, kv_head, t0 + begin, t0 + end, k_tiles, v_rows, dv_pad);
      });
    }
    // Items are handed out in order from one counter (causal items differ in cost).
    std::atomic<std::int64_t> next{0};
    run_tasks(static_cast<int>(std::min<std::int64_t>(threads, items.count)), threads,
              [&](int slot) {
                const FlashScratch w = scratch_of(scratch.get() + slot * scratch_floats);
                for (std::int64_t n = take_item(next, items.count, launch); n >= 0;
                     n = take_item(next, items.count, launch)) {
                  target.run_block(s.p, s.a, panel, items.item(b, kv_head, n, s.p), w);
                }
              });
  }
}

double flash_workspace_bytes(Pass pass, const Params& p, const Launch& launch) {
  if (pass == Pass::forward && p.empty_output()) return 0;  // flash_forward returns at once
  const FlashLayout& layout = flash_target_chosen().layout;
  const double max_q = static_cast<double>(p.seq.max_q()),
               max_k = static_cast<double>(p.seq.max_k());
  const double dims = static_cast<double>(p.head_dim + p.head_dim_v) + 128;
  // A bound first, in doubles: sizes past it are refused before any int64 size is formed.
  const double bound =
      (max_q * static_cast<double>(p.group) + max_k + layout.key_tile + layout.block_rows) * dims *
      (std::max(1, launch.threads) + 1.0) * 16.0 * static_cast<double>(p.batch * p.heads_kv + 1);
  if (!(bound < 0x1p50)) return bound;
  if (pass == Pass::forward) {
    // (At most the scratch of items of several heads, whatever the layout.)
    const FlashForwardPlan plan = plan_flash_forward(p, std::max(1, launch.threads), layout, true);
    const double threads = plan.workers;
    const double scratch = static_cast<double>(forward_scratch_floats(
        layout, p.head_dim, round_up(p.head_dim_v, layout.dv_align), plan.item_heads));
    const double panels = plan.on_the_fly ? 0
                          : plan.spread   ? threads * static_cast<double>(plan.panel_floats)
                                          : static_cast<double>(plan.panel_floats);
    const double split = static_cast<double>(split_workspace_floats(p, plan.splits));
    return 4.0 * (threads * scratch + panels + split);
  }
  return flash_backward_workspace_bytes(p, launch);
}

}  // namespace attncore::detail

namespace attncore {

std::vector<std::string> simd_targets_compiled() {
  std::vector<std::string> names;
  for (const detail::FlashTarget& t : detail::flash_targets_compiled()) names.emplace_back(t.name);
  return names;
}

std::vector<std::string> simd_targets_supported() {
  std::vector<std::string> names;
  for (const detail::FlashTarget& t : detail::targets_best_first()) {
    if (detail::flash_target_supported(t)) names.emplace_back(t.name);
  }
  return names;
}

std::string simd_target() { return detail::flash_target_chosen().name; }

std::string set_simd_target(const std::string& name) {
  if (!name.empty()) {
    const std::vector<std::string> supported = simd_targets_supported();
    if (std::find(supported.begin(), supported.end(), name) == supported.end()) {
      std::string list;
      for (const std::string& s : supported) list += (list.empty() ? "" : ", ") + s;
      throw InvalidArgument("set_simd_target: target is not available (name=" + name +
                            ", expected one of: " + list + ", or \"\" for automatic)");
    }
  }
  std::lock_guard<std::mutex> lock(detail::g_choice_mutex);
  std::string previous = detail::g_choice;
  detail::g_choice = name;
  return previous;
}

}  // namespace attncore
