"""attncore for torch: its attention as a torch.autograd.Function, so loss.backward() works.

scaled_dot_product_attention, flash_attn_func and attention here are the package's own
functions (they send torch tensors through AttentionFunction); importing them from
attncore.torch documents that the caller wants torch semantics and autograd. Gradients reach
query, key, value and a float attn_mask that requires grad (its gradient is dBias); ALiBi
slopes get none. A backward with dropout replays the forward's (seed, offset).
"""

import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

from . import _arrays
from ._attention import attention, backward4, forward4
from ._dropins import flash_attn_func, scaled_dot_product_attention

__all__ = ["AttentionFunction", "attention", "flash_attn_func", "scaled_dot_product_attention"]


class AttentionFunction(_torch.autograd.Function):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq]) of rank-4 views q [B, Hq, Lq, D],
    k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mask [B|1, Hq|1, Lq|1, Lk|1] or None, alibi slopes or
    None, and call (an attncore._attention.Call). lse is not differentiable."""

    @staticmethod
    def forward(ctx, query, key, value, mask, alibi_slopes, call):
        out, lse = forward4(_arrays.TORCH, query, key, value, mask, alibi_slopes, call)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(query, key, value, mask, alibi_slopes, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout, _dlse):
        query, key, value, mask, alibi_slopes, out, lse = ctx.saved_tensors
        lib = _arrays.TORCH
        want_dbias = ctx.needs_input_grad[3]
        dq, dk, dv, dbias = backward4(lib, lib.unit_last_stride(dout), query, key, value, out,
                                      lse, mask, alibi_slopes, ctx.call, want_dbias)
        return dq, dk, dv, dbias, None, None
