"""Every error: invalid arguments raise ValueError and unsupported combinations
NotImplementedError, with the library's message; none of them harms the interpreter."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from attncore import _core

SDPA = attncore.scaled_dot_product_attention
FLASH = attncore.flash_attn_func


def bhld(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


q, k, v = bhld(2, 4, 5, 8), bhld(2, 4, 6, 8), bhld(2, 4, 6, 8)
fq, fk = bhld(2, 5, 4, 8), bhld(2, 6, 4, 8)  # [B, L, H, D]
lse = np.zeros((2, 4, 5), np.float32)

INVALID = {
    # torch-SDPA's own rules
    "mask-and-causal": (lambda: SDPA(q, k, v, attn_mask=bhld(5, 6), is_causal=True),
                        "scaled_dot_product_attention: attn_mask is set with is_causal=True"),
    "mask-dtype": (lambda: SDPA(q, k, v, attn_mask=bhld(5, 6, dtype=np.float64)),
                   r"attn_mask has the wrong dtype \(dtype=float64, expected bool, float32 or "),
    "mask-dtype-bf16-query": (lambda: SDPA(torch.ones(2, 4, 5, 8, dtype=torch.bfloat16),
                                           torch.ones(2, 4, 6, 8, dtype=torch.bfloat16),
                                           torch.ones(2, 4, 6, 8, dtype=torch.bfloat16),
                                           attn_mask=torch.ones(5, 6, dtype=torch.float16)),
                              "dtype=float16, expected bool, float32 or query's bfloat16"),
    "mask-shape": (lambda: SDPA(q, k, v, attn_mask=bhld(3, 6)),
                   r"attn_mask has shape \[3, 6\], expected it to broadcast to \[2, 4, 5, 6\]"),
    "mask-rank": (lambda: SDPA(q, k, v, attn_mask=bhld(1, 1, 1, 5, 6)),
                  r"attn_mask has the wrong rank \(rank=5, expected <= 4"),
    "batch-dims": (lambda: SDPA(q, bhld(3, 4, 6, 8), v), r"key has leading dims \[3\]"),
    "rank": (lambda: SDPA(bhld(8), k, v), r"query has the wrong rank \(rank=1, expected >= 2"),
    # the library's checks, their messages passed through
    "head-dim": (lambda: SDPA(q, bhld(2, 4, 6, 9), v), r"^forward: key has shape \[2, 4, 6, 9\]"),
    "heads-without-gqa": (lambda: SDPA(q, bhld(2, 2, 6, 8), bhld(2, 2, 6, 8)),
                          "set enable_gqa"),
    "heads-not-dividing": (lambda: SDPA(q, bhld(2, 3, 6, 8), bhld(2, 3, 6, 8), enable_gqa=True),
                           r"Hq % Hkv == 0 \(Hq=4, Hkv=3\)"),
    "dtype-mismatch": (lambda: SDPA(q, k.astype(np.float64), v),
                       r"^forward: key has the wrong dtype \(dtype=f64, expected f32 like query"),
    "element-type": (lambda: SDPA(q.astype(np.int64), k, v),
                     r"query has an unsupported element type \(format='l', itemsize=8"),
    "index-array-as-query": (lambda: SDPA(q.astype(np.int32), k, v),
                             r"^forward: query has an unsupported dtype \(dtype=i32, expected f32"),
    "index-array-as-key": (lambda: SDPA(q, k.astype(np.int32), v),
                           r"^forward: key has the wrong dtype \(dtype=i32, expected f32 like "),
    "index-array-as-alibi": (lambda: FLASH(fq, fk, fk, alibi_slopes=np.ones(4, np.int32)),
                             r"alibi_slopes has the wrong dtype \(dtype=i32, expected f32"),
    "dropout-one": (lambda: SDPA(q, k, v, dropout_p=1.0), r"dropout_p is out of range"),
    "dropout-negative": (lambda: SDPA(q, k, v, dropout_p=-0.1), r"dropout_p is out of range"),
    "scale-nan": (lambda: SDPA(q, k, v, scale=float("nan")), r"scale is invalid \(scale=nan"),
    "scale-inf": (lambda: SDPA(q, k, v, scale=-float("inf")), r"scale is invalid"),
    "value-batch": (lambda: SDPA(q, k, bhld(2, 4, 7, 8)), r"^forward: value has shape"),
    # flash-attn's options
    "flash-rank": (lambda: FLASH(bhld(5, 4, 8), fk, fk), r"q has the wrong rank \(rank=3"),
    "window-negative": (lambda: FLASH(fq, fk, fk, window_size=(-2, 0)),
                        r"window_left is invalid \(window_left=-2"),
    "window-shape": (lambda: FLASH(fq, fk, fk, window_size=3), r"window_size is invalid"),
    "softcap": (lambda: attncore.attention(q, k, v, softcap=-1.0), r"softcap is invalid"),
    "softcap-nan": (lambda: FLASH(fq, fk, fk, softcap=float("nan")), r"softcap is invalid"),
    "alibi-shape": (lambda: FLASH(fq, fk, fk, alibi_slopes=bhld(3)),
                    r"alibi_slopes has shape \[3\], expected \[4\] or \[2, 4\]"),
    "alibi-dtype": (lambda: FLASH(fq, fk, fk, alibi_slopes=bhld(4, dtype=np.float64)),
                    r"alibi_slopes has the wrong dtype \(dtype=f64, expected f32"),
    # attncore's own API
    "causal-name": (lambda: attncore.attention(q, k, v, causal=True), r"causal is invalid"),
    "layout": (lambda: attncore.attention(q, k, v, layout="bshd"), r"layout is invalid"),
    "backend-name": (lambda: SDPA(q, k, v, backend="cudnn"), r"backend is invalid"),
    "backward-dropout-seed": (
        lambda: attncore.attention_backward(q, q, k, v, q, lse, dropout_p=0.1),
        r"dropout needs the forward call's seed"),
    "backward-lse-shape": (lambda: attncore.attention_backward(q, q, k, v, q, lse[:, :2]),
                           r"softmax_lse has shape \[2, 2, 5\], expected \[2, 4, 5\]"),
    "backward-dout-shape": (lambda: attncore.attention_backward(bhld(2, 4, 5, 3), q, k, v, q,
                                                                lse),
                            r"^backward: dout has shape \[2, 4, 5, 3\]"),
    "seed": (lambda: attncore.manual_seed(-1), r"seed is invalid"),
    "call-seed": (lambda: attncore.attention(q, k, v, dropout_p=0.1, seed=2 ** 64),
                  r"seed is invalid"),
    "rng-state": (lambda: attncore.set_rng_state((1, 2 ** 64)), r"offset is invalid"),
    "not-an-array": (lambda: SDPA(object(), k, v), r"rank=0"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_arguments_raise_value_error(case):
    call, message = INVALID[case]
    with pytest.raises(ValueError, match=message):
        call()


UNSUPPORTED = {
    "flash-f64": (lambda: SDPA(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), backend="flash"),
                  r"^forward: backend flash cannot run this call .*dtype f64 is not supported"),
    "flash-f64-backward": (lambda: attncore.attention_backward(
        *(x.astype(np.float64) for x in (q, q, k, v, q, lse)), backend="flash"),
        r"^backward: backend flash cannot run this call .*flash: dtype f64 is not supported"),
    # 2^16 x 2^16 scores exceed BLAS's int sizes (stride-0 views: nothing is allocated).
    "math-size": (lambda: SDPA(np.broadcast_to(np.float32(0), (1, 1, 1 << 16, 8)),
                               np.broadcast_to(np.float32(0), (1, 1, 1 << 16, 8)),
                               np.broadcast_to(np.float32(0), (1, 1, 1 << 16, 8)),
                               backend="math"),
                  r"math: Lq \* Lk does not fit BLAS.s 32-bit sizes \(Lq=65536"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_combinations_raise_not_implemented_error(case):
    call, message = UNSUPPORTED[case]
    with pytest.raises(NotImplementedError, match=message):
        call()


def test_errors_through_autograd_and_torch_tensors():
    t = torch.ones(2, 4, 5, 8, requires_grad=True)
    with pytest.raises(ValueError, match="^forward: key has shape"):
        attncore.torch.scaled_dot_product_attention(t, torch.ones(2, 4, 6, 9), t)


def test_outputs_must_be_writable_through_the_module():
    """The extension module refuses a read-only output buffer (a Python error, no crash)."""
    out = np.zeros((2, 4, 5, 8), np.float32)
    out.flags.writeable = False
    options = _core.CallOptions(scale=None, causal="none", window_left=-1, window_right=-1,
                                softcap=0.0, dropout_p=0.0, seed=0, offset=0, enable_gqa=True,
                                num_threads=0, backend="auto")
    with pytest.raises((BufferError, ValueError)):
        _core.forward(q, k, v, out, None, None, None, options)
    with pytest.raises(ValueError, match="causal is invalid"):
        _core.forward(q, k, v, np.zeros_like(q), None, None, None, _core.CallOptions(
            scale=None, causal="diagonal", window_left=-1, window_right=-1, softcap=0.0,
            dropout_p=0.0, seed=0, offset=0, enable_gqa=True, num_threads=0, backend="auto"))
    with pytest.raises(ValueError, match="too many dimensions"):
        _core.forward(bhld(1, 1, 1, 1, 1), k, v, out, None, None, None, options)


def test_workspace_past_the_machine_is_memory_error():
    # Stride-0 keys make an absurd Lk cheap to build; the workspace check refuses it up front.
    q = np.ones((1, 1, 64, 64), np.float32)
    k = np.broadcast_to(np.full((1, 1, 1, 64), 0.5, np.float32), (1, 1, 2**36, 64))
    for backend in ("flash", "reference"):
        with pytest.raises(MemoryError, match=r"^forward: the \w+ backend's workspace exceeds"):
            attncore.attention(q, k, k, backend=backend)
