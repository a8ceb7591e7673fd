"""torch's conventions: torch 2.x's SDPBackend members understood (tested with a stand-in enum
of torch's names and values, as torch 1.13 has none) and batch dims broadcast between query, key
and value as torch's math path does."""

import enum

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, randn


class SDPBackend(enum.IntEnum):
    """torch.nn.attention.SDPBackend's names and values (torch 2.5)."""

    ERROR = -1
    MATH = 0
    FLASH_ATTENTION = 1
    EFFICIENT_ATTENTION = 2
    CUDNN_ATTENTION = 3
    OVERRIDEABLE = 4


def _inputs():
    return [randn(2, 3, 5, 16, seed=i, dtype=torch.float32) for i in range(3)]


@pytest.mark.parametrize("member,ours", [(SDPBackend.MATH, "math"),
                                         (SDPBackend.FLASH_ATTENTION, "flash"),
                                         (SDPBackend.EFFICIENT_ATTENTION, "flash")])
def test_torch_members_name_attncore_backends(member, ours):
    q, k, v = _inputs()
    out = attncore.torch.scaled_dot_product_attention(q, k, v, backend=member)
    assert torch.equal(out, attncore.torch.scaled_dot_product_attention(q, k, v, backend=ours))
    with attncore.sdpa_kernel(member):
        assert [b.value for b in attncore.enabled_backends()] == [ours]


@pytest.mark.parametrize("member", [SDPBackend.CUDNN_ATTENTION, SDPBackend.OVERRIDEABLE])
def test_cuda_only_members_forced_are_not_implemented(member):
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match="backend is not available"):
        attncore.torch.scaled_dot_product_attention(q, k, v, backend=member)
    with pytest.raises(NotImplementedError, match="backend is not available"):
        with attncore.sdpa_kernel([member]):
            pass


def test_a_list_with_cuda_only_members_keeps_the_others():
    with attncore.sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                               SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert [b.value for b in attncore.enabled_backends()] == ["flash", "math"]


def test_a_member_torch_lacks_is_refused():
    with pytest.raises(ValueError, match="not one torch's SDPBackend has"):
        attncore.torch.scaled_dot_product_attention(*_inputs(), backend=SDPBackend.ERROR)


@pytest.mark.parametrize("shapes", [((2, 3), (1, 3), (2, 1)), ((2, 3), (3,), (1,)),
                                    ((4,), (1,), (4,))])
def test_batch_dims_broadcast_as_torchs_math_path(shapes):
    batch_q, batch_k, batch_v = shapes
    q = randn(*batch_q, 2, 5, 8, seed=1, requires_grad=True)
    k = randn(*batch_k, 2, 7, 8, seed=2, requires_grad=True)
    v = randn(*batch_v, 2, 7, 8, seed=3, requires_grad=True)
    out = attncore.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    full = torch.broadcast_shapes(batch_q, batch_k, batch_v)
    expected, _ = reference.attention(*(x.expand(*full, -1, -1, -1) for x in (q, k, v)),
                                      causal="upper-left")
    assert out.shape == expected.shape
    assert_close(out, expected, torch.float64, "out")
    dout = randn(*out.shape, seed=4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    for g, e, name in zip(grads, expected_grads, "qkv"):
        assert_close(g, e, torch.float64, name)
    # numpy: the same output, and attention_backward reduces the gradients to each input's shape.
    arrays = [x.detach().numpy() for x in (q, k, v)]
    out_np, lse = attncore.attention(*arrays, causal="upper-left", return_lse=True)
    np.testing.assert_allclose(out_np, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    grads_np = attncore.attention_backward(dout.numpy(), *arrays, out_np, lse,
                                           causal="upper-left")
    for g, e in zip(grads_np, grads):
        assert g.shape == tuple(e.shape)
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-10, atol=1e-12)


def test_batch_dims_that_do_not_broadcast_are_refused():
    q, k = randn(2, 3, 5, 8), randn(3, 3, 5, 8)
    with pytest.raises(ValueError, match="key has leading dims \\[3\\], expected them to "
                                         "broadcast with query's \\[2\\]"):
        attncore.scaled_dot_product_attention(q, k, k)


@pytest.mark.parametrize("call", ["sdpa", "sdpa float mask", "flash_attn alibi",
                                  "flash_attn_varlen"])
def test_a_lazily_negated_output_gradient_is_read_negated(call):
    """backward(gradient=g._neg_view()) gives the gradients of -g, as torch's own ops do, on
    every autograd path (the plain call, a float mask that requires grad, packed sources): the
    negation is resolved, never read as the plain memory."""
    q, k, v = (randn(1, 2, 5, 8, seed=i, dtype=torch.float32) for i in range(3))
    g = randn(1, 2, 5, 8, seed=4, dtype=torch.float32)
    mask = randn(5, 5, seed=5, dtype=torch.float32)

    def grads(dout):
        leaf = q.clone().requires_grad_()
        m = mask.clone().requires_grad_()
        if call == "sdpa":
            out = attncore.torch.scaled_dot_product_attention(leaf, k, v)
        elif call == "sdpa float mask":
            out = attncore.torch.scaled_dot_product_attention(leaf, k, v, attn_mask=m)
        elif call == "flash_attn alibi":  # [B, L, H, D]: q's 5 rows of 2 heads
            out = attncore.torch.flash_attn_func(leaf.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), alibi_slopes=torch.ones(2))
            dout = dout.transpose(1, 2)
        else:  # [total, H, D]: sequences of 2 and 3 rows
            cu = torch.tensor([0, 2, 5], dtype=torch.int32)
            out = attncore.torch.flash_attn_varlen_func(
                leaf[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 3, 3)
            dout = dout[0].transpose(0, 1)
        out.backward(dout)
        return leaf.grad

    negated = grads(torch._neg_view(g))
    assert negated.abs().sum() > 0
    torch.testing.assert_close(negated, grads(-g), rtol=0, atol=0)
