// The flash backend's driver: SIMD target choice, K/V packing, work items and threads of the
// fused forward and backward, and the call's cancel flag, read between work items.
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
#include "cpu/flash_split_kv.h"
#include "policy/mask.h"

namespace attncore::detail {

#if defined(__x86_64__)
FlashTarget flash_target_avx512bf16();
FlashTarget flash_target_avx512();
FlashTarget flash_target_avx2();
#endif
FlashTarget flash_target_generic();

namespace {

// 64-byte aligned float storage, allocated once per call (never per tile).
struct AlignedFloats {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  explicit AlignedFloats(std::int64_t count) {
    const std::size_t bytes =
        (static_cast<std::size_t>(std::max<std::int64_t>(count, 1)) * sizeof(float) + 63) &
        ~std::size_t{63};
    data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data) throw std::bad_alloc();
  }
  float* get() const { return data.get(); }
};

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

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
  return {flash_target_avx512bf16(), flash_target_avx512(), flash_target_avx2(),
          flash_target_generic()};
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

const FlashTarget& flash_target_chosen() {
  static const std::vector<FlashTarget>& targets =  // never destroyed: see g_choice
      *new std::vector<FlashTarget>(flash_targets_compiled());
  std::lock_guard<std::mutex> lock(g_choice_mutex);
  for (const FlashTarget& t : targets) {
    if ((g_choice.empty() || g_choice == t.name) && flash_target_supported(t)) return t;
  }
  return targets.back();  // generic: always compiled, always supported
}

namespace {

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

ItemPlan plan_items(const Params& p, std::int64_t block_rows) {
  if (p.seq.lq >= block_rows) {
    const std::int64_t per_head = (p.seq.lq + block_rows - 1) / block_rows;
    return {per_head, per_head * p.group, block_rows};
  }
  return {0, (p.group * p.seq.lq + block_rows - 1) / block_rows, block_rows};
}

}  // namespace

bool flash_reads_kv_in_place(const Params& p, int tile_rows) {
  return p.group * p.seq.lq <= tile_rows;
}

namespace {

// Most kv heads in one item reading K/V in place (FlashItem::heads): a key's row of 32 f32
// heads of D = 128 (16 KiB) read in order, the heads' scratch (q, S, O: 1.5 KiB a head for
// one row) within L2.
constexpr std::int64_t kMaxItemHeads = 32;

// One thread's FlashScratch of the forward, in floats, for items of up to `item_heads` kv
// heads.
std::int64_t forward_scratch_floats(const FlashLayout& layout, std::int64_t d, std::int64_t dv_pad,
                                    std::int64_t item_heads) {
  return round_up(layout.block_rows * (d + layout.key_tile + dv_pad + 3) +
                      layout.key_tile * (d + dv_pad) + layout.block_rows * layout.key_tile / 2,
                  16) +
         item_heads * direct_head_floats(layout.tile_rows, layout.key_tile, d, dv_pad);
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
    const double w = static_cast<double>(s.lq) * static_cast<double>(s.lk) *
                     static_cast<double>(call.group);
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
  // groups are spread only when, handed out in this order to whichever thread is free, no
  // thread gets more than 5% above its share (one sequence of 8192 among 63 of 16 with 32
  // query heads on one kv head is one group: it runs with every thread on its items). Else the groups go one after the other, their packing and their
  // items shared by all threads. A group with one item (decode) packs each tile just before
  // its use, into scratch: no panel at all.
  const std::int64_t tiles = (call.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  const std::int64_t dv_pad = round_up(call.head_dim_v, layout.dv_align);
  plan.panel_floats = round_up(tiles * layout.key_tile * (call.head_dim + dv_pad), 16);
  // A KV cache's sequences all have Lq rows: decode over a cache reads in place like dense
  // decode (each group one item, no panel), spread over the threads.
  plan.on_the_fly = (!call.seq.per_sequence() && plan_items(call, layout.block_rows).count == 1 &&
                     (groups >= threads || flash_reads_kv_in_place(call, layout.tile_rows))) ||
                    (call.seq.cache() && flash_reads_kv_in_place(call, layout.tile_rows));
  const double dims = static_cast<double>(call.head_dim + call.head_dim_v);
  const double q_rows = call.seq.varlen() ? static_cast<double>(call.seq.cu_q[call.batch])
                                          : static_cast<double>(call.batch * call.seq.lq);
  const double k_rows = call.seq.varlen() ? static_cast<double>(call.seq.cu_k[call.batch])
                                          : static_cast<double>(call.batch * call.seq.max_k());
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
  plan.spread = plan.on_the_fly ||
                (enough_groups && even &&
                 8.0 * threads * static_cast<double>(plan.panel_floats) <= operand_floats);
  // In place with the heads inside a key's row: an item takes a run of kv heads of one
  // sequence, so that it reads each key's row in order (one head's rows lie Hkv * D apart:
  // no hardware prefetch stream, L1 set conflicts). All of a sequence's heads when there are
  // sequences for every thread, else enough runs per sequence for the threads. A head's bits
  // do not depend on its run.
  if (plan.on_the_fly && heads_in_rows && flash_reads_kv_in_place(call, layout.tile_rows)) {
    const std::int64_t batch = std::max<std::int64_t>(call.batch, 1);
    const std::int64_t runs = std::clamp<std::int64_t>((threads + batch - 1) / batch, 1,
                                                       std::max<std::int64_t>(call.heads_kv, 1));
    plan.item_heads = std::clamp<std::int64_t>((call.heads_kv + runs - 1) / runs, 1, kMaxItemHeads);
  }
  return plan;
}

void flash_forward(const Params& call, const Launch& launch, const ForwardArgs& call_args) {
  if (call.empty_output()) return;
  const FlashTarget& target = flash_target_chosen();
  const FlashLayout& layout = target.layout;
  const std::int64_t d = call.head_dim;
  // Sized for the longest sequence (varlen) or every sequence (dense).
  const std::int64_t tiles = (call.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  const std::int64_t dv_pad = round_up(call.head_dim_v, layout.dv_align);
  const int threads = std::max(1, launch.threads);
  const bool heads_in_rows = call_args.k.stride[1] < call_args.k.stride[2] &&
                             call_args.v.stride[1] < call_args.v.stride[2];
  const FlashForwardPlan plan = plan_flash_forward(call, threads, layout, heads_in_rows);
  const std::int64_t scratch_floats = forward_scratch_floats(layout, d, dv_pad, plan.item_heads);
  const std::int64_t panel_floats = plan.panel_floats;
  const bool on_the_fly = plan.on_the_fly;

  auto scratch_of = [&](float* base) {
    const std::int64_t r = layout.block_rows;
    float* tiles_base = base + r * (d + layout.key_tile + dv_pad + 3);
    static_assert(sizeof(SoftmaxState) == 2 * sizeof(float), "a row's state takes two floats");
    float* probs16 = tiles_base + layout.key_tile * (d + dv_pad);
    return FlashScratch{base,
                        base + r * d,
                        base + r * (d + layout.key_tile),
                        reinterpret_cast<SoftmaxState*>(base + r * (d + layout.key_tile + dv_pad)),
                        base + r * (d + layout.key_tile + dv_pad + 2),
                        tiles_base,
                        tiles_base + layout.key_tile * d,
                        probs16,
                        base + round_up(probs16 + r * layout.key_tile / 2 - base, 16),
                        direct_head_floats(layout.tile_rows, layout.key_tile, d, dv_pad)};
  };
  AlignedFloats scratch(threads * scratch_floats);

  // Split-KV decode (cpu/flash_split_kv.h): kv groups of one work item, cut into key parts.
  const std::int64_t splits = plan_kv_splits(call, layout, machine_threads());
  if (splits > 1) {
    flash_forward_split(call, launch, call_args, target, plan.order, splits, [&](int slot) {
      return scratch_of(scratch.get() + slot * scratch_floats);
    });
    return;
  }

  // Modes and order: plan_flash_forward. An item of at most one micro-tile of rows reads K and
  // V in place, without packing, and so never gets a panel (its bits must not depend on the
  // thread count). Items compute the same in every mode. Each group resolves its sequence once
  // (core/sequence.h).
  if (plan.spread) {
    AlignedFloats panels(on_the_fly ? 1 : threads * panel_floats);
    // Runs of plan.item_heads kv heads, by their first group, in the plan's order.
    std::vector<std::int64_t> run_order;
    for (std::int64_t g : plan.order) {
      if (g % call.heads_kv % plan.item_heads == 0) run_order.push_back(g);
    }
    const std::int64_t runs = static_cast<std::int64_t>(run_order.size());
    std::atomic<std::int64_t> next{0};
    run_tasks(threads, threads, [&](int slot) {
      float* k_tiles = on_the_fly ? nullptr : panels.get() + slot * panel_floats;
      float* v_rows = on_the_fly ? nullptr : k_tiles + tiles * layout.key_tile * d;
      const FlashScratch w = scratch_of(scratch.get() + slot * scratch_floats);
      for (std::int64_t n = take_item(next, runs, launch); n >= 0;
           n = take_item(next, runs, launch)) {
        const std::int64_t g = run_order[static_cast<std::size_t>(n)];
        const std::int64_t b = g / call.heads_kv, kv_head = g % call.heads_kv;
        const Sequence<ForwardArgs> s = resolve_sequence(call, call_args, b);
        if (plan.item_heads > 1) {  // one item of a run of heads (in place)
          FlashItem item = plan_items(s.p, layout.block_rows).item(b, kv_head, 0, s.p);
          item.heads = std::min(plan.item_heads, call.heads_kv - kv_head);
          target.run_block(s.p, s.a, FlashPanel{nullptr, nullptr, dv_pad}, item, w);
          continue;
        }
        const ItemPlan items = plan_items(s.p, layout.block_rows);
        // One item: tiles packed on the fly (the same bits as from a panel).
        const bool packed = !on_the_fly && items.count > 1;
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
    const ItemPlan items = plan_items(s.p, layout.block_rows);
    if (items.count == 0) continue;
    // An item that reads K and V in place never gets a panel (see above).
    const bool packed = !flash_reads_kv_in_place(s.p, layout.tile_rows);
    const FlashPanel panel{packed ? k_tiles : nullptr, packed ? v_rows : nullptr, dv_pad};
    const std::int64_t seq_tiles = (s.p.seq.lk + layout.key_tile - 1) / layout.key_tile;
    if (packed) {
      parallel_for(seq_tiles, threads, [&](std::int64_t t_begin, std::int64_t t_end) {
        target.pack_tiles(s.p, s.a, b, kv_head, t_begin, t_end, k_tiles, v_rows, dv_pad);
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

namespace {

// Writes zeros into heads [h_begin, h_end) of batch b of a rank-4 view.
void zero_rows(const TensorView& t, std::int64_t b, std::int64_t h_begin, std::int64_t h_end) {
  std::vector<float> zeros(static_cast<std::size_t>(t.shape[3]), 0.0f);
  for (std::int64_t h = h_begin; h < h_end; ++h)
    for (std::int64_t i = 0; i < t.shape[2]; ++i)
      store_row(zeros.data(), t.shape[3], t.data, t.dtype, offset4(t, b, h, i, 0));
}

// Writes zeros into every element of a rank-4 view.
void zero_view(const TensorView& t) {
  std::vector<float> zeros(static_cast<std::size_t>(t.shape[3]), 0.0f);
  for (std::int64_t i0 = 0; i0 < t.shape[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < t.shape[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < t.shape[2]; ++i2)
        store_row(zeros.data(), t.shape[3], t.data, t.dtype, offset4(t, i0, i1, i2, 0));
}

}  // namespace

// Where a work item's dK and dV of one key tile go. A kv head's query heads are cut into runs
// (`runs` per kv head), one per item. With one run, straight into the outputs. With several,
// into an f32 sum per (b, kv head, tile) that the runs add to in head order: run r adds its
// tile once run r - 1 has added its own (a turn counter per tile), and the last run stores the
// sum. f32 outputs hold the sum themselves; bf16 and f16 outputs get an f32 sum of dK and dV
// beside them. Items are taken in order, so a run waits only on runs that are running or done:
// no deadlock, and the sum is bitwise the same for any thread count. Each sequence b has its
// own number of tiles (varlen); its tiles' slots start at tile_base_[b] * Hkv.
class KvTileReducer {
 public:
  KvTileReducer(const Params& p, const BackwardArgs& a, std::int64_t runs, std::int64_t d_pad,
                std::int64_t dv_pad, std::int64_t key_tile, std::int64_t key_rows)
      : p_(p),
        runs_(runs),
        d_pad_(d_pad),
        dv_pad_(dv_pad),
        key_tile_(key_tile),
        tile_base_(tile_bases(p, key_tile)),
        tile_floats_(key_rows * (d_pad + dv_pad)),
        in_place_(a.dk.dtype == DType::f32 && a.dv.dtype == DType::f32),
        // [slots][key_rows][d_pad + dv_pad]: dK rows, then dV rows
        sums_(runs > 1 && !in_place_ ? slots() * tile_floats_ : 1),
        turns_(runs > 1 ? slots() : 0) {}

  // An item's context for put(): its sequence (resolved), (b, kv head) and run.
  struct Run {
    KvTileReducer* reducer;
    const BackwardArgs* a;
    std::int64_t lk, b, kv_head, run;
  };
  static void put(void* context, std::int64_t t, const float* dk, const float* dv) {
    const Run& r = *static_cast<const Run*>(context);
    r.reducer->add(r, t, dk, dv);
  }

 private:
  static std::vector<std::int64_t> tile_bases(const Params& p, std::int64_t key_tile) {
    std::vector<std::int64_t> base(static_cast<std::size_t>(p.batch) + 1, 0);
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t lk = p.seq.at(b).lk;
      base[static_cast<std::size_t>(b) + 1] =
          base[static_cast<std::size_t>(b)] + (lk + key_tile - 1) / key_tile;
    }
    return base;
  }
  std::int64_t slots() const { return tile_base_.back() * p_.heads_kv; }

  void add(const Run& r, std::int64_t t, const float* dk, const float* dv) {
    const std::int64_t keys = std::min(key_tile_, r.lk - t * key_tile_);
    if (runs_ == 1) {
      store(r, t, keys, dk, dv);
      return;
    }
    const std::int64_t tiles = (r.lk + key_tile_ - 1) / key_tile_;
    const std::int64_t slot =
        tile_base_[static_cast<std::size_t>(r.b)] * p_.heads_kv + r.kv_head * tiles + t;
    const std::int64_t g = r.run;
    std::atomic<std::int64_t>& turn = turns_[static_cast<std::size_t>(slot)];
    for (std::int64_t seen = turn.load(std::memory_order_acquire); seen != g;
         seen = turn.load(std::memory_order_acquire)) {
      turn.wait(seen, std::memory_order_acquire);  // sleeps until run `seen` has added its tile
    }
    // sum = tile (run 0) or sum + tile, over `rows` rows of `cols` floats.
    auto accumulate = [g](const float* tile, std::int64_t tile_stride, float* sum,
                          std::int64_t sum_stride, std::int64_t rows, std::int64_t cols) {
      for (std::int64_t row = 0; row < rows; ++row) {
        const float* add = tile + row * tile_stride;
        float* to = sum + row * sum_stride;
        for (std::int64_t e = 0; e < cols; ++e) to[e] = g == 0 ? add[e] : to[e] + add[e];
      }
    };
    const std::int64_t j0 = t * key_tile_;
    const BackwardArgs& a = *r.a;
    if (in_place_) {  // the f32 outputs hold the sums (rows with a unit last stride)
      for (std::int64_t c = 0; c < keys; ++c) {
        float* k_row = static_cast<float*>(a.dk.data) + offset4(a.dk, r.b, r.kv_head, j0 + c, 0);
        float* v_row = static_cast<float*>(a.dv.data) + offset4(a.dv, r.b, r.kv_head, j0 + c, 0);
        accumulate(dk + c * d_pad_, 0, k_row, 0, 1, p_.head_dim);
        accumulate(dv + c * dv_pad_, 0, v_row, 0, 1, p_.head_dim_v);
      }
    } else {
      float* sum_k = sums_.get() + slot * tile_floats_;
      float* sum_v = sum_k + keys * d_pad_;
      accumulate(dk, d_pad_, sum_k, d_pad_, keys, d_pad_);
      accumulate(dv, dv_pad_, sum_v, dv_pad_, keys, dv_pad_);
      if (g == runs_ - 1) store(r, t, keys, sum_k, sum_v);
    }
    turn.store(g + 1, std::memory_order_release);
    turn.notify_all();
  }

  void store(const Run& r, std::int64_t t, std::int64_t keys, const float* dk,
             const float* dv) const {
    const std::int64_t j0 = t * key_tile_;
    const BackwardArgs& a = *r.a;
    for (std::int64_t c = 0; c < keys; ++c) {
      store_row(dk + c * d_pad_, p_.head_dim, a.dk.data, a.dk.dtype,
                offset4(a.dk, r.b, r.kv_head, j0 + c, 0));
      store_row(dv + c * dv_pad_, p_.head_dim_v, a.dv.data, a.dv.dtype,
                offset4(a.dv, r.b, r.kv_head, j0 + c, 0));
    }
  }

  const Params& p_;
  std::int64_t runs_;
  std::int64_t d_pad_, dv_pad_, key_tile_;
  std::vector<std::int64_t> tile_base_;  // [B + 1]: tiles of the sequences before b
  std::int64_t tile_floats_;
  bool in_place_;
  AlignedFloats sums_;
  std::vector<std::atomic<std::int64_t>> turns_;
};

FlashBackwardPlan plan_flash_backward(const Params& p, std::int64_t key_tile, bool dbias) {
  // Runs of `run_heads` consecutive query heads of one kv head. One head per item keeps the
  // workspace to one head's rows; with short Lq, a run fills about kRunRows rows so that each
  // K/V tile packed serves them all (decode-shaped backward B=4 Hq=32 Hkv=8 Lq=1 Lk=4096 f32,
  // 1 thread: 139 ms with one head per item, packing every tile once per head; 76 ms with runs
  // of 4 heads; math 85 ms). Varlen calls plan for their longest sequences.
  constexpr std::int64_t kRunRows = 256;
  const std::int64_t lq = p.seq.max_q(), lk = p.seq.max_k();
  FlashBackwardPlan plan{};
  plan.run_heads = std::clamp<std::int64_t>(kRunRows / std::max<std::int64_t>(lq, 1), 1, p.group);
  plan.runs = (p.group + plan.run_heads - 1) / plan.run_heads;  // per kv head
  // Fewer than 4 runs in all (B = 1 with 1 to 3 heads, or short Lq) would leave threads idle:
  // each run's key tiles are cut into up to 4 parts run as separate items (the reducer orders
  // them per tile like runs), each with its own dQ part, summed in part order afterwards. Not
  // with dBias, whose rows parts would share. The cut depends only on the problem, never on the
  // thread count, so results stay bitwise the same for any thread count.
  constexpr std::int64_t kSplitBelowRuns = 4, kMaxParts = 4;
  const std::int64_t tiles = (lk + key_tile - 1) / key_tile;
  plan.parts = p.batch * p.heads_kv * plan.runs < kSplitBelowRuns && !dbias
                   ? std::clamp<std::int64_t>(tiles, 1, kMaxParts)
                   : 1;
  return plan;
}

namespace {

// The backward's sizes, in floats: the scratch shape, the plan, and one thread's workspace.
struct BackwardSizes {
  FlashBackwardScratch shape;
  FlashBackwardPlan plan;
  std::int64_t key_rows, rows;  // rows of a key tile (padded to micro-tiles); an item's q rows
  std::int64_t sizes[16];       // FlashBackwardScratch's buffers, in its order
  std::int64_t per_thread;
};

BackwardSizes backward_sizes(const Params& p, const FlashLayout& layout, bool dbias) {
  BackwardSizes z{};
  const std::int64_t d = p.head_dim, dv = p.head_dim_v, tile = layout.key_tile;
  const std::int64_t block = layout.block_rows, tile_rows = layout.tile_rows;
  const std::int64_t max_q = p.seq.max_q();
  z.shape.d_pad = round_up(d, layout.dv_align);
  z.shape.dv_pad = round_up(dv, layout.dv_align);
  z.shape.lq_pad = round_up(max_q, tile_rows);  // each sequence's rows fit
  z.key_rows = round_up(tile, tile_rows);
  z.plan = plan_flash_backward(p, tile, dbias);
  const std::int64_t run_heads = z.plan.run_heads;
  z.rows = run_heads * z.shape.lq_pad;
  // 16-float (64-byte) aligned each. bf16 pairs take half the floats of the f32 values they
  // hold.
  const bool pairs = layout.bf16_dot && p.dtype == DType::bf16;
  const std::int64_t per_float = pairs ? 2 : 1, rows = z.rows;
  const FlashBackwardScratch& s = z.shape;
  // clang-format off
  const std::int64_t sizes[] = {
      rows * s.d_pad, run_heads * max_q,                                  // dq, delta
      tile * d, tile * s.d_pad, tile * dv,                               // k_t, k_rows, v_t
      z.key_rows * s.d_pad, z.key_rows * s.dv_pad,                        // dk, dv
      rows * s.d_pad / per_float, rows * s.dv_pad / per_float,            // q_rows, do_rows
      pairs ? rows * ((d + 1) / 2) : 0, pairs ? rows * ((dv + 1) / 2) : 0,  // q_t, do_t
      run_heads * max_q,                                                  // lse
      block * tile + tile_rows, block * tile + tile_rows, tile,           // s, ds, dcap
      pairs ? 3 * (block / 2) * tile : 0};                                // pairs
  // clang-format on
  static_assert(std::size(sizes) == std::size(BackwardSizes{}.sizes));
  for (std::size_t f = 0; f < std::size(sizes); ++f) {
    z.sizes[f] = sizes[f];
    z.per_thread += round_up(sizes[f], 16);
  }
  return z;
}

}  // namespace

double flash_workspace_bytes(Pass pass, const Params& p, const Launch& launch) {
  const FlashLayout& layout = flash_target_chosen().layout;
  const double threads = std::max(1, launch.threads);
  const double max_q = static_cast<double>(p.seq.max_q()), max_k = static_cast<double>(p.seq.max_k());
  const double dims = static_cast<double>(p.head_dim + p.head_dim_v) + 128;
  // A bound first, in doubles: sizes past it are refused before any int64 size is formed.
  const double bound = (max_q * static_cast<double>(p.group) + max_k + layout.key_tile +
                        layout.block_rows) *
                       dims * (threads + 1) * 16.0 * static_cast<double>(p.batch * p.heads_kv + 1);
  if (!(bound < 0x1p50)) return bound;
  if (pass == Pass::forward) {
    // (At most the scratch of items of several heads, whatever the layout.)
    const FlashForwardPlan plan = plan_flash_forward(p, launch.threads, layout, true);
    const double scratch = static_cast<double>(forward_scratch_floats(
        layout, p.head_dim, round_up(p.head_dim_v, layout.dv_align), plan.item_heads));
    const double panels = plan.on_the_fly ? 0
                          : plan.spread   ? threads * static_cast<double>(plan.panel_floats)
                                          : static_cast<double>(plan.panel_floats);
    const double split = static_cast<double>(
        split_workspace_floats(p, plan_kv_splits(p, layout, machine_threads())));
    return 4.0 * (threads * scratch + panels + split);
  }
  const BackwardSizes z = backward_sizes(p, layout, p.compute_dbias);
  const double kv_runs = static_cast<double>(p.batch * p.heads_kv * z.plan.runs);
  const double dq_parts = z.plan.parts > 1 ? kv_runs * static_cast<double>(z.plan.parts) *
                                                 static_cast<double>(z.rows * z.shape.d_pad)
                                           : 0;
  // The reducer's f32 sums of dK and dV (several runs per kv head, 16-bit outputs).
  const double tiles = std::ceil(max_k / layout.key_tile) * static_cast<double>(p.batch);
  const double sums = z.plan.runs > 1 && p.dtype != DType::f32
                          ? tiles * static_cast<double>(p.heads_kv) *
                                static_cast<double>(z.key_rows * (z.shape.d_pad + z.shape.dv_pad))
                          : 0;
  return 4.0 * (threads * static_cast<double>(z.per_thread) + dq_parts + sums);
}

std::vector<std::int64_t> flash_backward_order(const Params& p, std::int64_t runs,
                                               std::int64_t parts) {
  // Items n = kv_run * parts + part, kv_run = (b * Hkv + kv_head) * runs + run.
  std::vector<std::int64_t> order(static_cast<std::size_t>(p.batch * p.heads_kv * runs * parts));
  for (std::size_t n = 0; n < order.size(); ++n) order[n] = static_cast<std::int64_t>(n);
  if (!p.seq.per_sequence()) return order;
  // Varlen: the longest sequences first (lq * lk; ties keep their order, so the runs of one kv
  // head stay in run order and a run waits only on runs taken before it: no deadlock).
  std::vector<double> work(static_cast<std::size_t>(p.batch));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const SeqSpan s = p.seq.at(b);
    work[static_cast<std::size_t>(b)] = static_cast<double>(s.lq) * static_cast<double>(s.lk);
  }
  const std::int64_t per_batch = p.heads_kv * runs * parts;
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
    return work[static_cast<std::size_t>(x / per_batch)] >
           work[static_cast<std::size_t>(y / per_batch)];
  });
  return order;
}

void flash_backward(const Params& p, const Launch& launch, const BackwardArgs& a) {
  DbiasAccumulator dbias(p);
  if (p.batch == 0) return;
  const std::int64_t max_q = p.seq.max_q(), max_k = p.seq.max_k();
  if (!p.seq.varlen() && (max_q == 0 || max_k == 0)) {  // no pair: every gradient is 0
    zero_view(a.dq);
    zero_view(a.dk);
    zero_view(a.dv);
    dbias.store(a.dbias);
    return;
  }
  const FlashTarget& target = flash_target_chosen();
  const FlashLayout& layout = target.layout;
  const BackwardSizes z = backward_sizes(p, layout, dbias.active());
  const std::int64_t d = p.head_dim, tile = layout.key_tile;
  const std::int64_t block = layout.block_rows, tile_rows = layout.tile_rows;
  const FlashBackwardScratch& shape = z.shape;
  const std::int64_t key_rows = z.key_rows, rows = z.rows, per_thread = z.per_thread;
  const std::int64_t run_heads = z.plan.run_heads, runs = z.plan.runs, parts = z.plan.parts;
  const std::int64_t* sizes = z.sizes;
  // Items own their dQ rows; dBias rows are shared only when the mask broadcasts over batch or
  // heads, and then one thread runs the items in order.
  const int threads = dbias.shared_across(p) ? 1 : std::max(1, launch.threads);
  const std::int64_t kv_runs = p.batch * p.heads_kv * runs;
  const std::int64_t item_dq = rows * shape.d_pad;  // [run_heads][lq_pad][d_pad]
  AlignedFloats dq_parts(parts > 1 ? kv_runs * parts * item_dq : 1);
  const std::int64_t items = kv_runs * parts;
  AlignedFloats scratch(threads * per_thread);
  KvTileReducer reducer(p, a, runs, shape.d_pad, shape.dv_pad, tile, key_rows);
  // The heads of run r of (b, kv head): [first, last).
  auto run_heads_of = [&](std::int64_t kv_run, std::int64_t* first, std::int64_t* last) {
    const std::int64_t kv_head = kv_run / runs % p.heads_kv, r = kv_run % runs;
    *first = kv_head * p.group + r * run_heads;
    *last = std::min(*first + run_heads, (kv_head + 1) * p.group);
  };
  const std::vector<std::int64_t> order = flash_backward_order(p, runs, parts);
  std::atomic<std::int64_t> next{0};
  run_tasks(static_cast<int>(std::min<std::int64_t>(threads, items)), threads, [&](int slot) {
    FlashBackwardScratch w = shape;
    float* at = scratch.get() + slot * per_thread;
    float** fields[] = {&w.dq,      &w.delta, &w.k_t,  &w.k_rows, &w.v_t, &w.dk, &w.dv,   &w.q_rows,
                        &w.do_rows, &w.q_t,   &w.do_t, &w.lse,    &w.s,   &w.ds, &w.dcap, &w.pairs};
    for (std::size_t f = 0; f < std::size(fields); ++f) {  // BackwardSizes::sizes' order
      *fields[f] = at;
      at += round_up(sizes[f], 16);
    }
    // The dK, dV products read S and dS over whole micro-tiles of keys (132 rows for 6-row
    // tiles): past a full tile's 128 columns they read the next row's first ones, and past the
    // last row this slack, zeroed here (those dK, dV rows are scratch, never stored).
    std::fill_n(w.s, block * tile + tile_rows, 0.0f);
    std::fill_n(w.ds, block * tile + tile_rows, 0.0f);
    for (std::int64_t n = take_item(next, items, launch); n >= 0; n = take_item(next, items, launch)) {
      const std::int64_t taken = order[static_cast<std::size_t>(n)];
      const std::int64_t kv_run = taken / parts, part = taken % parts;
      const std::int64_t b = kv_run / (runs * p.heads_kv);
      std::int64_t first = 0, last = 0;
      run_heads_of(kv_run, &first, &last);
      const Sequence<BackwardArgs> s = resolve_sequence(p, a, b);
      const std::int64_t kv_head = first / p.group;
      if (s.p.seq.lq == 0 || s.p.seq.lk == 0) {  // a sequence with no pair: zero gradients
        if (part == 0) zero_rows(s.a.dq, b, first, last);
        if (part == 0 && kv_run % runs == 0) {
          zero_rows(s.a.dk, b, kv_head, kv_head + 1);
          zero_rows(s.a.dv, b, kv_head, kv_head + 1);
        }
        continue;
      }
      KvTileReducer::Run context{&reducer, &s.a, s.p.seq.lk, b, kv_head, kv_run % runs};
      const std::int64_t tiles = (s.p.seq.lk + tile - 1) / tile;
      FlashBackwardScratch item = w;
      item.lq_pad = round_up(s.p.seq.lq, tile_rows);
      item.tile_begin = tiles * part / parts;
      item.tile_end = tiles * (part + 1) / parts;
      item.store_dq = parts == 1;
      item.put_kv_tile = &KvTileReducer::put;
      item.put_context = &context;
      if (parts > 1) item.dq = dq_parts.get() + (kv_run * parts + part) * item_dq;
      target.run_backward_heads(s.p, s.a, b, first, last, item, dbias.active() ? &dbias : nullptr);
    }
  });
  if (parts > 1) {  // dQ = the parts summed in order
    for (std::int64_t kv_run = 0; kv_run < kv_runs; ++kv_run) {
      const std::int64_t b = kv_run / (runs * p.heads_kv);
      const Sequence<BackwardArgs> s = resolve_sequence(p, a, b);
      if (s.p.seq.lq == 0 || s.p.seq.lk == 0) continue;
      const std::int64_t lq_pad = round_up(s.p.seq.lq, tile_rows);
      float* sum = dq_parts.get() + kv_run * parts * item_dq;
      for (std::int64_t part = 1; part < parts; ++part) {
        const float* add = sum + part * item_dq;
        for (std::int64_t e = 0; e < item_dq; ++e) sum[e] += add[e];
      }
      std::int64_t first = 0, last = 0;
      run_heads_of(kv_run, &first, &last);
      for (std::int64_t h = first; h < last; ++h) {
        for (std::int64_t i = 0; i < s.p.seq.lq; ++i) {
          store_row(sum + ((h - first) * lq_pad + i) * shape.d_pad, d, s.a.dq.data, s.a.dq.dtype,
                    offset4(s.a.dq, b, h, i, 0));
        }
      }
    }
  }
  dbias.store(a.dbias);
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
  for (const detail::FlashTarget& t : detail::flash_targets_compiled()) {
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
