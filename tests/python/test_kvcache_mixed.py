"""A float32 query over a bfloat16 or float16 KV cache: attncore.flash_attn_with_kvcache
(numpy, torch and DLPack caches; bfloat16 through torch, numpy having none), PagedKVCache and
attncore.torch.PagedAttention against the float64 oracle over the widened values, bitwise the
call over a float32 cache holding them; appends of float32 or 16-bit rows rounded once into the
cache; every other dtype mix refused."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from conftest import assert_close, randn
from reference import attention
from test_arrays import DlpackOnly
from test_kvcache import oracle, rotate

NAN = float("nan")
CACHE_DTYPES = [torch.bfloat16, torch.float16]


def filled_caches(dtype, lens, pads, capacity=40, heads=2, dim=24, seed=0):
    """k, v caches [B, capacity, heads, dim] of `dtype`, NaN outside slots [pads[b], lens[b])."""
    k = randn(len(lens), capacity, heads, dim, seed=seed).to(dtype)
    v = randn(len(lens), capacity, heads, dim, seed=seed + 1).to(dtype)
    for b, (n, p) in enumerate(zip(lens, pads)):
        for x in (k, v):
            x[b, :p], x[b, n:] = NAN, NAN
    return k, v


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("backend", ["reference", "math", "flash"])
def test_torch_caches(cache_dtype, seqlen_q, backend):
    lens, pads = [33, 9], [2, 0]
    k_cache, v_cache = filled_caches(cache_dtype, lens, pads)
    q = randn(2, seqlen_q, 4, 24, seed=5).float()  # GQA: 4 query heads over 2
    kwargs = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                  cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=seqlen_q > 1,
                  return_softmax_lse=True, backend=backend)
    out, lse = attncore.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse = oracle(q, k_cache, v_cache, lens, [0, 1], pads, causal=seqlen_q > 1)
    assert_close(out, ref_out, torch.float32, "out")
    assert_close(lse, ref_lse, torch.float32, "lse")
    wide_out, wide_lse = attncore.flash_attn_with_kvcache(q, k_cache.float(), v_cache.float(),
                                                          **kwargs)
    assert torch.equal(out, wide_out) and torch.equal(lse, wide_lse)


def test_numpy_float16_and_dlpack_caches():
    lens, pads = [30, 12], [0, 3]
    k_cache, v_cache = filled_caches(torch.float16, lens, pads, seed=2)
    q = randn(2, 1, 2, 24, seed=6).float()
    ref_out, _ = oracle(q, k_cache, v_cache, lens, [0, 1], pads)
    seqlens, leftpad = np.array(lens, np.int32), np.array(pads, np.int32)
    out = attncore.flash_attn_with_kvcache(q.numpy(), k_cache.numpy(), v_cache.numpy(),
                                           cache_seqlens=seqlens, cache_leftpad=leftpad)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert_close(out, ref_out, torch.float32, "numpy out")
    for dtype in CACHE_DTYPES:  # caches from a library attncore knows only by DLPack
        k16, v16 = k_cache.to(dtype), v_cache.to(dtype)
        ref_out, _ = oracle(q, k16, v16, lens, [0, 1], pads)
        out = attncore.flash_attn_with_kvcache(q.numpy(), DlpackOnly(k16), DlpackOnly(v16),
                                               cache_seqlens=seqlens, cache_leftpad=leftpad)
        assert_close(out, ref_out, torch.float32, f"DLPack {dtype} out")


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("new_dtype", ["query", "cache"])
def test_append_with_rotary_rounds_once(cache_dtype, new_dtype):
    lens, new, rotary_dim = [7, 20], 3, 10
    k_cache, v_cache = filled_caches(cache_dtype, lens, [0, 0], seed=8)
    q = randn(2, new, 4, 24, seed=9).float()
    row_dtype = torch.float32 if new_dtype == "query" else cache_dtype
    k_new = randn(2, new, 2, 24, seed=10).to(row_dtype)
    v_new = randn(2, new, 2, 24, seed=11).to(row_dtype)
    angles = torch.arange(40, dtype=torch.float64)[:, None] * torch.linspace(0.1, 1.0,
                                                                             rotary_dim // 2)
    cos, sin = angles.cos().float(), angles.sin().float()
    # The same append into a float32 cache, rounded afterwards: what the 16-bit cache holds.
    k_wide, v_wide = k_cache.float(), v_cache.float()
    kwargs = dict(rotary_cos=cos, rotary_sin=sin, causal=True, rotary_interleaved=False,
                  cache_seqlens=torch.tensor(lens, dtype=torch.int32))
    wide_out = attncore.flash_attn_with_kvcache(q, k_wide, v_wide, k_new.float(), v_new.float(),
                                                **kwargs)
    out = attncore.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(k_cache, k_wide.to(cache_dtype), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_wide.to(cache_dtype), rtol=0, atol=0, equal_nan=True)
    # The rotated keys by the plain formula, within one rounding of the cache's dtype.
    for b in range(2):
        positions = torch.arange(lens[b], lens[b] + new)
        want = rotate(k_new[b], cos, sin, positions, False)
        torch.testing.assert_close(k_cache[b, lens[b]:lens[b] + new].double(), want,
                                   rtol=2 ** -7, atol=1e-6)
    # The attention: the oracle over the cache as the append left it.
    q_rot = torch.stack([rotate(q[b], cos, sin, torch.arange(lens[b], lens[b] + new), False)
                         for b in range(2)])
    ref_out, _ = oracle(q_rot, k_cache, v_cache, [n + new for n in lens], [0, 1], [0, 0],
                        causal=True)
    assert_close(out, ref_out, torch.float32, "out")
    if new_dtype == "cache":  # same rows, same cache: the float32 cache differs only by rounding
        assert_close(out, wide_out, cache_dtype, "out vs the float32 cache")


def test_numpy_float16_append():
    k_cache = np.full((1, 6, 1, 4), np.nan, np.float16)
    v_cache = np.full((1, 6, 1, 4), np.nan, np.float16)
    rows = np.array([[[[0.1, 1 / 3, 2.0, -7.5]]], [[[1e-3, 0.7, 0.9, 1.1]]]], np.float32)
    q = np.ones((1, 1, 1, 4), np.float32)
    out = attncore.flash_attn_with_kvcache(q, k_cache, v_cache, rows.reshape(1, 2, 1, 4),
                                           rows.reshape(1, 2, 1, 4) * 2,
                                           cache_seqlens=np.array([0], np.int32))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(k_cache[0, :2], rows.reshape(2, 1, 4).astype(np.float16))
    np.testing.assert_array_equal(v_cache[0, :2], (rows.reshape(2, 1, 4) * 2).astype(np.float16))
    assert np.isnan(k_cache[0, 2:]).all()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_paged_caches(cache_dtype):
    cache = attncore.PagedKVCache(6, 4, 2, 8, 2, cache_dtype)
    k_rows, v_rows = randn(9, 2, 8, seed=1).float(), randn(9, 2, 8, seed=2).float()
    cache.reserve(1, 9)
    cache.assign(1, torch.arange(9), k_rows, v_rows)  # float32 rows, rounded into the pages
    q = randn(2, 1, 4, 8, seed=3).float()
    out = attncore.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache,
                                           cache_seqlens=cache.seqlens,
                                           block_table=cache.page_table)
    assert out.dtype == torch.float32
    k16, v16 = k_rows.to(cache_dtype), v_rows.to(cache_dtype)
    ref, _ = attention(q[1].transpose(0, 1), k16.transpose(0, 1), v16.transpose(0, 1))
    assert_close(out[1], ref.transpose(0, 1), torch.float32, "out")
    assert torch.equal(out[0], torch.zeros(1, 4, 8))
    # torch's PagedAttention layout: K/V [1, H, n_pages * page_size, D] in the cache's dtype.
    pa = attncore.torch.PagedAttention(4, 2, 2, device="cpu")
    pa.reserve(torch.tensor(0), torch.tensor(3))
    k_cache = torch.full((1, 2, 8, 8), NAN, dtype=cache_dtype)
    v_cache = torch.full((1, 2, 8, 8), NAN, dtype=cache_dtype)
    k_val, v_val = randn(1, 2, 3, 8, seed=4).float(), randn(1, 2, 3, 8, seed=5).float()
    pa.assign(torch.tensor([0]), torch.tensor([[0, 1, 2]]), k_val, v_val, k_cache, v_cache)
    q = randn(1, 4, 2, 8, seed=6).float()
    out = pa.forward(q, k_cache, v_cache, torch.tensor([3]), causal=True)
    assert out.dtype == torch.float32
    ref, _ = attention(q[0], k_val[0].to(cache_dtype), v_val[0].to(cache_dtype),
                       causal="lower-right")
    assert_close(out[0], ref, torch.float32, "PagedAttention.forward")


def test_other_mixes_refused():
    k32, v32 = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8)
    q32 = torch.ones(1, 1, 2, 8)

    def call(q, k, v, *new):
        return attncore.flash_attn_with_kvcache(q, k, v, *new, cache_seqlens=1)

    wrong = "k_cache has the wrong dtype for the query"
    with pytest.raises(ValueError, match=f"{wrong} \\(k_cache=bf16, query=f16"):
        call(q32.half(), k32.bfloat16(), v32.bfloat16())
    with pytest.raises(ValueError, match=f"{wrong} \\(k_cache=f32, query=bf16"):
        call(q32.bfloat16(), k32, v32)
    with pytest.raises(ValueError, match=f"{wrong} \\(k_cache=f16, query=f64"):
        call(q32.numpy().astype(np.float64), k32.half().numpy(), v32.half().numpy())
    with pytest.raises(ValueError, match="v_cache has the wrong dtype \\(dtype=f16, expected "
                                         "bf16 like k_cache\\)"):
        call(q32, k32.bfloat16(), v32.half())
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    with pytest.raises(ValueError, match="k_new has the wrong dtype \\(dtype=f16, expected "
                                         "bf16 like k_cache or f32 like query\\)"):
        call(q32, k16, v16, torch.ones(1, 1, 2, 8).half(), torch.ones(1, 1, 2, 8).half())
    with pytest.raises(ValueError, match="v_new has the wrong dtype \\(dtype=bf16, expected "
                                         "f32 like k_new\\)"):
        call(q32, k16, v16, torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8).bfloat16())
    assert (k16 == 0).all() and (v16 == 0).all()  # nothing written by the refused calls
