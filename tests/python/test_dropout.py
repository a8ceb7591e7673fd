"""Dropout (docs/design.md section 1.5): attncore's generator, replay from (seed, offset), the kept
fraction, the same mask on every backend, and the backward replaying the forward's mask."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, randn


def keep_mask(batch, heads, seqlen_q, seqlen_k, p, seed, offset, backend=None):
    """The keep mask [B, H, Lq, Lk] of a call with these sizes and (seed, offset): with q = 0
    every row attends uniformly, and v = the identity makes out[.., i, j] = keep_ij / (Lk (1-p))."""
    dtype = np.float32 if backend == "flash" else np.float64
    q = np.zeros((batch, heads, seqlen_q, 8), dtype)
    k = np.ones((batch, heads, seqlen_k, 8), dtype)
    v = np.broadcast_to(np.eye(seqlen_k, dtype=dtype), (batch, heads, seqlen_k, seqlen_k))
    out = attncore.attention(q, k, v, dropout_p=p, seed=seed, offset=offset, backend=backend)
    scaled = out * seqlen_k * (1 - p)
    assert np.allclose(scaled, np.round(scaled)), "out holds values other than 0 and 1/(Lk(1-p))"
    return scaled > 0.5


def test_same_seed_and_offset_same_output():
    q, k, v = (randn(2, 3, 9, 16, seed=s) for s in (1, 2, 3))
    a = attncore.attention(q, k, v, dropout_p=0.3, seed=5, offset=1000)
    b = attncore.attention(q, k, v, dropout_p=0.3, seed=5, offset=1000)
    c = attncore.attention(q, k, v, dropout_p=0.3, seed=5, offset=1001)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generator_advances_per_call():
    q, k, v = (randn(2, 3, 9, 16, seed=s) for s in (1, 2, 3))
    attncore.manual_seed(7)
    assert attncore.get_rng_state() == (7, 0)
    first = attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert attncore.get_rng_state() == (7, 2 * 3 * 9 * 9)  # B * Hq * Lq * Lk positions used
    second = attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not torch.equal(first, second)
    attncore.scaled_dot_product_attention(q, k, v)  # no dropout: no positions used
    assert attncore.get_rng_state() == (7, 4 * 3 * 9 * 9)
    attncore.manual_seed(7)
    assert torch.equal(first, attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    attncore.set_rng_state((7, 2 * 3 * 9 * 9))
    assert torch.equal(second, attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_near_one_minus_p(p):
    keep = keep_mask(2, 4, 64, 64, p, seed=11, offset=0)
    n = keep.size
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean() - (1 - p)) < 5 * sigma


def test_mask_is_element_addressed():
    """Element (b, h, i, j) uses stream position offset + ((b*Hq + h)*Lq + i)*Lk + j: row 1 of a
    call is row 0 of the call whose offset is Lk further."""
    keep = keep_mask(1, 1, 2, 37, 0.5, seed=3, offset=100)
    shifted = keep_mask(1, 1, 2, 37, 0.5, seed=3, offset=137)
    assert (keep[0, 0, 1] == shifted[0, 0, 0]).all()


def test_same_mask_on_every_backend():
    masks = [keep_mask(2, 2, 13, 29, 0.4, seed=9, offset=77, backend=b)
             for b in ("reference", "math", "flash")]
    assert (masks[0] == masks[1]).all() and (masks[0] == masks[2]).all()


@pytest.mark.parametrize("dtype,backend", [(torch.float64, "math"), (torch.float32, "flash")],
                         ids=str)
def test_backward_replays_the_forward_mask(dtype, backend):
    """Gradients through attncore.torch equal the oracle's with the forward's keep mask, and
    numpy's attention_backward given the same (seed, offset) returns the same gradients."""
    p = 0.25
    q, k, v = (randn(2, 3, 7, 16, seed=s).to(dtype).requires_grad_() for s in (1, 2, 3))
    state = attncore.get_rng_state()
    out = attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                      backend=backend)
    dout = randn(2, 3, 7, 16, seed=9).to(dtype)
    (out * dout).sum().backward()
    keep = torch.from_numpy(keep_mask(2, 3, 7, 7, p, *state))
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, _ = reference.attention(*ref, causal="upper-left", keep=keep, dropout_p=p)
    (expected * dout.double()).sum().backward()
    assert_close(out.detach(), expected, dtype, "out")
    for got, want in zip((q, k, v), ref):
        assert_close(got.grad, want.grad, dtype)

    arrays = [x.detach().numpy() for x in (q, k, v)]
    out_np, lse = attncore.attention(*arrays, causal="upper-left", dropout_p=p, seed=state[0],
                                     offset=state[1], return_lse=True, backend=backend)
    assert (out_np == out.detach().numpy()).all()
    grads = attncore.attention_backward(dout.numpy(), *arrays, out_np, lse, causal="upper-left",
                                        dropout_p=p, seed=state[0], offset=state[1],
                                        backend=backend)
    for got, x in zip(grads, (q, k, v)):
        assert (got == x.grad.numpy()).all()
