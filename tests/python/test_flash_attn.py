"""flash_attn_func ([B, L, H, D], causal lower-right, windows, softcap, ALiBi, GQA, LSE) and
attention_backward against the torch oracle in float64, through torch autograd and numpy."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, randn

LENGTHS = ((5, 9), (8, 8), (13, 4), (1, 97), (97, 1), (1025, 7))
BACKENDS = ((torch.float64, "math"), (torch.float32, "flash"))

VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 2)),
    "window-left-causal": dict(window_size=(4, -1), causal=True),
    "window-right-only": dict(window_size=(-1, 0)),
    "window-zero": dict(window_size=(0, 0)),
    "softcap": dict(softcap=2.5),
    "alibi-heads": dict(alibi="heads"),
    "alibi-batch-heads-causal": dict(alibi="batch-heads", causal=True),
    "scale": dict(softmax_scale=0.21),
    "gqa-softcap-window": dict(heads_kv=2, softcap=4.0, window_size=(2, 5), causal=True),
}


def _inputs(seqlen_q, seqlen_k, heads_kv=6, batch=2, heads_q=6, dim=40):
    """[B, L, H, D] inputs."""
    return (randn(batch, seqlen_q, heads_q, dim, seed=1),
            randn(batch, seqlen_k, heads_kv, dim, seed=2),
            randn(batch, seqlen_k, heads_kv, dim, seed=3))


def _alibi(kind, batch=2, heads=6):
    if kind is None:
        return None
    # The geometric slopes of the ALiBi paper, 2^(-8 h / H), varied per batch entry.
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    if kind == "heads":
        return slopes
    return slopes * torch.tensor([1.0, 0.5])[:batch, None]


def _oracle(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None,
            softmax_scale=None):
    """The oracle in [B, H, L, D], results back in [B, L, H, D]; lse [B, H, L]."""
    out, lse = reference.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
        causal="lower-right" if causal else None, window=window_size, softcap=softcap,
        alibi=alibi)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda t: f"Lq{t[0]}-Lk{t[1]}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_flash_attn_func(dtype, backend, lengths, variant):
    options = dict(VARIANTS[variant])
    q, k, v = _inputs(*lengths, heads_kv=options.pop("heads_kv", 6))
    alibi = _alibi(options.pop("alibi", None))
    ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse, probs = attncore.torch.flash_attn_func(
        *ins, alibi_slopes=alibi, return_attn_probs=True, backend=backend, **options)
    assert probs.shape == (0,) and probs.dtype == dtype  # S_dmask: empty without dropout
    assert out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (2, 6, lengths[0])
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref_ins = [x.detach().double().requires_grad_() for x in ins]
    expected, expected_lse = _oracle(*ref_ins, alibi=alibi, **options)
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    for name, got, want in zip("qkv", ins, ref_ins):
        assert_close(got.grad, want.grad, dtype, "d" + name)


@pytest.mark.parametrize("variant", ["plain", "causal", "alibi-batch-heads-causal",
                                     "gqa-softcap-window"])
def test_numpy_forward_and_attention_backward(variant):
    """numpy in, numpy out; attention_backward with the forward's options gives the oracle's
    gradients."""
    options = dict(VARIANTS[variant])
    q, k, v = _inputs(7, 11, heads_kv=options.pop("heads_kv", 6))
    alibi = _alibi(options.pop("alibi", None))
    qn, kn, vn = (x.float().numpy() for x in (q, k, v))
    alibi_n = None if alibi is None else alibi.numpy()
    out, lse, _ = attncore.flash_attn_func(qn, kn, vn, alibi_slopes=alibi_n,
                                           return_attn_probs=True, **options)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == qn.shape
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (2, 6, 7)
    ref_ins = [torch.from_numpy(x).double().requires_grad_() for x in (qn, kn, vn)]
    expected, _ = _oracle(*ref_ins, alibi=alibi, **options)
    assert_close(out, expected, torch.float32, "out")
    dout = randn(*out.shape, seed=9)
    (expected * dout).sum().backward()
    grads = attncore.attention_backward(
        dout.float().numpy(), qn, kn, vn, out, lse, layout="blhd",
        scale=options.get("softmax_scale"),
        causal="lower-right" if options.get("causal") else None,
        window_size=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
        alibi_slopes=alibi_n)
    assert len(grads) == 3
    for name, got, x, want in zip("qkv", grads, (qn, kn, vn), ref_ins):
        assert isinstance(got, np.ndarray) and got.shape == x.shape and got.dtype == np.float32
        assert_close(got, want.grad, torch.float32, "d" + name)


def test_attention_backward_returns_dbias_of_a_float_mask():
    """attention_backward in layout bhld with a broadcast float mask: dbias has its shape."""
    q, k, v = (randn(2, 3, 6, 16, seed=s) for s in (1, 2, 3))
    mask = randn(3, 1, 6, seed=4, requires_grad=True)
    out, lse = attncore.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=mask.detach().numpy(),
                                  causal="upper-left", return_lse=True)
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    expected, expected_lse = reference.attention(*ref_ins, mask=mask, causal="upper-left")
    assert_close(out, expected, torch.float64)
    assert_close(lse, expected_lse, torch.float64)
    dout = randn(2, 3, 6, 16, seed=9)
    (expected * dout).sum().backward()
    dq, dk, dv, dbias = attncore.attention_backward(
        dout.numpy(), q.numpy(), k.numpy(), v.numpy(), out, lse,
        attn_mask=mask.detach().numpy(), causal="upper-left")
    for got, want in zip((dq, dk, dv, dbias), (*ref_ins, mask)):
        assert_close(got, want.grad, torch.float64)


def test_decode_lower_right():
    """One query row sees every key under lower-right causal (flash-attn's KV-cache decode)."""
    q, k, v = _inputs(1, 50)
    causal = attncore.flash_attn_func(q, k, v, causal=True)
    assert_close(causal, attncore.flash_attn_func(q, k, v), torch.float64)
