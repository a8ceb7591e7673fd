// The public entry points: validate, allocate what the caller did not provide, pick the
// backend (core/select.h), run it.
#include <new>
#include <string>

#include "attncore/attncore.h"
#include "core/select.h"
#include "core/threadpool.h"
#include "core/validate.h"
#include "cpu/flash.h"
#include "cpu/math.h"
#include "reference/reference.h"

namespace attncore {

namespace {

using detail::BackwardArgs;
using detail::ForwardArgs;
using detail::Problem;

// Allocation and kernel failures surface as attncore::Error with the op's name.
template <class Fn>
void guarded(const char* op, const char* stage, Fn&& fn) {
  try {
    fn();
  } catch (const std::bad_alloc&) {
    throw Error(std::string(op) + ": out of memory while " + stage);
  }
}

void run_forward(const Problem& p, const ForwardArgs& args, Backend backend) {
  const Backend chosen = detail::select_backend(detail::Pass::forward, p, backend);
  guarded("forward", "running the backend (outputs are incomplete)", [&] {
    if (chosen == Backend::flash) {
      detail::flash_forward(p, args);
    } else if (chosen == Backend::math) {
      detail::math_forward(p, args);
    } else {
      detail::reference_forward(p, args);
    }
  });
}

void run_backward(const Problem& p, const BackwardArgs& args, Backend backend) {
  const Backend chosen = detail::select_backend(detail::Pass::backward, p, backend);
  guarded("backward", "running the backend (outputs are incomplete)", [&] {
    if (chosen == Backend::flash) {
      detail::flash_backward(p, args);
    } else if (chosen == Backend::math) {
      detail::math_backward(p, args);
    } else {
      detail::reference_backward(p, args);
    }
  });
}

}  // namespace

void forward_into(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const std::optional<TensorView>& lse,
                  const Options& options, Backend backend) {
  const ForwardArgs args{q, k, v, out, lse.value_or(TensorView{})};
  Problem p = detail::validate_forward(args, options, backend, /*check_outputs=*/true);
  p.threads = detail::resolve_threads(p.threads);
  run_forward(p, args, backend);
}

ForwardResult forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, Backend backend) {
  ForwardArgs args{q, k, v, {}, {}};
  Problem p = detail::validate_forward(args, options, backend, /*check_outputs=*/false);
  p.threads = detail::resolve_threads(p.threads);
  ForwardResult r;
  guarded("forward", "allocating out and lse", [&] {
    r.out = Tensor(p.dtype, {p.batch, p.heads_q, p.seqlen_q, p.head_dim_v});
    r.lse =
        Tensor(p.dtype == DType::f64 ? DType::f64 : DType::f32, {p.batch, p.heads_q, p.seqlen_q});
  });
  args.out = r.out;
  args.lse = r.lse;
  run_forward(p, args, backend);
  return r;
}

void backward_into(const TensorView& dout, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& out, const TensorView& lse,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv,
                   const std::optional<TensorView>& dbias, const Options& options,
                   Backend backend) {
  const BackwardArgs args{dout, q, k, v, out, lse, dq, dk, dv, dbias.value_or(TensorView{})};
  Problem p = detail::validate_backward(args, options, backend, /*check_outputs=*/true);
  p.threads = detail::resolve_threads(p.threads);
  run_backward(p, args, backend);
}

BackwardResult backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                        const TensorView& v, const TensorView& out, const TensorView& lse,
                        const Options& options, Backend backend) {
  BackwardArgs args{dout, q, k, v, out, lse, {}, {}, {}, {}};
  Problem p = detail::validate_backward(args, options, backend, /*check_outputs=*/false);
  p.threads = detail::resolve_threads(p.threads);
  BackwardResult r;
  guarded("backward", "allocating the gradients", [&] {
    r.dq = Tensor(p.dtype, {p.batch, p.heads_q, p.seqlen_q, p.head_dim});
    r.dk = Tensor(p.dtype, {p.batch, p.heads_kv, p.seqlen_k, p.head_dim});
    r.dv = Tensor(p.dtype, {p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v});
    if (p.compute_dbias)
      r.dbias = Tensor(p.mask_original.dtype, p.mask_original.shape.data(), p.mask_original.rank);
  });
  args.dq = r.dq;
  args.dk = r.dk;
  args.dv = r.dv;
  args.dbias = r.dbias.view();
  run_backward(p, args, backend);
  return r;
}

}  // namespace attncore
