"""Dropout (docs/design.md section 1.5): attncore's generator for numpy calls and torch's for torch
calls, replay from (seed, offset), the kept fraction, the same mask on every backend, and the
backward replaying the forward's mask."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, next_torch_seed, randn


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
    """numpy calls take (seed, offset) from attncore's generator and advance it by the positions
    they use; torch's generator is left alone."""
    q, k, v = (randn(2, 3, 9, 16, seed=s).numpy() for s in (1, 2, 3))
    torch_state = torch.get_rng_state()
    attncore.manual_seed(7)
    assert attncore.get_rng_state() == (7, 0)
    first = attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert attncore.get_rng_state() == (7, 2 * 3 * 9 * 9)  # B * Hq * Lq * Lk positions used
    second = attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not (first == second).all()
    attncore.scaled_dot_product_attention(q, k, v)  # no dropout: no positions used
    assert attncore.get_rng_state() == (7, 4 * 3 * 9 * 9)
    attncore.manual_seed(7)
    assert (first == attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)).all()
    attncore.set_rng_state((7, 2 * 3 * 9 * 9))
    assert (second == attncore.scaled_dot_product_attention(q, k, v, dropout_p=0.3)).all()
    assert torch.equal(torch.get_rng_state(), torch_state)
    # A varlen call uses B * Hq * max_seqlen_q * max_seqlen_k positions.
    packed = q[0].swapaxes(0, 1)  # [9, 3, 16]
    cu_seqlens = np.array([0, 4, 9], np.int32)
    attncore.attention_varlen(packed, packed, packed, cu_seqlens, cu_seqlens, 6, 7, dropout_p=0.1)
    assert attncore.get_rng_state() == (7, 4 * 3 * 9 * 9 + 2 * 3 * 6 * 7)


def _draw_torch_seeds(count):
    for _ in range(count):
        torch.empty((), dtype=torch.int64).random_(-2 ** 63, None)


def test_torch_calls_draw_from_torch_generator():
    """Calls on torch tensors draw one 64-bit seed per call from torch's default CPU generator
    (offset 0), so torch.manual_seed reproduces them, and leave attncore's generator alone; the
    backward replays the seed its forward drew."""
    q, k, v = (randn(2, 3, 9, 16, seed=s, requires_grad=True) for s in (1, 2, 3))
    blhd = [x.transpose(1, 2) for x in (q, k, v)]
    packed = [x[0].transpose(0, 1) for x in (q, k, v)]
    attncore_state = attncore.get_rng_state()
    torch.manual_seed(11)
    seed = next_torch_seed()
    first = attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    expected = attncore.attention(q.detach(), k.detach(), v.detach(), dropout_p=0.3, seed=seed,
                                  offset=0)
    assert torch.equal(first.detach(), expected)
    second = attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert not torch.equal(first, second)
    torch.manual_seed(11)
    assert torch.equal(first, attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    assert attncore.get_rng_state() == attncore_state

    # Each function draws exactly one seed per call.
    torch.manual_seed(11)
    _draw_torch_seeds(4)
    after_four = torch.get_rng_state()
    torch.manual_seed(11)
    attncore.torch.attention(q, k, v, dropout_p=0.3)
    attncore.torch.flash_attn_func(*blhd, dropout_p=0.3)
    attncore.torch.flash_attn_varlen_func(*packed, [0, 9], [0, 9], 9, 9, dropout_p=0.3)
    attncore.torch.attention_varlen(*packed, [0, 4, 9], [0, 4, 9], 5, 5, dropout_p=0.3)
    assert torch.equal(torch.get_rng_state(), after_four)

    # The backward replays the forward's seed, whatever the generator did since.
    out = attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.rand(100)
    out.sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch.set_rng_state(after_four)
    attncore.torch.scaled_dot_product_attention(q, k, v, dropout_p=0.3).sum().backward()
    for got, x in zip(grads, (q, k, v)):
        assert torch.equal(got, x.grad)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_refused_calls_leave_the_generators_alone(library):
    """A call with dropout that is refused (an invalid dropout_p, a shape the library refuses)
    draws nothing: the next valid call gets the (seed, offset) it would have had."""
    q, k, v = (randn(2, 3, 9, 16, seed=s) for s in (1, 2, 3))
    if library == "numpy":
        q, k, v = (x.numpy() for x in (q, k, v))
    bad_key = k[..., :8]
    attncore_state, torch_state = attncore.get_rng_state(), torch.get_rng_state()
    for call in (lambda: attncore.attention(q, k, v, dropout_p=float("nan")),
                 lambda: attncore.attention(q, k, v, dropout_p=1.5),
                 lambda: attncore.scaled_dot_product_attention(q, bad_key, v, dropout_p=0.3),
                 lambda: attncore.flash_attn_func(q, bad_key, v, dropout_p=0.3),
                 lambda: attncore.flash_attn_varlen_func(q[0], k[0], v[0], [0, 3], [0, 9], 3, 9,
                                                         dropout_p=0.3)):
        with pytest.raises(ValueError):
            call()
        assert attncore.get_rng_state() == attncore_state
        assert torch.equal(torch.get_rng_state(), torch_state)
    attncore.attention(q, k, v, dropout_p=0.3)
    moved = (attncore.get_rng_state() != attncore_state,
             not torch.equal(torch.get_rng_state(), torch_state))
    assert moved == ((False, True) if library == "torch" else (True, False))


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
    state = (next_torch_seed(), 0)
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
