"""attncore.flash_attn_with_kvcache against the float64 torch oracle, one sequence at a time:
decode and chunked prefill, leftpad, cache_batch_idx, appends (with rotary, both pairings),
int cache_seqlens, unused cache slots never read, and its errors."""

import re

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from conftest import assert_close, randn
from reference import attention

NAN = float("nan")


def rotate(x, cos, sin, positions, interleaved):
    """x [L, H, D] with row l rotated at positions[l] over its first 2 * cos.shape[1] dims."""
    x = x.double().clone()
    half = cos.shape[1]
    c, s = cos.double()[positions][:, None, :], sin.double()[positions][:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].clone(), x[..., 1:2 * half:2].clone()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half].clone(), x[..., half:2 * half].clone()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, a * s + b * c
    return x


def oracle(q, k_cache, v_cache, lens, rows, pads, *, causal=False, window=(-1, -1), softcap=0.0,
           alibi=None):
    """(out [B, Lq, Hq, Dv], lse [B, Hq, Lq]) with sequence b over slots [pads[b], lens[b]) of
    cache row rows[b]."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k = k_cache[rows[b], pads[b]:lens[b]].transpose(0, 1)
        v = v_cache[rows[b], pads[b]:lens[b]].transpose(0, 1)
        out, lse = attention(q[b].transpose(0, 1), k, v, causal="lower-right" if causal else None,
                             window=window, softcap=softcap,
                             alibi=None if alibi is None else alibi)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def caches(b_cache, capacity, heads, dim, dtype, seed=0):
    """Random caches with NaN in every slot, then values where `fill` says."""
    return (randn(b_cache, capacity, heads, dim, seed=seed).to(dtype),
            randn(b_cache, capacity, heads, dim, seed=seed + 1).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_and_chunked_prefill_with_leftpad_and_batch_idx(dtype, seqlen_q, causal):
    k_cache, v_cache = caches(4, 24, 2, 16, dtype)
    lens, rows, pads = [9, 20, 6], [2, 0, 3], [0, 4, 1]
    # Slots outside [pad, len) of the used rows hold NaN: they must never be read.
    for b in range(3):
        for x in (k_cache, v_cache):
            x[rows[b], :pads[b]] = NAN
            x[rows[b], lens[b]:] = NAN
    k_cache[1], v_cache[1] = NAN, NAN
    q = randn(3, seqlen_q, 4, 16, seed=7).to(dtype)
    out, lse = attncore.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=causal,
        return_softmax_lse=True)
    ref_out, ref_lse = oracle(q, k_cache, v_cache, lens, rows, pads, causal=causal)
    assert out.shape == (3, seqlen_q, 4, 16) and lse.shape == (3, 4, seqlen_q)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


def test_int_cache_seqlens_numpy_and_options():
    k_cache, v_cache = caches(2, 12, 1, 8, torch.float32, seed=3)
    k_cache[:, 7:], v_cache[:, 7:] = NAN, NAN
    q = randn(2, 3, 2, 8, seed=4).float()
    alibi = torch.tensor([0.25, 0.5])
    out = attncore.flash_attn_with_kvcache(q.numpy(), k_cache.numpy(), v_cache.numpy(),
                                           cache_seqlens=7, causal=True, window_size=(3, 0),
                                           softcap=5.0, softmax_scale=0.3,
                                           alibi_slopes=alibi.numpy(), num_splits=4)
    assert isinstance(out, np.ndarray)
    ref = []
    for b in range(2):
        k, v = k_cache[b, :7].transpose(0, 1), v_cache[b, :7].transpose(0, 1)
        ref.append(attention(q[b].transpose(0, 1), k, v, scale=0.3, causal="lower-right",
                             window=(3, 0), softcap=5.0, alibi=alibi)[0].transpose(0, 1))
    assert_close(out, torch.stack(ref), torch.float32, "out")


def test_index_arrays_of_any_strides_give_the_same_bits():
    """cache_seqlens, cache_batch_idx, cache_leftpad and block_table that are not contiguous
    (a stride of 2, a broadcast, a transposed table; numpy and torch) are copied, as any input
    the library cannot read in place: the same bits as contiguous ones."""
    k_cache, v_cache = caches(3, 16, 2, 8, torch.float32, seed=5)
    q = randn(2, 1, 4, 8, seed=6).float()
    plain = attncore.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([9, 12], dtype=torch.int32),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cache_leftpad=torch.tensor([1, 1], dtype=torch.int32))
    strided = attncore.flash_attn_with_kvcache(
        q.numpy(), k_cache.numpy(), v_cache.numpy(),
        cache_seqlens=np.array([9, 0, 12, 0], np.int32)[::2],
        cache_batch_idx=torch.tensor([2, 7, 0, 7], dtype=torch.int32)[::2],
        cache_leftpad=np.broadcast_to(np.ones(1, np.int32), (2,)))
    assert np.array_equal(strided, plain.numpy())
    pages_k = k_cache.reshape(12, 4, 2, 8)  # pages of 4 slots
    pages_v = v_cache.reshape(12, 4, 2, 8)
    table = torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]], dtype=torch.int32)
    paged = attncore.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=12,
                                             block_table=table)
    transposed = attncore.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=12,
                                                  block_table=table.t().contiguous().t())
    assert torch.equal(transposed, paged)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_append_with_rotary(interleaved, causal):
    dtype, dim, rotary_dim, new = torch.float32, 16, 10, 3  # rotary_dim not a multiple of 16
    k_cache, v_cache = caches(3, 20, 2, dim, dtype, seed=10)
    lens, rows, pads = [4, 9], [2, 0], [1, 0]
    for b in range(2):
        for x in (k_cache, v_cache):
            x[rows[b], lens[b]:] = NAN
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = randn(2, new, 4, dim, seed=11).to(dtype)
    k_new = randn(2, new, 2, dim, seed=12).to(dtype)
    v_new = randn(2, new, 2, dim, seed=13).to(dtype)
    angles = torch.arange(32, dtype=torch.float64)[:, None] * torch.linspace(0.1, 1.0,
                                                                             rotary_dim // 2)
    cos, sin = angles.cos().float(), angles.sin().float()
    out = attncore.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=causal,
        rotary_interleaved=interleaved)
    q_rot = []
    for b in range(2):
        r, start = rows[b], lens[b] - pads[b]
        positions = torch.arange(start, start + new)
        k_before[r, lens[b]:lens[b] + new] = rotate(k_new[b], cos, sin, positions, interleaved)
        v_before[r, lens[b]:lens[b] + new] = v_new[b]
        q_pos = positions if causal else torch.full((new,), start)
        q_rot.append(rotate(q[b], cos, sin, q_pos, interleaved))
    # The caches were written in place (rows and slots past the appended ones untouched).
    torch.testing.assert_close(k_cache.double(), k_before.double(), equal_nan=True, rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(v_cache, v_before, equal_nan=True, rtol=0, atol=0)
    ref_out, _ = oracle(torch.stack(q_rot), k_cache, v_cache, [n + new for n in lens], rows,
                        pads, causal=causal)
    assert_close(out, ref_out, torch.float32, "out")  # f32 rotary tables


def test_append_into_numpy_caches_in_place():
    k_cache = np.zeros((2, 8, 1, 4), np.float32)
    v_cache = np.zeros((2, 8, 1, 4), np.float32)
    k_new = np.ones((2, 2, 1, 4), np.float32)
    q = np.ones((2, 1, 1, 4), np.float32)
    attncore.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new * 2,
                                     cache_seqlens=np.array([0, 3], np.int32))
    assert (k_cache[0, :2] == 1).all() and (v_cache[1, 3:5] == 2).all()
    assert (k_cache[0, 2:] == 0).all() and (k_cache[1, :3] == 0).all()


def test_errors():
    k_cache = np.zeros((1, 8, 1, 4), np.float32)
    v_cache = np.zeros((1, 8, 1, 4), np.float32)
    q = np.ones((1, 1, 1, 4), np.float32)
    new = np.ones((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="k_cache would need a copy"):
        wide = np.zeros((1, 8, 1, 8), np.float32)[..., ::2]
        attncore.flash_attn_with_kvcache(q, wide, v_cache, new, new, cache_seqlens=1)
    read_only = k_cache.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache is read-only"):
        attncore.flash_attn_with_kvcache(q, read_only, v_cache, new, new, cache_seqlens=1)
    # Without an append the cache is only read: a read-only array is fine.
    attncore.flash_attn_with_kvcache(q, read_only, v_cache, cache_seqlens=1)
    with pytest.raises(ValueError, match="v_cache would need a copy"):
        t = torch.zeros(1, 8, 1, 8)[..., ::2]
        attncore.flash_attn_with_kvcache(torch.ones(1, 1, 1, 4), torch.zeros(1, 8, 1, 4), t,
                                         torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4),
                                         cache_seqlens=1)
    with pytest.raises(TypeError, match="k_cache cannot be written in place"):
        attncore.flash_attn_with_kvcache(q, k_cache.tolist(), v_cache, new, new, cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_seqlens"):
        attncore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9)
    with pytest.raises(ValueError, match="does not fit in the cache"):
        attncore.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=8)
    assert (k_cache == 0).all()  # nothing written by the refused calls
    with pytest.raises(ValueError, match="rotary_cos"):
        attncore.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1,
                                         rotary_cos=np.ones((8, 2), np.float32),
                                         rotary_sin=np.ones((8, 2), np.float32))
    # A cache of another batch, named in the caller's layout [B_cache, capacity, Hkv, D].
    with pytest.raises(ValueError, match=re.escape(
            "flash_attn_with_kvcache: k_cache has shape [1, 8, 1, 4], expected a batch of 2 like "
            "q (B_cache=1, expected B_cache == B without cache_batch_idx)")):
        attncore.flash_attn_with_kvcache(np.ones((2, 1, 1, 4), np.float32), k_cache, v_cache,
                                         cache_seqlens=1)


def test_torch_grad_mode_refused():
    q = torch.ones(1, 1, 1, 4, requires_grad=True)
    k_cache, v_cache = torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: q requires grad"):
        attncore.torch.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)
    with torch.no_grad():
        out = attncore.torch.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)
    assert out.shape == (1, 1, 1, 4)
    assert attncore.torch.flash_attn_with_kvcache is attncore.flash_attn_with_kvcache
