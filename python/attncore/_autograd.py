"""AttentionFunction: forward4/backward4 as a torch.autograd.Function, so loss.backward() works.

_attention imports this module when it meets torch tensors (numpy callers need not have torch);
the public name is attncore.torch.AttentionFunction.
"""

import torch as _torch
from torch.autograd.function import once_differentiable as _once_differentiable

from . import _arrays
from ._rank4 import backward4, forward4


class AttentionFunction(_torch.autograd.Function):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq]) of rank-4 views q [B, Hq, Lq, D],
    k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mask [B|1, Hq|1, Lq|1, Lk|1] or None, alibi slopes or
    None, and call (an attncore._rank4.Call). lse is not differentiable."""

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


# Documented, and shown in reprs, under its public module.
AttentionFunction.__module__ = "attncore.torch"
