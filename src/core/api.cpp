// The public entry points: validate, allocate what the caller did not provide, pick the
// backend (core/select.h), run it through the backend table.
#include "core/api.h"

#include <cstdio>
#include <functional>
#include <new>
#include <optional>
#include <string>

#include "attncore/attncore.h"
#include "core/cpu_info.h"
#include "core/dbias.h"
#include "core/exit_guard.h"
#include "core/select.h"
#include "core/sequence.h"
#include "core/threadpool.h"
#include "core/validate.h"

namespace attncore {

namespace {

using detail::BackwardArgs;
using detail::ForwardArgs;
using detail::Launch;
using detail::Params;
using detail::Pass;

// Allocation failures surface as attncore::OutOfMemory with the op's name, a backend's
// cancellation as attncore::Cancelled, an executor's exception as attncore::Error.
template <class Fn>
void guarded(const char* op, const char* stage, Fn&& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(std::string(op) + ": out of memory while " + stage);
  } catch (const detail::CancelledWork&) {
    throw Cancelled(detail::cancelled_message(op));
  } catch (const detail::ExecutorFailed& failed) {
    throw Error(detail::executor_failed_message(op, failed));
  }
}

// Refuses, before anything is allocated or written, a call whose workspace plus the outputs
// the library allocates for it (`output_bytes`; 0 when the caller provides them) exceed the
// memory this process may use (memory_limit, attncore/info.h: physical memory, cgroup, RLIMIT_AS).
void check_memory(const char* op, const detail::BackendEntry& backend, Pass pass, const Params& p,
                  const Launch& launch, double output_bytes) {
  const bool no_work = pass == Pass::forward ? p.empty_output() : p.empty_backward();
  const double workspace =
      no_work ? 0
              : backend.workspace_bytes(pass, p, launch) +
                    (pass == Pass::backward ? detail::DbiasAccumulator::bytes(p) : 0);
  const std::optional<MemoryLimit> exceeded =
      detail::exceeded_memory_limit(workspace + output_bytes);
  if (!exceeded) return;
  const MemoryLimit limit = *exceeded;
  const std::string name(name_of(backend.id));
  char text[200];
  if (output_bytes == 0) {
    std::snprintf(text, sizeof text, "(workspace=%.4g bytes, expected <= %.4g bytes, %s)",
                  workspace, limit.bytes, limit.name);
    throw OutOfMemory(std::string(op) + ": the " + name +
                      " backend's workspace exceeds the memory this process may use " + text +
                      "; reduce the sizes or the thread count");
  }
  std::snprintf(text, sizeof text,
                "(outputs=%.4g bytes, workspace=%.4g bytes, expected a total <= %.4g bytes, %s)",
                output_bytes, workspace, limit.bytes, limit.name);
  throw OutOfMemory(std::string(op) + ": the outputs and the " + name +
                    " backend's workspace exceed the memory this process may use " + text +
                    "; reduce the sizes or the thread count");
}

Launch launch_of(const Options& options, const char* op) {
  return {detail::resolve_threads(options.num_threads, op), options.cancel, options.executor};
}

// The backend a call runs (core/select.h), its memory checked (check_memory), and the call's
// cancel flag read once before anything is allocated or written.
const detail::BackendEntry& prepare(Pass pass, const Params& p, const Launch& launch,
                                    Backend backend, double output_bytes) {
  const detail::BackendEntry& entry =
      *detail::find_backend(detail::select_backend(pass, p, launch, backend));
  check_memory(detail::name_of(pass), entry, pass, p, launch, output_bytes);
  if (launch.cancelled()) {
    throw Cancelled(detail::cancelled_message(detail::name_of(pass), /*started=*/false));
  }
  return entry;
}

void run_forward(const detail::BackendEntry& entry, const Params& p, const Launch& launch,
                 const ForwardArgs& args) {
  detail::run_in_flight([&] {
    guarded("forward", "running the backend (outputs are incomplete)", [&] {
      const detail::ExecutorScope executor(launch.executor);
      if (!p.empty_output()) entry.forward(p, launch, args);  // (no work: check_memory)
      detail::fill_unused_rows(p, args);
    });
  });
}

void run_forward(const Params& p, const Launch& launch, const ForwardArgs& args, Backend backend) {
  run_forward(prepare(Pass::forward, p, launch, backend, 0), p, launch, args);
}

void run_backward(const detail::BackendEntry& entry, const Params& p, const Launch& launch,
                  const BackwardArgs& args) {
  detail::run_in_flight([&] {
    guarded("backward", "running the backend (outputs are incomplete)", [&] {
      const detail::ExecutorScope executor(launch.executor);
      if (!p.empty_backward()) entry.backward(p, launch, args);
      detail::fill_unused_rows(p, args);
    });
  });
}

void run_backward(const Params& p, const Launch& launch, const BackwardArgs& args,
                  Backend backend) {
  run_backward(prepare(Pass::backward, p, launch, backend, 0), p, launch, args);
}

DType lse_dtype(const Params& p) { return p.dtype == DType::f64 ? DType::f64 : DType::f32; }

// Bytes of the outputs the allocating forms create: out [rows, Hq, Dv] and lse [Hq, rows] of
// the forward; dq, dk, dv like q, k, v (and dbias like the mask) of the backward. `rows_q`,
// `rows_k`: B * Lq and B * Lk (dense), total_q and total_k (varlen). Doubles: validation
// bounds every count below 2^63, and the memory check compares the bytes before any int64
// product of them is formed.
double forward_output_bytes(const Params& p, double rows_q) {
  return rows_q * static_cast<double>(p.heads_q) *
         (static_cast<double>(p.head_dim_v) * static_cast<double>(size_of(p.dtype)) +
          static_cast<double>(size_of(lse_dtype(p))));
}

double backward_output_bytes(const Params& p, double rows_q, double rows_k) {
  const double dims_q = static_cast<double>(p.heads_q) * static_cast<double>(p.head_dim);
  const double dims_k =
      static_cast<double>(p.heads_kv) * static_cast<double>(p.head_dim + p.head_dim_v);
  double bytes = (rows_q * dims_q + rows_k * dims_k) * static_cast<double>(size_of(p.dtype));
  if (p.compute_dbias) {
    double mask = static_cast<double>(size_of(p.mask_original.dtype));
    for (int d = 0; d < p.mask_original.rank; ++d)
      mask *= static_cast<double>(p.mask_original.size(d));
    bytes += mask;
  }
  return bytes;
}

double dense_rows(const Params& p, std::int64_t length) {
  return static_cast<double>(p.batch) * static_cast<double>(length);
}

// A dense-shaped forward (dense, KV cache) that allocates its outputs, out [B, Hq, Lq, Dv] and
// lse [B, Hq, Lq], once the backend is chosen and the memory checked (prepare); `before_run`,
// when set, runs just before the backend does.
ForwardResult forward_allocating(const Params& p, ForwardArgs args, const Options& options,
                                 Backend backend, const std::function<void()>& before_run = {}) {
  const Launch launch = launch_of(options, "forward");
  const detail::BackendEntry& entry =
      prepare(Pass::forward, p, launch, backend, forward_output_bytes(p, dense_rows(p, p.seq.lq)));
  ForwardResult r;
  guarded("forward", "allocating out and lse", [&] {
    r.out = Tensor(p.dtype, {p.batch, p.heads_q, p.seq.lq, p.head_dim_v});
    r.lse = Tensor(lse_dtype(p), {p.batch, p.heads_q, p.seq.lq});
  });
  args.out = r.out;
  args.lse = r.lse;
  if (before_run) before_run();
  run_forward(entry, p, launch, args);
  return r;
}

}  // namespace

void forward_into(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const std::optional<TensorView>& lse,
                  const Options& options, Backend backend) {
  const ForwardArgs args{q, k, v, out, lse.value_or(TensorView{})};
  const Params p = detail::validate_forward(args, options, backend, /*check_outputs=*/true);
  run_forward(p, launch_of(options, "forward"), args, backend);
}

ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, Backend backend) {
  ForwardArgs args{q, k, v, {}, {}};
  const Params p = detail::validate_forward(args, options, backend, /*check_outputs=*/false);
  return forward_allocating(p, args, options, backend);
}

void backward_into(const TensorView& dout, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& out, const TensorView& lse,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                   const std::optional<TensorView>& dbias, const Options& options,
                   Backend backend) {
  const BackwardArgs args{dout, q, k, v, out, lse, dq, dk, dv, dbias.value_or(TensorView{})};
  const Params p = detail::validate_backward(args, options, backend, /*check_outputs=*/true);
  run_backward(p, launch_of(options, "backward"), args, backend);
}

BackwardResult backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const Options& options, Backend backend) {
  BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  const Params p = detail::validate_backward(args, options, backend, /*check_outputs=*/false);
  const Launch launch = launch_of(options, "backward");
  const detail::BackendEntry& entry =
      prepare(Pass::backward, p, launch, backend,
              backward_output_bytes(p, dense_rows(p, p.seq.lq), dense_rows(p, p.seq.lk)));
  BackwardResult r;
  guarded("backward", "allocating the gradients", [&] {
    r.dq = Tensor(p.dtype, {p.batch, p.heads_q, p.seq.lq, p.head_dim});
    r.dk = Tensor(p.dtype, {p.batch, p.heads_kv, p.seq.lk, p.head_dim});
    r.dv = Tensor(p.dtype, {p.batch, p.heads_kv, p.seq.lk, p.head_dim_v});
    if (p.compute_dbias)
      r.dbias = Tensor(p.mask_original.dtype, p.mask_original.shape.data(), p.mask_original.rank);
  });
  args.dq = r.dq;
  args.dk = r.dk;
  args.dv = r.dv;
  args.dbias = r.dbias.view();
  run_backward(entry, p, launch, args);
  return r;
}

void forward_varlen_into(const TensorView& q, const TensorView& k, const TensorView& v,
                         const VarlenSeqs& seqs, const TensorView& out,
                         const std::optional<TensorView>& lse, const Options& options,
                         Backend backend) {
  ForwardArgs args{q, k, v, out, lse.value_or(TensorView{})};
  const Params p = detail::validate_varlen_forward(args, seqs, options, backend, true);
  run_forward(p, launch_of(options, "forward"), args, backend);
}

ForwardResult forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const VarlenSeqs& seqs, const Options& options, Backend backend) {
  ForwardArgs args{q, k, v, {}, {}};
  const Params p = detail::validate_varlen_forward(args, seqs, options, backend, false);
  (void)prepare(Pass::forward, p, launch_of(options, "forward"), backend,
                forward_output_bytes(p, static_cast<double>(p.seq.rows_q)));
  ForwardResult r;
  guarded("forward", "allocating out and lse", [&] {
    r.out = Tensor(p.dtype, {p.seq.rows_q, p.heads_q, p.head_dim_v});
    r.lse = Tensor(lse_dtype(p), {p.heads_q, p.seq.rows_q});
  });
  // Validated again with the outputs: cheap next to the call, and one path for both forms.
  forward_varlen_into(q, k, v, seqs, r.out, r.lse.view(), options, backend);
  return r;
}

void backward_varlen_into(const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& out, const TensorView& lse,
                          const VarlenSeqs& seqs, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, const Options& options, Backend backend) {
  BackwardArgs args{dout, q, k, v, out, lse, dq, dk, dv, {}};
  const Params p = detail::validate_varlen_backward(args, seqs, options, backend, true);
  run_backward(p, launch_of(options, "backward"), args, backend);
}

BackwardResult backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& out, const TensorView& lse,
                               const VarlenSeqs& seqs, const Options& options, Backend backend) {
  BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  const Params p = detail::validate_varlen_backward(args, seqs, options, backend, false);
  (void)prepare(Pass::backward, p, launch_of(options, "backward"), backend,
                backward_output_bytes(p, static_cast<double>(p.seq.rows_q),
                                      static_cast<double>(p.seq.rows_k)));
  BackwardResult r;
  guarded("backward", "allocating the gradients", [&] {
    r.dq = Tensor(p.dtype, {p.seq.rows_q, p.heads_q, p.head_dim});
    r.dk = Tensor(p.dtype, {p.seq.rows_k, p.heads_kv, p.head_dim});
    r.dv = Tensor(p.dtype, {p.seq.rows_k, p.heads_kv, p.head_dim_v});
  });
  backward_varlen_into(dout, q, k, v, out, lse, seqs, r.dq, r.dk, r.dv, options, backend);
  return r;
}

void forward_kvcache_into(const TensorView& q, const TensorView& k_cache,
                          const TensorView& v_cache, const KvCacheSeqs& seqs,
                          const TensorView& out, const std::optional<TensorView>& lse,
                          const Options& options, Backend backend) {
  detail::forward_kvcache_into_with(q, k_cache, v_cache, seqs, out, lse, options, backend, {});
}

void detail::forward_kvcache_into_with(const TensorView& q, const TensorView& k_cache,
                                       const TensorView& v_cache, const KvCacheSeqs& seqs,
                                       const TensorView& out, const std::optional<TensorView>& lse,
                                       const Options& options, Backend backend,
                                       const std::function<void()>& before_run) {
  const ForwardArgs args{q, k_cache, v_cache, out, lse.value_or(TensorView{})};
  const Params p = detail::validate_kvcache_forward(args, seqs, options, backend, true);
  const Launch launch = launch_of(options, "forward");
  const detail::BackendEntry& entry = prepare(Pass::forward, p, launch, backend, 0);
  if (before_run) before_run();
  run_forward(entry, p, launch, args);
}

ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                              const TensorView& v_cache, const KvCacheSeqs& seqs,
                              const Options& options, Backend backend) {
  return detail::forward_kvcache_with(q, k_cache, v_cache, seqs, options, backend, {});
}

ForwardResult detail::forward_kvcache_with(const TensorView& q, const TensorView& k_cache,
                                           const TensorView& v_cache, const KvCacheSeqs& seqs,
                                           const Options& options, Backend backend,
                                           const std::function<void()>& before_run) {
  ForwardArgs args{q, k_cache, v_cache, {}, {}};
  const Params p = detail::validate_kvcache_forward(args, seqs, options, backend, false);
  return forward_allocating(p, args, options, backend, before_run);
}

}  // namespace attncore
