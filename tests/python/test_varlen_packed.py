"""Packed inputs of flash-attn's drop-ins (qkv and kv, dense and variable-length: read in place,
one packed gradient) and dropout in variable-length and packed calls (S_dmask, the padded dense
call's mask, replayed backwards), against the torch oracle in float64 (test_varlen's helpers).
"""

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import assert_close, next_torch_seed, randn
from test_varlen import (BACKENDS, LENS_Q, LENS_K, alibi_slopes, check_grads, cu_seqlens,
                         make_case, oracle, packed)


# --- packed inputs ---------------------------------------------------------------------------

def _address(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype,backend", BACKENDS[:2], ids=str)
@pytest.mark.parametrize("options", [{}, dict(causal=True, softmax_scale=-0.3),
                                     dict(window_size=(2, 1), alibi=True)],
                         ids=["plain", "causal-negative-scale", "window-alibi"])
def test_flash_attn_varlen_qkvpacked_func(options, dtype, backend):
    """One qkv [total, 3, H, D] with shared cu_seqlens: read in place, the gradient is one
    tensor shaped like qkv."""
    options = dict(options)
    lens = (5, 0, 9, 1, 12)
    heads = 3
    alibi = alibi_slopes("heads", len(lens), heads) if options.pop("alibi", False) else None
    qkv = randn(sum(lens) + 2, 3, heads, 32, seed=1).to(dtype).requires_grad_()
    cu = cu_seqlens(lens)
    out, lse, _ = attncore.torch.flash_attn_varlen_qkvpacked_func(
        qkv, cu, max(lens), alibi_slopes=alibi, return_attn_probs=True, backend=backend,
        **options)
    addresses = _core._last_call_addresses()
    assert [addresses[n] for n in ("key", "value")] == [qkv[:, i].data_ptr() for i in (1, 2)]
    if "softmax_scale" not in options:  # a negative scale is applied to a copy of q
        assert addresses["query"] == qkv.data_ptr()
    ref_qkv = qkv.detach().double().requires_grad_()
    expected, expected_lse = oracle(
        ref_qkv[:, 0], ref_qkv[:, 1], ref_qkv[:, 2], cu, cu, alibi=alibi,
        causal="lower-right" if options.get("causal") else None,
        window=options.get("window_size", (-1, -1)), scale=options.get("softmax_scale"))
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    assert qkv.grad.shape == qkv.shape and qkv.grad.dtype == dtype
    assert_close(qkv.grad, ref_qkv.grad, dtype, "dqkv")


@pytest.mark.parametrize("dtype,backend", BACKENDS[:2], ids=str)
def test_flash_attn_varlen_kvpacked_func(dtype, backend):
    """q and one kv [total_k, 2, Hkv, D] (GQA), seqused_k and padded kv rows: kv read in
    place, its gradient one tensor shaped like kv."""
    heads_q, heads_kv = 4, 2
    q = packed(LENS_Q, heads_q, 24, seed=1).to(dtype).requires_grad_()
    kv = randn(sum(LENS_K) + 3, 2, heads_kv, 24, seed=2).to(dtype).requires_grad_()
    used = torch.tensor([max(n - 1, 0) for n in LENS_K], dtype=torch.int32)
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    out = attncore.torch.flash_attn_varlen_kvpacked_func(
        q, kv, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True, seqused_k=used,
        backend=backend)
    addresses = _core._last_call_addresses()
    assert addresses["key"] == kv.data_ptr() and addresses["value"] == kv[:, 1].data_ptr()
    assert addresses["query"] == q.data_ptr()
    ref_q, ref_kv = (t.detach().double().requires_grad_() for t in (q, kv))
    expected, _ = oracle(ref_q, ref_kv[:, 0], ref_kv[:, 1], cu_q, cu_k, seqused_k=used,
                         causal="lower-right")
    _check_q_kv(out, expected, q, kv, ref_q, ref_kv, dtype)


def _check_q_kv(out, expected, q, kv, ref_q, ref_kv, dtype):
    """out against the oracle's, then q's and the packed kv's gradients (one tensor shaped like
    kv) against the oracle's for one random dout."""
    assert_close(out.detach(), expected, dtype, "out")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    assert kv.grad.shape == kv.shape
    check_grads([("q", q.grad, ref_q.grad), ("kv", kv.grad, ref_kv.grad)], dtype)


def _dense_oracle(q, k, v, **options):
    """The oracle on [B, L, H, D] inputs, out back in [B, L, H, D]."""
    out, lse = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   **options)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("dtype,backend", BACKENDS[:2], ids=str)
@pytest.mark.parametrize("lengths", [(6, 6), (1, 1), (0, 0)], ids=str)
def test_flash_attn_qkvpacked_func(lengths, dtype, backend):
    """qkv [B, L, 3, H, D]: read in place, out [B, L, H, D] contiguous, one gradient."""
    seqlen = lengths[0]
    qkv = randn(2, seqlen, 3, 4, 40, seed=1).to(dtype).requires_grad_()
    alibi = alibi_slopes("batch-heads", 2, 4)
    out, lse, probs = attncore.torch.flash_attn_qkvpacked_func(
        qkv, causal=True, softcap=3.0, alibi_slopes=alibi, return_attn_probs=True,
        backend=backend)
    if seqlen:
        assert _core._last_call_addresses()["key"] == qkv[:, :, 1].data_ptr()
    assert out.shape == (2, seqlen, 4, 40) and out.is_contiguous()
    assert lse.shape == (2, 4, seqlen) and probs.shape == (0,)
    ref = qkv.detach().double().requires_grad_()
    expected, expected_lse = _dense_oracle(ref[:, :, 0], ref[:, :, 1], ref[:, :, 2],
                                           causal="lower-right", softcap=3.0, alibi=alibi)
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    assert qkv.grad.shape == qkv.shape
    assert_close(qkv.grad, ref.grad, dtype, "dqkv")


@pytest.mark.parametrize("dtype,backend", BACKENDS[:2], ids=str)
def test_flash_attn_kvpacked_func(dtype, backend):
    """q [B, Lq, Hq, D] and kv [B, Lk, 2, Hkv, D] with GQA and Lq < Lk (lower-right)."""
    q = randn(2, 5, 6, 32, seed=1).to(dtype).requires_grad_()
    kv = randn(2, 11, 2, 2, 32, seed=2).to(dtype).requires_grad_()
    out = attncore.torch.flash_attn_kvpacked_func(q, kv, causal=True, window_size=(3, -1),
                                                  backend=backend)
    ref_q, ref_kv = (t.detach().double().requires_grad_() for t in (q, kv))
    expected, _ = _dense_oracle(ref_q, ref_kv[:, :, 0], ref_kv[:, :, 1], causal="lower-right",
                                window=(3, -1))
    _check_q_kv(out, expected, q, kv, ref_q, ref_kv, dtype)


def test_packed_numpy():
    """numpy packed inputs are read in place too, and the results are numpy arrays."""
    qkv = randn(2, 7, 3, 2, 16, seed=1).float().numpy()
    out = attncore.flash_attn_qkvpacked_func(qkv)
    assert _core._last_call_addresses()["value"] == _address(qkv[:, :, 2])
    expected = attncore.flash_attn_func(*(np.ascontiguousarray(qkv[:, :, i]) for i in range(3)))
    assert isinstance(out, np.ndarray) and (out == expected).all()
    lens = (3, 4)
    qkv = randn(7, 3, 2, 16, seed=2).float().numpy()
    out = attncore.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens(lens).numpy(), 4)
    assert _core._last_call_addresses()["key"] == _address(qkv[:, 1])
    kv = np.ascontiguousarray(qkv[:, 1:])
    also = attncore.flash_attn_varlen_kvpacked_func(qkv[:, 0], kv, cu_seqlens(lens).numpy(),
                                                    cu_seqlens(lens).numpy(), 4, 4)
    assert isinstance(out, np.ndarray) and (out == also).all()


def test_gradcheck_packed():
    qkv = randn(5, 3, 2, 4, seed=1, requires_grad=True)
    cu = cu_seqlens((2, 3))
    assert gradcheck(lambda t: attncore.torch.flash_attn_varlen_qkvpacked_func(
        t, cu, 3, causal=True), (qkv,))
    qkv = randn(2, 3, 3, 2, 4, seed=2, requires_grad=True)
    assert gradcheck(lambda t: attncore.torch.flash_attn_qkvpacked_func(t, causal=True), (qkv,))


def test_softcap_zero_or_negative_is_off():
    x, _, _ = make_case("plain")
    args = (x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], x["max_q"], x["max_k"])
    plain = attncore.flash_attn_varlen_func(*args)
    assert torch.equal(plain, attncore.flash_attn_varlen_func(*args, softcap=0.0))
    assert torch.equal(plain, attncore.flash_attn_varlen_func(*args, softcap=-1.0))
    assert not torch.equal(plain, attncore.flash_attn_varlen_func(*args, softcap=1.0))


# --- dropout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "math", "flash"])
def test_dropout_packed_equals_padded_dense(backend):
    """A packed batch draws the mask of the same batch right-padded to (max_seqlen_q,
    max_seqlen_k) and run dense with a key-padding bool mask, with the same (seed, offset)."""
    dtype = torch.float32 if backend == "flash" else torch.float64
    lens_q, lens_k = (5, 0, 7, 3, 6), (6, 2, 0, 9, 6)
    max_q, max_k = 8, 11  # above the real maxima
    heads, dim = 3, 16
    q, k, v = (packed(lens, heads, dim, seed=s).to(dtype)
               for lens, s in ((lens_q, 1), (lens_k, 2), (lens_k, 3)))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    torch.manual_seed(123)
    seed, offset = next_torch_seed(), 0
    out = attncore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.3,
                                          backend=backend)
    batch = len(lens_q)

    def pad(x, lengths, cu, rows):
        y = torch.zeros(batch, heads, rows, x.shape[2], dtype=dtype)
        for b, n in enumerate(lengths):
            y[b, :, :n] = x[cu[b]:cu[b] + n].transpose(0, 1)
        return y

    key_padding = torch.arange(max_k)[None, :] < torch.tensor(lens_k)[:, None]  # [B, max_k]
    dense = attncore.attention(pad(q, lens_q, cu_q, max_q), pad(k, lens_k, cu_k, max_k),
                               pad(v, lens_k, cu_k, max_k), attn_mask=key_padding[:, None, None],
                               dropout_p=0.3, seed=seed, offset=offset, backend=backend)
    for b, n in enumerate(lens_q):
        assert_close(out[cu_q[b]:cu_q[b] + n].transpose(0, 1), dense[b, :, :n].double(), dtype,
                     f"sequence {b}")
    without = attncore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                              backend=backend)
    assert not torch.equal(out, without)


@pytest.mark.parametrize("dtype,backend", BACKENDS[:2], ids=str)
def test_dropout_s_dmask_and_gradients(dtype, backend):
    """With dropout, S_dmask [B, Hq, max_q, max_k] holds the probabilities with the dropped
    ones negated: the oracle given its keep mask reproduces out and the gradients through
    autograd, and |S_dmask| is the oracle's softmax."""
    p = 0.2
    x, options, ref = make_case("gqa-softcap-window")
    ins = [x[n].to(dtype).requires_grad_() for n in "qkv"]
    out, lse, s_dmask = attncore.torch.flash_attn_varlen_func(
        *ins, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"], dropout_p=p,
        return_attn_probs=True, backend=backend, **options)
    batch, heads_q = len(LENS_Q), x["q"].shape[1]
    assert s_dmask.shape == (batch, heads_q, x["max_q"], x["max_k"])
    assert s_dmask.dtype == dtype and not s_dmask.requires_grad
    keep = s_dmask > 0
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    expected, expected_lse = oracle(*ref_ins, x["cu_q"], x["cu_k"], keep=keep, dropout_p=p,
                                    **ref)
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")  # before dropout
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    check_grads(zip("qkv", (t.grad for t in ins), (t.grad for t in ref_ins)), dtype)
    # The probabilities: the oracle with v = the identity, per sequence.
    cu_q, cu_k = x["cu_q"].tolist(), x["cu_k"].tolist()
    for b in range(batch):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        qb = x["q"][cu_q[b]:cu_q[b + 1]].to(dtype).transpose(0, 1)
        kb = x["k"][cu_k[b]:cu_k[b + 1]].to(dtype).transpose(0, 1)
        eye = torch.eye(lk, dtype=torch.float64).expand(kb.shape[0], lk, lk)
        probs, _ = reference.attention(qb, kb, eye, causal="lower-right", window=ref["window"],
                                       softcap=ref["softcap"])
        assert_close(s_dmask[b, :, :lq, :lk].abs(), probs, dtype, f"probabilities {b}")
        assert (s_dmask[b, :, lq:] == 0).all() and (s_dmask[b, :, :, lk:] == 0).all()
    kept = keep[s_dmask != 0].double().mean().item()
    assert abs(kept - (1 - p)) < 0.05


def test_dropout_s_dmask_sizes_are_checked_before_the_call():
    """S_dmask's arrays are checked against the memory this process may use before the call
    runs or draws a seed: the unit rows [total_k, 1, max_seqlen_k] and the identity
    [max_seqlen_k, max_seqlen_k] of the keep mask (one query row over 2^20 keys: 2^42 bytes
    each), and the identity alone (4 keys, max_seqlen_k = 2^20)."""
    q = torch.ones(1, 1, 8)
    keys = torch.ones(1, 1, 8).expand(2**20, 1, 8)  # stride 0: nothing of this size exists
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    pattern = (r"^flash_attn_varlen_func: the outputs exceed the memory this process may use "
               r"\(outputs={} bytes")
    state = attncore.get_rng_state()
    with pytest.raises(MemoryError, match=pattern.format(r"8.796e\+12")):
        attncore.flash_attn_varlen_func(q, keys, keys, cu_q, torch.tensor([0, 2**20],
                                                                          dtype=torch.int32),
                                        1, 2**20, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(MemoryError, match=pattern.format(r"4.398e\+12")):
        attncore.flash_attn_varlen_func(q.numpy(), keys[:4].numpy(), keys[:4].numpy(),
                                        cu_q.numpy(), np.array([0, 4], np.int32), 1, 2**20,
                                        dropout_p=0.1, return_attn_probs=True)
    assert attncore.get_rng_state() == state  # a refused call draws nothing


def test_dropout_s_dmask_dense():
    """flash_attn_func and the dense packed forms return the same S_dmask shape [B, H, Lq, Lk],
    and their outputs follow its keep mask."""
    p = 0.25
    q, k, v = (randn(2, 6, 3, 16, seed=s) for s in (1, 2, 3))
    out, _, s_dmask = attncore.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                               return_attn_probs=True)
    assert s_dmask.shape == (2, 3, 6, 6)
    expected, _ = _dense_oracle(q, k, v, causal="lower-right", keep=s_dmask > 0, dropout_p=p)
    assert_close(out, expected, torch.float64)
    qkv = torch.stack([q, k, v], dim=2)
    torch.manual_seed(5)
    out, _, s_dmask = attncore.flash_attn_qkvpacked_func(qkv, dropout_p=p,
                                                         return_attn_probs=True)
    expected, _ = _dense_oracle(q, k, v, keep=s_dmask > 0, dropout_p=p)
    assert_close(out, expected, torch.float64)
    torch.manual_seed(5)
    again = attncore.flash_attn_kvpacked_func(q, qkv[:, :, 1:], dropout_p=p)
    assert torch.equal(out, again)


def test_attention_varlen_backward_replays_dropout():
    """numpy: attention_varlen_backward with the forward's (seed, offset) gives the gradients
    autograd gives through attncore.torch."""
    p = 0.3
    x, _, _ = make_case("causal")
    ins = [x[n].requires_grad_() for n in "qkv"]
    args = (x["cu_q"], x["cu_k"], x["max_q"], x["max_k"])
    state = (next_torch_seed(), 0)
    out, lse = attncore.attention_varlen(*ins, *args, causal="lower-right", dropout_p=p,
                                         return_lse=True)
    dout = randn(*out.shape, seed=9)
    (out * dout).sum().backward()
    arrays = [t.detach().numpy() for t in ins]
    grads = attncore.attention_varlen_backward(
        dout.numpy(), *arrays, out.detach().numpy(), lse.numpy(), *(a.numpy() for a in args[:2]),
        *args[2:], causal="lower-right", dropout_p=p, seed=state[0], offset=state[1])
    for got, t in zip(grads, ins):
        assert (got == t.grad.numpy()).all()
    with pytest.raises(ValueError, match="dropout needs the forward call's seed"):
        attncore.attention_varlen_backward(dout.numpy(), *arrays, out.detach().numpy(),
                                           lse.numpy(), *args, dropout_p=p)
