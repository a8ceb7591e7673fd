"""attncore's attention as torch operators (registered through torch's operator registration
API, by name), so that torch.jit.trace and torch.jit.script record a call as one node,
torch.ops.attncore.scaled_dot_product_attention, and a scripted or traced model can hold it.

Three operators, in the namespace "attncore":
- scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
  is_causal=False, scale=None, enable_gqa=False) -> Tensor: torch's SDPA semantics (as
  attncore.torch.scaled_dot_product_attention). Its autograd kernel records the two below.
- sdpa_forward(..., seed) -> (out, lse): the forward with an explicit dropout seed (offset 0).
- sdpa_backward(dout, query, key, value, out, lse, ..., seed) -> (dq, dk, dv).

Dropout draws its seed from torch's default generator when the call is made (as the package's
functions do), so torch.manual_seed reproduces a run. A float attn_mask that requires grad gets
no gradient through the operators (NotImplementedError: use attncore.torch's function). The
plain Python functions do not go through these operators (their fast path is cheaper).
"""

import torch as _torch
from torch import library as _registry

from . import _arrays
from ._attention import attention, attention_backward, explain
from ._autograd import first_order
from ._random import _torch_seed
from ._rank4 import check_sdpa_mask, sdpa_enable_gqa, sdpa_query_heads

_ARGS = ("Tensor? attn_mask=None, float dropout_p=0.0, bool is_causal=False, "
         "float? scale=None, bool enable_gqa=False")
_U64 = 2 ** 64

_ops = getattr(_registry, "Library")("attncore", "DEF")  # the operators' namespace
_ops.define(f"scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, {_ARGS})"
                " -> Tensor")
_ops.define(f"sdpa_forward(Tensor query, Tensor key, Tensor value, {_ARGS}, int seed=0)"
                " -> (Tensor, Tensor)")
_ops.define("sdpa_backward(Tensor dout, Tensor query, Tensor key, Tensor value, Tensor out, "
                f"Tensor lse, {_ARGS}, int seed=0) -> (Tensor, Tensor, Tensor)")


def _options(attn_mask, dropout_p, is_causal, scale, enable_gqa, seed):
    """attention()'s keyword arguments for the operators' arguments. The schema's int is
    signed: the 64-bit seed travels as its two's complement."""
    return dict(attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                causal="upper-left" if is_causal else None,
                seed=seed % _U64 if dropout_p > 0 else None, offset=0 if dropout_p > 0 else None)


def _sdpa_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, seed=0):
    with _torch.no_grad():
        return attention(query, key, value, return_lse=True, _op="sdpa_forward",
                         **_options(attn_mask, dropout_p, is_causal, scale, enable_gqa, seed))


def _sdpa_backward(dout, query, key, value, out, lse, attn_mask=None, dropout_p=0.0,
                   is_causal=False, scale=None, enable_gqa=False, seed=0):
    grads = attention_backward(dout, query, key, value, out, lse,
                               **_options(attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          seed))
    return tuple(grads[:3])  # a float mask's dbias is not an output of the operator


class _Sdpa(_torch.autograd.Function):
    """The autograd record of the operator: forward and backward run the two operators."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                seed):
        out, lse = _torch.ops.attncore.sdpa_forward(query, key, value, attn_mask, dropout_p,
                                                    is_causal, scale, enable_gqa, seed)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.options = (dropout_p, is_causal, scale, enable_gqa, seed)
        # (out is a view, laid out like query; autograd refuses in-place operations on a view
        # made inside a custom Function, so the caller gets a tensor that is none.)
        return out.detach()

    @staticmethod
    @first_order
    def backward(ctx, dout):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        dq, dk, dv = _torch.ops.attncore.sdpa_backward(dout.contiguous(), query, key, value, out,
                                                       lse, attn_mask, *ctx.options)
        return (dq, dk, dv) + (None,) * 6


def _seed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """A 64-bit seed from torch's default generator, as the schema's signed int: drawn after
    the call's checks (explain's, named as the forward names them), so that a call refused
    leaves the generator as it was, as the package's functions do."""
    if dropout_p <= 0:
        return 0
    explain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
            causal="upper-left" if is_causal else None, enable_gqa=enable_gqa,
            _op="sdpa_forward")
    seed = _torch_seed()[0]
    return seed - _U64 if seed >= _U64 // 2 else seed


def _checked(query, key, value, attn_mask, is_causal, enable_gqa):
    """The public operator takes attn_mask and K/V heads as torch's function does
    (_rank4.check_sdpa_mask, sdpa_enable_gqa, sdpa_query_heads): (the query, broadcast to the
    kv heads where torch broadcasts it, enable_gqa as attention() takes it)."""
    op = "scaled_dot_product_attention"
    if attn_mask is not None:
        check_sdpa_mask(op, is_causal, _arrays.TORCH.dtype_name(attn_mask),
                        _arrays.TORCH.dtype_name(query))
    enable_gqa = sdpa_enable_gqa(op, key, value, enable_gqa)
    return sdpa_query_heads(op, query, key, value, enable_gqa), enable_gqa


def _sdpa_autograd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    query, enable_gqa = _checked(query, key, value, attn_mask, is_causal, enable_gqa)
    if attn_mask is not None and attn_mask.requires_grad and _torch.is_grad_enabled():
        raise NotImplementedError(
            "attncore.scaled_dot_product_attention (torch operator): a float attn_mask that "
            "requires grad gets no gradient through the operator; call attncore.torch."
            "scaled_dot_product_attention for dBias")
    return _Sdpa.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       _seed(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa))


def _sdpa_inference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    query, enable_gqa = _checked(query, key, value, attn_mask, is_causal, enable_gqa)
    return _sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                         _seed(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa))[0]


_ops.impl("scaled_dot_product_attention", _sdpa_autograd, "Autograd")
_ops.impl("scaled_dot_product_attention", _sdpa_inference, "CPU")
_ops.impl("sdpa_forward", _sdpa_forward, "CPU")
_ops.impl("sdpa_backward", _sdpa_backward, "CPU")
