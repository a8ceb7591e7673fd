// Split-KV decode: the planner, the driver of the (group, part) items, and the merge of their
// partial results (cpu/flash_split_kv.h).
#include "cpu/flash_split_kv.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "core/convert.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "policy/softmax_state.h"

namespace attncore::detail {

namespace {

// Parts shorter than this many keys are not planned. Measured on this machine (2 cores, B=1
// Hkv=1 D=128 f32 dense decode, `attncore run --num-splits`, medians of 9 interleaved runs on
// 2 threads): Hq=32, Lk=2048: 0.209 ms unsplit, 0.164 ms in 2 parts of 1024 keys; Lk=1024:
// 0.108 ms unsplit, 0.121 ms in 2 parts of 512 (the parts' start and the merge cost more than
// the second thread brings). Hq=4 (memory-bound) changed by under 5% either way at these sizes.
constexpr std::int64_t kMinSplitKeys = 1024;

}  // namespace

std::int64_t plan_kv_splits(const Params& p, const FlashLayout& layout, int cpus) {
  // Split: dense and KV-cache calls whose kv groups are one work item each (group * Lq rows
  // within one block of rows: decode, GQA decode, short chunks), which read K/V in place
  // (flash_reads_kv_in_place) or pack each tile just before its use: a part reads only its own
  // keys. Not split: groups of several items (longer Lq), which share K/V packed once into a
  // panel and already spread their items over the threads; varlen calls without a cache, whose
  // groups are planned longest first (cutting them would need per-sequence plans).
  if (p.seq.varlen() || p.group * p.seq.lq > layout.block_rows) return 1;
  const std::int64_t tiles = (p.seq.max_k() + layout.key_tile - 1) / layout.key_tile;
  if (p.num_splits > 0)
    return std::clamp<std::int64_t>(p.num_splits, 1, std::max<std::int64_t>(tiles, 1));
  const std::int64_t groups = p.batch * p.heads_kv;
  if (groups <= 0 || groups >= cpus) return 1;
  // Enough parts that every CPU has one; when the items do not share evenly among the CPUs,
  // twice that many, so that the last round of items leaves fewer cores idle.
  std::int64_t splits = (cpus + groups - 1) / groups;
  if (groups * splits % cpus != 0) splits = (2 * cpus + groups - 1) / groups;
  const std::int64_t min_tiles = (kMinSplitKeys + layout.key_tile - 1) / layout.key_tile;
  splits = std::min({splits, tiles / min_tiles, std::int64_t{kMaxSplits}});
  return std::max<std::int64_t>(splits, 1);
}

std::int64_t split_workspace_floats(const Params& p, std::int64_t splits) {
  if (splits <= 1) return 0;
  // [splits][B][Hq][Lq][Dv] outputs, then [splits][B][Hq][Lq] LSEs.
  return splits * p.batch * p.heads_q * p.seq.lq * (p.head_dim_v + 1);
}

void flash_forward_split(const Params& call, const Launch& launch, const ForwardArgs& args,
                         const FlashTarget& target, const FlashForwardPlan& plan,
                         const std::function<FlashScratch(int)>& scratch_of) {
  const FlashLayout& layout = target.layout;
  const std::int64_t splits = plan.splits;
  const std::int64_t lq = call.seq.lq, dv = call.head_dim_v;
  const std::int64_t dv_pad = (dv + layout.dv_align - 1) / layout.dv_align * layout.dv_align;
  const std::int64_t rows = call.batch * call.heads_q * lq;  // the call's query rows
  std::vector<float> workspace(static_cast<std::size_t>(split_workspace_floats(call, splits)));
  float* const outs = workspace.data();           // [splits][B][Hq][Lq][Dv]
  float* const lses = outs + splits * rows * dv;  // [splits][B][Hq][Lq]
  // Part s's outputs as views of the call's shape: an item stores into them as into out, lse.
  auto part_args = [&](const ForwardArgs& a, std::int64_t s) {
    ForwardArgs r = a;
    r.out = TensorView::contiguous(outs + s * rows * dv, DType::f32,
                                   {call.batch, call.heads_q, lq, dv});
    r.lse = TensorView::contiguous(lses + s * rows, DType::f32, {call.batch, call.heads_q, lq});
    return r;
  };

  // Items n = run (of plan.item_heads kv heads, by its first group in the plan's order) *
  // splits + part. Part s of a sequence of `tiles` key tiles covers tiles [tiles * s / splits,
  // tiles * (s + 1) / splits): a sequence shorter than the longest has shorter parts (or empty
  // ones: output 0, LSE -inf, which merge to nothing). Each group is one item of group * Lq
  // rows (plan_kv_splits), with no panel (K/V read in place or packed tile by tile into
  // scratch): that item, for the run's heads, once per part.
  const std::vector<std::int64_t> order = run_order(plan, call.heads_kv);
  const std::int64_t items = static_cast<std::int64_t>(order.size()) * splits;
  const int threads = std::max(1, launch.threads);
  std::atomic<std::int64_t> next{0};
  run_tasks(static_cast<int>(std::min<std::int64_t>(threads, items)), threads, [&](int slot) {
    const FlashScratch w = scratch_of(slot);
    const FlashPanel panel{nullptr, nullptr, dv_pad};
    for (std::int64_t n = take_item(next, items, launch); n >= 0;
         n = take_item(next, items, launch)) {
      const std::int64_t g = order[static_cast<std::size_t>(n / splits)], s = n % splits;
      const std::int64_t b = g / call.heads_kv, kv_head = g % call.heads_kv;
      const Sequence<ForwardArgs> seq = resolve_sequence(call, args, b);
      const std::int64_t tiles = (seq.p.seq.lk + layout.key_tile - 1) / layout.key_tile;
      FlashItem item{b, kv_head, 0, call.group * lq};
      item.heads = std::min(plan.item_heads, call.heads_kv - kv_head);
      item.key_begin = tiles * s / splits * layout.key_tile;
      item.key_end = tiles * (s + 1) / splits * layout.key_tile;
      target.run_block(seq.p, part_args(seq.a, s), panel, item, w);
    }
  });

  // Row r's parts merged in part order by the one merge of finished results
  // (policy/softmax_state.h), then stored in the outputs' dtype. The same sums in the same
  // order whatever the thread count.
  launch.check_cancel();
  parallel_for(rows, threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> merged(static_cast<std::size_t>(dv));
    for (std::int64_t r = begin; r < end; ++r) {
      std::copy_n(outs + r * dv, dv, merged.data());
      float lse = lses[r];
      for (std::int64_t s = 1; s < splits; ++s) {
        lse = merge_outputs(merged.data(), lse, outs + (s * rows + r) * dv, lses[s * rows + r], dv,
                            merged.data());
      }
      const std::int64_t b = r / (call.heads_q * lq), h = r / lq % call.heads_q, i = r % lq;
      store_row(merged.data(), dv, args.out.data, args.out.dtype, offset4(args.out, b, h, i, 0));
      if (args.lse.data != nullptr) {
        store_element(args.lse.data, args.lse.dtype,
                      b * args.lse.stride[0] + h * args.lse.stride[1] + i * args.lse.stride[2],
                      lse);
      }
    }
  });
}

}  // namespace attncore::detail
