// Which backend runs a call: the backends `Backend::automatic` may choose from on this thread,
// why each one can or cannot run a given call, and what the cost model expects of it.
//
// Rules (README: Backend selection):
// - A call with `Backend::automatic` considers the enabled backends of the calling thread, in
//   their priority order, drops those that cannot run the call, and among the rest takes the
//   one the cost model estimates fastest at the machine's logical core count (ties: the earlier
//   one), so that the choice, and every bit of the result, is the same for any thread count of
//   the call (the verdicts show the estimates for the call's own threads). `reference` is taken
//   only when nothing else can run. When nothing can, the call throws one Unsupported that lists
//   every backend with its reasons.
// - A call that names a backend runs that backend or throws Unsupported with its reasons; the
//   enabled list does not restrict it (like calling a kernel directly).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "attncore/export.h"
#include "attncore/options.h"
#include "attncore/tensor.h"

namespace attncore {

// Backends `automatic` may choose from on this thread, in priority order (default
// {flash, math, reference}).
ATTNCORE_API std::vector<Backend> enabled_backends();

// Replaces this thread's list; returns the previous one. Empty list or `automatic` in it ->
// InvalidArgument. Repeated backends count once, at their first position.
ATTNCORE_API std::vector<Backend> set_enabled_backends(std::vector<Backend> backends);

// RAII: set_enabled_backends in the constructor, restore in the destructor.
class ATTNCORE_API BackendScope {
 public:
  explicit BackendScope(std::vector<Backend> backends);
  ~BackendScope();
  BackendScope(const BackendScope&) = delete;
  BackendScope& operator=(const BackendScope&) = delete;

 private:
  std::vector<Backend> previous_;
};

// One backend's verdict on one call.
struct BackendVerdict {
  Backend backend;
  bool enabled;                      // in this thread's enabled list
  std::vector<std::string> reasons;  // why it cannot run the call; empty: it can
  double estimated_seconds;          // the cost model's estimate; < 0 if not estimated
};

// What `Backend::automatic` would do with a call.
struct ATTNCORE_API Explanation {
  std::vector<BackendVerdict> verdicts;  // the enabled backends in priority order, then the rest
  Backend chosen;                        // `automatic` if no backend can run the call
  std::string summary() const;           // multi-line human text
};

// Validate the arguments like forward/backward (bad input throws InvalidArgument) and explain
// the automatic choice on this thread; run nothing. With a named `backend`, also refuse the call
// where that backend cannot run it, as the call with it does (Unsupported): a caller can check a
// call this way before it prepares the inputs (the explanation is automatic's either way).
ATTNCORE_API Explanation explain_forward(const TensorView& q, const TensorView& k,
                                         const TensorView& v, const Options& options,
                                         Backend backend = Backend::automatic);
ATTNCORE_API Explanation explain_backward(const TensorView& dout, const TensorView& q,
                                          const TensorView& k, const TensorView& v,
                                          const TensorView& out, const TensorView& lse,
                                          const Options& options,
                                          Backend backend = Backend::automatic);

// The constants of this CPU behind `estimated_seconds`.
struct CostConstants {
  double fma_gflops;        // f32 FMA peak of one thread, GFLOP/s
  double memory_gbps;       // one thread streaming a buffer larger than the last-level cache
  double softmax_per_s;     // one thread: elements/s of the unfused softmax row (std::exp)
  double dispatch_seconds;  // waking the library's thread pool for one parallel region
  double measure_seconds;   // how long measuring these took; 0 for the fixed ones
  std::string basis;        // the SIMD target of the fixed values ("avx512bf16"), or "measured"
};

// The constants the cost model uses: fixed per SIMD target (the best one this CPU supports,
// whatever set_simd_target chose), so that the automatic choice, and with it every bit of a
// result, depends only on the call and fixed properties of the machine, never on a timing.
ATTNCORE_API CostConstants cost_constants();

// The same quantities measured on this machine, for comparison with the fixed ones (`attncore
// explain` and `attncore info` show both): measured once per process, at the first call (about
// 20-30 ms), then reused. The cost model does not read them.
ATTNCORE_API CostConstants measured_cost_constants();

}  // namespace attncore
