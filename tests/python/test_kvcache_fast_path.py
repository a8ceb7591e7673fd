"""The fast path of flash_attn_with_kvcache (attncore._core.attend_kvcache): the calls it takes
give the general path's bits, outputs and LSE alike; the calls it declines reach the general
path, which handles or refuses them."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import FLASH_OPTION_CASES, assert_close, assert_same_bits, in_library, randn

BATCH, HEADS_Q, HEADS_KV, DIM, CAPACITY, PAGE = 2, 4, 2, 16, 40, 8


def _call(lib, dtype, cache_dtype=None, seqlen_q=1, paged=False, **options):
    """The arguments of one call: q [2, Lq, 4, 16], caches [2, 40, 2, 16] (or, paged, a pool
    [12, 8, 2, 16] with a shuffled block table), cache_seqlens [33, 40]."""
    cache_dtype = cache_dtype or dtype
    q = randn(BATCH, seqlen_q, HEADS_Q, DIM, dtype=dtype, seed=1)
    if paged:
        pages = BATCH * CAPACITY // PAGE + 2
        k = randn(pages, PAGE, HEADS_KV, DIM, dtype=cache_dtype, seed=2)
        v = randn(pages, PAGE, HEADS_KV, DIM, dtype=cache_dtype, seed=3)
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(4))
        options["block_table"] = order[:BATCH * CAPACITY // PAGE].reshape(BATCH, -1).int()
    else:
        k = randn(BATCH, CAPACITY, HEADS_KV, DIM, dtype=cache_dtype, seed=2)
        v = randn(BATCH, CAPACITY, HEADS_KV, DIM, dtype=cache_dtype, seed=3)
    options.setdefault("cache_seqlens", torch.tensor([33, 40], dtype=torch.int32))
    for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table"):
        if isinstance(options.get(name), list):
            options[name] = torch.tensor(options[name], dtype=torch.int32)
    return in_library(lib, [q, k, v], options)


CASES = {
    **FLASH_OPTION_CASES,
    "int-seqlens": {"cache_seqlens": 33},
    "leftpad": {"cache_leftpad": [3, 0]},
    "batch-idx": {"cache_batch_idx": [1, 0]},
    "paged": {"paged": True},
    "lse": {"return_softmax_lse": True},
    "splits": {"num_splits": 2},
    "chunked-prefill": {"seqlen_q": 3, "causal": True},
    "backend-math": {"backend": "math"},
    "append": {"append": 2, "cache_seqlens": [30, 37]},
    "append-rotary": {"append": 1, "rotary": 12, "causal": True, "cache_seqlens": [30, 37]},
    "append-rotary-halves": {"append": 3, "rotary": 10, "rotary_interleaved": False,
                             "cache_seqlens": [30, 37], "paged": True},
}


def _appended(lib, dtype, options, new_rows, rotary_dim):
    """The options of an append of new_rows keys and values (and rotary tables of rotary_dim)
    to the call's caches."""
    arrays = [randn(BATCH, new_rows, HEADS_KV, DIM, dtype=dtype, seed=s) for s in (5, 6)]
    if rotary_dim:
        angles = torch.arange(64, dtype=torch.float64)[:, None] / (1 + torch.arange(rotary_dim // 2))
        arrays += [angles.cos().float(), angles.sin().float()]
    if lib == "numpy":
        arrays = [x.numpy() for x in arrays]
    options = dict(options, k=arrays[0], v=arrays[1])
    if rotary_dim:
        options.update(rotary_cos=arrays[2], rotary_sin=arrays[3])
    return options


def _copies(lib, *xs):
    return [x.copy() if lib == "numpy" else x.clone() for x in xs]


def _general(q, k, v, options):
    """The same call through the general path: window_size as a list, which the fast path
    declines (it takes a tuple) and the general path reads alike."""
    options = dict(options)
    options["window_size"] = list(options.get("window_size", (-1, -1)))
    return attncore.flash_attn_with_kvcache(q, k, v, **options)


def _fast(q, k, v, options):
    o = dict(options)
    return _core.attend_kvcache(
        q, k, v, o.get("k"), o.get("v"), o.get("rotary_cos"), o.get("rotary_sin"),
        o.get("rotary_interleaved", True), o.get("cache_seqlens"), o.get("cache_batch_idx"),
        o.get("cache_leftpad"), o.get("block_table"), o.get("softmax_scale"),
        o.get("causal", False), o.get("window_size", (-1, -1)), o.get("softcap", 0.0),
        o.get("num_splits", 0), o.get("backend"), o.get("return_softmax_lse", False))


def _oracle(q, k, v, options):
    """(out [B, Lq, Hq, Dv], lse [B, Hq, Lq]) of a call with a dense cache and no append, in
    float64 (tests/python/reference.py): sequence b attends to slots [leftpad[b], seqlens[b]) of
    cache row batch_idx[b] (or b), causal lower-right against that length."""
    q, k, v = (torch.as_tensor(x) for x in (q, k, v))
    batch = q.shape[0]

    def per_sequence(name, default):
        x = options.get(name)
        if x is None:
            return [default(b) for b in range(batch)]
        if isinstance(x, int):
            return [x] * batch
        return [int(n) for n in torch.as_tensor(x)]

    lengths = per_sequence("cache_seqlens", lambda b: k.shape[1])
    rows = per_sequence("cache_batch_idx", lambda b: b)
    starts = per_sequence("cache_leftpad", lambda b: 0)
    outs, lses = [], []
    for b in range(batch):
        keys = slice(starts[b], lengths[b])
        out, lse = reference.attention(
            q[b].transpose(0, 1), k[rows[b], keys].transpose(0, 1),
            v[rows[b], keys].transpose(0, 1), scale=options.get("softmax_scale"),
            causal="lower-right" if options.get("causal") else None,
            window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0))
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_gives_the_general_paths_bits(lib, dtype, case):
    options = dict(CASES[case])
    seqlen_q, paged = options.pop("seqlen_q", 1), options.pop("paged", False)
    new_rows, rotary_dim = options.pop("append", 0), options.pop("rotary", 0)
    (q, k, v), options = _call(lib, dtype, seqlen_q=seqlen_q, paged=paged, **options)
    if new_rows:  # each call appends to caches of its own, copied from the same ones
        options = _appended(lib, dtype, options, new_rows, rotary_dim)
        caches = [_copies(lib, k, v) for _ in range(4)]
    else:
        caches = [(k, v)] * 4
    fast = _fast(q, *caches[0], options)
    assert fast is not None, "the fast path declined a plain call"
    assert_same_bits(fast, _general(q, *caches[1], options))
    assert_same_bits(attncore.flash_attn_with_kvcache(q, *caches[2], **options), fast)
    assert_same_bits(attncore.torch.flash_attn_with_kvcache(q, *caches[3], **options), fast)
    for written in caches[1:]:  # the appends wrote the same rows
        assert_same_bits(tuple(written), tuple(caches[0]))
    if not (new_rows or paged or options.get("backend")):  # against the float64 oracle
        out, lse = _oracle(q, k, v, options)
        fast = fast if isinstance(fast, tuple) else (fast,)
        assert_close(fast[0], out, dtype, case)
        if len(fast) == 2:
            assert_close(fast[1], lse, dtype, case)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_fast_path_of_a_bf16_cache(query_dtype):
    (q, k, v), options = _call("torch", query_dtype, cache_dtype=torch.bfloat16)
    fast = _fast(q, k, v, options)
    assert fast is not None and fast.dtype == query_dtype
    assert_same_bits(fast, _general(q, k, v, options))


def test_declined_calls_take_the_general_path():
    (q, k, v), options = _call("torch", torch.float32)
    plain = attncore.flash_attn_with_kvcache(q, k, v, **options)
    # An index array with strides the library does not read, a cache_seqlens of another kind, a
    # scale of a numpy type: declined, then read by the general path alike.
    strided = torch.stack([options["cache_seqlens"]] * 2, 1)[:, 0]
    assert _fast(q, k, v, dict(options, cache_seqlens=strided)) is None
    assert_same_bits(
        attncore.flash_attn_with_kvcache(q, k, v, **dict(options, cache_seqlens=strided)), plain)
    numpy_lens = options["cache_seqlens"].numpy()
    assert _fast(q, k, v, dict(options, cache_seqlens=numpy_lens)) is None
    assert_same_bits(
        attncore.flash_attn_with_kvcache(q, k, v, **dict(options, cache_seqlens=numpy_lens)), plain)
    assert _fast(q, k, v, dict(options, softmax_scale=np.float64(0.25))) is None
    # Calls the general path refuses: by name, as ever.
    with pytest.raises(TypeError, match="^flash_attn_with_kvcache: causal"):
        attncore.flash_attn_with_kvcache(q, k, v, causal="false", **options)
    assert _fast(q, k, v, dict(options, window_size=(-2, 0))) is None
    with pytest.raises(ValueError, match="window_left is invalid \\(window_left=-2"):
        attncore.flash_attn_with_kvcache(q, k, v, window_size=(-2, 0), **options)
    with pytest.raises(NotImplementedError, match="^flash_attn_with_kvcache: "):
        attncore.flash_attn_with_kvcache(q.clone().requires_grad_(), k, v, **options)
    with pytest.raises(ValueError, match="^flash_attn_with_kvcache: k_cache has shape"):
        attncore.flash_attn_with_kvcache(q, k[:, :, :1].expand(-1, -1, 3, -1), v, **options)


def test_fast_path_appends_as_the_general_path_does():
    """An append on the fast path moves the caches' version counters (autograd then refuses a
    graph that saved them); read-only numpy caches and inference tensors outside inference mode
    are declined and refused by the general path."""
    (q, k, v), options = _call("torch", torch.float32, cache_seqlens=[30, 37])
    options = _appended("torch", torch.float32, options, 1, 0)
    versions = k._version, v._version
    assert _fast(q, k, v, options) is not None
    attncore.torch.flash_attn_with_kvcache(q, k, v, **options)
    assert k._version > versions[0] and v._version > versions[1]

    (qn, kn, vn), numpy_options = _call("numpy", torch.float32, cache_seqlens=[30, 37])
    numpy_options = _appended("numpy", torch.float32, numpy_options, 1, 0)
    kn.flags.writeable = False
    assert _fast(qn, kn, vn, numpy_options) is None
    with pytest.raises(ValueError, match="^flash_attn_with_kvcache: k_cache is read-only"):
        attncore.flash_attn_with_kvcache(qn, kn, vn, **numpy_options)

    with torch.inference_mode():
        ki, vi = k.clone(), v.clone()
        assert _fast(q, ki, vi, options) is not None  # inside inference mode: written
    assert _fast(q, ki, vi, options) is None
    with pytest.raises(ValueError, match="^flash_attn_with_kvcache: k_cache is an inference"):
        attncore.torch.flash_attn_with_kvcache(q, ki, vi, **options)


def test_refusals_are_the_general_paths():
    """Outputs past the memory this process may use are refused before the library's checks,
    as the general path refuses them (MemoryError); a backend name that is no UTF-8 is read by
    the general path (ValueError), and an append refused so moves no version counter."""
    q = np.broadcast_to(np.ones((1, 1, 1, 16), np.float32), (2, 2 ** 40, 4, 16))
    kc = np.ones((2, 40, 2, 16), np.float32)
    with pytest.raises(MemoryError, match="^flash_attn_with_kvcache: the outputs exceed"):
        attncore.flash_attn_with_kvcache(q, kc, kc.copy(), cache_seqlens=-1)
    (q, k, v), options = _call("torch", torch.float32, cache_seqlens=[30, 37])
    options = _appended("torch", torch.float32, options, 1, 0)
    versions = k._version, v._version
    assert _fast(q, k, v, dict(options, backend="\ud800")) is None
    with pytest.raises(ValueError, match="backend is invalid"):
        attncore.torch.flash_attn_with_kvcache(q, k, v, backend="\ud800", **options)
    assert (k._version, v._version) == versions
