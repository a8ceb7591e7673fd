"""torch.autograd.gradcheck (float64, central differences) through attncore.torch: gradients of
query, key, value and of a float attn_mask (dBias), for both layouts and every option."""

import pytest
import torch
from torch.autograd import gradcheck

import attncore
import attncore.torch
from conftest import randn

BACKENDS = ["math", "reference"]  # the float64 backends


def _qkv(shape_q, shape_kv):
    return (randn(*shape_q, seed=1, requires_grad=True),
            randn(*shape_kv, seed=2, requires_grad=True),
            randn(*shape_kv, seed=3, requires_grad=True))


SDPA_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool-mask": dict(attn_mask=randn(4, 5, seed=4) > -0.5),
    "float-mask-dbias": dict(attn_mask=randn(2, 1, 5, seed=4, requires_grad=True)),
    "float-mask-4d-dbias": dict(attn_mask=randn(1, 2, 4, 5, seed=4, requires_grad=True)),
    "scale-negative": dict(scale=-0.4),
    "gqa": dict(enable_gqa=True, kv_heads=1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa(case, backend):
    kwargs = dict(SDPA_CASES[case])
    q, k, v = _qkv((1, 2, 4, 6), (1, kwargs.pop("kv_heads", 2), 5, 6))
    mask = kwargs.pop("attn_mask", None)
    inputs = (q, k, v) if mask is None or not mask.requires_grad else (q, k, v, mask)

    def f(q, k, v, m=mask):
        return attncore.torch.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                           backend=backend, **kwargs)

    assert gradcheck(f, inputs)


FLASH_CASES = {
    "causal-window": dict(causal=True, window_size=(2, -1)),
    "softcap-alibi": dict(softcap=1.5, alibi_slopes=torch.tensor([0.5, 0.25])),
    "gqa-window": dict(window_size=(1, 1), kv_heads=1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attn_func(case, backend):
    kwargs = dict(FLASH_CASES[case])
    q, k, v = _qkv((2, 4, 2, 6), (2, 5, kwargs.pop("kv_heads", 2), 6))
    assert gradcheck(lambda q, k, v: attncore.torch.flash_attn_func(q, k, v, backend=backend,
                                                                    **kwargs), (q, k, v))


def test_dropout_with_fixed_seed():
    """With (seed, offset) fixed, dropout is a fixed mask, so the function is differentiable."""
    q, k, v = _qkv((1, 2, 4, 6), (1, 2, 5, 6))
    assert gradcheck(lambda q, k, v: attncore.torch.attention(
        q, k, v, dropout_p=0.3, seed=12, offset=34, causal="lower-right"), (q, k, v))


def test_leading_dims_and_unbatched():
    q, k, v = _qkv((2, 1, 2, 3, 4), (2, 1, 2, 5, 4))
    mask = randn(1, 3, 5, seed=4, requires_grad=True)
    assert gradcheck(lambda *a: attncore.torch.scaled_dot_product_attention(*a[:3],
                                                                            attn_mask=a[3]),
                     (q, k, v, mask))
    q, k, v = _qkv((3, 4), (5, 4))
    assert gradcheck(attncore.torch.scaled_dot_product_attention, (q, k, v))


def test_loss_backward_reaches_leaves_through_views():
    """A model-like use: q, k, v sliced from one projection, loss.backward() fills its grad."""
    x = randn(2, 6, 3 * 8, seed=1, requires_grad=True)
    q, k, v = (t.reshape(2, 6, 2, 4).transpose(1, 2) for t in x.split(8, dim=-1))
    out = attncore.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.square().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and torch.isfinite(x.grad).all()


# The calls torch users differentiate: the fast path (sdpa, flash_attn_func), the general path
# (a mask; attention in flash-attn's layout), packed sources and the registered operator.
def _calls():
    mask = torch.ones(3, 3, dtype=torch.bool)
    return {
        "sdpa": lambda q, k, v: attncore.torch.scaled_dot_product_attention(q, k, v),
        "sdpa-mask": lambda q, k, v: attncore.torch.scaled_dot_product_attention(
            q, k, v, attn_mask=mask),
        "flash": lambda q, k, v: attncore.torch.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "attention-blhd": lambda q, k, v: attncore.attention(q, k, v, layout="blhd"),
        "kvpacked": lambda q, k, v: attncore.flash_attn_kvpacked_func(q, torch.stack((k, v), 2)),
        "operator": lambda q, k, v: torch.ops.attncore.scaled_dot_product_attention(q, k, v),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_second_derivatives_raise_instead_of_reading_zero(name):
    """Gradients taken with create_graph=True keep their values, but differentiating them again
    raises NotImplementedError: they were constants of q, k and v, so a gradient penalty's
    share of the next gradient was silently 0."""
    call = _calls()[name]
    q, k, v = (randn(1, 2, 3, 4, seed=s, requires_grad=True) for s in range(3))
    (gq,) = torch.autograd.grad(call(q, k, v).sum(), q, create_graph=True)
    (plain,) = torch.autograd.grad(call(q, k, v).sum(), q)
    assert torch.equal(gq.detach(), plain)
    with pytest.raises(NotImplementedError, match=r"^backward: a second derivative is not "
                                                  r"supported \(create_graph=True"):
        gq.pow(2).sum().backward()
    # torch.autograd.grad too, with respect to an input (its graph reaches q, k and v).
    for wrt in (q, k):
        for unused in (False, True):
            with pytest.raises(NotImplementedError, match=r"^backward: a second derivative"):
                torch.autograd.grad(gq.pow(2).sum(), wrt, allow_unused=unused)


@pytest.mark.parametrize("name", list(_calls()))
def test_outputs_take_in_place_operations(name):
    """As torch's own function's: an in-place operation on the output runs (it was refused as
    one on a view made inside a custom Function), and a backward after it is refused by
    torch's version check, since the backward reads the output."""
    call = _calls()[name]
    q, k, v = (randn(1, 2, 3, 4, dtype=torch.float32, seed=s, requires_grad=True)
               for s in range(3))
    out = call(q, k, v)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_attention_function_checks_its_arguments():
    """attncore.torch.AttentionFunction.apply, a public name, names what it was given."""
    q = randn(1, 2, 3, 4, requires_grad=True)
    call = attncore.torch.AttentionFunction.apply
    with pytest.raises(TypeError, match=r"^AttentionFunction: call is not an attncore call "
                                        r"\(type=NoneType"):
        call(q, q, q, None, None, None)
    from attncore._rank4 import Call
    with pytest.raises(ValueError, match=r"^AttentionFunction: key has the wrong rank \(rank=3, "
                                         r"expected 4"):
        call(q, q[0], q, None, None, Call())
