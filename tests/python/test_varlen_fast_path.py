"""The fast path of flash_attn_varlen_func (attncore._core.attend_varlen): the calls it takes
give the general path's bits and the float64 oracle's values within the dtype's tolerance; the
calls it declines reach the general path, which handles or refuses them; a call the library
refuses raises the general path's error."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import FLASH_OPTION_CASES, assert_close, assert_same_bits, in_library, randn

HEADS_Q, HEADS_KV, DIM, DIM_V, PAGE = 4, 2, 16, 12, 8
LENS_Q, LENS_K = [1, 3, 0, 1], [30, 7, 12, 19]


def _call(lib, dtype, paged=False, **options):
    """The arguments of one call: 4 sequences of 1, 3, 0 and 1 query rows over 30, 7, 12 and 19
    keys, packed (or, paged, in a pool of pages of 8 slots in a shuffled order)."""
    cu_q = torch.tensor(np.cumsum([0] + LENS_Q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + LENS_K), dtype=torch.int32)
    q = randn(int(cu_q[-1]), HEADS_Q, DIM, dtype=dtype, seed=1)
    k = randn(int(cu_k[-1]), HEADS_KV, DIM, dtype=dtype, seed=2)
    v = randn(int(cu_k[-1]), HEADS_KV, DIM_V, dtype=dtype, seed=3)
    if paged:  # each sequence's keys copied into its pages
        pages_of = [-(-n // PAGE) for n in LENS_K]
        order = torch.randperm(sum(pages_of) + 2, generator=torch.Generator().manual_seed(4))
        table = torch.full((len(LENS_K), max(pages_of)), -1, dtype=torch.int32)
        k_pool = torch.zeros(len(order), PAGE, HEADS_KV, DIM, dtype=dtype)
        v_pool = torch.zeros(len(order), PAGE, HEADS_KV, DIM_V, dtype=dtype)
        used = 0
        for b, n in enumerate(LENS_K):
            for p in range(pages_of[b]):
                page = int(order[used])
                used += 1
                table[b, p] = page
                rows = slice(int(cu_k[b]) + p * PAGE, int(cu_k[b]) + min(n, (p + 1) * PAGE))
                k_pool[page, :rows.stop - rows.start] = k[rows]
                v_pool[page, :rows.stop - rows.start] = v[rows]
        options["block_table"] = table
        k, v = k_pool, v_pool
    arrays = [q, k, v, cu_q, cu_k]
    if "seqused_k" in options:
        options["seqused_k"] = torch.tensor(options["seqused_k"], dtype=torch.int32)
    return in_library(lib, arrays, options)


CASES = {
    **FLASH_OPTION_CASES,
    "seqused-k": {"seqused_k": [20, 7, 0, 19]},
    "paged": {"paged": True},
    "paged-causal": {"paged": True, "causal": True},
    "backend-math": {"backend": "math"},
}


def _fast(q, k, v, cu_q, cu_k, options):
    o = dict(options)
    return _core.attend_varlen(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), o.get("seqused_k"), o.get("block_table"),
        o.get("softmax_scale"), o.get("causal", False), o.get("window_size", (-1, -1)),
        o.get("softcap", 0.0), 0.0, o.get("backend"))


def _general(q, k, v, cu_q, cu_k, options):
    """The same call through the general path: window_size as a list, which the fast path
    declines (it takes a tuple) and the general path reads alike."""
    options = dict(options)
    options["window_size"] = list(options.get("window_size", (-1, -1)))
    return attncore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                           **options)


def _oracle(q, k, v, cu_q, cu_k, options):
    """out [total_q, Hq, Dv] in float64 (tests/python/reference.py), sequence by sequence on
    its packed keys (the first seqused_k[b] of them)."""
    q, k, v = (torch.as_tensor(x) for x in (q, k, v))
    used = options.get("seqused_k")
    outs = []
    for b in range(len(LENS_Q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        end = int(cu_k[b]) + (LENS_K[b] if used is None else int(used[b]))
        keys = slice(int(cu_k[b]), end)
        out, _ = reference.attention(
            q[rows].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1),
            scale=options.get("softmax_scale"),
            causal="lower-right" if options.get("causal") else None,
            window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0))
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_fast_path_gives_the_general_paths_bits(lib, dtype, case):
    options = dict(CASES[case])
    paged = options.pop("paged", False)
    (q, k, v, cu_q, cu_k), options = _call(lib, dtype, paged=paged, **options)
    fast = _fast(q, k, v, cu_q, cu_k, options)
    assert fast is not None, "the fast path declined a plain call"
    assert_same_bits(fast, _general(q, k, v, cu_q, cu_k, options))
    for module in (attncore, attncore.torch):
        assert_same_bits(module.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q),
                                                       max(LENS_K), **options), fast)
    if not paged:
        assert_close(fast, _oracle(q, k, v, cu_q, cu_k, options), dtype, case)


def test_fast_path_of_bf16():
    (q, k, v, cu_q, cu_k), options = _call("torch", torch.bfloat16, causal=True)
    fast = _fast(q, k, v, cu_q, cu_k, options)
    assert fast is not None and fast.dtype == torch.bfloat16
    assert_same_bits(fast, _general(q, k, v, cu_q, cu_k, options))


def test_declined_calls_take_the_general_path():
    (q, k, v, cu_q, cu_k), options = _call("torch", torch.float32)
    plain = _fast(q, k, v, cu_q, cu_k, options)

    def through_both(*args, **kwargs):  # the drop-in's result, and the fast path's verdict
        return (attncore.torch.flash_attn_varlen_func(*args, max(LENS_Q), max(LENS_K), **kwargs),
                _core.attend_varlen(*args, max(LENS_Q), max(LENS_K), kwargs.get("seqused_k"),
                                    None, kwargs.get("softmax_scale"), False, (-1, -1), 0.0, 0.0,
                                    None))

    # numpy cu_seqlens with torch arrays: taken (the library only reads them).
    out, verdict = through_both(q, k, v, cu_q.numpy(), cu_k.numpy())
    assert_same_bits(verdict, plain)
    assert_same_bits(out, plain)
    # cu_seqlens with a stride the library does not read, a scale of a numpy type: declined,
    # then read by the general path alike.
    for args, kwargs in [((q, k, v, torch.stack([cu_q] * 2, 1)[:, 0], cu_k), {}),
                         ((q, k, v, cu_q, cu_k), {"softmax_scale": np.float64(0.25)})]:
        out, verdict = through_both(*args, **kwargs)
        assert verdict is None
        expected = plain if "softmax_scale" not in kwargs else _general(
            q, k, v, cu_q, cu_k, {"softmax_scale": 0.25})
        assert_same_bits(out, expected)
    # A torch input that requires grad (the autograd record), dropout: the general path.
    qg = q.clone().requires_grad_()
    assert _core.attend_varlen(qg, k, v, cu_q, cu_k, 3, 30, None, None, None, False, (-1, -1),
                               0.0, 0.0, None) is None
    out = attncore.torch.flash_attn_varlen_func(qg, k, v, cu_q, cu_k, 3, 30)
    assert out.requires_grad
    assert_same_bits(out.detach(), plain)
    assert _core.attend_varlen(q, k, v, cu_q, cu_k, 3, 30, None, None, None, False, (-1, -1),
                               0.0, 0.1, None) is None
    # Calls the general path refuses: by name, as ever (int64 cu_seqlens: declined first).
    assert _core.attend_varlen(q, k, v, cu_q.long(), cu_k, 3, 30, None, None, None, False,
                               (-1, -1), 0.0, 0.0, None) is None
    with pytest.raises(ValueError, match="^flash_attn_varlen_func: cu_seqlens_q has the wrong"):
        attncore.torch.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 3, 30)
    with pytest.raises(TypeError, match="^flash_attn_varlen_func: causal"):
        attncore.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 30, causal="false")
    with pytest.raises(ValueError, match="^flash_attn_varlen_func: q has the wrong rank"):
        attncore.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 3, 30)


def test_refusals_are_the_general_paths():
    """A call the library refuses raises the same error on either path (a bool key: declined,
    as the general path names its dtype); outputs past the memory this process may use are
    refused (MemoryError) by the general path."""
    (q, k, v, cu_q, cu_k), options = _call("numpy", torch.float32)
    bad_cu = cu_q.copy()
    bad_cu[2] = 9  # past total_q
    heads = k[:, :1].repeat(3, 1)  # 3 kv heads for 4 query heads
    for args in [(q, k, v, bad_cu, cu_k), (q, heads, v[:, :1].repeat(3, 1), cu_q, cu_k),
                 (torch.from_numpy(q), torch.from_numpy(k) > 0, torch.from_numpy(v),
                  torch.from_numpy(cu_q), torch.from_numpy(cu_k))]:
        with pytest.raises(ValueError) as fast:
            attncore.flash_attn_varlen_func(*args, 3, 30)
        with pytest.raises(ValueError) as general:
            attncore.flash_attn_varlen_func(*args, 3, 30, window_size=[-1, -1])
        assert str(fast.value) == str(general.value)
    big = np.broadcast_to(np.ones((1, 1, DIM), np.float32), (2 ** 40, HEADS_Q, DIM))
    with pytest.raises(MemoryError):
        attncore.flash_attn_varlen_func(big, k, v, cu_q, cu_k, 3, 30)


LSE_PROGRAM = """
import resource
limit = 4 << 30  # memory_limit() follows RLIMIT_AS
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import numpy as np
import attncore
rows = int(0.6 * limit / 4)  # out alone 0.6 of the limit; with the LSE the general path makes, 1.2
q = np.broadcast_to(np.ones((1, 1, 1), np.float32), (rows, 1, 1))
k = np.ones((1, 1, 1), np.float32)
cu = np.array([0, 1], np.int32)
for window in ((-1, -1), [-1, -1]):  # the fast path, then the general one
    try:
        attncore.flash_attn_varlen_func(q, k, k, cu, cu, 1, 1, window_size=window)
        print("made", flush=True)
    except MemoryError as e:
        print("MemoryError", str(e).split(" (")[0], flush=True)
"""


def test_outputs_count_the_lse_the_general_path_makes():
    # The general path makes the LSE of every call: the fast path counts it against the memory
    # limit too, so that outputs past it are refused alike (the fast path made such an out).
    import subprocess, sys, os
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", LSE_PROGRAM], env=env, capture_output=True,
                            text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], (result.stdout, result.stderr)
    assert lines[0].startswith("MemoryError forward: the outputs exceed"), lines
