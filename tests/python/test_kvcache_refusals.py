"""More hostile inputs to the KV-cache surfaces (flash_attn_with_kvcache, the paged varlen call,
PagedKVCache, attncore.torch.PagedAttention, merge_attention_states): each refused in
attncore's form (docs/design.md section 4) before work of its size, or taken as the caller
meant it."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from attncore import _paged_torch
from conftest import raises


def broadcast_query(limit, layout_rows=1):
    """A float32 query [1, layout_rows, H, D] of stride 0 whose copy exceeds `limit` bytes."""
    dim = 4096
    heads = int(limit // (layout_rows * dim * 4)) + 1
    return torch.zeros(dim).as_strided((1, layout_rows, heads, dim), (0, 0, 0, 1))


def test_repeated_cache_rows_are_found_in_a_large_batch():
    # Rows sorted once (not compared pair by pair): 100k sequences append in one call, and a
    # row repeated 99,998 sequences apart is named.
    batch = 100_000
    q = np.zeros((batch, 1, 1, 1), np.float32)
    caches = np.zeros((2, batch, 2, 1, 1), np.float32)
    rows = np.arange(batch, dtype=np.int32)[::-1].copy()
    new = np.ones((batch, 1, 1, 1), np.float32)
    attncore.flash_attn_with_kvcache(q, *caches, k=new, v=new, cache_seqlens=0,
                                     cache_batch_idx=rows)
    assert caches[0][:, 0].all() and not caches[0][:, 1].any()
    rows[-1] = rows[1]
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, *caches, k=new, v=new, cache_seqlens=1, cache_batch_idx=rows),
        f"cache_batch_idx[1]=cache_batch_idx[{batch - 1}]={rows[1]}, expected distinct rows")
    assert not caches[0][:, 1].any()  # nothing appended by the refused call


def test_a_scale_at_most_zero_refuses_a_query_product_that_would_not_fit():
    # A scale <= 0 is applied as the query times its sign (the library takes scale > 0): over
    # a broadcast query that product is refused up front, not attempted.
    limit = attncore._core.memory_limit()[0]
    q = broadcast_query(limit)
    kc, vc = torch.zeros(1, 4, 1, q.shape[-1]), torch.zeros(1, 4, 1, 1)
    for scale in (-1.0, 0.0):
        raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=4, softmax_scale=scale),
               "q needs a contiguous copy larger than", "a scale <= 0")
    raises(MemoryError, lambda: attncore.torch.flash_attn_func(q, kc, kc, softmax_scale=-1.0),
           "query needs a contiguous copy larger than")
    out = attncore.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, softmax_scale=0.5)
    assert out.shape == (1, 1, q.shape[2], 1)


def test_errors_of_the_per_sequence_calls_keep_their_kind():
    # PagedAttention.forward renames the errors of the calls it makes; numpy's MemoryError
    # subclass (built from more than a message) stays a MemoryError.
    error = np.core._exceptions._ArrayMemoryError((4,), np.dtype(np.float32))
    renamed = _paged_torch._naming("PagedAttention.forward", error)
    assert isinstance(renamed, MemoryError), type(renamed)
    assert str(renamed) == str(error)  # (its message has no "<call>: " to rename)
    renamed = _paged_torch._naming("PagedAttention.forward", ValueError("forward: k_cache has"))
    assert type(renamed) is ValueError and str(renamed) == "PagedAttention.forward: k_cache has"


def test_rotary_tables_must_be_float_and_their_conversion_must_fit():
    q = np.zeros((1, 1, 1, 4), np.float32)
    caches = np.zeros((2, 1, 4, 1, 4), np.float32)
    new = np.ones((1, 1, 1, 4), np.float32)
    for table in (np.ones((4, 2), np.complex64), np.ones((4, 2), bool),
                  torch.ones(4, 2, dtype=torch.complex64), np.ones((4, 2), np.int32)):
        raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
            q, *caches, k=new, v=new, rotary_cos=table, rotary_sin=table, cache_seqlens=0),
               "rotary_cos has the wrong dtype", "expected a float dtype")
    assert not caches.any()
    limit = attncore._core.memory_limit()[0]
    rows = int(limit // 16) + 1
    wide = np.broadcast_to(np.ones((1, 4), np.float64), (rows, 4))  # [rows, 4] f64, stride 0
    raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(
        q, *caches, k=new, v=new, rotary_cos=wide, rotary_sin=wide, cache_seqlens=0),
           "rotary_cos needs a contiguous copy larger than", "pass it as float32")
    half = np.ones((4, 2), np.float16)  # converted exactly: as the float32 table
    got = attncore.flash_attn_with_kvcache(q + 1, *caches, k=new, v=new, rotary_cos=half,
                                           rotary_sin=half * 0, cache_seqlens=0)
    want = attncore.flash_attn_with_kvcache(q + 1, *np.zeros((2, 1, 4, 1, 4), np.float32),
                                            k=new, v=new, rotary_cos=half.astype(np.float32),
                                            rotary_sin=np.zeros((4, 2), np.float32),
                                            cache_seqlens=0)
    np.testing.assert_array_equal(got, want)


def test_lazily_negated_tensors_are_resolved_as_their_distinct_elements(monkeypatch):
    # A lazily negated broadcast view standing for more bytes than this process may use is
    # resolved as its distinct elements (its broadcast dims kept broadcast): the call runs, with
    # the results of the negated values. A copy past that memory is refused before it is made.
    monkeypatch.setattr(attncore._core, "memory_limit", lambda: (2.0**20, "a test's limit"))
    q = broadcast_query(2**20)
    kc, vc = torch.zeros(1, 4, 1, q.shape[-1]), torch.ones(1, 4, 1, 1)
    out = attncore.flash_attn_with_kvcache(torch._neg_view(q), kc, vc, cache_seqlens=4)
    assert out.shape == (1, 1, q.shape[2], 1) and bool(out.eq(1).all())
    small = torch.randn(1, 3, 2, 8)
    neg = torch._neg_view(small)
    got = attncore.flash_attn_with_kvcache(neg, kc[..., :8].clone() + 1, vc.clone(),
                                           cache_seqlens=2)
    want = attncore.flash_attn_with_kvcache(-small, kc[..., :8].clone() + 1, vc.clone(),
                                            cache_seqlens=2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    monkeypatch.setattr(attncore._core, "memory_limit", lambda: (64.0, "a test's limit"))
    raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(
        neg, kc[..., :8].clone(), vc.clone(), cache_seqlens=2),
           "q needs a contiguous copy larger than", "resolve_neg")


def test_paged_attention_refuses_page_table_entries_past_int32_and_overlapping_caches():
    attn = attncore.torch.PagedAttention(4, 4, 1)
    attn.reserve(0, 4)
    cache = torch.arange(16.0).reshape(1, 1, 16, 1).expand(1, 1, 16, 4).contiguous()
    q = torch.zeros(1, 1, 1, 4)
    attn.page_table[0, 0] = 2 ** 32 + 3  # would wrap to page 3 as int32
    raises(ValueError, lambda: attn.forward(q, cache, cache.clone(), torch.tensor([1])),
           "page_table is out of range", "page_table[0][0]=4294967299")
    attn.page_table[0, 0] = 0
    base = torch.zeros(64)
    overlapping = base.as_strided((1, 1, 16, 4), (64, 4, 1, 1))  # rows one element apart
    raises(ValueError, lambda: attn.assign(torch.tensor([0]), torch.tensor([[0, 1]]),
                                           torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4),
                                           overlapping, torch.zeros(1, 1, 16, 4)),
           "k_cache is an output whose elements may overlap")
    assert not base.any()


def test_assign_refuses_more_positions_than_were_reserved_before_copying_them():
    cache = attncore.PagedKVCache(4, 2, 1, 4, 1)
    cache.reserve(0, 3)
    positions = np.broadcast_to(np.zeros(1, np.int64), (2 ** 30,))  # 4 GiB as int32
    rows = np.broadcast_to(np.zeros((1, 1, 4), np.float32), (2 ** 30, 1, 4))
    raises(ValueError, lambda: cache.assign(0, positions, rows, rows),
           "input_pos has more entries than batch_idx=0 reserved (len(input_pos)=1073741824, "
           "expected <= capacity=4); reserve first")
    raises(ValueError, lambda: cache.assign(7, positions, rows, rows),  # named as assign's
           "PagedKVCache.assign: batch_idx is out of range (batch_idx=7")


def test_messages_name_what_the_caller_passed():
    q = np.ones((2, 1, 1, 4), np.float32)
    kc = np.ones((2, 8, 1, 4), np.float32)
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(q, kc.astype(bool), kc,
                                                                cache_seqlens=3),
           "k_cache has the wrong dtype for the query (k_cache=bool")
    huge = np.broadcast_to(np.zeros(4, np.float32), (2, 2 ** 40, 1, 4))
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(q, huge, huge),
           "k_cache has more slots than cache_seqlens' default can count "
           "(capacity=1099511627776", "pass cache_seqlens")
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3,
                                                                alibi_slopes=1.0),
           "alibi_slopes has shape []")
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        z(1, 1, 2, 4), z(1, 8, 2, 4), z(1, 8, 2, 6), z(1, 1, 2, 4), z(1, 1, 2, 4),
        cache_seqlens=0), "v has shape [1, 1, 2, 4], expected [1, 1, 2, 6]")
    # A block table as nested lists of ints: int32, in the paged varlen call too.
    pool = np.random.default_rng(2).standard_normal((4, 4, 1, 4)).astype(np.float32)
    args = (np.ones((2, 1, 4), np.float32), pool, pool, np.array([0, 1, 2], np.int32),
            np.array([0, 5, 10], np.int32), 1, 5)
    np.testing.assert_array_equal(
        attncore.flash_attn_varlen_func(*args, block_table=[[0, 1], [2, 3]]),
        attncore.flash_attn_varlen_func(*args, block_table=np.array([[0, 1], [2, 3]], np.int32)))


def test_writes_into_torch_caches_move_their_version_counters():
    # An append into a cache tensor a graph saved, and assign into a paged cache's torch views:
    # autograd refuses the backward, as after torch's own in-place ops (before, it ran on the
    # new values). A refused append moves nothing.
    one = torch.ones(1, 1, 1, 8)
    w = torch.randn(8, 8, requires_grad=True)
    k_cache, v_cache = torch.zeros(1, 5, 1, 8), torch.zeros(1, 5, 1, 8)
    before = k_cache._version
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        one, k_cache, v_cache, k=one, v=one, cache_seqlens=5), "k_new does not fit")
    assert k_cache._version == before
    y = (k_cache @ w).sum()
    attncore.flash_attn_with_kvcache(one, k_cache, v_cache, k=one, v=one, cache_seqlens=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    cache = attncore.PagedKVCache(4, 4, 1, 8, 2, torch.float32)
    view = cache.k_cache
    z = (view.reshape(16, 8) @ w).sum()
    cache.reserve(0, 4)
    cache.assign(0, [0], torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_appends_move_both_counters_of_caches_that_require_grad_under_no_grad():
    # Caches that require grad take an append under no_grad (the general path, as the fast path
    # declines inputs that require grad): both version counters move, each by one, and the
    # values are written; caches that do not, by the fast path, likewise.
    one = torch.ones(1, 1, 1, 8)
    for requires_grad in (True, False):
        k_cache = torch.zeros(1, 5, 1, 8, requires_grad=requires_grad)
        v_cache = torch.zeros(1, 5, 1, 8, requires_grad=requires_grad)
        before = (k_cache._version, v_cache._version)
        with torch.no_grad():
            attncore.torch.flash_attn_with_kvcache(one, k_cache, v_cache, k=one, v=2 * one,
                                                   cache_seqlens=1)
        assert (k_cache._version, v_cache._version) == (before[0] + 1, before[1] + 1)
        assert k_cache[0, 1].eq(1).all() and v_cache[0, 1].eq(2).all()
        assert not k_cache[0, 2:].any()


def test_marking_a_cache_written_changes_nothing_else():
    # Caches that are views (a slice of a larger buffer, a transposed one), one that requires
    # grad under no_grad: after an append each keeps its shape, strides, storage and, but for
    # the appended slot, its values; its version counter moves, and so does its base's.
    one = torch.ones(1, 1, 1, 8)
    buffer = torch.randn(2, 7, 1, 8)
    transposed = torch.randn(1, 1, 5, 8).transpose(1, 2)  # [1, 5, 1, 8] from [1, 1, 5, 8]
    leaf = torch.randn(1, 5, 1, 8, requires_grad=True)
    for k_cache in (buffer[1:, 1:6], transposed, leaf):
        v_cache = k_cache.detach().clone()
        k_before = k_cache.detach().clone()
        layout = (k_cache.shape, k_cache.stride(), k_cache.data_ptr())
        base = k_cache._base if k_cache._base is not None else k_cache
        versions = (k_cache._version, base._version)
        with torch.no_grad():
            attncore.torch.flash_attn_with_kvcache(one, k_cache, v_cache, k=2 * one, v=one,
                                                   cache_seqlens=3)
        assert (k_cache.shape, k_cache.stride(), k_cache.data_ptr()) == layout
        assert k_cache._version == versions[0] + 1 and base._version == versions[1] + 1
        assert torch.equal(k_cache[0, 3], 2 * one[0, 0])
        k_before[0, 3] = 2
        assert torch.equal(k_cache.detach(), k_before)


def test_inference_tensors_are_written_only_in_inference_mode():
    # As torch refuses an in-place write into an inference tensor outside inference mode: an
    # append into one, or PagedAttention.assign into one of its caches, is refused before
    # either cache is written; inside inference mode both run.
    one = torch.ones(1, 1, 1, 8)
    with torch.inference_mode():
        k_inference = torch.zeros(1, 5, 1, 8)
    v_cache = torch.zeros(1, 5, 1, 8)
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        one, v_cache, k_inference, k=one, v=one, cache_seqlens=0),
        "v_cache is an inference tensor written outside inference mode")
    assert not v_cache.any() and not k_inference.any()
    with torch.inference_mode():
        attncore.flash_attn_with_kvcache(one, k_inference, v_cache, k=one, v=one,
                                         cache_seqlens=0)
    assert k_inference[0, 0].eq(1).all()
    pa = attncore.torch.PagedAttention(4, 4, 1)
    pa.reserve(torch.tensor(0), torch.tensor(4))
    k_cache = torch.zeros(1, 1, 16, 8)
    with torch.inference_mode():
        v_inference = torch.zeros(1, 1, 16, 8)
    raises(ValueError, lambda: pa.assign(torch.tensor([0]), torch.tensor([[0]]),
                                         torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8),
                                         k_cache, v_inference),
           "PagedAttention.assign: v_cache is an inference tensor")
    assert not k_cache.any()


def test_paged_cache_dtypes_and_positions_by_type():
    # bfloat16 named by a string gives torch views (numpy has none), usable at once; positions
    # that are no sequence are a TypeError.
    cache = attncore.PagedKVCache(4, 4, 1, 8, 2, "bfloat16")
    assert cache.k_cache.dtype == torch.bfloat16 and cache.page_table.dtype == torch.int32
    cache = attncore.PagedKVCache(4, 4, 1, 8, 2)
    cache.reserve(0, 4)
    rows = np.ones((1, 1, 8), np.float32)
    for positions in (None, "0", 0, bytearray(b"\x00")):
        raises(TypeError, lambda: cache.assign(0, positions, rows, rows),
               "PagedKVCache.assign: input_pos is not a sequence of positions")
    # Positions past int32 are named by their place and value (the message gave the maximum).
    rows2 = np.ones((2, 1, 8), np.float32)
    for positions, named in (([0, -2 ** 32], "input_pos[1]=-4294967296"),
                             (np.array([2 ** 40, 1], np.uint64), "input_pos[0]=1099511627776")):
        raises(ValueError, lambda: cache.assign(0, positions, rows2, rows2),
               f"PagedKVCache.assign: input_pos is out of range ({named}, expected int32 "
               "positions)")
    # Views first read inside inference mode are normal tensors: assign runs outside it.
    cache = attncore.PagedKVCache(4, 4, 1, 8, 2, torch.float32)
    with torch.inference_mode():
        view = cache.k_cache
    assert not view.is_inference()
    cache.reserve(0, 4)
    cache.assign(0, [0], torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    assert view[0, 0].eq(1).all()


def test_an_int_cache_seqlens_is_checked_without_sequences():
    """An int cache_seqlens is broadcast over q's batch; out of range it is refused also where
    that batch is empty (it was accepted then)."""
    q, cache = np.zeros((0, 1, 1, 8), np.float32), np.zeros((0, 4, 1, 8), np.float32)
    for length in (-5, 5):
        with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: cache_seqlens is out of "
                           rf"range \(cache_seqlens={length}, expected 0 <= cache_seqlens <= "
                           r"capacity=4\)$"):
            attncore.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=length)
    assert attncore.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4).shape == (0, 1, 1, 8)


def test_an_int_cache_seqlens_over_a_huge_broadcast_batch_is_refused_before_its_lengths():
    """An int cache_seqlens becomes B int32 lengths; a broadcast query of empty rows (Lq = 0)
    has empty outputs for any B, so the lengths are what a huge B would allocate: refused in
    attncore's form, naming cache_seqlens, before they are made (numpy raised its own error for
    B = 2^33 and filled 1 GiB for B = 2^28)."""
    batch = 2 ** 36
    q = np.broadcast_to(np.zeros((1, 0, 2, 8), np.float32), (batch, 0, 2, 8))
    cache = np.broadcast_to(np.zeros((1, 8, 1, 8), np.float32), (batch, 8, 1, 8))
    raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(q, cache, cache,
                                                                 cache_seqlens=3),
           f"flash_attn_with_kvcache: cache_seqlens needs a contiguous copy larger than the "
           f"memory this process may use (shape=[{batch}]",
           "pass cache_seqlens as an int32 array of B entries, or a smaller batch")
    small = 3
    assert attncore.flash_attn_with_kvcache(q[:small], cache[:small], cache[:small],
                                            cache_seqlens=3).shape == (small, 0, 2, 8)
