// The public entry points: validate, allocate what the caller did not provide, pick the
// backend (core/select.h), run it through the backend table.
#include <cstdio>
#include <new>
#include <string>

#include "attncore/attncore.h"
#include "core/cpu_info.h"
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

// Allocation failures surface as attncore::OutOfMemory with the op's name.
template <class Fn>
void guarded(const char* op, const char* stage, Fn&& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(std::string(op) + ": out of memory while " + stage);
  }
}

// Refuses, before any work, a call whose workspace this machine cannot hold.
void check_workspace(const char* op, const detail::BackendEntry& backend, Pass pass,
                     const Params& p, const Launch& launch) {
  const double bytes = backend.workspace_bytes(pass, p, launch);
  const double memory = detail::physical_memory_bytes();
  if (!(bytes <= memory)) {
    char text[160];
    std::snprintf(text, sizeof text, "(workspace=%.4g bytes, expected <= %.4g bytes", bytes,
                  memory);
    throw OutOfMemory(std::string(op) + ": the " + std::string(name_of(backend.id)) +
                      " backend's workspace exceeds this machine's memory " + text +
                      "); reduce the sizes or the thread count");
  }
}

Launch launch_of(const Options& options, const char* op) {
  return {detail::resolve_threads(options.num_threads, op)};
}

void run_forward(const Params& p, const Launch& launch, const ForwardArgs& args, Backend backend) {
  const detail::BackendEntry& entry =
      *detail::find_backend(detail::select_backend(Pass::forward, p, launch, backend));
  check_workspace("forward", entry, Pass::forward, p, launch);
  guarded("forward", "running the backend (outputs are incomplete)", [&] {
    entry.forward(p, launch, args);
    detail::fill_unused_rows(p, args);
  });
}

void run_backward(const Params& p, const Launch& launch, const BackwardArgs& args,
                  Backend backend) {
  const detail::BackendEntry& entry =
      *detail::find_backend(detail::select_backend(Pass::backward, p, launch, backend));
  check_workspace("backward", entry, Pass::backward, p, launch);
  guarded("backward", "running the backend (outputs are incomplete)", [&] {
    entry.backward(p, launch, args);
    detail::fill_unused_rows(p, args);
  });
}

DType lse_dtype(const Params& p) { return p.dtype == DType::f64 ? DType::f64 : DType::f32; }

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
  const Launch launch = launch_of(options, "forward");
  ForwardResult r;
  guarded("forward", "allocating out and lse", [&] {
    r.out = Tensor(p.dtype, {p.batch, p.heads_q, p.seq.lq, p.head_dim_v});
    r.lse = Tensor(lse_dtype(p), {p.batch, p.heads_q, p.seq.lq});
  });
  args.out = r.out;
  args.lse = r.lse;
  run_forward(p, launch, args, backend);
  return r;
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
  run_backward(p, launch, args, backend);
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
  const ForwardArgs args{q, k_cache, v_cache, out, lse.value_or(TensorView{})};
  const Params p = detail::validate_kvcache_forward(args, seqs, options, backend, true);
  run_forward(p, launch_of(options, "forward"), args, backend);
}

ForwardResult forward_kvcache(const TensorView& q, const TensorView& k_cache,
                              const TensorView& v_cache, const KvCacheSeqs& seqs,
                              const Options& options, Backend backend) {
  const ForwardArgs args{q, k_cache, v_cache, {}, {}};
  const Params p = detail::validate_kvcache_forward(args, seqs, options, backend, false);
  ForwardResult r;
  guarded("forward", "allocating out and lse", [&] {
    r.out = Tensor(p.dtype, {p.batch, p.heads_q, p.seq.lq, p.head_dim_v});
    r.lse = Tensor(lse_dtype(p), {p.batch, p.heads_q, p.seq.lq});
  });
  forward_kvcache_into(q, k_cache, v_cache, seqs, r.out, r.lse.view(), options, backend);
  return r;
}

}  // namespace attncore
