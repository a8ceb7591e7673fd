"""Hostile inputs to the paged and cache surfaces, one test per defect class once found: every
refusal in attncore's message form and type (docs/design.md section 4) before anything is
written, and the good neighbours of each refused call still right against a float64 oracle."""

import numbers

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from conftest import raises


def oracle(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float64 for q [Lq, H, D], k, v [Lk, H, D] (one head group
    per head)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


# flash_attn_with_kvcache appends: writes that would collide or alias are refused unwritten.

def test_append_refuses_one_array_for_k_cache_and_v_cache():
    cache = np.zeros((2, 8, 1, 4), np.float32)
    new = np.ones((2, 1, 1, 4), np.float32)
    q = np.ones((2, 1, 1, 4), np.float32)
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, cache, cache, k=new, v=2 * new, cache_seqlens=3), "v_cache overlaps k_cache")
    both = np.zeros((2, 8, 1, 8), np.float32)  # K and V interleaved in one buffer
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, both[..., :4], both[..., 2:6], k=new, v=2 * new, cache_seqlens=3),
        "v_cache overlaps k_cache")
    assert not cache.any() and not both.any()
    attncore.flash_attn_with_kvcache(q, both[..., :4], both[..., 4:], k=new, v=2 * new,
                                     cache_seqlens=3)  # side by side: fine
    np.testing.assert_array_equal(both[:, 3, 0], np.tile([1, 1, 1, 1, 2, 2, 2, 2], (2, 1)))


def paged_call(table, lens, l_new=1):
    rng = np.random.default_rng(0)
    k_pool = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)
    v_pool = rng.standard_normal((5, 4, 1, 8)).astype(np.float32)
    before = k_pool.copy(), v_pool.copy()
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    new = rng.standard_normal((2, l_new, 1, 8)).astype(np.float32)
    call = lambda: attncore.flash_attn_with_kvcache(  # noqa: E731
        q, k_pool, v_pool, k=new, v=new, cache_seqlens=np.array(lens, np.int32),
        block_table=np.array(table, np.int32))
    return call, (k_pool, v_pool), before, (q, new)


def test_paged_append_refuses_two_rows_for_one_slot():
    # Both sequences append their slot 5, row 1 of page 3 in both rows of the table.
    call, pools, before, _ = paged_call([[4, 3, -1], [2, 3, -1]], [5, 5])
    raises(ValueError, call, "k_new writes one pool slot twice",
           "slot 5 of sequence 0 and slot 5 of sequence 1 are both row 1 of page 3")
    assert all(np.array_equal(a, b) for a, b in zip(pools, before))


def test_paged_append_refuses_a_page_mapped_twice_in_its_sequence():
    # Sequence 0 maps page 4 at logical pages 0 and 1: its new slot 5 is its own key 1.
    call, pools, before, _ = paged_call([[4, 4, -1], [2, 3, -1]], [5, 5])
    raises(ValueError, call, "block_table[0][0]=block_table[0][1]=4")
    assert all(np.array_equal(a, b) for a, b in zip(pools, before))


def test_paged_append_with_a_page_repeated_past_its_slots_is_right():
    call, (k_pool, v_pool), (k0, v0), (q, new) = paged_call([[4, 1, 1], [0, 3, -1]], [3, 5])
    out = call()
    for b, (pages, length) in enumerate((([4], 4), ([0, 3], 6))):
        k = np.concatenate([k_pool[p] for p in pages])[:length]
        v = np.concatenate([v_pool[p] for p in pages])[:length]
        np.testing.assert_array_equal(k[length - 1], new[b, 0])
        np.testing.assert_allclose(out[b], oracle(q[b], np.repeat(k, 2, 1), np.repeat(v, 2, 1)),
                                   atol=1e-5)


# PagedKVCache.

def test_paged_cache_refuses_what_is_no_cache_dtype():
    raises(ValueError, lambda: attncore.PagedKVCache(2, 2, 1, 4, 1, torch.int32),
           "dtype=int32")
    raises(ValueError, lambda: attncore.PagedKVCache(2, 2, 1, 4, 1, torch.complex64),
           "dtype=complex64")
    raises(TypeError, lambda: attncore.PagedKVCache(2, 2, 1, 4, 1, object()), "type=object")
    raises(TypeError, lambda: attncore.PagedKVCache(2, 2, 1, 4, 1, None), "type=NoneType")
    assert attncore.PagedKVCache(2, 2, 1, 4, 1, torch.float16).k_cache.dtype == torch.float16


def test_paged_cache_refuses_tensors_it_cannot_read():
    cache = attncore.PagedKVCache(4, 2, 1, 4, 2)
    meta = torch.zeros((), dtype=torch.int64, device="meta")
    raises(NotImplementedError, lambda: cache.reserve(meta, 2), "PagedKVCache.reserve",
           "device=meta")
    cache.reserve(torch.tensor(0), torch.tensor([2]))
    rows = np.ones((2, 1, 4), np.float32)
    raises(NotImplementedError, lambda: cache.assign(
        0, torch.zeros(2, dtype=torch.int32, device="meta"), rows, rows), "input_pos",
        "device=meta")
    assert cache.seqlens[0] == 0


def test_paged_cache_assign_refuses_rows_in_its_own_pages():
    cache = attncore.PagedKVCache(3, 4, 1, 2, 1)
    cache.reserve(0, 4)
    rng = np.random.default_rng(1)
    cache.assign(0, np.arange(4), rng.standard_normal((4, 1, 2)), rng.standard_normal((4, 1, 2)))
    page = cache.k_cache[cache.page_table[0, 0]]  # slots 0..3 of sequence 0: [4, 1, 2]
    before = cache.k_cache.copy()
    raises(ValueError, lambda: cache.assign(0, [1, 2, 3, 0], page, page.copy()),
           "PagedKVCache.assign: k_cache overlaps k_val")
    np.testing.assert_array_equal(cache.k_cache, before)
    cache.assign(0, [1, 2, 3, 0], page.copy(), page.copy())  # a copy: rotated as asked
    np.testing.assert_array_equal(cache.k_cache[cache.page_table[0, 0]],
                                  np.roll(before[cache.page_table[0, 0]], 1, axis=0))


def test_paged_cache_errors_name_the_python_class_and_its_arguments():
    """The C++ cache's messages reach Python naming PagedKVCache, its methods and their
    arguments (max_batch_size, num_heads, input_pos, k_val), never the C++ names."""
    cache = attncore.PagedKVCache(2, 4, 1, 8, 2)
    rows = np.zeros((1, 1, 8), np.float32)
    messages = [
        raises(ValueError, lambda: cache.erase(5), "PagedKVCache.erase: batch_idx is out of "
               "range (batch_idx=5, expected 0 <= batch_idx < max_batch_size=2)"),
        raises(ValueError, lambda: cache.assign(0, [0], rows, rows),
               "PagedKVCache.assign: input_pos has more entries than batch_idx=0 reserved "
               "(len(input_pos)=1, expected <= capacity=0); reserve first"),
        raises(ValueError, lambda: attncore.PagedKVCache(2, 4, 0, 8, 2),
               "PagedKVCache: num_heads is out of range (num_heads=0,"),
    ]
    cache.reserve(0, 8)
    messages += [
        raises(MemoryError, lambda: cache.reserve(1, 4), "PagedKVCache.reserve: requested 1 "
               "pages but only 0 are free"),
        raises(ValueError, lambda: cache.assign(0, [9], rows, rows),
               "PagedKVCache.assign: input_pos is out of what batch_idx=0 reserved "
               "(input_pos[0]=9,"),
        raises(ValueError, lambda: cache.assign(0, [1, 1], rows.repeat(2, 0), rows.repeat(2, 0)),
               "PagedKVCache.assign: input_pos repeats a position (position=1, expected "
               "distinct positions)"),
        raises(ValueError, lambda: cache.assign(0, [0], np.zeros((1, 2, 8), np.float32), rows),
               "PagedKVCache.assign: k_val has", "len(input_pos)"),
        raises(ValueError, lambda: cache.assign(0, [0], rows, rows[0]),
               "PagedKVCache.assign: v_val has the wrong rank"),
        raises(ValueError, lambda: cache.assign(0, [[0]], rows, rows),
               "PagedKVCache.assign: input_pos has the wrong rank (rank=2, expected 1: [S])"),
    ]
    for message in messages:
        assert "PagedKvCache" not in message and "max_batch=" not in message, message
        assert "positions" not in message.partition(" (")[0], message


def test_paged_cache_bookkeeping_survives_writes_to_its_page_table_view():
    cache = attncore.PagedKVCache(4, 2, 1, 2, 2)
    cache.reserve(0, 2)
    held = int(cache.page_table[0, 0])
    cache.page_table[1, 0] = held  # the view must not be written; doing so frees nothing
    cache.erase(1)
    assert cache.references(held) == 1 and cache.free_pages() == 3
    cache.reserve(1, 6)
    assert held not in cache.page_table[1].tolist()


# flash_attn_varlen_func(block_table=...).

def varlen_args():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((5, 2, 8)).astype(np.float32)
    pool = rng.standard_normal((6, 4, 1, 8)).astype(np.float32)
    table = np.array([[5, 2, -1], [0, 3, 1]], np.int32)
    return q, pool, table


@pytest.mark.parametrize("cu_k, fragment", [
    (np.array([0.0, 8.5, 18.0]), "forward: cu_seqlens_k has the wrong dtype (dtype=f64"),
    (np.array([0, 8, 18], np.int64),
     "flash_attn_varlen_func: cu_seqlens_k has the wrong dtype (dtype=int64"),
    (torch.tensor([0, 8, 18]), "flash_attn_varlen_func: cu_seqlens_k has the wrong dtype "
                               "(dtype=int64"),
    (np.array([2, 10, 20], np.int32), "forward: cu_seqlens_k does not start at 0"),
    (np.array([0, 8, 4], np.int32), "forward: cu_seqlens_k is decreasing"),
    (np.array([0, 8, 40], np.int32), "forward: cu_seqlens_k gives sequence 1 more keys than its "
                                     "pages hold (cu_seqlens_k[2] - cu_seqlens_k[1]=32, "
                                     "expected <= max_pages_per_seq * page_size=12)"),
])
def test_varlen_paged_refuses_bad_offsets(cu_k, fragment):
    # As the packed call refuses them: the library's checks, the same call.
    q, pool, table = varlen_args()
    raises(ValueError, lambda: attncore.flash_attn_varlen_func(
        q, pool, pool, np.array([0, 2, 5], np.int32), cu_k, 3, 10, block_table=table),
        fragment)


def test_varlen_paged_refuses_dropout_first():
    # Not supported over page pools, whatever else the call asks for (max_seqlen past what
    # dropout could address, S_dmask past the memory).
    q, pool, table = varlen_args()
    for probs in (False, True):
        raises(NotImplementedError, lambda: attncore.flash_attn_varlen_func(
            q, pool, pool, np.array([0, 2, 5], np.int32), np.array([0, 8, 18], np.int32),
            2 ** 31 - 1, 2 ** 31 - 1, dropout_p=0.1, return_attn_probs=probs, block_table=table),
            "forward: dropout is not supported over page pools (dropout_p=0.1")


def test_varlen_paged_refuses_every_sequence_before_attending_any():
    q, pool, table = varlen_args()
    bad = table.copy()
    bad[1, 2] = 6  # sequence 1's third page: past the pool of 6 pages
    raises(ValueError, lambda: attncore.flash_attn_varlen_func(
        q, pool, pool, np.array([0, 2, 5], np.int32), np.array([0, 8, 18], np.int32), 3, 10,
        block_table=bad), "forward: block_table names no page of the pool",
        "block_table[1][2]=6")
    raises(TypeError, lambda: attncore.flash_attn_varlen_func(
        q, pool, pool, ["a", "b", "c"], np.array([0, 8, 18], np.int32), 3, 10,
        block_table=table), "cu_seqlens_q")
    out = attncore.flash_attn_varlen_func(q, pool, pool, [0, 2, 5], [0, 8, 18], 3, 10,
                                          block_table=table)
    for b, (q0, q1, n) in enumerate(((0, 2, 8), (2, 5, 10))):
        k = np.concatenate([pool[p] for p in table[b] if p >= 0])[:n]
        np.testing.assert_allclose(out[q0:q1], oracle(q[q0:q1], np.repeat(k, 2, 1),
                                                      np.repeat(k, 2, 1)), atol=1e-5)


# Index arrays inside the cache an append writes (an out-of-bounds write once the append changed
# them), and inputs whose copy would not fit: refused before anything is written or copied.

def test_append_refuses_index_arrays_inside_the_cache():
    q = np.ones((2, 1, 1, 4), np.float32)
    k = np.full((2, 1, 1, 4), 1e30, np.float32)
    kc, vc = np.zeros((2, 8, 1, 4), np.float32), np.zeros((2, 8, 1, 4), np.float32)
    inside = kc.reshape(-1).view(np.int32)[:2]  # k_cache[0, 0, 0, :2], values 0
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(q, kc, vc, k=k, v=k,
                                                                cache_seqlens=inside),
           "k_cache overlaps cache_seqlens")
    assert not kc.any() and not vc.any()
    rows = vc.reshape(-1).view(np.int32)[:2]
    rows[:] = [0, 1]
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, vc, k=k, v=k, cache_seqlens=np.zeros(2, np.int32), cache_batch_idx=rows),
           "v_cache overlaps cache_batch_idx")
    assert not kc.any() and rows.tolist() == [0, 1] and not vc.reshape(-1)[2:].any()
    pages_k, pages_v = np.zeros((4, 2, 1, 4), np.float32), np.zeros((4, 2, 1, 4), np.float32)
    table = pages_v.reshape(-1).view(np.int32)[:4].reshape(2, 2)
    table[:] = [[0, 1], [2, 3]]
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, pages_k, pages_v, k=k, v=k, cache_seqlens=np.zeros(2, np.int32), block_table=table),
           "v_cache overlaps block_table")
    assert not pages_k.any() and table.tolist() == [[0, 1], [2, 3]]


def test_inputs_whose_copy_would_not_fit_are_refused_before_the_copy():
    limit = attncore._core.memory_limit()[0]
    length = 2 ** 20
    heads = max(8, int(limit // (64 * length * 128 * 4)) + 8)  # a copy past the limit
    q = torch.zeros(64, 1, heads, 128)
    kc = torch.zeros(1, 1, 1, 1).expand(64, length, heads, 128)  # last stride 0: copied
    # (as its distinct elements, one row of 128, its broadcast dims kept broadcast: the call runs)
    out = attncore.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1)
    assert out.shape == (64, 1, heads, 128) and not out.any()
    wide = torch.zeros(1, 1, 1, 1).expand(2, 3, 1, 2 ** 40)  # a last dim of 2^40, broadcast
    raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(
        torch.zeros(1, 1, 1, 1).expand(2, 1, 1, 2 ** 40), wide, wide, cache_seqlens=1),
           "needs a contiguous copy larger than the memory this process may use")
    # A batch broadcast past what the outputs can hold, with lengths broadcast over it: the
    # outputs are refused before the lengths' copy (B int32 entries: 32 GiB at 2^33) is made.
    many = 2 ** 33
    raises(MemoryError, lambda: attncore.flash_attn_with_kvcache(
        np.broadcast_to(np.zeros((1, 1, 1, 8), np.float32), (many, 1, 1, 8)),
        *[np.broadcast_to(np.zeros((1, 4, 1, 8), np.float32), (many, 4, 1, 8))] * 2,
        cache_seqlens=np.broadcast_to(np.int32(3), (many,))),
           "flash_attn_with_kvcache: the outputs exceed the memory this process may use")
    rows = int(limit // (1024 * 4)) + 1
    out = torch.zeros(1, 1).expand(rows, 1024)
    lse = torch.zeros(1).expand(rows)
    # (merge reads its inputs in place, through any strides: only its outputs would not fit)
    raises(MemoryError, lambda: attncore.merge_attention_states(out, lse, out, lse),
           "the outputs exceed the memory this process may use")


def test_index_tables_broadcast_along_their_rows_are_refused_before_any_copy():
    # A block table whose rows repeat one entry (a broadcast last dim) stands for far more
    # entries than its memory holds; the copy the library would need expands it: refused
    # first, before the other checks (here a float64 q over a float32 cache). A table
    # broadcast over its sequences (unit last stride) is read in place.
    kc = np.zeros((4, 4, 2, 8), np.float32)
    q = np.ones((2, 1, 4, 8), np.float32)
    fragment = ("block_table repeats one entry along its last dim, a broadcast that a copy would "
                "expand (shape=[2, 268435456]")
    for table in (np.broadcast_to(np.zeros((1, 1), np.int32), (2, 2 ** 28)),
                  torch.zeros(1, 1, dtype=torch.int32).expand(2, 2 ** 28)):
        lib_q = q if isinstance(table, np.ndarray) else torch.from_numpy(q)
        lib_kc = kc if isinstance(table, np.ndarray) else torch.from_numpy(kc)
        raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
            lib_q.astype(np.float64) if isinstance(lib_q, np.ndarray) else lib_q.double(),
            lib_kc, lib_kc, cache_seqlens=3, block_table=table), fragment)
    cu = np.array([0, 2, 5], np.int32)
    raises(ValueError, lambda: attncore.flash_attn_varlen_func(
        np.zeros((5, 4, 8)), kc, kc, cu, cu, 3, 3,
        block_table=np.broadcast_to(np.zeros((1, 1), np.int32), (2, 2 ** 28))), fragment)
    shared = np.broadcast_to(np.array([[3, 1]], np.int32), (2, 2))  # stride 0 over sequences
    out = attncore.flash_attn_with_kvcache(q, kc + 1, kc + 2, cache_seqlens=[5, 7],
                                           block_table=shared)
    np.testing.assert_array_equal(out, attncore.flash_attn_with_kvcache(
        q, kc + 1, kc + 2, cache_seqlens=[5, 7], block_table=shared.copy()))


def test_index_lists_refuse_bools_among_ints_and_name_huge_ints_in_tables():
    q = np.ones((2, 1, 1, 4), np.float32)
    kc = np.zeros((4, 2, 1, 4), np.float32)
    raises(TypeError, lambda: attncore.flash_attn_with_kvcache(
        q, kc[:2], kc[:2], cache_seqlens=[True, 1]),
           "cache_seqlens holds a bool among integers (cache_seqlens[0]=True, expected integers)")
    raises(TypeError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=3, block_table=[[0, 1], [2, np.True_]]),
           "block_table holds a bool among integers (block_table[1][1]=True, expected integers)")
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=3, block_table=[[0, 1], [2, 2 ** 70]]),
           "block_table holds values past int32 (min=0, max=1.18e+21")
    pa = attncore.torch.PagedAttention(4, 2, 1)
    raises(ValueError, lambda: pa.assign(torch.tensor([0]), [[2 ** 70]], torch.ones(1, 1, 1, 4),
                                         torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 8, 4),
                                         torch.zeros(1, 1, 8, 4)),
           "PagedAttention.assign: input_pos holds integers past int64 (min=1.18e+21")
    out = attncore.flash_attn_with_kvcache(q, kc, kc + 1, cache_seqlens=3,
                                           block_table=[[0, 1], [2, 3]])
    assert out.shape == (2, 1, 1, 4) and (out == 1).all()


def test_varlen_paged_checks_alibi_slopes_whole():
    kp = np.zeros((4, 4, 2, 8), np.float32)
    cu = np.array([0, 2, 5], np.int32)
    q = np.zeros((5, 2, 8), np.float32)
    table = np.array([[0, 1], [2, 3]], np.int32)
    for shape in ((3, 2), (1, 2), (3,)):
        raises(ValueError, lambda: attncore.flash_attn_varlen_func(
            q, kp, kp, cu, cu, 3, 3, block_table=table,
            alibi_slopes=np.ones(shape, np.float32)),
               f"alibi_slopes has shape {list(shape)}, expected [2] or [2, 2]")


def test_index_arrays_of_another_integer_dtype_or_python_type_are_named():
    q = np.ones((2, 1, 1, 4), np.float32)
    kc = np.zeros((2, 8, 1, 4), np.float32)
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=np.array([1, 2], np.int64)),
           "cache_seqlens has the wrong dtype (dtype=int64, expected int32)")
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=torch.tensor([1, 2])),
           "cache_seqlens has the wrong dtype (dtype=int64, expected int32)")
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=[1, 2 ** 40]), "cache_seqlens holds values past int32")
    for value in (3.0, float("nan"), True):
        raises(TypeError, lambda: attncore.flash_attn_with_kvcache(q, kc, kc,
                                                                   cache_seqlens=value),
               "cache_seqlens is not an integer")


def test_paged_cache_names_a_ragged_input_pos_and_a_numpy_bool():
    cache = attncore.PagedKVCache(4, 2, 1, 4, 1)
    raises(TypeError, lambda: cache.reserve(np.bool_(False), 2), "batch_idx is not an integer")
    cache.reserve(0, 2)
    rows = np.ones((2, 1, 4), np.float32)
    raises(ValueError, lambda: cache.assign(0, [[0], [1, 2]], rows, rows),
           "input_pos is not a flat sequence of integers")


def test_varlen_paged_checks_every_argument_with_no_sequence():
    # B = 0: the arguments are still checked.
    pool = torch.zeros(6, 4, 2, 8)
    none = torch.zeros(1, dtype=torch.int32)
    table = torch.zeros(0, 3, dtype=torch.int32)
    call = attncore.flash_attn_varlen_func
    raises(ValueError, lambda: call(torch.zeros(5, 2, 8, dtype=torch.int32), pool, pool, none,
                                    none, 0, 0, block_table=table), "query", "dtype=i32")
    raises(ValueError, lambda: call(torch.zeros(5, 2, 8), torch.zeros(6, 4, 2, 11), pool, none,
                                    none, 0, 0, block_table=table),
           "forward: key has shape [6, 4, 2, 11], expected [num_pages, page_size, Hkv, 8]")
    raises(ValueError, lambda: call(torch.zeros(5, 2, 8), pool, pool, none, none, 0, 0,
                                    block_table=table, backend="cuda"), "backend='cuda'")
    out = call(torch.ones(5, 2, 8), pool, pool, none, none, 0, 0, block_table=table)
    assert out.shape == (5, 2, 8) and not out.any()


def test_empty_caches_and_positions_need_no_strides():
    # numpy gives zero-size arrays zero strides: nothing is read or written through them.
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    out = attncore.flash_attn_with_kvcache(z(0, 1, 4, 8), z(0, 16, 2, 8), z(0, 16, 2, 8),
                                           k=z(0, 1, 2, 8), v=z(0, 1, 2, 8), cache_seqlens=5)
    assert out.shape == (0, 1, 4, 8)
    cache = attncore.PagedKVCache(4, 4, 2, 8, 2)
    cache.reserve(0, 4)
    cache.assign(0, [], z(0, 2, 8), z(0, 2, 8))  # [] is no positions, not float64 ones
    assert cache.seqlens[0] == 0


def test_paged_sizes_are_named_in_the_callers_layout():
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        z(1, 1, 4, 8), z(6, 0, 2, 8), z(6, 0, 2, 8), cache_seqlens=1,
        block_table=np.zeros((1, 2), np.int32)), "k_cache has shape [6, 0, 2, 8]",
        "page_size >= 1 (page_size=0)")
    raises(ValueError, lambda: attncore.PagedKVCache(4, 4, 2, 2**62, 2), "D + Dv=9.22337e+18")


def test_append_past_int32_lengths_names_the_sum():
    # Pages of 2^30 + 1 slots (zero pages the kernel maps lazily, never touched): an append at
    # the largest int32 length is refused with the lengths passed, not a wrapped one.
    pool = np.zeros((1, 2**30 + 1, 1, 1), np.float16)
    end = 2**31 - 1
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        np.zeros((1, 1, 1, 1), np.float32), pool, np.zeros(pool.shape, pool.dtype),
        k=np.zeros((1, 1, 1, 1), np.float32), v=np.zeros((1, 1, 1, 1), np.float32),
        cache_seqlens=end, cache_leftpad=np.array([end], np.int32),
        block_table=np.array([[-1, 0]], np.int32)),
        "k_new makes a sequence too long (cache_seqlens[0]=2147483647 + L_new=1")


def test_varlen_paged_returns_an_empty_s_dmask_as_without_pages():
    q, pool, table = varlen_args()
    args = (np.array([0, 2, 5], np.int32), np.array([0, 8, 18], np.int32), 3, 10)
    for to in (np.asarray, torch.from_numpy):
        flat = attncore.flash_attn_varlen_func(to(q), to(pool.reshape(24, 1, 8)),
                                               to(pool.reshape(24, 1, 8)), *args,
                                               return_attn_probs=True)[2]
        paged = attncore.flash_attn_varlen_func(to(q), to(pool), to(pool), *args,
                                                block_table=to(table),
                                                return_attn_probs=True)[2]
        assert type(paged) is type(flat) and tuple(paged.shape) == (0,) == tuple(flat.shape)
        assert paged.dtype == flat.dtype


class _Integer:
    """An integer type of another library (registered as numbers.Integral, as gmpy2's are)."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value

    __index__ = __int__

    def __lt__(self, other):
        return self.value < int(other)

    def __gt__(self, other):
        return self.value > int(other)


numbers.Integral.register(_Integer)


def test_index_lists_of_other_integer_types_empty_tables_and_lists_that_hold_themselves():
    # Integers of another library are read as ints (and an index list of them past int32
    # named); an empty table with pages per sequence is no broadcast (numpy gives empty
    # arrays stride 0); a list that holds itself is refused as ragged, at once.
    q = np.ones((2, 1, 1, 4), np.float32)
    kc = np.zeros((2, 4, 1, 4), np.float32)
    np.testing.assert_array_equal(
        attncore.flash_attn_with_kvcache(q, kc, kc + 1,
                                         cache_seqlens=[_Integer(2), _Integer(3)]),
        attncore.flash_attn_with_kvcache(q, kc, kc + 1, cache_seqlens=[2, 3]))
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(
        q, kc, kc, cache_seqlens=[_Integer(2), _Integer(2 ** 40)]),
           "cache_seqlens holds values past int32 (min=2, max=1099511627776")
    pools = np.zeros((4, 2, 1, 4), np.float32)
    none = np.zeros(1, np.int32)
    out = attncore.flash_attn_varlen_func(np.zeros((0, 1, 4), np.float32), pools, pools, none,
                                          none, 0, 0, block_table=np.zeros((0, 2), np.int32))
    assert out.shape == (0, 1, 4)
    itself = [0, 1]
    itself.append(itself)
    raises(ValueError, lambda: attncore.flash_attn_with_kvcache(q, kc, kc,
                                                                cache_seqlens=itself),
           "cache_seqlens is a ragged sequence")


def test_varlen_paged_checks_every_sequences_slopes_before_attending_any():
    # A sequence without queries has ALiBi slopes too: a NaN among them is refused, named by
    # its sequence, as the unpaged call names it.
    pools = np.ones((2, 4, 1, 4), np.float32)
    args = (np.ones((2, 1, 4), np.float32), pools, pools, np.array([0, 2, 2], np.int32),
            np.array([0, 3, 5], np.int32), 2, 3)
    slopes = np.array([[0.5], [np.nan]], np.float32)
    message = "alibi_slopes holds a slope that is not finite (alibi_slopes[1][0]=nan"
    raises(ValueError, lambda: attncore.flash_attn_varlen_func(
        *args, block_table=np.array([[0], [1]], np.int32), alibi_slopes=slopes), message)
    raises(ValueError, lambda: attncore.flash_attn_varlen_func(
        args[0], pools.reshape(8, 1, 4), pools.reshape(8, 1, 4), *args[3:],
        alibi_slopes=slopes), message)
