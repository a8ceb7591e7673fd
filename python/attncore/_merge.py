"""merge_attention_states: two attention results over disjoint key sets combined into the
result over their union (the C++ merge_attention_states_into, docs/design.md section 1.12).

Below the drop-ins: it only needs _arrays and _core.
"""

import sys

from . import _arrays, _copies, _core
from ._rank4 import INT32_MAX, int_option, lse_dtype


def refuse_grad(op, named):
    """NotImplementedError where torch autograd would have to track a call that has no backward
    here: grad mode on and an input that requires grad. named: (name, array or None) pairs."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return
    for name, x in named:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise NotImplementedError(
                f"{op}: {name} requires grad ({name}.requires_grad=True, expected no autograd); "
                f"{op} is forward only: call it under torch.no_grad() or pass {name}.detach()")


def _empty_like_order(lib, shape, dtype_name, strides):
    """A new array of `shape` whose dims lie in memory in the order of `strides` (largest
    first), so that a result comes back laid out like the argument it corresponds to."""
    rank = len(shape)
    order = sorted(range(rank), key=lambda d: -strides[d])
    buffer = lib.empty(tuple(shape[d] for d in order), dtype_name)
    return lib.permute(buffer, tuple(order.index(d) for d in range(rank)))


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, num_threads=0):
    """(out, lse) of attention over the union of two disjoint key sets, from the results over
    each: lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b - lse)
    out_b, computed stably. A side whose LSE is -inf adds nothing (whatever its output holds);
    both -inf give out 0 and lse -inf.

    out_a, out_b [..., Dv] (rank <= 4, one shape and dtype: float32, float16, bfloat16 or
    float64); lse_a, lse_b shaped as the output without its last dim (float32; float64 for
    float64 outputs); all four read through their strides, without a copy (numpy's negative
    strides and strides of no whole element excepted). flash-attn's softmax_lse is [B, H, L] for an
    output [B, L, H, Dv]: pass lse.transpose(1, 2) (numpy: swapaxes(1, 2)), and transpose the
    returned lse back. Varlen outputs [total_q, H, Dv] take their LSE [H, total_q] transposed the
    same way. The results are new arrays of out_a's library, laid out in memory like out_a and
    lse_a. Forward only: torch inputs that require grad under grad mode raise
    NotImplementedError.
    """
    op = "merge_attention_states"
    refuse_grad(op, (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)))
    # (adopt copies only numpy's negative strides and strides of no whole element.)
    lib, a, give_back = _arrays.adopt(out_a, op, "out_a")
    lse_lib, la, _ = _arrays.adopt(lse_a, op, "lse_a")
    b_lib, b, _ = _arrays.adopt(out_b, op, "out_b")
    lb_lib, lb, _ = _arrays.adopt(lse_b, op, "lse_b")
    num_threads = int_option(op, "num_threads", num_threads, -INT32_MAX - 1, INT32_MAX,
                             "; 0 = default")
    shape = tuple(a.shape)
    dtype = lib.dtype_name(a)
    _copies.check_new_arrays(op, (shape, dtype), (shape[:-1], lse_dtype(dtype)))
    out = _arrays.empty_in_order_of(lib, a, shape, dtype) if shape else lib.empty(shape, dtype)
    lse_shape = shape[:-1]
    lse_strides = (tuple(lse_lib.strides(la)) if tuple(la.shape) == lse_shape
                   else tuple(range(len(lse_shape), 0, -1)))
    lse = _empty_like_order(lib, lse_shape, lse_dtype(dtype), lse_strides)
    _core.merge_attention_states(lib.to_core(a), lse_lib.to_core(la), b_lib.to_core(b),
                                 lb_lib.to_core(lb), lib.to_core(out), lib.to_core(lse),
                                 num_threads)
    return give_back(out), give_back(lse)

