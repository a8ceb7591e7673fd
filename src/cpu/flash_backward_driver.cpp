// The flash backend's driver of the fused backward: work items (runs of query heads of one kv
// head, their key tiles in parts), the dK/dV reducer that sums the runs of a kv head in order,
// the workspace, and the threads; the call's cancel flag is read between work items and
// between an item's key tiles (a run that stops there abandons its tiles: KvTileReducer).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "core/convert.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "cpu/aligned_floats.h"
#include "cpu/flash.h"

namespace attncore::detail {

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
                std::int64_t dv_pad, std::int64_t key_tile, std::int64_t key_rows, NarrowFn narrow)
      : p_(p),
        narrow_(narrow),
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

  // A run that stops within its item (cancelled between key tiles, or any error: `cause`)
  // never adds its remaining tiles: every tile's turn, of every kv head, is marked abandoned
  // and its waiters woken, and they rethrow the first cause instead of waiting, so that the
  // call reports it whichever thread's error comes out first (outputs are then incomplete).
  void abandon(std::exception_ptr cause) {
    {
      const std::lock_guard<std::mutex> lock(cause_mutex_);
      if (!cause_) cause_ = cause;
    }
    for (std::atomic<std::int64_t>& turn : turns_) {
      turn.store(kAbandoned, std::memory_order_release);
      turn.notify_all();
    }
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
      if (seen == kAbandoned) rethrow_cause();        // the run before stopped: abandon()
      turn.wait(seen, std::memory_order_acquire);     // sleeps until run `seen` adds its tile
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
    // The next run's turn, unless abandon() came first (then the tile stays abandoned).
    std::int64_t mine = g;
    turn.compare_exchange_strong(mine, g + 1, std::memory_order_release, std::memory_order_relaxed);
    turn.notify_all();
  }

  void store(const Run& r, std::int64_t t, std::int64_t keys, const float* dk,
             const float* dv) const {
    const std::int64_t j0 = t * key_tile_;
    const BackwardArgs& a = *r.a;
    for (std::int64_t c = 0; c < keys; ++c) {
      store_row_narrowed(narrow_, dk + c * d_pad_, p_.head_dim, a.dk.data, a.dk.dtype,
                         offset4(a.dk, r.b, r.kv_head, j0 + c, 0));
      store_row_narrowed(narrow_, dv + c * dv_pad_, p_.head_dim_v, a.dv.data, a.dv.dtype,
                         offset4(a.dv, r.b, r.kv_head, j0 + c, 0));
    }
  }

  const Params& p_;
  NarrowFn narrow_;  // 16-bit dK and dV: the call's target's rounding
  std::int64_t runs_;
  std::int64_t d_pad_, dv_pad_, key_tile_;
  std::vector<std::int64_t> tile_base_;  // [B + 1]: tiles of the sequences before b
  std::int64_t tile_floats_;
  bool in_place_;
  AlignedFloats sums_;
  [[noreturn]] void rethrow_cause() {
    std::exception_ptr cause;
    {
      const std::lock_guard<std::mutex> lock(cause_mutex_);
      cause = cause_;
    }
    std::rethrow_exception(cause);
  }

  // Per tile slot: the run whose tile is to be added next, or kAbandoned.
  static constexpr std::int64_t kAbandoned = -1;
  std::vector<std::atomic<std::int64_t>> turns_;
  std::mutex cause_mutex_;
  std::exception_ptr cause_;  // abandon()'s first cause
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

double flash_backward_workspace_bytes(const Params& p, const Launch& launch) {
  const FlashLayout& layout = flash_target_chosen().layout;
  const double max_k = static_cast<double>(p.seq.max_k());
  const BackwardSizes z = backward_sizes(p, layout, p.compute_dbias);
  const double kv_runs = static_cast<double>(p.batch * p.heads_kv * z.plan.runs);
  // (As flash_backward: no more threads' scratch than there are items.)
  const double threads = std::min(static_cast<double>(std::max(1, launch.threads)),
                                  std::max(1.0, kv_runs * static_cast<double>(z.plan.parts)));
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
  // heads, and then one thread runs the items in order. No more threads than items: a thread
  // past them would get only its scratch (O(Lq x D)) and an idle OS thread.
  const std::int64_t kv_runs = p.batch * p.heads_kv * runs;
  const std::int64_t items = kv_runs * parts;
  const std::int64_t most = dbias.shared_across(p) ? 1 : std::max<std::int64_t>(items, 1);
  const int threads = static_cast<int>(std::clamp<std::int64_t>(launch.threads, 1, most));
  const std::int64_t item_dq = rows * shape.d_pad;  // [run_heads][lq_pad][d_pad]
  AlignedFloats dq_parts(parts > 1 ? kv_runs * parts * item_dq : 1);
  AlignedFloats scratch(threads * per_thread);
  KvTileReducer reducer(p, a, runs, shape.d_pad, shape.dv_pad, tile, key_rows, target.narrow);
  // The heads of run r of (b, kv head): [first, last).
  auto run_heads_of = [&](std::int64_t kv_run, std::int64_t* first, std::int64_t* last) {
    const std::int64_t kv_head = kv_run / runs % p.heads_kv, r = kv_run % runs;
    *first = kv_head * p.group + r * run_heads;
    *last = std::min(*first + run_heads, (kv_head + 1) * p.group);
  };
  const std::vector<std::int64_t> order = flash_backward_order(p, runs, parts);
  std::atomic<std::int64_t> next{0};
  run_tasks(threads, threads, [&](int slot) {
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
    for (std::int64_t n = take_item(next, items, launch); n >= 0;
         n = take_item(next, items, launch)) {
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
      item.launch = &launch;
      if (parts > 1) item.dq = dq_parts.get() + (kv_run * parts + part) * item_dq;
      try {
        target.run_backward_heads(s.p, s.a, b, first, last, item,
                                  dbias.active() ? &dbias : nullptr);
      } catch (...) {
        reducer.abandon(std::current_exception());  // no run waits for tiles never added
        throw;
      }
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
          store_row_narrowed(target.narrow, sum + ((h - first) * lq_pad + i) * shape.d_pad, d,
                             s.a.dq.data, s.a.dq.dtype, offset4(s.a.dq, b, h, i, 0));
        }
      }
    }
  }
  dbias.store(a.dbias);
}
}  // namespace attncore::detail
