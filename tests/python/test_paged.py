"""Paged KV caches against the float64 torch oracle: flash_attn_with_kvcache(block_table=...)
over shuffled pages of any size (decode, chunked prefill, leftpad, appends), the paged
flash_attn_varlen_func, attncore.PagedKVCache (views without copies, fork and copy-on-write,
out of pages), attncore.torch.PagedAttention (torch's page bookkeeping), forward-only refusals
and errors."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from conftest import assert_close, randn
from reference import attention

NAN = float("nan")


def paged(dense_k, dense_v, page_size, lens, seed=0, spare=3):
    """The dense caches [B, capacity, H, D] cut into pages of page_size in a random order over a
    pool with `spare` extra pages; every slot not copied holds NaN and table entries of pages
    wholly past lens[b] are -1. Returns (k_pool, v_pool, block_table int32)."""
    batch, capacity = dense_k.shape[:2]
    per_seq = -(-capacity // page_size)
    num_pages = batch * per_seq + spare
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    pools = []
    for dense in (dense_k, dense_v):
        pool = torch.full((num_pages, page_size) + tuple(dense.shape[2:]), NAN, dtype=dense.dtype)
        for b in range(batch):
            for s in range(lens[b]):
                pool[perm[b * per_seq + s // page_size], s % page_size] = dense[b, s]
        pools.append(pool)
    table = perm[:batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    for b in range(batch):
        table[b, -(-lens[b] // page_size):] = -1
    return pools[0], pools[1], table


def oracle(q, k, v, lens, pads, *, causal=False, alibi=None):
    """(out [B, Lq, Hq, Dv], lse [B, Hq, Lq]) of sequence b over slots [pads[b], lens[b])."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = attention(q[b].transpose(0, 1), k[b, pads[b]:lens[b]].transpose(0, 1),
                             v[b, pads[b]:lens[b]].transpose(0, 1),
                             causal="lower-right" if causal else None,
                             alibi=None if alibi is None else alibi[b])
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_cache_against_the_oracle(dtype, page_size, seqlen_q, causal):
    lens, pads = [21, 0, 9], [3, 0, 2]
    k, v = randn(3, 24, 2, 16, seed=1).to(dtype), randn(3, 24, 2, 8, seed=2).to(dtype)
    k_pool, v_pool, table = paged(k, v, page_size, lens, seed=page_size)
    q = randn(3, seqlen_q, 4, 16, seed=3).to(dtype)
    slopes = torch.rand(3, 4, generator=torch.Generator().manual_seed(4)).float() * 0.2
    out, lse = attncore.flash_attn_with_kvcache(
        q, k_pool, v_pool, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), block_table=table, causal=causal,
        alibi_slopes=slopes, return_softmax_lse=True)
    ref_out, ref_lse = oracle(q, k, v, lens, pads, causal=causal, alibi=slopes)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    # numpy arrays take the same path, and every backend that runs paged calls agrees.
    for backend in ("reference", "math"):
        np_out = attncore.flash_attn_with_kvcache(
            q.numpy(), k_pool.numpy(), v_pool.numpy(), cache_seqlens=np.array(lens, np.int32),
            cache_leftpad=np.array(pads, np.int32), block_table=table.numpy(), causal=causal,
            alibi_slopes=slopes.numpy(), backend=backend)
        assert_close(torch.from_numpy(np_out), ref_out, dtype, f"numpy {backend}")


@pytest.mark.parametrize("page_size", [1, 5])
def test_paged_append_writes_the_pages_then_attends(page_size):
    lens, l_new = [6, 11], 3
    k, v = randn(2, 16, 1, 8, seed=5).float(), randn(2, 16, 1, 8, seed=6).float()
    after = [n + l_new for n in lens]
    k_pool, v_pool, table = paged(k, v, page_size, after, seed=7)
    k_new, v_new = randn(2, l_new, 1, 8, seed=8).float(), randn(2, l_new, 1, 8, seed=9).float()
    q = randn(2, 2, 2, 8, seed=10).float()
    out = attncore.torch.flash_attn_with_kvcache(
        q, k_pool, v_pool, k=k_new, v=v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        block_table=table, causal=True, num_splits=3)
    for b in range(2):
        k[b, lens[b]:after[b]], v[b, lens[b]:after[b]] = k_new[b], v_new[b]
        for s in range(after[b]):
            page, row = table[b, s // page_size], s % page_size
            assert torch.equal(k_pool[page, row], k[b, s])
            assert torch.equal(v_pool[page, row], v[b, s])
    ref_out, _ = oracle(q, k, v, after, [0, 0], causal=True)
    assert_close(out, ref_out, torch.float32, "out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_splits_changes_bits_within_the_oracle_rule_never_with_threads(dtype):
    """Split-KV decode: every split count (planned, none, forced, more than the tiles) within
    the oracle's tolerance, LSE merged; a forced split gives the same bits on 1 and 2 threads;
    some split count rounds differently from none (the parts do run)."""
    lens, pads = [1500, 300], [0, 7]
    k, v = randn(2, 1504, 2, 64, seed=1).to(dtype), randn(2, 1504, 2, 64, seed=2).to(dtype)
    k_pool, v_pool, table = paged(k, v, 16, lens)
    q = randn(2, 1, 4, 64, seed=3).to(dtype)
    ref_out, ref_lse = oracle(q.double(), k.double(), v.double(), lens, pads, causal=True)

    def run(n):
        return attncore.flash_attn_with_kvcache(
            q, k_pool, v_pool, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
            cache_leftpad=torch.tensor(pads, dtype=torch.int32), block_table=table, causal=True,
            num_splits=n, return_softmax_lse=True, backend="flash")

    results = {n: run(n) for n in (0, 1, 2, 3, 7, 256)}
    for n, (out, lse) in results.items():
        assert_close(out, ref_out, dtype, f"out, num_splits={n}")
        assert_close(lse, ref_lse, torch.float32, f"lse, num_splits={n}")
    assert any(not torch.equal(out, results[1][0]) or not torch.equal(lse, results[1][1])
               for n, (out, lse) in results.items() if n > 1)
    try:
        attncore.set_num_threads(1)
        one = run(3)
        attncore.set_num_threads(2)
        two = run(3)
    finally:
        attncore.set_num_threads(0)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for bad in (-1, 257):
        with pytest.raises(ValueError, match="num_splits is out of range"):
            run(bad)


def test_paged_errors():
    k, v = randn(2, 8, 1, 8, seed=1).float(), randn(2, 8, 1, 8, seed=2).float()
    k_pool, v_pool, table = paged(k, v, 4, [8, 5])
    q = randn(2, 1, 1, 8, seed=3).float()
    lens = torch.tensor([8, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="flash-attn refuses it too"):
        attncore.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens, block_table=table,
                                         cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    bad = table.clone()
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[1\]\[1\]=-1"):
        attncore.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens, block_table=bad)
    with pytest.raises(ValueError, match=r"block_table has the wrong dtype \(dtype=int64, "
                                         r"expected int32\)"):
        attncore.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens,
                                         block_table=table.long())
    with pytest.raises(ValueError, match="cache_seqlens is out of range"):
        attncore.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=table,
                                         cache_seqlens=torch.tensor([9, 5], dtype=torch.int32))


def test_forward_only_refusals():
    k, v = randn(1, 8, 1, 8, seed=1).float(), randn(1, 8, 1, 8, seed=2).float()
    k_pool, v_pool, table = paged(k, v, 4, [8])
    q = randn(1, 1, 1, 8, seed=3, requires_grad=True).float()
    for kw in ({"block_table": table}, {}):
        pools = (k_pool, v_pool) if kw else (k, v)
        with pytest.raises(NotImplementedError, match="forward only"):
            attncore.torch.flash_attn_with_kvcache(q, *pools, cache_seqlens=8, **kw)
        with torch.no_grad():
            attncore.torch.flash_attn_with_kvcache(q, *pools, cache_seqlens=8, **kw)
    cache = attncore.PagedKVCache(2, 4, 1, 8, 1, torch.float32)
    cache.reserve(0, 1)
    with pytest.raises(NotImplementedError, match="forward only"):
        cache.assign(0, [0], randn(1, 1, 8, requires_grad=True).float(), torch.zeros(1, 1, 8))


@pytest.mark.parametrize("page_size", [1, 4])
def test_varlen_paged_against_the_oracle(page_size):
    cu_q, lens = [0, 3, 3, 8], [10, 4, 7]
    k, v = randn(3, 12, 2, 8, seed=1), randn(3, 12, 2, 8, seed=2)
    k_pool, v_pool, table = paged(k, v, page_size, lens)
    q = randn(9, 4, 8, seed=3)  # one row past cu_q[-1]
    cu_k = torch.tensor([0, 10, 14, 21], dtype=torch.int32)
    out, lse, _ = attncore.flash_attn_varlen_func(
        q, k_pool, v_pool, torch.tensor(cu_q, dtype=torch.int32), cu_k, 5, 10, causal=True,
        block_table=table, return_attn_probs=True)
    for b in range(3):
        rows = slice(cu_q[b], cu_q[b + 1])
        ref_out, ref_lse = oracle(q[rows][None], k[b:b + 1], v[b:b + 1], [lens[b]], [0],
                                  causal=True)
        assert_close(out[rows], ref_out[0], torch.float64, f"out {b}")
        assert_close(lse[:, rows], ref_lse[0], torch.float64, f"lse {b}")
    assert torch.equal(out[8], torch.zeros(4, 8)) and bool((lse[:, 8] == -float("inf")).all())
    # seqused_k: sequence b uses its first seqused_k[b] keys.
    used = torch.tensor([5, 0, 7], dtype=torch.int32)
    out_used = attncore.flash_attn_varlen_func(
        q, k_pool, v_pool, torch.tensor(cu_q, dtype=torch.int32), cu_k, 5, 10, block_table=table,
        seqused_k=used)
    ref0, _ = oracle(q[0:3][None], k[0:1], v[0:1], [5], [0])
    assert_close(out_used[0:3], ref0[0], torch.float64, "seqused_k")
    assert torch.equal(out_used[3:3], torch.zeros(0, 4, 8))
    with pytest.raises(NotImplementedError, match="dropout is not supported"):
        attncore.flash_attn_varlen_func(q, k_pool, v_pool, torch.tensor(cu_q, dtype=torch.int32),
                                        cu_k, 5, 10, dropout_p=0.1, block_table=table)


@pytest.mark.parametrize("slopes_as", ["tensor", "list"])
def test_varlen_paged_batches_of_mixed_lengths_against_the_oracle(slopes_as):
    """Sequences of the same query length attend in one call: a batch of 1-, 3- and 7-row
    sequences (and some without rows) with keys per sequence and ALiBi slopes per sequence
    equals each sequence's oracle."""
    gen = torch.Generator().manual_seed(5)
    batch = 24
    q_lens = torch.tensor([0, 1, 1, 1, 3, 7])[torch.randint(0, 6, (batch,), generator=gen)]
    k_lens = (q_lens + torch.randint(0, 20, (batch,), generator=gen)).tolist()
    cu_q = [0] + torch.cumsum(q_lens, 0).tolist()
    k, v = randn(batch, 27, 2, 8, seed=1), randn(batch, 27, 2, 8, seed=2)
    k_pool, v_pool, table = paged(k, v, 4, k_lens)
    q = randn(cu_q[-1], 4, 8, seed=3)
    slopes = torch.rand(batch, 4, generator=gen, dtype=torch.float64).float()
    cu_k = torch.tensor([0] + np.cumsum(k_lens).tolist(), dtype=torch.int32)
    out, lse, _ = attncore.flash_attn_varlen_func(
        q, k_pool, v_pool, torch.tensor(cu_q, dtype=torch.int32), cu_k, 7, 27, causal=True,
        block_table=table, return_attn_probs=True,
        alibi_slopes=slopes.tolist() if slopes_as == "list" else slopes)
    for b in range(batch):
        rows = slice(cu_q[b], cu_q[b + 1])
        ref_out, ref_lse = oracle(q[rows][None], k[b:b + 1], v[b:b + 1], [k_lens[b]], [0],
                                  causal=True, alibi=slopes[b:b + 1].double())
        assert_close(out[rows], ref_out[0], torch.float64, f"out {b}")
        assert_close(lse[:, rows], ref_lse[0], torch.float64, f"lse {b}")


def test_varlen_paged_is_the_per_sequence_loop_and_the_dense_call_bit_for_bit():
    """Paged varlen gives, bit for bit, what one cache call per sequence gives and what the
    non-paged varlen call over the same keys gives (shuffled pages == dense; packed == the
    per-sequence loop), with short sequences and long ones (planned split-KV) in one batch, on
    flash."""
    gen = torch.Generator().manual_seed(7)
    q_lens = [1, 1, 3, 1, 3, 1, 1]
    k_lens = [5, 900, 40, 3000, 1024, 1025, 5000]
    cu_q = [0] + np.cumsum(q_lens).tolist()
    batch, capacity = len(q_lens), max(k_lens)
    k = torch.randn(batch, capacity, 2, 16, generator=gen)
    v = torch.randn(batch, capacity, 2, 16, generator=gen)
    k_pool, v_pool, table = paged(k, v, 16, k_lens)
    q = torch.randn(cu_q[-1], 4, 16, generator=gen)
    cu_q32 = torch.tensor(cu_q, dtype=torch.int32)
    cu_k = torch.tensor([0] + np.cumsum(k_lens).tolist(), dtype=torch.int32)
    out = attncore.flash_attn_varlen_func(q, k_pool, v_pool, cu_q32, cu_k, 3, capacity,
                                          causal=True, block_table=table, backend="flash")
    packed_k = torch.cat([k[b, :k_lens[b]] for b in range(batch)])
    packed_v = torch.cat([v[b, :k_lens[b]] for b in range(batch)])
    dense = attncore.flash_attn_varlen_func(q, packed_k, packed_v, cu_q32, cu_k, 3, capacity,
                                            causal=True, backend="flash")
    assert torch.equal(out, dense)
    for b in range(batch):
        rows = slice(cu_q[b], cu_q[b + 1])
        alone = attncore.flash_attn_with_kvcache(
            q[rows][None], k_pool, v_pool, cache_seqlens=torch.tensor([k_lens[b]]).int(),
            block_table=table[b:b + 1], causal=True, backend="flash")
        assert torch.equal(out[rows], alone[0]), b


def test_varlen_paged_checks_max_seqlen_as_the_packed_call():
    """flash_attn_varlen_func(block_table=...) checks max_seqlen_q / max_seqlen_k and the
    options as the non-paged call does (the library's call with page pools)."""
    lens = [10, 4, 7]
    k, v = randn(3, 12, 2, 8, seed=1), randn(3, 12, 2, 8, seed=2)
    k_pool, v_pool, table = paged(k, v, 4, lens)
    q = randn(8, 4, 8, seed=3)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 14, 21], dtype=torch.int32)

    def call(max_q, max_k, **kw):
        return attncore.flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max_q, max_k,
                                               block_table=table, **kw)

    op = "^flash_attn_varlen_func: "
    library = "^forward: "
    for bad in ("5", 5.0, None, True):
        with pytest.raises(TypeError, match=op + r"max_seqlen_q is not an integer"):
            call(bad, 10)
        with pytest.raises(TypeError, match=op + r"max_seqlen_k is not an integer"):
            call(5, bad)
    with pytest.raises(ValueError, match=library + r"max_seqlen_q is smaller than a sequence "
                       r"\(max_seqlen_q=4, expected >= the longest sequence's 5\)"):
        call(4, 10)
    with pytest.raises(ValueError, match=library + r"max_seqlen_k is smaller than a sequence "
                       r"\(max_seqlen_k=9, expected >= the longest sequence's 10\)"):
        call(5, 9)
    with pytest.raises(ValueError, match=library + r"max_seqlen_k is too large"):
        call(5, 2 ** 31)
    # seqused_k bounds the keys: 7 is then the longest; larger maxima are accepted.
    used = torch.tensor([5, 0, 7], dtype=torch.int32)
    assert torch.equal(call(5, 7, seqused_k=used), call(np.int64(9), 2 ** 31 - 1, seqused_k=used))
    with pytest.raises(ValueError, match=library + r"max_seqlen_k is smaller .*sequence's 7\)"):
        call(5, 6, seqused_k=used)
    # Options, checked as for the packed call.
    with pytest.raises(ValueError, match=library + r"window_left is invalid"):
        call(5, 10, window_size=(-5, 0))
    with pytest.raises(ValueError, match=op + r"scale is invalid"):
        call(5, 10, softmax_scale=float("nan"))


def test_paged_kv_cache_views_assign_and_attention():
    cache = attncore.PagedKVCache(6, 3, 2, 8, 2, "float32", head_dim_v=4)
    assert cache.k_cache.shape == (6, 3, 2, 8) and cache.v_cache.shape == (6, 3, 2, 4)
    assert cache.page_table.dtype == np.int32 and (cache.page_table == -1).all()
    torch_views = cache.views("torch")
    # The same memory: writes through one library show in the other, and in the cache.
    assert torch_views.k_cache.data_ptr() == cache.k_cache.ctypes.data
    k_rows, v_rows = randn(7, 2, 8, seed=1).float(), randn(7, 2, 4, seed=2).float()
    cache.reserve(1, 7)
    assert cache.capacity(1) == 9 and cache.free_pages() == 3
    cache.assign(1, torch.arange(7), k_rows, v_rows)
    assert cache.seqlens.tolist() == [0, 7] and torch_views.seqlens.tolist() == [0, 7]
    q = randn(2, 1, 2, 8, seed=3).float()
    out = attncore.flash_attn_with_kvcache(q, torch_views.k_cache, torch_views.v_cache,
                                           cache_seqlens=torch_views.seqlens,
                                           block_table=torch_views.page_table)
    ref, _ = attention(q[1].transpose(0, 1), k_rows.transpose(0, 1), v_rows.transpose(0, 1))
    assert_close(out[1], ref.transpose(0, 1), torch.float32, "out")
    assert torch.equal(out[0], torch.zeros(1, 2, 4))  # an empty sequence: output 0
    with pytest.raises(MemoryError, match="requested 5 pages but only 3 are free"):
        cache.reserve(0, 15)
    with pytest.raises(ValueError, match="numpy has no bfloat16"):
        attncore.PagedKVCache(2, 2, 1, 8, 1, torch.bfloat16).views("numpy")
    bf16 = attncore.PagedKVCache(2, 2, 1, 8, 1, torch.bfloat16)
    assert bf16.k_cache.dtype == torch.bfloat16 and bf16.page_table.dtype == torch.int32
    with pytest.raises(ValueError, match="dtype is not a cache dtype"):
        attncore.PagedKVCache(2, 2, 1, 8, 1, "int32")
    with pytest.raises(ValueError, match="input_pos repeats a position"):
        cache.assign(1, [1, 1], k_rows[:2], v_rows[:2])
    with pytest.raises(ValueError, match="reserve first"):
        cache.assign(0, [0], k_rows[:1], v_rows[:1])


def test_fork_and_copy_on_write():
    cache = attncore.PagedKVCache(8, 4, 1, 8, 3, torch.float32)
    k_rows, v_rows = randn(10, 1, 8, seed=1).float(), randn(10, 1, 8, seed=2).float()
    cache.reserve(0, 10)
    cache.assign(0, range(10), k_rows, v_rows)
    before = cache.k_cache.clone(), cache.v_cache.clone()
    cache.fork(0, 1, 6)
    cache.fork(0, 2, 10)
    assert cache.seqlens.tolist() == [10, 6, 10]
    assert cache.references(int(cache.page_table[0, 0])) == 3
    new_k, new_v = randn(2, 1, 8, seed=3).float(), randn(2, 1, 8, seed=4).float()
    cache.reserve(1, 8)
    cache.assign(1, [6, 7], new_k, new_v)  # logical page 1: shared, copied first
    src_pages = cache.page_table[0][cache.page_table[0] >= 0]
    for page in src_pages.tolist():  # src's pages keep their bits
        assert torch.equal(cache.k_cache[page], before[0][page])
        assert torch.equal(cache.v_cache[page], before[1][page])
    q = randn(3, 1, 1, 8, seed=5).float()
    out = attncore.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache,
                                           cache_seqlens=cache.seqlens,
                                           block_table=cache.page_table)
    want_k = torch.cat([k_rows[:6], new_k]), torch.cat([v_rows[:6], new_v])
    for b, (ks, vs) in enumerate([(k_rows, v_rows), want_k, (k_rows, v_rows)]):
        ref, _ = attention(q[b].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
        assert_close(out[b], ref.transpose(0, 1), torch.float32, f"sequence {b}")
    cache.erase(0)
    cache.erase(1)
    cache.erase(2)
    assert cache.free_pages() == 8


def test_torch_paged_attention():
    pa = attncore.torch.PagedAttention(4, 2, 3, device="cpu")
    pa.reserve(torch.tensor(0), torch.tensor(3))  # torch's order: pages [1, 0]
    assert pa.page_table[0].tolist() == [1, 0, -1, -1] and pa.capacity.tolist() == [4, 0, 0]
    pa.reserve(torch.tensor(1), torch.tensor(2))
    assert pa.page_table[1].tolist() == [2, -1, -1, -1]
    k_cache, v_cache = torch.full((1, 2, 8, 8), NAN), torch.full((1, 2, 8, 8), NAN)
    k_val, v_val = randn(2, 2, 2, 8, seed=1).float(), randn(2, 2, 2, 8, seed=2).float()
    pa.assign(torch.tensor([0, 1]), torch.tensor([[0, 1], [0, 1]]), k_val, v_val, k_cache,
              v_cache)
    k3, v3 = randn(1, 2, 1, 8, seed=3).float(), randn(1, 2, 1, 8, seed=4).float()
    pa.assign(torch.tensor([0]), torch.tensor([[2]]), k3, v3, k_cache, v_cache)
    assert torch.equal(k_cache[0, :, 0], k3[0, :, 0])  # position 2 -> page 0, row 0
    q = randn(2, 2, 1, 8, seed=5).float()
    out = pa.forward(q, k_cache, v_cache, torch.tensor([3, 2]))
    seq0_k = torch.cat([k_val[0], k3[0]], dim=1)
    seq0_v = torch.cat([v_val[0], v3[0]], dim=1)
    ref0, _ = attention(q[0], seq0_k, seq0_v)
    ref1, _ = attention(q[1], k_val[1], v_val[1])
    assert_close(out, torch.stack([ref0, ref1]), torch.float32, "forward")
    # Errors of the options forward passes on name forward, not the call it makes.
    with pytest.raises(ValueError, match=r"^PagedAttention\.forward: window_left is invalid"):
        pa.forward(q, k_cache, v_cache, torch.tensor([3, 2]), window_size=(-5, 0))
    with pytest.raises(ValueError, match=r"^PagedAttention\.forward: alibi_slopes has shape"):
        pa.forward(q, k_cache, v_cache, torch.tensor([3, 2]),
                   alibi_slopes=torch.ones(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="reserve first"):
        pa.assign(torch.tensor([1]), torch.tensor([[2]]), k3, v3, k_cache, v_cache)
    with pytest.raises(MemoryError, match="requested 2 pages but only 1 are free"):
        pa.reserve(torch.tensor(2), torch.tensor(4))
    pa.erase(torch.tensor(0))
    assert pa.empty_pages == [3, 1, 0] and pa.page_table[0].tolist() == [-1] * 4
    # The mask mod maps physical slots back to logical positions.
    mask = pa.get_mask_mod(lambda b, h, q_idx, kv_idx: kv_idx < 1)
    assert mask(torch.tensor(1), 0, 0, torch.tensor([4, 5, 0])).tolist() == [True, False, False]
    with pytest.raises(NotImplementedError, match="BlockMask"):
        pa.convert_logical_block_mask(None)
    with pytest.raises(NotImplementedError, match="cpu"):
        attncore.torch.PagedAttention(4, 2, 3, device="cuda")


def test_raw_appends_write_the_pages_as_mapped():
    """flash_attn_with_kvcache(k=, v=) into a PagedKVCache's views appends in place through the
    page table as it is: no copy-on-write (a shared page changes for both sequences), and
    seqlens is left to the caller."""
    cache = attncore.PagedKVCache(4, 4, 1, 8, 2)  # numpy views
    rows = randn(3, 1, 8, seed=1).float().numpy()
    cache.reserve(0, 3)
    cache.assign(0, [0, 1, 2], rows, rows)
    cache.fork(0, 1, 2)  # page 0 shared; sequence 1 has length 2
    shared = int(cache.page_table[0, 0])
    new = randn(2, 1, 1, 8, seed=2).float().numpy()
    q = randn(2, 1, 1, 8, seed=3).float().numpy()
    lens = cache.seqlens[:2].copy()
    attncore.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k=new, v=new,
                                     cache_seqlens=np.array([3, 2], np.int32),
                                     block_table=cache.page_table[:2])
    assert (cache.seqlens[:2] == lens).all()  # not advanced
    # Sequence 1's new key went to slot 2 of the shared page: sequence 0 sees it too.
    assert np.array_equal(cache.k_cache[shared, 2], new[1, 0])
    assert np.array_equal(cache.k_cache[shared, 3], new[0, 0])
    assert cache.references(shared) == 2
