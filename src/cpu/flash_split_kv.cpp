// Split-KV decode: the planner, the driver of the (group, part) items, and the merge of their
// partial results (cpu/flash_split_kv.h).
#include "cpu/flash_split_kv.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/convert.h"
#include "core/cpu_info.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "policy/softmax_state.h"

namespace attncore::detail {

namespace {

// Planned parts hold at most this many keys: a part adds each key's P V into its rows'
// running outputs in f32, which stop growing once they are 2^24 times the terms they add
// (2^25 keys of equal scores gave 0.5 for 1.0 unsplit); 2^22 keeps a factor 4 from there. The
// merge weighs the parts' outputs by their f64 LSEs. (Up to kMaxSplits parts: Lk past 2^30
// gets parts of up to 2^23 keys.)
constexpr std::int64_t kMaxPartKeys = std::int64_t{1} << 22;

// The parts of a dense or cache call's groups (every sequence the same) that the CPUs ask
// for, or the call's num_splits.
std::int64_t splits_for_cpus(const Params& p, const FlashLayout& layout, int cpus) {
  // Split: calls whose kv groups are one work item each (group * Lq rows within one block of
  // rows: decode, GQA decode, short chunks), which read K/V in place (flash_reads_kv_in_place)
  // or pack each tile just before its use: a part reads only its own keys. Not split: groups
  // of several items (longer Lq), which share K/V packed once into a panel and already spread
  // their items over the threads.
  if (p.group * p.seq.max_q() > layout.block_rows) return 1;
  const std::int64_t tiles = (p.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  if (p.num_splits > 0)
    return std::clamp<std::int64_t>(p.num_splits, 1, std::max<std::int64_t>(tiles, 1));
  // The units of work: a sequence's run of up to kMaxItemHeads kv heads where decode reads
  // K/V in place (an item of such a run reads each key's row in order when the layout keeps a
  // key's heads together; counted so in every layout, which must split alike to give the same
  // bits), else each kv group. Splitting single runs mattered: MHA B=1 Hq=Hkv=32 Lk=4096/16384
  // on 2 threads, bench --decode, % of the 2-thread probe, 3 interleaved passes, unsplit (two
  // runs of 16 heads, each reading half of every key's row) against 2 parts of 32 heads: f32
  // [B, L, Hkv, D] 86/75 -> 97/86, p256 79/76 -> 91/87, bf16 73/59 -> 110/77, p256 72/59 ->
  // 102/77; [B, Hkv, L, D] and f16 within 4 points; 1 thread 0-3 points slower (5 passes).
  // (A group cut into two items of its rows, flash_in_place_items, counts once: the two,
  // taken one after the other, read the same part's keys at once, and the second finds them in
  // the cache.)
  const std::int64_t units = flash_in_place_items(p, layout.tile_rows) > 0
                                 ? p.batch * ((p.heads_kv + kMaxItemHeads - 1) / kMaxItemHeads)
                                 : p.batch * p.heads_kv;
  if (units <= 0 || units >= cpus) return 1;
  // Enough parts that every CPU has one; when the items do not share evenly among the CPUs,
  // twice that many, so that the last round of items leaves fewer cores idle.
  std::int64_t splits = (cpus + units - 1) / units;
  if (units * splits % cpus != 0) splits = (2 * cpus + units - 1) / units;
  // Parts shorter than attncore::kMinSplitKeys (1024) keys are not planned. Measured on this
  // machine (2 cores, B=1 Hkv=1 D=128 f32 dense decode, `attncore run --num-splits`, medians of
  // 9 interleaved runs on 2 threads): Hq=32, Lk=2048: 0.209 ms unsplit, 0.164 ms in 2 parts of
  // 1024 keys; Lk=1024: 0.108 ms unsplit, 0.121 ms in 2 parts of 512 (the parts' start and the
  // merge cost more than the second thread brings). Hq=4 (memory-bound) changed by under 5%
  // either way at these sizes.
  const std::int64_t min_tiles = (kMinSplitKeys + layout.key_tile - 1) / layout.key_tile;
  splits = std::min({splits, tiles / min_tiles, std::int64_t{kMaxSplits}});
  return std::max<std::int64_t>(splits, 1);
}

// The parts of a dense or cache call's groups: splits_for_cpus, and, unless the call names its
// count, at least enough parts of at most kMaxPartKeys keys.
std::int64_t plan_call_splits(const Params& p, const FlashLayout& layout, int cpus) {
  const std::int64_t planned = splits_for_cpus(p, layout, cpus);
  if (p.num_splits > 0 || p.group * p.seq.max_q() > layout.block_rows) return planned;
  const std::int64_t needed = (p.seq.max_k() + kMaxPartKeys - 1) / kMaxPartKeys;
  return std::max(planned, std::min(needed, std::int64_t{kMaxSplits}));
}

}  // namespace

std::vector<std::int64_t> sequence_splits(const Params& p, const FlashLayout& layout, int cpus) {
  if (!p.seq.varlen()) {
    return std::vector<std::int64_t>(static_cast<std::size_t>(p.batch),
                                     plan_call_splits(p, layout, cpus));
  }
  // A batch holding a sequence of several work items (a chunk of more rows than one block) is
  // not split at all: the parts' workspace would cover its rows too.
  std::vector<std::int64_t> splits(static_cast<std::size_t>(p.batch), 1);
  if (p.group * p.seq.max_q() > layout.block_rows) return splits;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    Params one = sequence_params(p, p.seq.at(b));
    one.batch = 1;
    splits[static_cast<std::size_t>(b)] = plan_call_splits(one, layout, cpus);
  }
  return splits;
}

std::int64_t plan_kv_splits(const Params& p, const FlashLayout& layout, int cpus) {
  if (!p.seq.varlen()) return plan_call_splits(p, layout, cpus);
  const std::vector<std::int64_t> splits = sequence_splits(p, layout, cpus);
  return splits.empty() ? 1 : *std::max_element(splits.begin(), splits.end());
}

namespace {

// A part's outputs, laid out as the call's: [B][Hq][Lq] rows, or for varlen [Hq][the
// sequences' rows] (batch stride 0; rows past the last sequence have none).
struct PartRows {
  std::int64_t batch, lq;
  explicit PartRows(const Params& p)
      : batch(p.seq.varlen() ? 1 : p.batch), lq(p.seq.varlen() ? p.seq.cu_q[p.batch] : p.seq.lq) {}
};

}  // namespace

std::int64_t split_workspace_floats(const Params& p, std::int64_t splits) {
  if (splits <= 1) return 0;
  // [splits][rows][Dv] f32 outputs, then [splits][rows] f64 LSEs (two floats' worth each).
  const PartRows part(p);
  return splits * part.batch * p.heads_q * part.lq * (p.head_dim_v + 2);
}

void flash_forward_split(const Params& call, const Launch& launch, const ForwardArgs& args,
                         const FlashTarget& target, const FlashForwardPlan& plan,
                         const std::function<FlashScratch(int)>& scratch_of) {
  const FlashLayout& layout = target.layout;
  const std::int64_t splits = plan.splits;
  const PartRows part(call);
  const std::int64_t lq = part.lq, dv = call.head_dim_v;
  const std::int64_t dv_pad = (dv + layout.dv_align - 1) / layout.dv_align * layout.dv_align;
  const std::int64_t rows = part.batch * call.heads_q * lq;  // a part's rows
  // Each part's output in f32 and its LSE in f64 (SoftmaxState::lse): merged by
  // exp(LSE - max LSE), its parts' weights would carry an f32 LSE's rounding (ulp 0.0078 at
  // 1e5, 1.1e-5 from the fp64 oracle where the unsplit decode is 7e-8 off).
  std::vector<float> workspace(static_cast<std::size_t>(splits * rows * dv));
  std::vector<double> part_lse(static_cast<std::size_t>(splits * rows));
  float* const outs = workspace.data();  // [splits][rows][Dv]
  double* const lses = part_lse.data();  // [splits][rows]
  // Part s's outputs as views of the call's shape (varlen: batch stride 0, as the call's own):
  // an item stores into them, resolved to its sequence, as into out, lse.
  auto part_args = [&](std::int64_t s) {
    ForwardArgs r = args;
    r.out = TensorView::contiguous(outs + s * rows * dv, DType::f32,
                                   {part.batch, call.heads_q, lq, dv});
    r.lse = TensorView::contiguous(lses + s * rows, DType::f64, {part.batch, call.heads_q, lq});
    if (call.seq.varlen()) {
      r.out.shape[0] = r.lse.shape[0] = call.batch;
      r.out.stride[0] = r.lse.stride[0] = 0;
    }
    return r;
  };

  // Items: each run (of plan.heads_of(its sequence) kv heads, by its first group in the plan's
  // order) once per part of its sequence. Part s of `parts` of a sequence of `tiles` key tiles
  // covers tiles [tiles * s / parts, tiles * (s + 1) / parts): a sequence shorter than the longest
  // has shorter parts (or empty ones: output 0, LSE -inf, which merge to nothing). Each group is
  // one item of group * Lq rows (plan_kv_splits), with no panel (K/V read in place or packed
  // tile by tile into scratch): that item, for the run's heads, once per part.
  const std::vector<std::int64_t> splits_of = sequence_splits(call, layout, machine_threads());
  // A group read in place as two items of half its rows (flash_in_place_items, by its
  // sequence's rows) runs both: each (group, part) is listed twice, the second skipped where
  // the sequence's rows make one item.
  constexpr std::int64_t row_items = 2;
  struct Part {
    std::int64_t group, part, parts, row_item;
  };
  std::vector<Part> list;
  for (std::int64_t g : run_order(plan, call)) {
    const std::int64_t parts = splits_of[static_cast<std::size_t>(g / call.heads_kv)];
    for (std::int64_t s = 0; s < parts; ++s) {
      for (std::int64_t i = 0; i < row_items; ++i) list.push_back({g, s, parts, i});
    }
  }
  const auto items = static_cast<std::int64_t>(list.size());
  const int threads = plan.workers;  // (each with its scratch: scratch_of)
  std::atomic<std::int64_t> next{0};
  run_tasks(static_cast<int>(std::min<std::int64_t>(threads, items)), threads, [&](int slot) {
    const FlashScratch w = scratch_of(slot);
    const FlashPanel panel{nullptr, nullptr, dv_pad};
    for (std::int64_t n = take_item(next, items, launch); n >= 0;
         n = take_item(next, items, launch)) {
      const auto [g, s, parts, row_item] = list[static_cast<std::size_t>(n)];
      const std::int64_t b = g / call.heads_kv, kv_head = g % call.heads_kv;
      const Sequence<ForwardArgs> seq = resolve_sequence(call, part_args(s), b);
      if (seq.p.seq.lq == 0) continue;  // (a varlen sequence without query rows)
      const std::int64_t tiles = (seq.p.seq.lk + layout.key_tile - 1) / layout.key_tile;
      const std::int64_t group_rows = call.group * seq.p.seq.lq;
      const std::int64_t items_of_rows =
          std::max<std::int64_t>(flash_in_place_items(seq.p, layout.tile_rows), 1);
      if (row_item >= items_of_rows) continue;
      const std::int64_t item_rows = (group_rows + items_of_rows - 1) / items_of_rows;
      FlashItem item{b, kv_head, row_item * item_rows,
                     std::min(item_rows, group_rows - row_item * item_rows)};
      item.heads = std::min(plan.heads_of(call, b), call.heads_kv - kv_head);
      item.key_begin = tiles * s / parts * layout.key_tile;
      item.key_end = tiles * (s + 1) / parts * layout.key_tile;
      target.run_block(seq.p, seq.a, panel, item, w);
    }
  });

  // Row r's parts merged all at once by the one merge of finished results
  // (policy/softmax_state.h), then stored in the outputs' dtype (16-bit: the target's rounding).
  // The same sums in the same order whatever the thread count. (Varlen rows past the last
  // sequence have no part: the call fills them.)
  launch.check_cancel();
  // The sequence of row r: its batch index (dense, cache), or the one whose rows hold it.
  auto sequence_of = [&](std::int64_t r) {
    if (!call.seq.varlen()) return r / (call.heads_q * lq);
    const std::int32_t* cu = call.seq.cu_q;
    return static_cast<std::int64_t>(std::upper_bound(cu, cu + call.batch + 1, r % lq) - cu) - 1;
  };
  parallel_for(rows, threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> merged(static_cast<std::size_t>(dv));
    std::vector<const float*> part_outs(static_cast<std::size_t>(splits));  // row r's part s: [Dv]
    std::vector<double> part_lses(static_cast<std::size_t>(splits));
    for (std::int64_t r = begin; r < end; ++r) {
      const int parts = static_cast<int>(splits_of[static_cast<std::size_t>(sequence_of(r))]);
      for (int s = 0; s < parts; ++s) {
        part_outs[static_cast<std::size_t>(s)] = outs + (s * rows + r) * dv;
        part_lses[static_cast<std::size_t>(s)] = lses[s * rows + r];
      }
      const double lse =
          merge_outputs(part_outs.data(), part_lses.data(), parts, dv, merged.data());
      const std::int64_t b = r / (call.heads_q * lq), h = r / lq % call.heads_q, i = r % lq;
      store_row_narrowed(target.narrow, merged.data(), dv, args.out.data, args.out.dtype,
                         offset4(args.out, b, h, i, 0));
      if (args.lse.data != nullptr) {
        store_element(args.lse.data, args.lse.dtype,
                      b * args.lse.stride[0] + h * args.lse.stride[1] + i * args.lse.stride[2],
                      lse);
      }
    }
  });
}

}  // namespace attncore::detail
