// What a call computes beyond plain softmax(scale * q k^T) v: masks, score modifiers, dropout.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "attncore/export.h"
#include "attncore/tensor.h"

namespace attncore {

// The most threads one call may use: Options::num_threads, ATTNCORE_NUM_THREADS and the
// program's --threads above it are InvalidArgument errors. Above the logical core count of any
// machine attncore targets (the largest two-socket servers have 768), so that only a mistake
// reaches it, and fixed, so that a value valid on one machine is valid on every one.
inline constexpr int kMaxThreads = 1024;

// The most key splits Options::num_splits may force: above it an InvalidArgument error. Fixed
// (as kMaxThreads) so that a value valid on one machine is valid on every one; flash-attn's own
// planner stops at 128.
inline constexpr int kMaxSplits = 256;

// The fewest keys of a planned split part (src/cpu/flash_split_kv.cpp has its measurement): a
// kv group of at most this many keys is never split unless num_splits forces it, so its bits
// are the same in any batch, alone or not.
inline constexpr int kMinSplitKeys = 1024;

// The process-wide thread count of calls whose Options::num_threads is 0 (docs/design.md
// section 8's order: Options::num_threads, else this setting, else ATTNCORE_NUM_THREADS, else
// the CPUs the calling thread may run on). 1 to kMaxThreads sets it; 0 resets it (calls follow
// ATTNCORE_NUM_THREADS and the affinity mask again); a negative count or one past kMaxThreads
// throws InvalidArgument and leaves the setting as it was. Returns the previous setting (0 when
// none). Safe to call from any thread; calls already running keep their count.
ATTNCORE_API int set_num_threads(int num_threads);

// The thread count a call with Options::num_threads = 0 made now from this thread would use:
// set_num_threads's setting, else default_num_threads() (attncore/info.h), whose
// InvalidArgument for a bad ATTNCORE_NUM_THREADS it passes on.
ATTNCORE_API int get_num_threads();

// A thread pool of the caller's that runs a call's parallel work (Options::executor), so that
// attention runs inside an engine's own threads instead of attncore's pool.
class ATTNCORE_API Executor {
 public:
  // One task: its index in [0, num_tasks) and the worker running it, in [0, concurrency).
  using Task = std::function<void(int task, int worker)>;

  virtual ~Executor() = default;

  // Runs task(t, worker) once for every t in [0, num_tasks) on at most `concurrency` threads
  // at a time (the calling thread may be one of them; one thread running them in turn is
  // valid), and returns when every task has returned. Tasks running at the same time get
  // different worker indices. A task may wait for another task that has started, never for
  // one that has not: every started task must be left to run to its end (no suspending it to
  // run other tasks on its thread). Tasks do not throw: attncore catches inside them and
  // rethrows after parallel_for returns. If parallel_for throws, attncore takes it that no
  // task is running any more and the call throws attncore::Error with its message (the
  // outputs are incomplete). attncore calls it from the thread that made the call,
  // once per parallel region, with 2 <= num_tasks and concurrency <= the call's thread count.
  virtual void parallel_for(int num_tasks, int concurrency, const Task& task) const = 0;
};

// Which diagonal a causal mask keeps (query row i, key column j, lengths Lq and Lk).
enum class Causal : std::uint8_t {
  none,
  upper_left,   // j <= i               (torch is_causal)
  lower_right,  // j <= i + Lk - Lq     (flash-attn causal=True, KV-cache decode)
};

// The backend that runs a call. `automatic` picks, among the backends enabled on the calling
// thread that can run the call, the one the cost model estimates fastest (attncore/backend.h).
// GPU backends will take the values after `flash`.
enum class Backend : std::uint8_t {
  automatic,  // chosen per call: see attncore/backend.h
  reference,  // plain loops, fp64 accumulation: obviously correct, slow
  math,       // unfused: scores materialised, QK^T and PV as GEMMs
  flash,      // fused: tiled online softmax, SIMD, never materialises Lq x Lk (f32/bf16/f16)
};

ATTNCORE_API std::string_view name_of(Causal c);
// "auto", "reference", "math", "flash".
ATTNCORE_API std::string_view name_of(Backend b);
// The backend name_of(b) names; InvalidArgument on any other name.
ATTNCORE_API Backend backend_from_name(std::string_view name);

struct Options {
  // Multiplies q.k; default 1/sqrt(D). Must be finite and > 0.
  std::optional<double> scale{};
  Causal causal = Causal::none;
  // Sliding window, flash-attn semantics aligned lower-right; -1 = unbounded on that side:
  // key j is visible to query i iff i + Lk - Lq - window_left <= j <= i + Lk - Lq + window_right.
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  // Softcap: s = softcap * tanh(s / softcap); 0 = off, else > 0.
  double softcap = 0.0;
  // ALiBi slopes, f32 [Hq] or [B, Hq]: s -= slope * |i + Lk - Lq - j|.
  std::optional<TensorView> alibi_slopes{};
  // Attention mask, rank 2 [Lq|1, Lk|1] or rank 4 [B|1, Hq|1, Lq|1, Lk|1].
  // bool: true = takes part; floating (any of f32, f64, bf16, f16): added to the scores.
  std::optional<TensorView> mask{};
  // With an additive mask, backward also returns its gradient (reduced to the mask's shape);
  // forward computes nothing for it, so one Options value serves both calls (both refuse it
  // without an additive mask).
  bool compute_dbias = false;
  // Dropout on the attention probabilities, in [0, 1). The keep decision of element
  // (b, h, i, j) is element (offset + ((b*Hq + h)*Lq + i)*Lk + j) of the Philox4x32-10 stream
  // keyed by `seed`; backward replays it from the same (seed, offset).
  double dropout_p = 0.0;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  // Allow Hkv < Hq (GQA/MQA): query head h uses key/value head h / (Hq / Hkv).
  bool enable_gqa = true;
  // Threads for this call, 0 to kMaxThreads; 0 = get_num_threads(): set_num_threads's setting,
  // else ATTNCORE_NUM_THREADS if set (an integer from 1 to kMaxThreads, else the call throws
  // InvalidArgument), else the CPUs the calling thread may run on (its affinity mask:
  // `taskset -c 0` gives 1).
  int num_threads = 0;
  // Cancellation: when not null, the call reads *cancel before it starts and between its work
  // items (every backend: reference rows or tasks, math blocks, flash work items and kv
  // groups; a flash forward or backward item also between its key tiles), and once it reads
  // true, stops
  // and throws attncore::Cancelled; outputs are then incomplete. Set it from any thread; the
  // caller keeps the flag alive during the call.
  const std::atomic<bool>* cancel = nullptr;
  // When not null, the call's parallel regions run through this executor (kept alive by the
  // caller during the call) instead of attncore's pool, on at most the call's thread count
  // (num_threads and its defaults, as above). Results are the same bits either way.
  const Executor* executor = nullptr;
  // Split-KV decode (flash-decoding): how many parts the `flash` backend cuts each kv group's
  // keys into in dense, KV-cache and varlen calls whose query rows per kv head (Hq / Hkv * Lq) fit
  // one work item (48 rows on AVX2, 64 on AVX-512: decode, GQA decode, short chunks), each part run
  // as its own work item and the parts' (out, LSE) merged in order (docs/design.md section
  // 1.12). 0 = flash's planner chooses from the problem and the machine's CPU count (never from
  // the thread count: results are the same bits for any num_threads or executor); 1 = no split;
  // 2 to kMaxSplits = that many, capped to the number of 128-key tiles of the longest sequence
  // (varlen: of each sequence, which is split as its own dense call would be, unless the batch
  // holds a longer chunk: then nothing is split). reference, math and longer query chunks
  // compute without splitting. A split changes the rounding of the result (within
  // docs/design.md section 6's rule of the exact one), never its meaning.
  int num_splits = 0;
};

}  // namespace attncore
