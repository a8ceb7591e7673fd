"""Inputs the library cannot read in place (a last stride other than 1, batch dims that fold
into one only in a copy) are copied only after the call's checks, which read stand-ins of them
(_copies.LateCopies): invalid calls are refused before any such copy, valid ones give the
results of contiguous inputs."""

import re
import tracemalloc

import numpy as np
import torch

import attncore
from attncore import _copies


def _peak_bytes(fn):
    """(the exception fn raised, the peak of numpy's allocations while it ran)."""
    tracemalloc.start()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned for the caller's checks
        raised = e
    else:
        raised = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


def test_invalid_calls_are_refused_before_their_inputs_are_copied():
    # Inputs the library cannot read in place (a last stride of 0; batch dims broadcast against
    # each other, which fold into one only in a copy) stand for 64 MiB each: a call the library
    # (or the package) refuses raises before any of them is copied.
    col = np.ones((1, 1, 1, 1), np.float32)
    q = np.broadcast_to(col, (64, 4, 1024, 64))  # last stride 0
    k = np.ones((1, 4, 1024, 64), np.float32)
    limit = 8 << 20
    calls = [
        (lambda: attncore.attention(q, k[..., :32], k), ValueError, "^forward: key has shape"),
        (lambda: attncore.attention(q, k, k[:, :, :7]), ValueError, "^forward: value has shape"),
        (lambda: attncore.attention(q, k, k, causal="sideways"), ValueError, "causal is invalid"),
        (lambda: attncore.attention(q, k, k, attn_mask=np.ones((3, 3), bool)), ValueError,
         "attn_mask has shape"),
        (lambda: attncore.attention(q, k, k, dropout_p=1.5), ValueError, "dropout_p"),
    ]
    qb = np.ones((64, 1, 4, 64, 64), np.float32)  # with kb: batch [64, 64], not foldable
    kb = np.ones((1, 64, 4, 64, 64), np.float32)
    calls.append((lambda: attncore.attention(qb, kb, kb[..., :5, :]), ValueError,
                  "^forward: value has shape"))
    swapped = np.zeros((64, 4, 1024, 128), ">f4")[..., ::2]  # another byte order, stride 2
    calls.append((lambda: attncore.attention(swapped, k, k), ValueError,
                  "^forward: query has an unsupported element type"))
    lse = np.zeros((64, 4, 1024), np.float32)
    calls.append((lambda: attncore.attention_backward(q, q, k, k, q, lse[:, :, :5]),
                  ValueError, "softmax_lse has shape"))
    calls.append((lambda: attncore.attention_backward(q, q, k, k[..., :5], q, lse),
                  ValueError, "^backward: "))
    for call, error, message in calls:
        raised, peak = _peak_bytes(call)
        assert isinstance(raised, error) and re.search(message, str(raised)), raised
        assert peak < limit, (str(raised), peak)
    # The same valid call copies them (the check is on the copies, not on their absence).
    raised, peak = _peak_bytes(lambda: attncore.attention(q, k, k))
    assert raised is None and peak >= 64 << 20


def test_inputs_copied_after_the_checks_give_the_results_of_contiguous_ones():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 1, 2, 5, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 2, 6, 8)).astype(np.float32)[..., ::2][..., :3]  # stride 2
    mask = rng.standard_normal((3, 1, 1, 5, 6)).astype(np.float32)
    dense = [np.ascontiguousarray(np.broadcast_to(x, (3, 2) + x.shape[2:])) for x in (q, k, v)]
    dense_mask = np.ascontiguousarray(np.broadcast_to(mask, (3, 2, 2, 5, 6)))
    out, lse = attncore.attention(q, k, v, attn_mask=mask, return_lse=True)
    want, want_lse = attncore.attention(*dense, attn_mask=dense_mask, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    dout = np.broadcast_to(np.ones((1, 1, 1, 1, 1), np.float32), out.shape)
    grads = attncore.attention_backward(dout, q, k, v, out, lse, attn_mask=mask)
    want_grads = attncore.attention_backward(np.ascontiguousarray(dout), *dense, want, want_lse,
                                             attn_mask=dense_mask)
    for got, dense_grad, like in zip(grads, want_grads, (q, k, v, mask)):
        axes = tuple(d for d, n in enumerate(like.shape) if n == 1 and dense_grad.shape[d] != 1)
        np.testing.assert_allclose(got, dense_grad.sum(axis=axes, keepdims=True), rtol=1e-5,
                                   atol=1e-6)
    # torch: the copies made after the checks carry the gradients back to the inputs.
    base = [torch.tensor(x, requires_grad=True) for x in (q, k)]
    base.append(torch.tensor(np.repeat(v, 2, axis=-1), requires_grad=True))
    t_out = attncore.attention(base[0], base[1], base[2][..., ::2])  # batch and last stride
    t_out.sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in base]
    ref_out = attncore.attention(*(x.expand((3, 2) + tuple(x.shape[2:])).contiguous()
                                   for x in (ref[0], ref[1], ref[2][..., ::2])))
    ref_out.sum().backward()
    torch.testing.assert_close(t_out, ref_out)
    for got, want_t in zip(base, ref):
        torch.testing.assert_close(got.grad, want_t.grad)


def test_invalid_packed_and_varlen_calls_are_refused_before_their_inputs_are_copied():
    # As above for the packed (flash_attn_*packed_func) and variable-length calls: sources
    # with a last stride of 0 stand for 64 MiB each as copies.
    col = np.ones((1, 1, 1), np.float32)
    total, heads, dim = 4096 * 16, 4, 64
    q = np.broadcast_to(col, (total, heads, dim))
    kv = np.ones((256, heads, dim), np.float32)
    cu_q = np.array([0, total], np.int32)
    cu_k = np.array([0, 256], np.int32)
    bad_cu = np.array([0, 300], np.int32)  # past the keys
    qkv = np.broadcast_to(np.ones((1, 1, 1, 1, 1), np.float32), (4, 4096, 3, heads, dim))
    lse = np.zeros((heads, total), np.float32)
    out = np.broadcast_to(np.zeros((1, 1, dim), np.float32), (total, heads, dim))
    limit = 8 << 20
    calls = [
        (lambda: attncore.attention_varlen(q, kv, kv, cu_q, bad_cu, total, 300), ValueError,
         "^forward: "),
        (lambda: attncore.attention_varlen(q, kv[..., :32], kv, cu_q, cu_k, total, 256),
         ValueError, "^forward: key"),
        (lambda: attncore.flash_attn_varlen_func(q, kv, kv, cu_q, cu_k, total, 256,
                                                 alibi_slopes=np.ones(3, np.float32)),
         ValueError, "alibi_slopes"),
        (lambda: attncore.flash_attn_qkvpacked_func(qkv, window_size=(-5, 0)), ValueError,
         "window"),
        (lambda: attncore.attention_varlen_backward(q, q, kv, kv, out, lse[:, :5], cu_q, cu_k,
                                                    total, 256), ValueError, "^backward: lse"),
    ]
    for call, error, message in calls:
        raised, peak = _peak_bytes(call)
        assert isinstance(raised, error) and re.search(message, str(raised)), raised
        assert peak < limit, (str(raised), peak)


def test_a_named_backend_that_cannot_run_the_call_is_refused_before_the_copies():
    # f64 inputs the library cannot read in place (a last stride of 0 or 2: 64 MiB or more as
    # copies) with backend="flash", which has no f64: refused as the call with it refuses,
    # before anything of their size is copied; math runs the same calls.
    limit = 8 << 20
    q = np.broadcast_to(np.ones((1, 1, 1, 1)), (64, 4, 512, 64))
    k = np.ones((1, 4, 512, 64))
    lse = np.zeros((64, 4, 512))
    total = 4096 * 4
    packed = np.broadcast_to(np.ones((1, 1, 1)), (total, 4, 128))
    kv = np.ones((256, 4, 128))
    cu_q, cu_k = np.array([0, total], np.int32), np.array([0, 256], np.int32)
    cache = np.ones((1, 16384, 4, 128))[..., ::2]
    q1 = np.ones((1, 1, 4, 64))
    calls = [
        lambda backend: attncore.attention(q, k, k, backend=backend),
        lambda backend: attncore.attention_backward(q, q, k, k, q, lse, backend=backend),
        lambda backend: attncore.attention_varlen(packed, kv, kv, cu_q, cu_k, total, 256,
                                                  backend=backend),
        lambda backend: attncore.flash_attn_with_kvcache(q1, cache, cache, cache_seqlens=5,
                                                         backend=backend),
    ]
    for call in calls:
        raised, peak = _peak_bytes(lambda: call("flash"))
        assert isinstance(raised, NotImplementedError), raised
        assert re.search("^(forward|backward): backend flash cannot run this call",
                         str(raised)), raised
        assert peak < limit, (str(raised), peak)
    raised, peak = _peak_bytes(lambda: calls[0]("math"))
    assert raised is None and peak >= 64 << 20


def test_packed_sources_copied_after_the_checks_give_the_results_of_contiguous_ones():
    rng = np.random.default_rng(11)
    wide = rng.standard_normal((2, 9, 3, 2, 16)).astype(np.float32)
    qkv = wide[..., ::2]  # [B, L, 3, H, D] with a last stride of 2
    out = attncore.flash_attn_qkvpacked_func(qkv, causal=True)
    np.testing.assert_array_equal(
        out, attncore.flash_attn_qkvpacked_func(np.ascontiguousarray(qkv), causal=True))
    q = rng.standard_normal((7, 2, 16)).astype(np.float32)[..., ::2]
    k = rng.standard_normal((10, 2, 8)).astype(np.float32)
    cu_q, cu_k = np.array([0, 3, 7], np.int32), np.array([0, 4, 10], np.int32)
    out, lse = attncore.attention_varlen(q, k, k, cu_q, cu_k, 4, 6, return_lse=True)
    dense_q = np.ascontiguousarray(q)
    want, want_lse = attncore.attention_varlen(dense_q, k, k, cu_q, cu_k, 4, 6, return_lse=True)
    np.testing.assert_array_equal(out, want)
    dout = np.broadcast_to(np.ones((1, 1, 1), np.float32), out.shape)
    strided_out = np.repeat(out, 2, axis=-1)[..., ::2]  # a last stride of 2
    grads = attncore.attention_varlen_backward(dout, q, k, k, strided_out, lse, cu_q, cu_k, 4, 6)
    want_grads = attncore.attention_varlen_backward(np.ascontiguousarray(dout), dense_q, k, k,
                                                    want, want_lse, cu_q, cu_k, 4, 6)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_array_equal(got, expected)
    # torch: gradients reach a packed tensor through its late copy.
    t_wide = torch.tensor(wide, requires_grad=True)
    attncore.flash_attn_qkvpacked_func(t_wide[..., ::2], causal=True).sum().backward()
    ref = torch.tensor(wide, requires_grad=True)
    attncore.flash_attn_qkvpacked_func(ref[..., ::2].contiguous(), causal=True).sum().backward()
    torch.testing.assert_close(t_wide.grad, ref.grad)


def test_invalid_kvcache_reads_are_refused_before_the_cache_is_copied():
    # A cache the library cannot read in place (a last stride of 2: 64 MiB as a copy) is
    # copied only after the call's checks when nothing is appended.
    wide = np.ones((1, 65536, 4, 128), np.float32)
    cache = wide[..., ::2]
    q = np.ones((1, 1, 8, 64), np.float32)
    calls = [
        (lambda: attncore.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=70000),
         ValueError, "cache_seqlens"),
        (lambda: attncore.flash_attn_with_kvcache(q[..., :32], cache, cache, cache_seqlens=5),
         ValueError, "k_cache has shape|expected"),
        (lambda: attncore.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5,
                                                  alibi_slopes=np.ones(3, np.float32)),
         ValueError, "alibi_slopes"),
    ]
    for call, error, message in calls:
        raised, peak = _peak_bytes(call)
        assert isinstance(raised, error) and re.search(message, str(raised)), raised
        assert peak < 8 << 20, (str(raised), peak)
    rng = np.random.default_rng(5)
    small = rng.standard_normal((2, 12, 2, 16)).astype(np.float32)
    qs = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)[..., ::2]
    lens = np.array([5, 12], np.int32)
    got = attncore.flash_attn_with_kvcache(qs, small[..., ::2], small[..., 1::2],
                                           cache_seqlens=lens, causal=True)
    want = attncore.flash_attn_with_kvcache(np.ascontiguousarray(qs),
                                            np.ascontiguousarray(small[..., ::2]),
                                            np.ascontiguousarray(small[..., 1::2]),
                                            cache_seqlens=lens, causal=True)
    np.testing.assert_array_equal(got, want)


def test_invalid_appends_are_refused_before_their_inputs_are_copied():
    # With new keys and values appended, q, k, v and the rotary tables the library cannot read
    # in place (a last stride of 2: 32 MiB each as a copy) are copied only after the call's
    # checks, which include the append's; the caches are written in place (never copied).
    cache, v_cache = np.zeros((2, 1, 8, 2, 64), np.float32)
    new = np.ones((1, 32768, 2, 128), np.float32)[..., ::2]
    q = np.ones((1, 32768, 4, 128), np.float32)[..., ::2]
    cos = np.ones((70000, 64), np.float32)[:, ::2]
    calls = [
        (lambda: attncore.flash_attn_with_kvcache(q, cache, v_cache, k=new, v=new,
                                                  cache_seqlens=0),
         ValueError, "k_new does not fit in the cache"),
        (lambda: attncore.flash_attn_with_kvcache(q, cache, v_cache, k=new[:, :4],
                                                  v=new[:, :4], rotary_cos=cos[:2],
                                                  rotary_sin=cos[:2], cache_seqlens=0),
         ValueError, "rotary_cos has too few positions"),
        (lambda: attncore.flash_attn_with_kvcache(q, cache, v_cache, k=new[:, :4],
                                                  v=new[:, :4, :1], cache_seqlens=0),
         ValueError, "v has shape|v_new has shape"),
    ]
    for call, error, message in calls:
        raised, peak = _peak_bytes(call)
        assert isinstance(raised, error) and re.search(message, str(raised)), raised
        assert peak < 8 << 20, (str(raised), peak)
    assert not cache.any() and not v_cache.any()  # nothing was appended by a refused call
    rng = np.random.default_rng(9)
    caches = [rng.standard_normal((2, 10, 2, 16)).astype(np.float32) for _ in range(2)]
    copies = [c.copy() for c in caches]
    qs = rng.standard_normal((2, 3, 4, 32)).astype(np.float32)[..., ::2]
    ks = rng.standard_normal((2, 3, 2, 32)).astype(np.float32)[..., ::2]
    vs = rng.standard_normal((2, 3, 2, 32)).astype(np.float32)[..., 1::2]
    table = rng.standard_normal((16, 8)).astype(np.float32)
    lens = np.array([2, 7], np.int32)
    got = attncore.flash_attn_with_kvcache(qs, *caches, k=ks, v=vs, rotary_cos=table[:, ::2],
                                           rotary_sin=table[:, 1::2], cache_seqlens=lens,
                                           causal=True)
    want = attncore.flash_attn_with_kvcache(
        *(np.ascontiguousarray(x) for x in (qs,)), *copies, k=np.ascontiguousarray(ks),
        v=np.ascontiguousarray(vs), rotary_cos=np.ascontiguousarray(table[:, ::2]),
        rotary_sin=np.ascontiguousarray(table[:, 1::2]), cache_seqlens=lens, causal=True)
    np.testing.assert_array_equal(got, want)
    for c, w in zip(caches, copies):
        np.testing.assert_array_equal(c, w)


def test_merge_and_assign_read_any_strides_without_a_copy(monkeypatch):
    def refuse_copy(*args):  # every copy of an input is checked first (check_copy)
        raise AssertionError("copied")

    rng = np.random.default_rng(4)
    wide = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    lse = rng.standard_normal((2, 4, 3, 2)).astype(np.float32)
    out_a, out_b = wide[..., ::2], wide[..., 1::2]  # [2, 3, 4, 8], last stride 2
    lse_a, lse_b = lse[..., 0].swapaxes(1, 2), lse[..., 1].swapaxes(1, 2)  # [2, 3, 4]
    want = attncore.merge_attention_states(*(np.ascontiguousarray(x)
                                             for x in (out_a, lse_a, out_b, lse_b)))
    monkeypatch.setattr(_copies, "check_copy", refuse_copy)
    got = attncore.merge_attention_states(out_a, lse_a, out_b, lse_b)
    t_wide, t_lse = torch.from_numpy(wide), torch.from_numpy(lse)
    t_got = attncore.merge_attention_states(t_wide[..., ::2], t_lse[..., 0].transpose(1, 2),
                                            t_wide[..., 1::2], t_lse[..., 1].transpose(1, 2))
    monkeypatch.undo()
    for g in (got, t_got):
        np.testing.assert_array_equal(np.asarray(g[0]), want[0])
        np.testing.assert_array_equal(np.asarray(g[1]), want[1])
    cache = attncore.PagedKVCache(4, 2, 2, 8, 2, "float32")
    rows = rng.standard_normal((3, 2, 16)).astype(np.float32)
    for b in range(2):
        cache.reserve(b, 3)
    cache.assign(0, np.array([2, 0, 1], np.int32), np.ascontiguousarray(rows[..., ::2]),
                 np.ascontiguousarray(rows[..., 1::2]))
    monkeypatch.setattr(_copies, "check_copy", refuse_copy)
    cache.assign(1, np.array([2, 0, 1], np.int32), rows[..., ::2], rows[..., 1::2])
    monkeypatch.undo()
    k_pages, v_pages = (np.asarray(x) for x in (cache.k_cache, cache.v_cache))
    table = np.asarray(cache.page_table)
    for pages in (k_pages, v_pages):
        seq0 = pages[table[0, :2]].reshape(4, 2, 8)[:3]
        seq1 = pages[table[1, :2]].reshape(4, 2, 8)[:3]
        np.testing.assert_array_equal(seq0, seq1)


def test_paged_varlen_pools_are_copied_once_after_the_checks(monkeypatch):
    # flash_attn_varlen_func(block_table=...) runs one KV-cache call per sequence: pools it
    # cannot read in place are copied once, after the checks (not once per sequence).
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 7, 12], np.int32)
    table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    big = np.zeros((256, 256, 4, 128), np.float32)[..., ::2]  # 64 MiB as a copy
    raised, peak = _peak_bytes(lambda: attncore.flash_attn_varlen_func(
        np.zeros((5, 8, 64), np.float64), big, big, cu_q, cu_k, 3, 8, block_table=table))
    assert isinstance(raised, ValueError) and "wrong dtype" in str(raised), raised
    assert peak < 8 << 20, peak
    copies = []
    compact_copy = _copies.compact_copy
    monkeypatch.setattr(_copies, "compact_copy",
                        lambda lib, x, *args, **kwargs: copies.append(x.shape) or compact_copy(
                            lib, x, *args, **kwargs))
    attncore.flash_attn_varlen_func(np.zeros((5, 8, 64), np.float32), big, big, cu_q, cu_k, 3, 8,
                                    block_table=table)
    assert copies == [big.shape, big.shape]  # k's and v's, once
    monkeypatch.undo()
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6, 4, 2, 16)).astype(np.float32)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    got = attncore.flash_attn_varlen_func(np.repeat(q, 2, axis=-1)[..., ::2], pool[..., ::2],
                                          pool[..., 1::2], cu_q, cu_k, 3, 8, block_table=table,
                                          causal=True)
    want = attncore.flash_attn_varlen_func(q, np.ascontiguousarray(pool[..., ::2]),
                                           np.ascontiguousarray(pool[..., 1::2]), cu_q, cu_k, 3,
                                           8, block_table=table, causal=True)
    np.testing.assert_array_equal(got, want)
