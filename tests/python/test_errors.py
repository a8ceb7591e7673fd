"""Every error: invalid arguments raise ValueError, arguments of the wrong Python type TypeError
and unsupported combinations NotImplementedError, all in the library's message form
(`<op>: <what> <problem> (<name>=<value>, expected <constraint>)`); none of them harms the
interpreter."""

import re
import warnings

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


def records(*shape):
    """A numpy array of records (a structured dtype): an array, but not of numbers."""
    return np.zeros(shape, [("a", np.float32), ("b", np.float32)])


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
    "dropout-one-in-f32": (lambda: SDPA(q, k, v, dropout_p=1 - 2 ** -25),
                           r"dropout_p is too close to 1 \(dropout_p=0.99999997"),
    "scale-nan": (lambda: SDPA(q, k, v, scale=float("nan")), r"scale is invalid \(scale=nan"),
    # Any finite scale is taken (<= 0 applied to q), so a bad one is named without "> 0".
    "scale-inf": (lambda: SDPA(q, k, v, scale=-float("inf")),
                  r"^scaled_dot_product_attention: scale is invalid \(scale=-inf, expected a "
                  r"finite value\)$"),
    "flash-scale-nan": (lambda: FLASH(fq, fk, fk, softmax_scale=float("nan")),
                        r"^flash_attn_func: scale is invalid \(scale=nan, expected a finite "
                        r"value\)$"),
    # A negative scale is passed as |scale| with q negated: named as the magnitude it is.
    "scale-negative-past-f32": (lambda: SDPA(q, k, v, scale=-1e300),
                                r"scale is too large for f32 arithmetic \(\|scale\|=1e\+300, "
                                r"expected \|scale\| <= 3\.40282e\+38 with f32 inputs\)$"),
    "value-batch": (lambda: SDPA(q, k, bhld(2, 4, 7, 8)), r"^forward: value has shape"),
    # flash-attn's layout: shapes named as passed, [B, L, H, D]
    "flash-head-dim": (lambda: FLASH(fq, bhld(2, 6, 4, 7), bhld(2, 6, 4, 7)),
                       r"^flash_attn_func: k has shape \[2, 6, 4, 7\], expected \[2, Lk, Hkv, 8\] "
                       r"\(\[B, Lk, Hkv, D\]\) with Hq % Hkv == 0 \(Hq=4, Hkv=4\)$"),
    "flash-heads-not-dividing": (lambda: FLASH(fq, bhld(2, 6, 3, 8), bhld(2, 6, 3, 8)),
                                 r"^flash_attn_func: k has shape \[2, 6, 3, 8\].*\(Hq=4, Hkv=3\)$"),
    "flash-value-length": (lambda: FLASH(fq, fk, bhld(2, 7, 4, 8)),
                           r"^flash_attn_func: v has shape \[2, 7, 4, 8\], expected \[2, 6, 4, "
                           r"Dv\] \(\[B, Lk, Hkv, Dv\] like k\)$"),
    "flash-torch-batch": (lambda: FLASH(torch.ones(2, 5, 4, 8), torch.ones(3, 6, 4, 8),
                                        torch.ones(3, 6, 4, 8)),
                          r"^flash_attn_func: k has shape \[3, 6, 4, 8\], expected \[2, Lk, Hkv, "
                          r"8\]"),
    "kvpacked-head-dim": (lambda: attncore.flash_attn_kvpacked_func(fq, bhld(2, 6, 2, 4, 7)),
                          r"^flash_attn_kvpacked_func: kv has shape \[2, 6, 2, 4, 7\], expected "
                          r"\[2, Lk, 2, Hkv, 8\] \(\[B, Lk, 2, Hkv, D\]\)"),
    "kvcache-head-dim": (lambda: attncore.flash_attn_with_kvcache(
        bhld(2, 1, 4, 7), bhld(2, 16, 2, 8), bhld(2, 16, 2, 8)),
        r"^flash_attn_with_kvcache: k_cache has shape \[2, 16, 2, 8\], expected \[B_cache, "
        r"capacity, Hkv, 7\] \(\[B_cache, capacity, Hkv, D\]\) with Hq % Hkv == 0 "
        r"\(Hq=4, Hkv=2\)$"),
    "kvcache-value-heads": (lambda: attncore.flash_attn_with_kvcache(
        bhld(2, 1, 4, 8), bhld(2, 16, 2, 8), bhld(2, 16, 1, 8)),
        r"^flash_attn_with_kvcache: v_cache has shape \[2, 16, 1, 8\], expected \[2, 16, 2, "
        r"Dv\]"),
    "kvcache-new-heads": (lambda: attncore.flash_attn_with_kvcache(
        bhld(2, 1, 4, 8), bhld(2, 16, 2, 8), bhld(2, 16, 2, 8), k=bhld(2, 1, 1, 8),
        v=bhld(2, 1, 1, 8)),
        r"^flash_attn_with_kvcache: k has shape \[2, 1, 1, 8\], expected \[2, 1, 2, 8\] "
        r"\(\[B, L_new, Hkv, D\] with k_cache's Hkv\)$"),
    "kvcache-new-length": (lambda: attncore.flash_attn_with_kvcache(
        bhld(2, 1, 4, 8), bhld(2, 16, 2, 8), bhld(2, 16, 2, 8), k=bhld(2, 1, 2, 8),
        v=bhld(2, 3, 2, 8)),
        r"^flash_attn_with_kvcache: v has shape \[2, 3, 2, 8\], expected \[2, 1, 2, Dv\] "
        r"\(\[B, L_new, Hkv, Dv\] like k\)$"),
    # flash-attn's options
    "flash-rank": (lambda: FLASH(bhld(5, 4, 8), fk, fk), r"q has the wrong rank \(rank=3"),
    "window-negative": (lambda: FLASH(fq, fk, fk, window_size=(-2, 0)),
                        r"window_left is invalid \(window_left=-2"),
    "window-length": (lambda: FLASH(fq, fk, fk, window_size=(1, 2, 3)),
                      r"^flash_attn_func: window_size is invalid \(window_size=\(1, 2, 3\)"),
    "window-past-int64": (lambda: FLASH(fq, fk, fk, window_size=(2 ** 63, 0)),
                          r"^flash_attn_func: window_left is out of range "
                          r"\(window_left=9223372036854775808, expected window_left < 2\^63"),
    "window-below-int64": (lambda: attncore.attention(q, k, v, window_size=(0, -2 ** 63 - 1)),
                           r"^attention: window_right is out of range"),
    "threads-past-int": (lambda: attncore.attention(q, k, v, num_threads=2 ** 40),
                         r"^attention: num_threads is out of range "
                         r"\(num_threads=1099511627776, expected num_threads < 2\^31"),
    "threads-negative": (lambda: attncore.attention(q, k, v, num_threads=-1),
                         r"^forward: num_threads is negative \(num_threads=-1"),
    "scale-past-float": (lambda: SDPA(q, k, v, scale=10 ** 400),
                         r"^scaled_dot_product_attention: scale is out of range"),
    "max-seqlen-past-int64": (lambda: attncore.flash_attn_varlen_func(
        np.ones((5, 4, 8), np.float32), np.ones((5, 4, 8), np.float32),
        np.ones((5, 4, 8), np.float32), [0, 5], [0, 5], 2 ** 64, 5),
        r"^flash_attn_varlen_func: max_seqlen_q is out of range"),
    "ragged-query": (lambda: attncore.attention([[1.0, 2.0], [3.0]], k, v),
                     r"^attention: query is a ragged sequence \(type=list"),
    "bf16-key-for-numpy-query": (lambda: SDPA(q, torch.ones(2, 4, 6, 8, dtype=torch.bfloat16), v),
                                 r"^scaled_dot_product_attention: key has a dtype numpy lacks "
                                 r"\(dtype=bfloat16"),
    "uint16-key-for-torch-query": (lambda: SDPA(torch.ones(2, 4, 5, 8), k.astype(np.uint16), v),
                                   r"^scaled_dot_product_attention: key has an unsupported "
                                   r"element type \(dtype=<u2"),
    "softcap": (lambda: attncore.attention(q, k, v, softcap=-1.0), r"softcap is invalid"),
    "softcap-nan": (lambda: FLASH(fq, fk, fk, softcap=float("nan")), r"softcap is invalid"),
    "alibi-shape": (lambda: FLASH(fq, fk, fk, alibi_slopes=bhld(3)),
                    r"alibi_slopes has shape \[3\], expected \[4\] or \[2, 4\]"),
    "alibi-dtype": (lambda: FLASH(fq, fk, fk, alibi_slopes=bhld(4, dtype=np.float64)),
                    r"alibi_slopes has the wrong dtype \(dtype=f64, expected f32"),
    # A listed slope past float32's range, named as given (not as its cast, inf).
    "alibi-list-past-f32": (lambda: FLASH(fq, fk, fk, alibi_slopes=[1.0, 1e300, 1.0, 1.0]),
                            r"alibi_slopes holds a slope past float32's range "
                            r"\(alibi_slopes\[1\]=1e\+300, expected \|slope\| <= 3.4028235e\+38\)"),
    # attncore's own API
    "causal-name": (lambda: attncore.attention(q, k, v, causal="diagonal"), r"causal is invalid"),
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
    "rng-state-length": (lambda: attncore.set_rng_state((1, 2, 3)),
                         r"^set_rng_state: state is invalid \(state=\(1, 2, 3\), expected "
                         r"\(seed, offset\)"),
}

# `<op>: <what> ...`: every message names the call first.
FORM = re.compile(r"^[a-z_]+: [a-zA-Z_]+ .*\(")


@pytest.mark.parametrize("case", INVALID)
def test_invalid_arguments_raise_value_error(case):
    call, message = INVALID[case]
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert type(error.value) is ValueError and FORM.match(str(error.value)), str(error.value)


def test_slopes_past_float32_are_refused_without_a_warning():
    """numpy's cast of 1e300 to float32 warns of an overflow and gives inf; the slope is
    checked first, and named as given."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"\(alibi_slopes\[0\]\[1\]=-1e\+39, expected"):
            FLASH(fq, fk, fk, alibi_slopes=[[1.0, -1e39, 1.0, 1.0]])


def _enter(context):
    """Enters and leaves a context manager (where entering it raises, nothing changes)."""
    with context:
        pass


WRONG_TYPE = {
    "causal-bool": (lambda: attncore.attention(q, k, v, causal=True),
                    r"^attention: causal is not a string \(type=bool, expected None, "
                    r"'upper-left' or 'lower-right'\)"),
    "layout-none": (lambda: attncore.attention(q, k, v, layout=None),
                    r"^attention: layout is not a string \(type=NoneType"),
    "window-scalar": (lambda: FLASH(fq, fk, fk, window_size=3),
                      r"^flash_attn_func: window_size is not a pair \(type=int"),
    "window-bytearray": (lambda: FLASH(fq, fk, fk, window_size=bytearray(b"\x01\x01")),
                         r"^flash_attn_func: window_size is not a pair \(type=bytearray"),
    "window-floats": (lambda: FLASH(fq, fk, fk, window_size=(1.5, 2.7)),
                      r"^flash_attn_func: window_left is not an integer \(type=float"),
    "window-float-right": (lambda: attncore.attention(q, k, v, window_size=(1, 2.0)),
                           r"^attention: window_right is not an integer \(type=float"),
    "window-strings": (lambda: attncore.attention(q, k, v, window_size=("1", "2")),
                       r"^attention: window_left is not an integer \(type=str"),
    "threads-float": (lambda: attncore.attention(q, k, v, num_threads=1.5),
                      r"^attention: num_threads is not an integer \(type=float"),
    "threads-string": (lambda: attncore.attention(q, k, v, num_threads="2"),
                       r"^attention: num_threads is not an integer \(type=str"),
    "scale-string": (lambda: SDPA(q, k, v, scale="0.5"),
                     r"^scaled_dot_product_attention: scale is not a real number \(type=str"),
    "scale-complex": (lambda: SDPA(q, k, v, scale=1j), r"scale is not a real number"),
    "dropout-string": (lambda: SDPA(q, k, v, dropout_p="0.1"),
                       r"^scaled_dot_product_attention: dropout_p is not a real number"),
    "dropout-list": (lambda: SDPA(q, k, v, dropout_p=[0.1]), r"dropout_p is not a real number"),
    "softcap-string": (lambda: FLASH(fq, fk, fk, softcap="1"),
                       r"^flash_attn_func: softcap is not a real number \(type=str"),
    "softcap-bool": (lambda: FLASH(fq, fk, fk, softcap=True),
                     r"^flash_attn_func: softcap is not a real number \(type=bool"),
    "scale-numpy-bool": (lambda: SDPA(q, k, v, scale=np.True_),
                         r"^scaled_dot_product_attention: scale is not a real number \(type=bool"),
    "softcap-bool-tensor": (lambda: FLASH(fq, fk, fk, softcap=torch.tensor(True)),
                            r"^flash_attn_func: softcap is not a real number \(type=Tensor"),
    "enable-gqa-string": (lambda: SDPA(q, k, v, enable_gqa="no"),
                          r"^scaled_dot_product_attention: enable_gqa is not a bool"),
    "enable-gqa-none": (lambda: SDPA(q, k, v, enable_gqa=None),
                        r"^scaled_dot_product_attention: enable_gqa is not a bool"),
    "enable-gqa-zero": (lambda: SDPA(q, k, v, enable_gqa=0),
                        r"^scaled_dot_product_attention: enable_gqa is not a bool"),
    "seed-string": (lambda: attncore.attention(q, k, v, dropout_p=0.1, seed="1"),
                    r"^attention: seed is not an integer \(type=str"),
    "backend-int": (lambda: SDPA(q, k, v, backend=3),
                    r"^scaled_dot_product_attention: backend is not a backend name \(type=int"),
    "query-object": (lambda: SDPA(object(), k, v),
                     r"^scaled_dot_product_attention: query is not an array \(type=object"),
    "query-none": (lambda: FLASH(None, fk, fk), r"^flash_attn_func: q is not an array"),
    "key-string": (lambda: attncore.attention(q, "abc", v),
                   r"^attention: key is not an array \(type=str"),
    "mask-string": (lambda: SDPA(q, k, v, attn_mask="abc"),
                    r"^scaled_dot_product_attention: attn_mask is not an array"),
    "alibi-string": (lambda: FLASH(fq, fk, fk, alibi_slopes="abc"),
                     r"^flash_attn_func: alibi_slopes is not an array"),
    "lse-object": (lambda: attncore.attention_backward(q, q, k, v, q, object()),
                   r"^attention_backward: softmax_lse is not an array"),
    "masked-array": (lambda: SDPA(np.ma.masked_array(q), k, v),
                     r"^scaled_dot_product_attention: query is a masked array"),
    "cu-seqlens-object": (lambda: attncore.flash_attn_varlen_func(
        np.ones((5, 4, 8), np.float32), np.ones((5, 4, 8), np.float32),
        np.ones((5, 4, 8), np.float32), object(), [0, 5], 5, 5),
        r"^flash_attn_varlen_func: cu_seqlens_q is not an array \(type=object"),
    "max-seqlen-float": (lambda: attncore.flash_attn_varlen_func(
        np.ones((5, 4, 8), np.float32), np.ones((5, 4, 8), np.float32),
        np.ones((5, 4, 8), np.float32), [0, 5], [0, 5], 5.0, 5),
        r"^flash_attn_varlen_func: max_seqlen_q is not an integer \(type=float"),
    "manual-seed-string": (lambda: attncore.manual_seed("1"),
                           r"^manual_seed: seed is not an integer \(type=str"),
    "rng-state-int": (lambda: attncore.set_rng_state(5),
                      r"^set_rng_state: state is not a pair \(type=int"),
    # numpy arrays whose elements are no numbers: named with their dtype, not numpy's error
    "query-structured": (lambda: SDPA(records(2, 4, 5, 8), k, v),
                         r"^scaled_dot_product_attention: query is not an array of numbers "
                         r"\(dtype=\[\('a', '<f4'\), \('b', '<f4'\)\], expected a numeric "
                         r"dtype\); pass one field, such as query\['a'\]"),
    "key-object": (lambda: SDPA(q, k.astype(object), v),
                   r"^scaled_dot_product_attention: key is not an array of numbers "
                   r"\(dtype=object, expected a numeric dtype\); convert it with key.astype"),
    "query-datetime": (lambda: SDPA(q.astype("datetime64[s]"), k, v),
                       r"^scaled_dot_product_attention: query is not an array of numbers "
                       r"\(dtype=datetime64\[s\]"),
    "flash-value-structured": (lambda: FLASH(fq, fk, records(2, 6, 4, 8)),
                               r"^flash_attn_func: v is not an array of numbers"),
    "flash-query-strings": (lambda: FLASH(fq.astype(str), fk, fk),
                            r"^flash_attn_func: q is not an array of numbers \(dtype=<U32"),
    "kvcache-query-structured": (lambda: attncore.flash_attn_with_kvcache(
        records(2, 1, 4, 8), fk, fk), r"^flash_attn_with_kvcache: q is not an array of numbers"),
    "kvcache-cache-object": (lambda: attncore.flash_attn_with_kvcache(
        fq, fk.astype(object), fk), r"^flash_attn_with_kvcache: k_cache is not an array of "
                                    r"numbers \(dtype=object"),
    # flags: a string such as 'no' would read as True
    "is-causal-string": (lambda: SDPA(q, k, v, is_causal="no"),
                         r"^scaled_dot_product_attention: is_causal is not a bool \(type=str"),
    "is-causal-int-with-mask": (lambda: SDPA(q, k, v, attn_mask=np.ones((5, 6), bool),
                                             is_causal=0),
                                r"^scaled_dot_product_attention: is_causal is not a bool "
                                r"\(type=int"),
    "flash-causal-string": (lambda: FLASH(fq, fk, fk, causal="false"),
                            r"^flash_attn_func: causal is not a bool \(type=str"),
    "flash-deterministic-string": (lambda: FLASH(fq, fk, fk, deterministic="yes"),
                                   r"^flash_attn_func: deterministic is not a bool"),
    "flash-probs-int": (lambda: FLASH(fq, fk, fk, return_attn_probs=1),
                        r"^flash_attn_func: return_attn_probs is not a bool \(type=int"),
    "qkvpacked-causal-none": (lambda: attncore.flash_attn_qkvpacked_func(
        np.ones((2, 4, 3, 2, 8), np.float32), causal=None),
        r"^flash_attn_qkvpacked_func: causal is not a bool \(type=NoneType"),
    "varlen-causal-string": (lambda: attncore.flash_attn_varlen_func(
        np.ones((5, 4, 8), np.float32), np.ones((5, 4, 8), np.float32),
        np.ones((5, 4, 8), np.float32), [0, 5], [0, 5], 5, 5, causal="no"),
        r"^flash_attn_varlen_func: causal is not a bool"),
    "kvcache-causal-string": (lambda: attncore.flash_attn_with_kvcache(fq, fk, fk, causal="no"),
                              r"^flash_attn_with_kvcache: causal is not a bool \(type=str"),
    "kvcache-interleaved-string": (lambda: attncore.flash_attn_with_kvcache(
        fq, fk, fk, rotary_interleaved="no"),
        r"^flash_attn_with_kvcache: rotary_interleaved is not a bool"),
    "kvcache-lse-string": (lambda: attncore.flash_attn_with_kvcache(
        fq, fk, fk, return_softmax_lse="no"),
        r"^flash_attn_with_kvcache: return_softmax_lse is not a bool"),
    "attention-return-lse-string": (lambda: attncore.attention(q, k, v, return_lse="no"),
                                    r"^attention: return_lse is not a bool \(type=str"),
    "explain-backward-string": (lambda: attncore.explain(q, k, v, backward="yes"),
                                r"^explain: backward is not a bool \(type=str"),
    "sdpa-kernel-priority-string": (lambda: _enter(attncore.sdpa_kernel("math",
                                                                        set_priority="yes")),
                                    r"^sdpa_kernel: set_priority is not a bool \(type=str"),
    # pairs: a dict or a set would give its keys, a string its characters
    "rng-state-dict": (lambda: attncore.set_rng_state({1: 2, 3: 4}),
                       r"^set_rng_state: state is not a pair \(type=dict"),
    "rng-state-set": (lambda: attncore.set_rng_state({1, 2}),
                      r"^set_rng_state: state is not a pair \(type=set"),
    "window-dict": (lambda: attncore.attention(q, k, v, window_size={-1: 0, 0: 1}),
                    r"^attention: window_size is not a pair \(type=dict"),
    # a seed is checked whenever given, with dropout or without
    "seed-string-without-dropout": (lambda: attncore.attention(q, k, v, seed="x"),
                                    r"^attention: seed is not an integer \(type=str"),
    "offset-string-without-dropout": (lambda: attncore.attention_varlen(
        q[0].swapaxes(0, 1), k[0].swapaxes(0, 1), v[0].swapaxes(0, 1), [0, 5], [0, 6], 5, 6,
        offset="x"), r"^attention_varlen: offset is not an integer \(type=str"),
}


@pytest.mark.parametrize("case", WRONG_TYPE)
def test_arguments_of_the_wrong_type_raise_type_error(case):
    call, message = WRONG_TYPE[case]
    with pytest.raises(TypeError, match=message) as error:
        call()
    assert type(error.value) is TypeError and FORM.match(str(error.value)), str(error.value)


def test_numpy_bools_are_flags():
    """Flags take numpy's bools as Python's (the results of comparisons often are)."""
    np.testing.assert_array_equal(FLASH(fq, fk, fk, causal=np.True_), FLASH(fq, fk, fk, causal=True))
    np.testing.assert_array_equal(SDPA(q, k, v, is_causal=np.bool_(True)),
                                  SDPA(q, k, v, is_causal=True))
    out, lse = attncore.flash_attn_with_kvcache(fq, fk, fk, causal=np.False_,
                                                return_softmax_lse=np.True_)
    np.testing.assert_array_equal(out, attncore.flash_attn_with_kvcache(fq, fk, fk))


def test_gradients_a_numpy_query_would_drop_are_refused():
    """A torch key, value or mask that requires grad, with a query that is no torch tensor: the
    call would return a numpy array and drop their gradients, so it is refused."""
    grad = torch.ones(2, 4, 6, 8, requires_grad=True)
    with pytest.raises(TypeError, match=r"^attention: key requires grad but the query is no "
                                        r"torch tensor \(key.requires_grad=True"):
        attncore.attention(q, grad, v)
    with pytest.raises(TypeError, match=r"^scaled_dot_product_attention: value requires grad"):
        SDPA(q, k, grad)
    with pytest.raises(TypeError, match=r"attn_mask requires grad"):
        SDPA(q, k, v, attn_mask=torch.zeros(5, 6, requires_grad=True))
    with pytest.raises(TypeError, match=r"^flash_attn_kvpacked_func: kv requires grad"):
        attncore.flash_attn_kvpacked_func(fq, torch.ones(2, 6, 2, 4, 8, requires_grad=True))
    # Without grad mode, or with a torch query, nothing is lost.
    with torch.no_grad():
        assert isinstance(attncore.attention(q, grad, v), np.ndarray)
    out = attncore.attention(torch.from_numpy(q), grad, v)
    out.sum().backward()
    assert grad.grad is not None and out.dtype == torch.float32


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


class OtherDevice:
    """A DLPack producer whose memory is on a CUDA device."""

    def __dlpack__(self, stream=None):
        raise AssertionError("a device array is never exported")

    def __dlpack_device__(self):
        return (2, 0)


META = torch.empty(2, 4, 5, 8, device="meta")
UNSUPPORTED.update({
    "meta-query": (lambda: attncore.attention(META, META, META),
                   r"^attention: query is not in CPU memory \(device=meta, expected cpu\)"),
    "meta-key-numpy-query": (lambda: attncore.attention(q, META, META),
                             r"^attention: key is not in CPU memory \(device=meta"),
    "meta-sdpa-autograd": (lambda: attncore.torch.scaled_dot_product_attention(
        torch.ones(2, 4, 5, 8, requires_grad=True), META, META),
        r"^scaled_dot_product_attention: key is not in CPU memory"),
    "meta-mask": (lambda: SDPA(torch.ones(2, 4, 5, 8), torch.ones(2, 4, 6, 8),
                               torch.ones(2, 4, 6, 8), attn_mask=torch.zeros(5, 6, device="meta")),
                  r"^scaled_dot_product_attention: attn_mask is not in CPU memory"),
    "meta-flash": (lambda: FLASH(META, META, META), r"^flash_attn_func: q is not in CPU memory"),
    "meta-qkvpacked": (lambda: attncore.flash_attn_qkvpacked_func(
        torch.empty(2, 5, 3, 4, 8, device="meta")),
        r"^flash_attn_qkvpacked_func: qkv is not in CPU memory"),
    "meta-varlen": (lambda: attncore.flash_attn_varlen_func(
        META[0], META[0], META[0], [0, 5], [0, 5], 5, 5),
        r"^flash_attn_varlen_func: q is not in CPU memory"),
    "meta-cu-seqlens": (lambda: attncore.flash_attn_varlen_func(
        torch.ones(5, 4, 8), torch.ones(5, 4, 8), torch.ones(5, 4, 8),
        torch.tensor([0, 5], dtype=torch.int32, device="meta"), [0, 5], 5, 5),
        r"^flash_attn_varlen_func: cu_seqlens_q is not in CPU memory"),
    "meta-backward": (lambda: attncore.attention_backward(META, META, META, META, META,
                                                          torch.empty(2, 4, 5, device="meta")),
                      r"^attention_backward: query is not in CPU memory"),
    "meta-explain": (lambda: attncore.explain(META, META, META),
                     r"^explain: query is not in CPU memory"),
    "sparse": (lambda: SDPA(torch.ones(2, 4, 5, 8).to_sparse(), torch.ones(2, 4, 6, 8),
                            torch.ones(2, 4, 6, 8)),
               r"^scaled_dot_product_attention: query has an unsupported layout "
               r"\(layout=torch.sparse_coo, expected torch.strided\)"),
    "other-device": (lambda: SDPA(OtherDevice(), k, v),
                     r"^scaled_dot_product_attention: query is not in CPU memory "
                     r"\(dlpack device_type=2"),
    "other-device-key": (lambda: SDPA(q, OtherDevice(), v),
                         r"^scaled_dot_product_attention: key is not in CPU memory"),
    "scale-requires-grad": (lambda: SDPA(q, k, v, scale=torch.tensor(0.5, requires_grad=True)),
                            r"^scaled_dot_product_attention: scale requires grad "
                            r"\(requires_grad=True, expected a number"),
})


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_combinations_raise_not_implemented_error(case):
    call, message = UNSUPPORTED[case]
    with pytest.raises(NotImplementedError, match=message) as error:
        call()
    assert FORM.match(str(error.value)), str(error.value)


def test_extension_module_errors_name_the_call():
    """Arrays the extension module itself refuses: the message starts with the library's name
    of the call, like the library's own."""
    with pytest.raises(ValueError, match=r"^forward: query has an unsupported element type "
                                         r"\(format='l', itemsize=8, expected float32, float64 or "
                                         r"float16 for values, bool for masks, int32 for "
                                         r"indices\)$"):
        SDPA(q.astype(np.int64), k, v)
    with pytest.raises(ValueError, match=r"^forward: query has an unsupported element type "
                                         r"\(format='>f'"):
        SDPA(q.astype(">f4"), k, v)
    # A KV-cache call's arrays likewise (they were named "forward_kvcache: ..."), the cache's,
    # a new key's and an index array's alike.
    fq, cache = np.ones((1, 1, 1, 8), np.float32), np.zeros((1, 8, 1, 8), np.float32)
    new = np.ones((1, 1, 1, 8), np.float32)
    for name, kwargs in (("k_cache", {"k_cache": cache.astype(">f4")}),
                         ("k", {"k": new.astype(">f4"), "v": new}),
                         ("cache_seqlens", {"cache_seqlens": np.array([1], ">i4")})):
        call = {"q": fq, "k_cache": cache, "v_cache": cache, "cache_seqlens": 1, **kwargs}
        with pytest.raises(ValueError, match=rf"^forward: {name} has an unsupported element "
                                             r"type \(format='>"):
            attncore.flash_attn_with_kvcache(**call)
    with pytest.raises(ValueError, match=r"^forward: query has an unsupported element type "
                                         r"\(dlpack code=5, bits=64, lanes=1, expected float32, "
                                         r"float64, float16 or bfloat16 for values, bool for "
                                         r"masks, int32 for indices\)$"):
        SDPA(torch.ones(2, 4, 5, 8, dtype=torch.complex64), k, v)
    options = _core.CallOptions(scale=None, causal="none", window_left=-1, window_right=-1,
                                softcap=0.0, dropout_p=0.0, seed=0, offset=0, enable_gqa=True,
                                num_threads=0, backend="auto")
    out = np.zeros((2, 4, 5, 8), np.float32)
    with pytest.raises(NotImplementedError, match=r"^forward: query is not in CPU memory "
                                                  r"\(dlpack device_type=2"):
        _core.forward(OtherDevice(), k, v, out, None, None, None, options)
    with pytest.raises(ValueError, match=r"^forward: key cannot be read through DLPack "
                                         r"\(type=Tensor, error='.*meta"):
        _core.forward(q, META, v, out, None, None, None, options)
    with pytest.raises(TypeError, match=r"^backward: dout is not an array \(type=object"):
        _core.backward(object(), q, k, v, out, lse, q, k, v, None, None, None, options)


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


def test_copies_of_negative_strides_past_the_machine_are_refused(monkeypatch):
    # A reversed broadcast view stands for 2^46 bytes: copied as its 64 distinct elements (its
    # broadcast dims kept broadcast), so the call is refused for its outputs, not for a copy.
    # A copy past the memory this process may use is refused before it is made.
    row = np.ones((1, 1, 1, 64), np.float32)
    huge = np.broadcast_to(row, (2**24, 2**12, 4, 64))[..., ::-1]
    with pytest.raises(MemoryError, match=r"^forward: the outputs exceed the memory this "
                                          r"process may use"):
        attncore.attention(huge, row, row)
    reversed_q = np.ones((1, 4, 64, 64), np.float32)[..., ::-1]
    monkeypatch.setattr(attncore._core, "memory_limit", lambda: (4096.0, "a test's limit"))
    with pytest.raises(MemoryError, match=r"^attention: query needs a contiguous copy larger "
                                          r"than the memory this process may use \(shape="
                                          r"\[1, 4, 64, 64\], copy=6.554e\+04 bytes, "
                                          r".*; pass it with non-negative strides"):
        attncore.attention(reversed_q, row, row)


def test_outputs_past_the_machine_are_refused_before_allocation():
    # Broadcast (stride 0) inputs make outputs of 2^40 elements and more cheap to ask for: the
    # package refuses them with attncore's MemoryError before allocating anything.
    row = np.ones((1, 1, 1, 64), np.float32)
    huge_q = np.broadcast_to(row, (1, 4, 2**32, 64))
    k = np.ones((1, 4, 4, 64), np.float32)
    pattern = r"^{}: the outputs exceed the memory this process may use \(outputs=[0-9.e+]+ bytes"
    with pytest.raises(MemoryError, match=pattern.format("forward")):
        attncore.attention(huge_q, k, k)
    cache = np.ones((1, 8, 1, 64), np.float32)
    with pytest.raises(MemoryError, match=pattern.format("flash_attn_with_kvcache")):
        attncore.flash_attn_with_kvcache(np.broadcast_to(row, (1, 2**32, 4, 64)), cache, cache,
                                         cache_seqlens=3)
    out = np.broadcast_to(row, (2**20, 2**20, 1, 64))
    lse = np.broadcast_to(np.zeros((1, 1, 1), np.float32), (2**20, 2**20, 1))
    with pytest.raises(MemoryError, match=pattern.format("merge_attention_states")):
        attncore.merge_attention_states(out, lse, out, lse)
    q = np.broadcast_to(np.ones((1, 1, 64), np.float32), (2**30, 2**10, 64))
    kv = np.ones((4, 2**10, 64), np.float32)
    cu_q = np.array([0, 2**30], np.int32)
    cu_k = np.array([0, 4], np.int32)
    with pytest.raises(MemoryError, match=pattern.format("forward")):
        attncore.attention_varlen(q, kv, kv, cu_q, cu_k, 2**30, 4)


def test_integers_of_thousands_of_digits_are_named_short():
    # An int past what Python prints (4300 digits) raised Python's own ValueError from inside
    # the message, and one just below it made a message of thousands of digits: such values are
    # shown as their leading digits and power of ten, in attncore's message.
    huge = 10**5000
    q = np.zeros((1, 1, 1, 8), np.float32)
    k = np.zeros((1, 4, 1, 8), np.float32)
    cases = [
        (lambda: attncore.flash_attn_with_kvcache(q, k, k, cache_seqlens=huge),
         "flash_attn_with_kvcache: cache_seqlens is out of range (cache_seqlens=1e+5000, "),
        (lambda: attncore.flash_attn_with_kvcache(q, k, k, cache_seqlens=[-3 * huge]),
         "flash_attn_with_kvcache: cache_seqlens holds values past int32 (min=-3e+5000, "),
        (lambda: attncore.flash_attn_func(q, k, k, softmax_scale=huge),
         "flash_attn_func: scale is out of range (scale=1e+5000, expected a finite float)"),
        (lambda: attncore.attention(q, q, q, dropout_p=0.5, seed=huge // 7),
         "attention: seed is invalid (seed=1.43e+4999, "),
        (lambda: attncore.PagedKVCache(4, 4, 1, 8, -(10**4000)),
         "PagedKVCache: max_batch_size is out of range (max_batch_size=-1e+4000, "),
    ]
    for call, start in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value).startswith(start) and len(str(info.value)) < 200, info.value
    # Numpy's integers in full as Python's are (not as their repr); a mantissa that rounds up
    # moves to the next power.
    from attncore._arrays import number_text
    assert number_text(np.int64(3_000_000_000)) == "3000000000"
    assert number_text(10**20) == "1e+20" and number_text(-(10**25)) == "-1e+25"
    assert number_text(99999 * 10**20) == "1e+25" and number_text(2.5) == "2.5"


def test_a_scale_that_requires_grad_is_taken_under_no_grad():
    """As the package's other refusals of grad: only under grad mode (no gradient is asked for
    under torch.no_grad())."""
    q = torch.randn(1, 2, 3, 8)
    scale = torch.tensor(0.5, requires_grad=True)
    with torch.no_grad():
        out = attncore.torch.scaled_dot_product_attention(q, q, q, scale=scale)
    assert torch.equal(out, attncore.torch.scaled_dot_product_attention(q, q, q, scale=0.5))
