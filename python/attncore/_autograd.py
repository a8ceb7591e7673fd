"""AttentionFunction: forward4/backward4 as a torch.autograd.Function, so loss.backward() works;
PackedAttentionFunction: the same for calls whose q, k, v are views of packed tensors (or of
three separate ones), dense or variable-length.

Their gradients are first-order only (first_order): under create_graph=True, differentiating
them again raises NotImplementedError.

_attention imports this module when it meets torch tensors (numpy callers need not have torch);
the public name is attncore.torch.AttentionFunction.
"""

import functools

import torch as _torch

from . import _arrays, _copies
from ._rank4 import Call, backward4, forward4


class _SecondDerivative(_torch.autograd.Function):
    """Marks gradients that a backward made with create_graph=True: the same values, but a
    derivative of them (a double backward through attention) raises NotImplementedError."""

    @staticmethod
    def forward(ctx, count, *tensors):
        # The first `count` tensors are the gradients; the others (the call's inputs that
        # require grad) are there only so that the gradients' graph reaches them.
        return tensors[:count]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "backward: a second derivative is not supported (create_graph=True and a gradient "
            "of attncore's gradients, expected first-order gradients only); take higher-order "
            "derivatives through torch's own attention")


def first_order(backward):
    """A backward that computes without a graph (as once_differentiable), whose gradients, under
    create_graph=True, raise NotImplementedError when differentiated again. (once_differentiable
    marks them only where dout requires grad: gradients of a loss such as out.sum() came back
    as constants of q, k and v, and second derivatives were silently 0.)"""

    @functools.wraps(backward)
    def wrapped(ctx, *args):
        with _torch.no_grad():
            grads = backward(ctx, *args)
        if not _torch.is_grad_enabled():  # create_graph=False
            return grads
        given = [g for g in grads if isinstance(g, _torch.Tensor)]
        # The call's inputs (its saved tensors, dout) that require grad: the gradients' graph
        # goes through _SecondDerivative to them, so that torch.autograd.grad(f(g), q) meets
        # its error too (with detached leaves in their place q was not in that graph: torch's
        # own RuntimeError, or None with allow_unused).
        anchors = [t for t in (*ctx.saved_tensors, *args)
                   if isinstance(t, _torch.Tensor) and t.requires_grad]
        if not given or not anchors:
            return grads
        marked = _SecondDerivative.apply(len(given), *(g.detach() for g in given), *anchors)
        marked = iter(marked if isinstance(marked, tuple) else (marked,))
        return tuple(next(marked) if isinstance(g, _torch.Tensor) else g for g in grads)
    return wrapped


def checked_dout(lib, dout):
    """The gradient of the output as the kernels read it: a lazily negated view resolved (as
    every input is: _arrays.asarray), a last stride other than 1 copied."""
    return lib.unit_last_stride(lib.asarray(dout, "backward", "dout"), "backward", "dout")


class AttentionFunction(_torch.autograd.Function):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq]) of rank-4 views q [B, Hq, Lq, D],
    k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], mask [B|1, Hq|1, Lq|1, Lk|1] or None, alibi slopes or
    None, and call (an attncore._rank4.Call). lse is not differentiable."""

    @staticmethod
    def forward(ctx, query, key, value, mask, alibi_slopes, call):
        op = "AttentionFunction"
        if not isinstance(call, Call):
            raise TypeError(f"{op}: call is not an attncore call (type={type(call).__name__}, "
                            "expected the Call that attncore.attention makes); call "
                            "attncore.torch.scaled_dot_product_attention or attncore.attention")
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, _torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{op}: {name} has the wrong rank (rank="
                                 f"{getattr(x, 'ndim', None)}, expected 4: [B, H, L, D])")
        # 16-bit inputs: the kernel writes an f32 out, kept for the backward's
        # Delta = rowsum(dO * O), and the caller gets it rounded to the inputs' dtype. From the
        # rounded out, dQ and dK err up to 2-4x more in FlashAttention's
        # test_flash_attn_bwd_overflow case (tests/python/test_backward_precision.py). Memory:
        # the graph holds 4 bytes per out element until backward, besides the returned 16-bit
        # out (which alone it held before): +4 bytes per element.
        sixteen_bit = query.dtype in (_torch.float16, _torch.bfloat16)
        out, lse = forward4(_arrays.TORCH, query, key, value, mask, alibi_slopes, call,
                            "float32" if sixteen_bit else None)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(query, key, value, mask, alibi_slopes, out, lse)
        ctx.call = call
        return (out.to(query.dtype) if sixteen_bit else out), lse

    @staticmethod
    @first_order
    def backward(ctx, dout, _dlse):
        query, key, value, mask, alibi_slopes, out, lse = ctx.saved_tensors
        lib = _arrays.TORCH
        want_dbias = ctx.needs_input_grad[3]
        dout = checked_dout(lib, dout)
        dq, dk, dv, dbias = backward4(lib, dout, query, key, value, out, lse, mask,
                                      alibi_slopes, ctx.call, want_dbias)
        return dq, dk, dv, dbias, None, None


class PackedAttentionFunction(_torch.autograd.Function):
    """(out, lse) of kernel.forward(q, k, v) where (q, k, v) = split(*sources): the sources are
    q, k and v themselves, q and a packed kv, or one packed qkv, and split takes views of them
    (no copies). The backward allocates one gradient per source, laid out like it, and the
    kernel writes dq, dk, dv into split's views of those, so a packed input's gradient is one
    packed tensor. kernel: an attncore._rank4.DenseKernel or attncore._varlen.VarlenKernel.
    lse is not differentiable."""

    @staticmethod
    def forward(ctx, kernel, split, *sources):
        out, lse = kernel.forward(_arrays.TORCH, *split(*sources))
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(*sources, out, lse)
        ctx.kernel, ctx.split = kernel, split
        return out, lse

    @staticmethod
    @first_order
    def backward(ctx, dout, _dlse):
        *sources, out, lse = ctx.saved_tensors
        lib = _arrays.TORCH
        specs = [(tuple(s.shape), lib.dtype_name(s)) for s in sources]
        _copies.check_new_arrays("backward", *specs)  # (a broadcast source: a large gradient)
        grads = [_arrays.empty_in_order_of(lib, s, *spec) for s, spec in zip(sources, specs)]
        dout = checked_dout(lib, dout)
        ctx.kernel.backward_into(lib, dout, *ctx.split(*sources), out, lse, *ctx.split(*grads))
        needed = ctx.needs_input_grad[2:]
        return (None, None) + tuple(g if need else None for g, need in zip(grads, needed))


# Documented, and shown in reprs, under its public module.
AttentionFunction.__module__ = "attncore.torch"


class FastAttentionFunction(_torch.autograd.Function):
    """The autograd record of a call that attncore._core.attend ran (the fast path of
    scaled_dot_product_attention and flash_attn_func): forward takes q, k, v, mask (or None)
    and the out and lse the call made, returns out; backward runs backward4 on the rank-4
    views (q [B, Lq, Hq, D] seen as [B, Hq, Lq, D] when blhd). lse is not returned."""

    @staticmethod
    def forward(ctx, query, key, value, mask, out, lse, call, blhd):
        ctx.save_for_backward(query, key, value, mask, out, lse)
        ctx.call, ctx.blhd = call, blhd
        # (Not out itself: autograd would take an input returned as is for a view, on which
        # it refuses in-place operations.)
        return out.detach()

    @staticmethod
    @first_order
    def backward(ctx, dout):
        query, key, value, mask, out, lse = ctx.saved_tensors
        lib = _arrays.TORCH
        four = (lambda x: x.transpose(1, 2)) if ctx.blhd else (lambda x: x)
        dout = checked_dout(lib, four(dout))
        dq, dk, dv, dbias = backward4(lib, dout, four(query),
                                      four(key), four(value), four(out), lse, mask, None,
                                      ctx.call, ctx.needs_input_grad[3])
        return four(dq), four(dk), four(dv), dbias, None, None, None, None
