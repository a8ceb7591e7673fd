"""The rank-4 calls into attncore._core: Call (one call's options, everything but its arrays)
and forward4/backward4 on views q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; the
same as a DenseKernel for calls on views of packed tensors.

Below both _attention (which brings the caller's arrays to these views) and _autograd (whose
AttentionFunction runs them for torch tensors).
"""

import collections.abc
import dataclasses
import math
import numbers
import operator
from typing import Optional

import numpy as np

from . import _arrays, _copies, _core

INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1


def real_option(op, name, value):
    """A float option (scale, softcap, dropout_p) as a float: TypeError for anything but a real
    number (bools too, and arrays of bool, as integer options refuse them), ValueError past
    the float range, NotImplementedError for a tensor that requires grad under grad mode (no
    gradient reaches it). Its range is the library's to check."""
    torch = _arrays._torch()
    if (getattr(value, "requires_grad", False) and torch is not None
            and torch.is_grad_enabled()):
        raise NotImplementedError(f"{op}: {name} requires grad (requires_grad=True, expected a "
                                  "number: no gradient flows to it); pass a float")
    real = (hasattr(type(value), "__float__") and not isinstance(value, (str, bool, np.bool_))
            and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool")
            and (isinstance(value, numbers.Real) or not isinstance(value, numbers.Complex)))
    if real:
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{op}: {name} is out of range "
                             f"({name}={_arrays.number_text(value)}, expected a finite float)"
                             ) from None
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{op}: {name} is not a real number (type={type(value).__name__}, "
                    "expected a float)")


def scale_option(op, value):
    """The caller's softmax scale (None: the library's 1 / sqrt(D)) as a float: any finite value
    (a scale <= 0 is applied to q: Call.q_factor), ValueError otherwise, named for this API
    (the library itself takes a scale > 0)."""
    if value is None:
        return None
    scale = real_option(op, "scale", value)
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale is invalid (scale={scale}, expected a finite value)")
    return scale


def int_option(op, name, value, low=-INT64_MAX - 1, high=INT64_MAX, meaning=""):
    """An integer option as an int in [low, high]: TypeError for anything but an integer (bool
    and float included), ValueError outside the range. The default range is what the library's
    int64 options hold; the library checks their values (`meaning` ends the message)."""
    try:
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise TypeError(f"{op}: {name} is not an integer (type={type(value).__name__}, "
                        "expected int)")
    if number > high:
        bound = {INT32_MAX: "2^31", INT64_MAX: "2^63"}.get(high, str(high + 1))
        raise ValueError(f"{op}: {name} is out of range ({name}={_arrays.number_text(number)}, "
                         f"expected {name} < {bound}{meaning})")
    if number < low:
        bound = {-INT32_MAX - 1: "-2^31", -INT64_MAX - 1: "-2^63"}.get(low, str(low))
        raise ValueError(f"{op}: {name} is out of range ({name}={_arrays.number_text(number)}, "
                         f"expected {name} >= {bound}{meaning})")
    return number


def bool_option(op, name, value):
    """A flag as a bool: TypeError for anything but a bool (Python's or numpy's)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{op}: {name} is not a bool (type={type(value).__name__}, expected True "
                    "or False)")


def check_sdpa_mask(op, is_causal, mask_dtype, query_dtype):
    """torch's scaled_dot_product_attention's rules for a given attn_mask (dtypes by name): not
    with is_causal, and bool, float32 or the query's dtype. ValueError in attncore's form."""
    if is_causal:
        raise ValueError(f"{op}: attn_mask is set with is_causal=True (expected at most one of "
                         "them)")
    if mask_dtype not in ("bool", "float32", query_dtype):
        raise ValueError(f"{op}: attn_mask has the wrong dtype (dtype={mask_dtype}, expected "
                         f"bool, float32 or query's {query_dtype})")


def sdpa_enable_gqa(op, key, value, enable_gqa):
    """torch's scaled_dot_product_attention's heads rule as attention()'s enable_gqa: key and
    value with one head (or no head dim) serve every query head, as torch's broadcasting does,
    whatever enable_gqa says."""
    enable_gqa = bool_option(op, "enable_gqa", enable_gqa)  # (a falsy None or 0 ran as False)
    return enable_gqa or _kv_heads(op, key, value) == {1}


def sdpa_kv_heads(op, query, key, value, enable_gqa, check):
    """torch's scaled_dot_product_attention with enable_gqa takes key and value of different head
    counts that each divide the query's (its math path repeats both to the query's heads): here
    each is repeated head by head to their least common multiple, which the query's heads
    divide, so every query head meets the key and value heads it meets in torch; only what has
    fewer heads than that multiple is copied (as its distinct elements: _copies.repeat_heads).
    Heads that do not divide the query's: ValueError. Before any copy, check(key, value) runs
    the call's checks on stand-ins of the repeated ones (no memory of their size): a call
    refused for any reason copies nothing. Else (key, value), whose shapes the library
    checks."""
    if enable_gqa is not True:
        return key, value
    shapes = [_arrays.shape_of(x, op, name) for x, name in ((query, "query"), (key, "key"),
                                                            (value, "value"))]
    if any(len(s) < 3 for s in shapes):
        return key, value
    heads_q, heads_k, heads_v = (s[-3] for s in shapes)
    if heads_k == heads_v or 0 in (heads_k, heads_v):
        return key, value
    if heads_q % heads_k or heads_q % heads_v:
        raise ValueError(f"{op}: key and value have head counts that do not divide the query's "
                         f"(Hq={heads_q}, Hk={heads_k}, Hv={heads_v}, expected Hq % Hk == 0 and "
                         "Hq % Hv == 0 with enable_gqa)")
    common = math.lcm(heads_k, heads_v)
    kv = [(_arrays.adopt(x, op, name), name, heads)
          for x, name, heads in ((key, "key", heads_k), (value, "value", heads_v))]
    check(*(lib.standin(x, tuple(x.shape[:-3]) + (common,) + tuple(x.shape[-2:]))
            if heads != common else x for (lib, x, _), _, heads in kv))
    return tuple(_copies.repeat_heads(lib, x, common // heads, op, name,
                                      "pass key and value with one head count")
                 if heads != common else x for (lib, x, _), name, heads in kv)


def _heads(shape):
    """The heads of an SDPA operand's shape [..., H, L, E]: 1 without a head dim."""
    return shape[-3] if len(shape) >= 3 else 1


def _kv_heads(op, key, value):
    """The set of key's and value's head counts."""
    return {_heads(_arrays.shape_of(x, op, name)) for x, name in ((key, "key"), (value, "value"))}


def sdpa_query_heads(op, query, key, value, enable_gqa):
    """torch's scaled_dot_product_attention's broadcasting of the query's heads: without
    enable_gqa, a query of one head (or of no head dim) against key and value of H > 1 heads
    attends as H heads, a view of it (torch's math path broadcasts its product). Else query."""
    if enable_gqa is not False:
        return query
    heads, q_shape = _kv_heads(op, key, value), _arrays.shape_of(query, op, "query")
    if len(heads) != 1 or heads == {1} or _heads(q_shape) != 1 or len(q_shape) < 2:
        return query
    lib, query, _ = _arrays.adopt(query, op, "query")
    shape = tuple(query.shape)
    if len(shape) == 2:  # [L, E] as [1, L, E]
        query = lib.reshape(query, (1,) + shape)
        shape = (1,) + shape
    return lib.broadcast_to(query, shape[:-3] + (heads.pop(),) + shape[-2:])


def pair(op, name, value, expected):
    """value's two items as a tuple: TypeError for what is no sequence (a number; a string,
    bytes, a dict or a set, whose characters, bytes, keys or order would be taken), ValueError
    for a sequence of another length. expected: how the message describes a pair, such as
    "(left, right)"."""
    items = None
    if not isinstance(value, (str, bytes, bytearray, memoryview, collections.abc.Mapping,
                              collections.abc.Set)):
        try:
            items = tuple(value)
        except TypeError:
            pass
    if items is None:
        raise TypeError(f"{op}: {name} is not a pair (type={type(value).__name__}, expected "
                        f"{expected})")
    if len(items) != 2:
        raise ValueError(f"{op}: {name} is invalid ({name}={value!r}, expected {expected})")
    return items


def check_blhd(op, query, keys, values, layout, same_batch=True):
    """Shapes in flash-attn's layout, named as the caller passed them (the library is handed
    [B, H, L, D] views, whose shapes it would name): query (name, shape [B, Lq, Hq, D]),
    keys (name, shape) laid out as `layout` ("[B, Lk, Hkv, D]", "[B_cache, capacity, Hkv, D]",
    "[B, Lk, 2, Hkv, D]", ...: Hkv next to last) with Hkv dividing Hq, the query's D and, with
    same_batch, its B; values (name, shape) like keys but for the last dim (None: packed with
    the keys). Ranks are checked before. ValueError in attncore's form."""
    (_, (batch, _, heads_q, dim)), (k_name, ks) = query, keys
    heads = ks[-2]
    if (same_batch and ks[0] != batch) or ks[-1] != dim or heads == 0 or heads_q % heads:
        fields = layout.strip("[]").split(", ")
        want = [str(batch) if same_batch else fields[0], *fields[1:-1], str(dim)]
        raise ValueError(f"{op}: {k_name} has shape {list(ks)}, expected [{', '.join(want)}] "
                         f"({layout}) with Hq % Hkv == 0 (Hq={heads_q}, Hkv={heads})")
    if values is not None and tuple(values[1][:-1]) != tuple(ks[:-1]):
        v_name, vs = values
        want = ", ".join(str(n) for n in ks[:-1])
        raise ValueError(f"{op}: {v_name} has shape {list(vs)}, expected [{want}, Dv] "
                         f"({layout[:-2]}Dv] like {k_name})")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's options, everything but its arrays: what a backward replays."""

    scale: Optional[float] = None  # the caller's; <= 0 is applied to q (see q_factor)
    causal: str = "none"  # "none", "upper-left" (torch is_causal), "lower-right" (flash-attn)
    window_size: tuple = (-1, -1)  # (left, right), flash-attn semantics; -1 = unbounded
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    enable_gqa: bool = True
    backend: str = "auto"
    num_threads: int = 0
    num_splits: int = 0  # flash's split-KV decode: 0 = planned, 1 = none, > 1 forced

    @property
    def q_factor(self):
        """1, -1 or 0: what q is multiplied by so that the library's scale is positive (the
        library takes scale > 0; torch and flash-attn take any scale)."""
        if self.scale is None or not self.scale <= 0 or math.isinf(self.scale):
            return 1
        return 0 if self.scale == 0 else -1

    def checked_options(self):
        """core_options for the library's checks of the call before its seed is drawn (a seed
        of None: every seed is checked alike)."""
        return dataclasses.replace(self, seed=self.seed or 0, offset=self.offset or 0
                                   ).core_options()

    def core_options(self):
        scale = self.scale
        if scale is not None and self.q_factor != 1:
            scale = 1.0 if self.q_factor == 0 else -scale
        window_left, window_right = self.window_size
        return _core.CallOptions(
            scale=scale, causal=self.causal, window_left=window_left,
            window_right=window_right, softcap=self.softcap, dropout_p=self.dropout_p,
            seed=self.seed, offset=self.offset, enable_gqa=self.enable_gqa,
            num_threads=self.num_threads, backend=self.backend, num_splits=self.num_splits)


def lse_dtype(dtype_name):
    return "float64" if dtype_name == "float64" else "float32"


def alibi_array(lib, op, slopes):
    """ALiBi slopes in library `lib` (None stays None): a list or tuple of numbers, or a Python
    number (then refused for its rank), becomes float32, the slopes' dtype (as a list of ints
    becomes int32 for an index array); arrays are taken as they are, their dtype the library's
    to check."""
    if slopes is None:
        return None
    if is_slope_list(slopes):
        array = _arrays.NUMPY.asarray(slopes, op, "alibi_slopes")
        if array.dtype.kind in "iuf":
            with np.errstate(over="ignore"):
                narrowed = array.astype(np.float32)
            # A finite number past float32's range, named as given (not as its cast, inf).
            past = np.flatnonzero(np.isfinite(array) & ~np.isfinite(narrowed))
            if past.size:
                at = np.unravel_index(int(past[0]), array.shape)
                name = "alibi_slopes" + "".join(f"[{int(n)}]" for n in at)
                raise ValueError(f"{op}: alibi_slopes holds a slope past float32's range "
                                 f"({name}={array[at].item()!r}, expected |slope| <= "
                                 f"{float(np.finfo(np.float32).max):.8g})")
            array = narrowed
        return lib.asarray(array, op, "alibi_slopes")
    return lib.asarray(slopes, op, "alibi_slopes")


def is_slope_list(slopes):
    """Whether alibi_array makes float32 slopes of `slopes` (a list, tuple or Python number)."""
    return isinstance(slopes, (list, tuple, int, float)) and not isinstance(slopes, bool)


def core_or_none(lib, x):
    return None if x is None else lib.to_core(x)


def forward4(lib, q4, k4, v4, mask4, alibi, call, out_dtype=None):
    """out [B, Hq, Lq, Dv] (laid out in memory like q4; of q4's dtype, or out_dtype "float32"
    for 16-bit inputs: unrounded) and lse [B, Hq, Lq] of the views q4 [B, Hq, Lq, D],
    k4 [B, Hkv, Lk, D], v4 [B, Hkv, Lk, Dv], mask4 [B|1, Hq|1, Lq|1, Lk|1]."""
    batch, heads_q, seqlen_q, _ = q4.shape
    dtype = lib.dtype_name(q4)
    _copies.check_new_arrays("forward",
                             ((batch, heads_q, seqlen_q, v4.shape[-1]), out_dtype or dtype),
                             ((batch, heads_q, seqlen_q), lse_dtype(dtype)))
    out = _arrays.empty_in_order_of(lib, q4, (batch, heads_q, seqlen_q, v4.shape[-1]),
                                    out_dtype or dtype)
    lse = lib.empty((batch, heads_q, seqlen_q), lse_dtype(dtype))
    _core.forward(lib.to_core(q4), lib.to_core(k4), lib.to_core(v4), lib.to_core(out),
                  lib.to_core(lse), core_or_none(lib, mask4), core_or_none(lib, alibi),
                  call.core_options())
    return out, lse


def backward4(lib, dout4, q4, k4, v4, out4, lse3, mask4, alibi, call, want_dbias):
    """dq, dk, dv (shaped and laid out like q4, k4, v4) and dbias (mask4's shape, or None) of
    forward4's call; dout4 and out4 [B, Hq, Lq, Dv], lse3 [B, Hq, Lq]."""
    dtype = lib.dtype_name(q4)
    _copies.check_new_arrays("backward", *((tuple(x.shape), dtype) for x in (q4, k4, v4)),
                             *([(tuple(mask4.shape), lib.dtype_name(mask4))] if want_dbias else []))
    dq, dk, dv = (_arrays.empty_in_order_of(lib, x, tuple(x.shape), dtype)
                  for x in (q4, k4, v4))
    dbias = lib.empty(tuple(mask4.shape), lib.dtype_name(mask4)) if want_dbias else None
    backward4_into(lib, dout4, q4, k4, v4, out4, lse3, dq, dk, dv, dbias, mask4, alibi, call)
    return dq, dk, dv, dbias


def backward4_into(lib, dout4, q4, k4, v4, out4, lse3, dq, dk, dv, dbias, mask4, alibi, call):
    """backward4 into given views dq, dk, dv (shaped like q4, k4, v4) and dbias or None."""
    _core.backward(lib.to_core(dout4), lib.to_core(q4), lib.to_core(k4), lib.to_core(v4),
                   lib.to_core(out4), lib.to_core(lse3), lib.to_core(dq), lib.to_core(dk),
                   lib.to_core(dv), core_or_none(lib, dbias), core_or_none(lib, mask4),
                   core_or_none(lib, alibi), call.core_options())


def times(x, factor, op, name="query"):
    """x * factor for factor in (1, -1, 0); a product, so that torch autograd sees it and NaN
    stays NaN. The product is a new array of x's size, refused first (MemoryError) where it
    would not fit: a broadcast query stands for more elements than its memory holds. name:
    x's, in the message."""
    if factor == 1:
        return x
    lib = _arrays.NUMPY if isinstance(x, np.ndarray) else _arrays.TORCH
    _copies.check_copy(op, name, tuple(x.shape), lib.dtype_name(x), "a scale <= 0 is applied "
                       "as the query times its sign: pass a positive scale, or the query "
                       "scaled by it")
    return x * factor


class DenseKernel:
    """forward4/backward4 of one call without a mask, for callers that hold q4, k4, v4 as views
    of packed tensors (attncore._autograd.PackedAttentionFunction): the backward writes into
    the caller's dq, dk, dv views. Call.q_factor is applied here."""

    def __init__(self, alibi, call):
        self.alibi, self.call = alibi, call

    def forward(self, lib, q4, k4, v4):
        """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])."""
        return forward4(lib, times(q4, self.call.q_factor, "forward"), k4, v4, None, self.alibi,
                        self.call)

    def backward_into(self, lib, dout4, q4, k4, v4, out4, lse3, dq, dk, dv):
        factor = self.call.q_factor
        backward4_into(lib, dout4, times(q4, factor, "backward"), k4, v4, out4, lse3, dq, dk, dv,
                       None, None,
                       self.alibi, self.call)
        if factor != 1:
            dq[...] = dq * factor
