"""The fast path (attncore._core.attend) of scaled_dot_product_attention and flash_attn_func:
the calls it takes give the general path's bits (attncore.attention, which never takes it),
outputs and gradients, and match the float64 oracle; the calls it declines reach the general
path, which handles them."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import assert_close, randn


def _attend(q, k, v, mask=None, *, blhd=False, causal="none", scale=None, window=None,
            softcap=0.0, dropout_p=0.0, enable_gqa=False, backend=None):
    return _core.attend(q, k, v, mask, blhd, causal, scale, window, softcap, dropout_p,
                        enable_gqa, backend)


def _inputs(lib, dtype, heads_q=4, heads_kv=2, seqlen_q=5, seqlen_k=9, dim=16, blhd=False):
    shapes = [(2, heads_q, seqlen_q, dim), (2, heads_kv, seqlen_k, dim),
              (2, heads_kv, seqlen_k, dim)]
    xs = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)]
    if blhd:
        xs = [x.transpose(1, 2).contiguous() for x in xs]
    return [x.numpy() for x in xs] if lib == "numpy" else xs


SDPA_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True},
    "bool-mask-2d": {"attn_mask": "bool2"},
    "float-mask-4d": {"attn_mask": "float4"},
    "backend-math": {"backend": "math"},
}


def _mask(kind, lib, dtype):
    if kind == "bool2":
        m = randn(5, 9, seed=7) > -0.5
    else:
        m = randn(2, 1, 5, 9, seed=8, dtype=dtype)
    return m.numpy() if lib == "numpy" else m


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_fast_path_gives_the_general_paths_bits(lib, dtype, case):
    kwargs = dict(SDPA_CASES[case])
    q, k, v = _inputs(lib, dtype)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = _mask(kwargs["attn_mask"], lib, dtype)
    if not kwargs.get("enable_gqa"):
        k, v = k[:, :1], v[:, :1]  # one key/value head serves every query head
    fast = _attend(q, k, v, kwargs.get("attn_mask"),
                   causal="upper-left" if kwargs.get("is_causal") else "none",
                   scale=kwargs.get("scale"), enable_gqa=bool(kwargs.get("enable_gqa")),
                   backend=kwargs.get("backend"))
    assert fast is not None, "the fast path declined a plain call"
    out = attncore.scaled_dot_product_attention(q, k, v, **kwargs)
    general = attncore.attention(
        q, k, v, causal="upper-left" if kwargs.get("is_causal") else None,
        scale=kwargs.get("scale"), attn_mask=kwargs.get("attn_mask"),
        backend=kwargs.get("backend"))
    assert type(out) is type(q) and out.shape == general.shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(general))
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(general))
    mask = kwargs.get("attn_mask")
    expected, _ = reference.attention(
        torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), scale=kwargs.get("scale"),
        causal="upper-left" if kwargs.get("is_causal") else None,
        mask=None if mask is None else torch.as_tensor(mask))
    assert_close(torch.as_tensor(out), expected, dtype, case)


FLASH_CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window-softcap": {"window_size": (3, 1), "softcap": 2.5, "softmax_scale": 0.4},
    "softcap-off": {"softcap": -1.0},
}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_fast_path_gives_the_general_paths_bits(lib, case):
    kwargs = FLASH_CASES[case]
    q, k, v = _inputs(lib, torch.float32, blhd=True)
    assert _attend(q, k, v, blhd=True, window=kwargs.get("window_size", (-1, -1)),
                   softcap=kwargs.get("softcap", 0.0), scale=kwargs.get("softmax_scale"),
                   causal="lower-right" if kwargs.get("causal") else "none",
                   enable_gqa=True) is not None
    out = attncore.flash_attn_func(q, k, v, **kwargs)
    general = attncore.attention(
        q, k, v, layout="blhd", causal="lower-right" if kwargs.get("causal") else None,
        window_size=kwargs.get("window_size", (-1, -1)),
        softcap=max(kwargs.get("softcap", 0.0), 0.0), scale=kwargs.get("softmax_scale"))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(general))
    # The output is laid out like q: a contiguous [B, L, H, D].
    assert np.asarray(out).flags.c_contiguous


@pytest.mark.parametrize("blhd", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
def test_fast_path_gradients_are_the_general_paths(blhd, float_mask):
    q, k, v = _inputs("torch", torch.float64, blhd=blhd)
    mask = randn(2, 1, 5, 9, seed=9) if float_mask and not blhd else None

    def run(function):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        m = None if mask is None else mask.clone().requires_grad_()
        out = function(*ins, m)
        out.backward(torch.ones_like(out))
        grads = [x.grad for x in ins] + ([m.grad] if m is not None else [])
        return out.detach(), grads, out.grad_fn

    if blhd:
        fast = run(lambda q, k, v, m: attncore.torch.flash_attn_func(q, k, v, causal=True))
        general = run(lambda q, k, v, m: attncore.torch.attention(
            q, k, v, layout="blhd", causal="lower-right"))
    else:
        fast = run(lambda q, k, v, m: attncore.torch.scaled_dot_product_attention(
            q, k, v, attn_mask=m, enable_gqa=True))
        general = run(lambda q, k, v, m: attncore.torch.attention(q, k, v, attn_mask=m))
    assert "FastAttentionFunction" in type(fast[2]).__name__
    assert torch.equal(fast[0], general[0])
    for a, b in zip(fast[1], general[1]):
        assert a.shape == b.shape and torch.equal(a, b)


def _neg_view(x):
    return torch._neg_view(x)


DECLINED = {
    # (what the call gets, why the fast path must leave it to the general path)
    "non-unit last stride": lambda q, k, v: (q[..., ::2], k[..., ::2], v[..., ::2]),
    "mixed libraries": lambda q, k, v: (q, k.numpy(), v),
    "rank 3": lambda q, k, v: (q[0], k[0], v[0]),
    "lazily negated": lambda q, k, v: (_neg_view(q), k, v),
    "batch dims broadcast": lambda q, k, v: (q, k[:1], v[:1]),
}


@pytest.mark.parametrize("case", DECLINED)
def test_declined_calls_take_the_general_path(case):
    q, k, v = _inputs("torch", torch.float64, heads_kv=4)
    args = DECLINED[case](q, k, v)
    assert _attend(*args) is None
    out = attncore.scaled_dot_product_attention(*args)
    plain = [torch.as_tensor(x).clone().resolve_neg() for x in args]
    if case == "batch dims broadcast":
        plain = [x.expand(2, -1, -1, -1) for x in plain]
    expected, _ = reference.attention(*plain)
    assert_close(out, expected, torch.float64, case)


@pytest.mark.parametrize("key", ["torch bool", "numpy int32"])
def test_keys_of_no_value_dtype_get_the_general_paths_error(key):
    """A key no call takes (a torch bool key; an int32 one) is declined, so both entries name
    it as the general path does (flash_attn_func's fast path named a bool key differently)."""
    q, k, v = _inputs("torch", torch.float32, heads_kv=4)
    if key == "numpy int32":
        q, k, v = q.numpy(), k.numpy().astype(np.int32), v.numpy()
    else:
        k = k > 0
    assert _attend(q, k, v) is None
    assert _attend(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), blhd=True) is None
    for call in (lambda *a: attncore.scaled_dot_product_attention(*a, scale=0.5),
                 lambda *a: attncore.flash_attn_func(*(x.swapaxes(1, 2) for x in a))):
        with pytest.raises(ValueError) as error:
            call(q, k, v)
        with pytest.raises(ValueError) as general:
            attncore.attention(q, k, v)
        assert str(error.value) == str(general.value)


@pytest.mark.parametrize("option", ["dropout", "string scale", "tuple-less window",
                                    "enum backend", "bool causal value"])
def test_options_of_other_types_take_the_general_path(option):
    q, k, v = _inputs("numpy", torch.float32, heads_kv=4)
    kwargs = {"dropout": {"dropout_p": 0.5}, "string scale": {"scale": "0.5"},
              "tuple-less window": {"window": [1, 1]},
              "enum backend": {"backend": attncore.SDPBackend.FLASH},
              "bool causal value": {"softcap": True}}[option]
    assert _attend(q, k, v, **kwargs) is None


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_outputs_past_the_memory_limit_are_refused_by_name(lib):
    """A broadcast query (no memory) whose output would exceed the memory this process may
    use: attncore's MemoryError, not the array library's failed allocation."""
    rows = int(attncore._core.memory_limit()[0] // (8 * 4)) + 1
    one = torch.ones(1, 1, 1, 8)
    k = torch.ones(1, 1, 4, 8)
    q_bhld, q_blhd = one.expand(1, 1, rows, 8), one.expand(1, rows, 1, 8)
    if lib == "numpy":
        q_bhld, q_blhd, k = (np.broadcast_to(x.numpy(), x.shape) for x in (q_bhld, q_blhd, k))
    with pytest.raises(MemoryError, match="^forward: the outputs exceed the memory this process may use"):
        attncore.scaled_dot_product_attention(q_bhld, k, k)
    k_blhd = k.swapaxes(1, 2)
    with pytest.raises(MemoryError, match="^forward: the outputs exceed the memory this process may use"):
        attncore.flash_attn_func(q_blhd, k_blhd, k_blhd)


def test_large_outputs_are_made_only_for_a_valid_call():
    """Where the outputs would fit the limit but not the memory left (RLIMIT_AS a little above
    what the process uses), an invalid call raises its own error, not a failed allocation: its
    checks run before a large output is made."""
    code = """
import resource, numpy as np, torch, attncore.torch as AT
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
left = 1 << 29
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
if hard != resource.RLIM_INFINITY and hard < used + left:
    raise SystemExit("skip: RLIMIT_AS's hard limit is below what the test sets")
resource.setrlimit(resource.RLIMIT_AS, (used + left, hard))
rows = (left + used // 2) // 256  # out: within the limit, more than is left
q = torch.ones(1, 1, 1, 64).expand(1, 1, rows, 64)
try:
    AT.scaled_dot_product_attention(q, torch.ones(1, 1, 4, 64).double(), torch.ones(1, 1, 4, 64))
except Exception as e:
    print(type(e).__name__, str(e))
"""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc/self/statm (Linux)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    if result.stderr.startswith("skip:"):
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ValueError forward: key has the wrong dtype"), result.stdout
