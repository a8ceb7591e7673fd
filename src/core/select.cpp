// Backend selection: the thread-local enabled list, the machine constants the cost model
// reads (fixed per SIMD target; measured only for comparison), and the choice over the backend
// table (each backend's limits and cost term are its
// own: src/cpu/*_cost.cpp). Messages follow docs/design.md section 4.
#include "core/select.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <thread>

#include "attncore/error.h"
#include "attncore/info.h"
#include "core/cpu_info.h"
#include "core/large_memory.h"
#include "core/threadpool.h"
#include "core/sequence.h"
#include "core/validate.h"
#include "policy/score_row.h"

namespace attncore {

namespace detail {

namespace {

// Every backend of this build, in the default priority order.
std::vector<Backend> all_backends() {
  std::vector<Backend> ids;
  for (const BackendEntry& e : backend_table()) ids.push_back(e.id);
  return ids;
}

bool is_backend(Backend b) { return find_backend(b) != nullptr; }

std::string list_string(const std::vector<Backend>& backends) {
  std::string s = "[";
  for (std::size_t i = 0; i < backends.size(); ++i) {
    s += (i ? ", " : "") + std::string(name_of(backends[i]));
  }
  return s + "]";
}

std::string join(const std::vector<std::string>& parts, const char* separator) {
  std::string s;
  for (const std::string& part : parts) s += (s.empty() ? "" : separator) + part;
  return s;
}

thread_local std::vector<Backend> t_enabled = all_backends();

// ---------------------------------------------------------------------------------------------
// The constants the cost model reads, fixed per SIMD target: the best target the CPU supports,
// a fixed property of the machine. Measured constants moved between processes on one machine
// (FMA 220-266 GFLOP/s, memory 21-42 GB/s, softmax 180-294 M/s, the pool's wake-up 0.6 us to
// 1 ms), which flipped near-ties: `attncore explain --heads-q 2 --seqlen-q 14 --head-dim 64`
// chose math in 15 and flash in 5 of 20 fresh processes.
struct TargetConstants {
  const char* target;
  double fma_gflops, memory_gbps, softmax_per_s, dispatch_seconds;
};

// avx512bf16: 2 cores of an AMD EPYC (Zen 5) as they measured
// itself when the cost terms were last checked against `attncore bench --select` (README:
// FMA 233 GFLOP/s, memory 31 GB/s, softmax 238 M elements/s per thread; the first fits, in
// core/cost.h, ran at 224, 23 and 183 M), and the middle of the pool wake-ups it measured
// (0.6-4 us). With them the model makes the choices of the README's select table (tiny f32:
// math, bf16: flash; from Hq = 8, L = 32 on: flash). The other rows were not measured on
// machines of their own: the FMA rate scales with the vector width (avx512: the same two
// 16-lane FMA pipes; avx2: two 8-lane ones, half; generic: 4-lane SSE without FMA, an eighth),
// and the rest, which no vector width changes, is the measuring machine's.
constexpr TargetConstants kTargetConstants[] = {
    {"avx512bf16", 233, 31, 238e6, 2e-6},
    {"avx512", 233, 31, 238e6, 2e-6},
    {"avx2", 116, 31, 238e6, 2e-6},
    {"generic", 29, 31, 238e6, 2e-6},
};

CostConstants fixed_cost_constants() {
  const std::vector<std::string> supported = simd_targets_supported();
  const std::string best = supported.empty() ? "generic" : supported.front();
  const TargetConstants* row = &kTargetConstants[std::size(kTargetConstants) - 1];
  for (const TargetConstants& t : kTargetConstants) {
    if (best == t.target) row = &t;
  }
  return {row->fma_gflops, row->memory_gbps, row->softmax_per_s, row->dispatch_seconds, 0.0,
          row->target};
}

// ---------------------------------------------------------------------------------------------
// Measuring the constants for comparison (about 20-30 ms once per process).

// Keeps the measured loops' results alive: a store the compiler must perform.
std::atomic<float> g_measure_sink{0.0f};

// One thread reading a 48 MiB buffer (1.5x the 32 MiB L3 of the measuring machine, more
// than most CPUs' last-level cache), written first so that its pages exist: the better of 2
// passes (StreamedMemory: huge pages, where the OS offers them, make the first touch cheap).
double measure_memory_gbps() {
  constexpr std::size_t kBytes = std::size_t{48} << 20;
  constexpr std::size_t kCount = kBytes / sizeof(float);
  const StreamedMemory buffer(kBytes);
  float* data = static_cast<float*>(buffer.data());
  std::memset(data, 0, kBytes);
  double best = 0;
  float sink = 0;
  for (int run = 0; run < 2; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    float acc[16] = {};
    for (std::size_t i = 0; i < kCount; i += 16) {
      for (int l = 0; l < 16; ++l) acc[l] += data[i + static_cast<std::size_t>(l)];
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (float a : acc) sink += a;
    best = std::max(best, kBytes / std::chrono::duration<double>(t1 - t0).count() * 1e-9);
  }
  g_measure_sink.store(sink, std::memory_order_relaxed);
  return best;
}

// The math backend's softmax row (policy/score_row.h) on 2048 scores in cache: elements/s,
// the best of 20 runs of 8 rows (each row copied in first, untimed).
double measure_softmax_per_s() {
  constexpr std::int64_t kRow = 2048, kRows = 8;
  std::vector<float> source(kRow), scores(kRow);
  for (std::int64_t j = 0; j < kRow; ++j) source[j] = static_cast<float>((j * 37) % 101) * 0.05f;
  double best = 0;
  float sink = 0;
  for (int run = 0; run < 20; ++run) {
    std::chrono::steady_clock::duration elapsed{};
    for (int r = 0; r < kRows; ++r) {
      std::copy(source.begin(), source.end(), scores.begin());
      const auto t0 = std::chrono::steady_clock::now();
      sink += softmax_row(scores.data(), kRow);
      elapsed += std::chrono::steady_clock::now() - t0;
    }
    best = std::max(best, kRows * kRow / std::chrono::duration<double>(elapsed).count());
  }
  g_measure_sink.store(sink, std::memory_order_relaxed);
  return best;
}

// How long a sleeping helper of the thread pool takes to start a task: a 2-task region whose
// caller, in its task, waits up to 1 ms for the helper to start the other. The fastest of the
// runs a helper started, of 16 after 4 that start the worker and let it settle (the fastest:
// the least disturbed run; the median swung from 5 to 45 us between processes on one machine;
// on a shared 2-CPU machine a helper missed the 1 ms in one run of several, where counting
// that run as 1 ms showed a wake-up of 1000 us in 4 `attncore explain` runs of 6). Where no
// helper comes in 4 runs (the pool busy with another caller's job, or the process held to one
// CPU), 1 ms: the model then expects no gain from a second thread, which the caller's taking
// every task bounds (parallel_seconds). 0 with one core.
double measure_dispatch_seconds() {
  if (affinity_threads() < 2) return 0;
  double best = HUGE_VAL;
  int missed = 0;
  for (int run = 0; run < 20; ++run) {
    std::atomic<bool> started{false};
    std::chrono::steady_clock::time_point t_start{};
    const std::thread::id caller = std::this_thread::get_id();
    const auto t0 = std::chrono::steady_clock::now();
    run_tasks(2, 2, [&](int) {
      if (std::this_thread::get_id() != caller) {
        t_start = std::chrono::steady_clock::now();
        started.store(true, std::memory_order_release);
        return;
      }
      while (!started.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1)) {
        std::this_thread::yield();  // the helper's own clock times it; on one CPU it can run
      }
    });
    if (!started.load()) {
      if (++missed == 4) break;  // (4 ms at most where no helper comes)
    } else if (run >= 4) {
      best = std::min(best, std::chrono::duration<double>(t_start - t0).count());
    }
  }
  return best < HUGE_VAL ? best : 1e-3;  // (no helper came)
}

CostConstants measure_cost_constants() {
  const auto t0 = std::chrono::steady_clock::now();
  CostConstants c{};
  constexpr double kFmaRunSeconds = 0.002;  // 3 runs of 2 ms: within 3% of the 0.06 s probe
  c.fma_gflops = measure_fma_peak_gflops(1, kFmaRunSeconds, 3);
  c.memory_gbps = measure_memory_gbps();
  c.softmax_per_s = measure_softmax_per_s();
  c.dispatch_seconds = measure_dispatch_seconds();
  c.measure_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  c.basis = "measured";
  return c;
}

std::string not_enabled_reason(Backend b, const std::vector<Backend>& enabled) {
  const std::string name(name_of(b));
  return name + ": backend is not enabled on this thread (enabled=" + list_string(enabled) +
         ", expected " + name + " among them); see BackendScope or set_enabled_backends";
}

}  // namespace

const char* name_of(Pass pass) { return pass == Pass::forward ? "forward" : "backward"; }

std::vector<std::string> can_use(Backend backend, Pass pass, const Params& p) {
  std::vector<std::string> reasons;
  const BackendEntry* e = find_backend(backend);
  if (e != nullptr && e->can_use != nullptr) e->can_use(pass, p, reasons);
  return reasons;
}

CostModel current_cost_model() {
  // Never destroyed: a call may be in flight at exit (tests/exit_test.cpp).
  static const CostConstants* const fixed = new CostConstants(fixed_cost_constants());
  CostModel m;
  m.machine = *fixed;
  for (const BackendEntry& e : backend_table()) {
    if (e.describe != nullptr) e.describe(m);
  }
  m.choice_threads = machine_threads();
  return m;
}

double estimate_seconds(Backend backend, Pass pass, const Params& p, const Launch& launch,
                        const CostModel& model) {
  const BackendEntry* e = find_backend(backend);
  if (e == nullptr || e->estimate == nullptr) return -1;
  return e->estimate(pass, dense_equivalent(p), launch, model);
}

Explanation select(Pass pass, const Params& p, const Launch& launch, Backend requested,
                   const std::vector<Backend>& enabled, const CostModel& model) {
  Explanation e;
  e.chosen = Backend::automatic;
  std::vector<Backend> order = enabled;
  for (const BackendEntry& entry : backend_table()) {
    const Backend b = entry.id;
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  }
  for (Backend b : order) {
    BackendVerdict v{b, std::find(enabled.begin(), enabled.end(), b) != enabled.end(),
                     can_use(b, pass, p), -1.0};
    if (v.reasons.empty()) v.estimated_seconds = estimate_seconds(b, pass, p, launch, model);
    if (requested == Backend::automatic && !v.enabled) {
      v.reasons.push_back(not_enabled_reason(b, enabled));
    }
    e.verdicts.push_back(std::move(v));
  }
  if (requested != Backend::automatic) {
    for (const BackendVerdict& v : e.verdicts) {
      if (v.backend == requested && v.reasons.empty()) e.chosen = requested;
    }
    return e;
  }
  // The fastest estimate among the enabled backends that can run, reference aside; backends
  // without an estimate rank after those with one, in priority order. The estimates compared
  // are those at the model's choice_threads, so that the choice, and with it every bit of the
  // result, does not depend on the call's thread count (docs/design.md section 6); the verdicts
  // show the call's own.
  const Launch reference_call{std::max(1, model.choice_threads)};
  const BackendVerdict* best = nullptr;
  double best_rank = HUGE_VAL;
  for (const BackendVerdict& v : e.verdicts) {
    if (!v.reasons.empty() || v.backend == Backend::reference) continue;
    const double t = reference_call.threads == launch.threads
                         ? v.estimated_seconds
                         : estimate_seconds(v.backend, pass, p, reference_call, model);
    const double rank = t >= 0 ? t : HUGE_VAL;  // no estimate: after those with one
    if (best == nullptr || rank < best_rank) {
      best = &v;
      best_rank = rank;
    }
  }
  if (best != nullptr) {
    e.chosen = best->backend;
    return e;
  }
  for (const BackendVerdict& v : e.verdicts) {
    if (v.backend == Backend::reference && v.reasons.empty()) e.chosen = Backend::reference;
  }
  return e;
}

Backend select_backend(Pass pass, const Params& p, const Launch& launch, Backend requested) {
  if (requested != Backend::automatic) {
    const std::vector<std::string> reasons = can_use(requested, pass, p);
    if (reasons.empty()) return requested;
    const std::string op = name_of(pass), name(name_of(requested));
    throw Unsupported(op + ": backend " + name + " cannot run this call (backend=" + name +
                      ", expected a backend that supports it); " + join(reasons, "; "));
  }
  const Explanation e = select(pass, p, launch, requested, t_enabled, current_cost_model());
  if (e.chosen != Backend::automatic) return e.chosen;
  const std::string op = name_of(pass);
  std::vector<std::string> reasons;
  for (const BackendVerdict& v : e.verdicts) {
    reasons.insert(reasons.end(), v.reasons.begin(), v.reasons.end());
  }
  throw Unsupported(op + ": no backend can run this call (enabled=" + list_string(t_enabled) +
                    ", expected one whose checks pass); " + join(reasons, "; "));
}

Explanation explain_call(Pass pass, const Params& p, const Options& options, Backend backend) {
  const Launch launch{resolve_threads(options.num_threads, name_of(pass))};
  if (backend != Backend::automatic) (void)select_backend(pass, p, launch, backend);
  return select(pass, p, launch, Backend::automatic, t_enabled, current_cost_model());
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Public API (attncore/backend.h).

std::vector<Backend> enabled_backends() { return detail::t_enabled; }

std::vector<Backend> set_enabled_backends(std::vector<Backend> backends) {
  if (backends.empty()) {
    throw InvalidArgument(
        "set_enabled_backends: backends is empty (backends=[], expected at least one of "
        "flash, math, reference)");
  }
  std::vector<Backend> unique;
  for (Backend b : backends) {
    if (!detail::is_backend(b)) {
      const std::string value =
          b == Backend::automatic ? std::string("auto") : std::to_string(static_cast<unsigned>(b));
      throw InvalidArgument("set_enabled_backends: backends has an invalid entry (backend=" +
                            value + ", expected flash, math or reference)");
    }
    if (std::find(unique.begin(), unique.end(), b) == unique.end()) unique.push_back(b);
  }
  std::swap(detail::t_enabled, unique);
  return unique;
}

BackendScope::BackendScope(std::vector<Backend> backends)
    : previous_(set_enabled_backends(std::move(backends))) {}

BackendScope::~BackendScope() { std::swap(detail::t_enabled, previous_); }

std::string Explanation::summary() const {
  std::ostringstream os;
  for (const BackendVerdict& v : verdicts) {
    os << name_of(v.backend) << (v.enabled ? "" : " (not enabled)") << ": ";
    if (v.reasons.empty()) {
      os << "can run";
    } else {
      os << "cannot run";
    }
    if (v.estimated_seconds >= 0) os << ", estimated " << v.estimated_seconds * 1e3 << " ms";
    os << '\n';
    for (const std::string& r : v.reasons) os << "  - " << r << '\n';
  }
  os << "chosen: " << (chosen == Backend::automatic ? "none" : name_of(chosen)) << '\n';
  return os.str();
}

Explanation explain_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                            const Options& options, Backend backend) {
  const detail::ForwardArgs args{q, k, v, {}, {}};
  const detail::Params p =
      detail::validate_forward(args, options, backend, /*check_outputs=*/false);
  return detail::explain_call(detail::Pass::forward, p, options, backend);
}

Explanation explain_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                             const TensorView& v, const TensorView& out, const TensorView& lse,
                             const Options& options, Backend backend) {
  const detail::BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  const detail::Params p =
      detail::validate_backward(args, options, backend, /*check_outputs=*/false);
  return detail::explain_call(detail::Pass::backward, p, options, backend);
}

Explanation explain_forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const VarlenSeqs& seqs, const Options& options,
                                   Backend backend) {
  detail::ForwardArgs args{q, k, v, {}, {}};
  const detail::Params p = detail::validate_varlen_forward(args, seqs, options, backend, false);
  return detail::explain_call(detail::Pass::forward, p, options, backend);
}

Explanation explain_forward_kvcache(const TensorView& q, const TensorView& k_cache,
                                    const TensorView& v_cache, const KvCacheSeqs& seqs,
                                    const Options& options, Backend backend) {
  const detail::ForwardArgs args{q, k_cache, v_cache, {}, {}};
  const detail::Params p = detail::validate_kvcache_forward(args, seqs, options, backend, false);
  return detail::explain_call(detail::Pass::forward, p, options, backend);
}

Explanation explain_backward_varlen(const TensorView& dout, const TensorView& q,
                                    const TensorView& k, const TensorView& v, const TensorView& out,
                                    const TensorView& lse, const VarlenSeqs& seqs,
                                    const Options& options, Backend backend) {
  detail::BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  const detail::Params p = detail::validate_varlen_backward(args, seqs, options, backend, false);
  return detail::explain_call(detail::Pass::backward, p, options, backend);
}

CostConstants cost_constants() { return detail::current_cost_model().machine; }

CostConstants measured_cost_constants() {
  static const CostConstants* const measured =  // never destroyed (tests/exit_test.cpp)
      new CostConstants(detail::measure_cost_constants());
  return *measured;
}

}  // namespace attncore
