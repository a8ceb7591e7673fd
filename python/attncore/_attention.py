"""attention() and attention_backward(): attncore's own Python functions, on which the torch-SDPA
and flash-attn drop-ins (_dropins) are built, over the rank-4 calls of _rank4.

Arrays are numpy arrays, torch tensors or other DLPack producers (see _arrays). Each argument is
brought to the rank-4 views the C++ library takes, without a copy where its strides allow (only
the last stride must be 1):
    q [..., Hq, Lq, D]  (layout "bhld", torch)  or  [..., Lq, Hq, D]  (layout "blhd", flash-attn)
    ->  [B, Hq, Lq, D]  with B the product of the leading (batch) dims,
and results come back in the caller's layout, library and dtype.
"""

import math
import typing

from . import _arrays, _core, _random
from ._rank4 import Call, backward4, core_or_none, forward4, lse_dtype
from .backends import backend_name, explanation_from_core

LAYOUTS = ("bhld", "blhd")
CAUSAL = ("none", "upper-left", "lower-right")


def _resolve_call(op, form, *, scale, causal, window_size, softcap, dropout_p, seed, offset,
                  enable_gqa, backend, num_threads, draw_seed):
    causal = "none" if causal is None or causal is False else causal
    if causal not in CAUSAL:
        raise ValueError(f"{op}: causal is invalid (causal={causal!r}, expected None, "
                         "'upper-left' or 'lower-right')")
    try:
        window_left, window_right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: window_size is invalid (window_size={window_size!r}, "
                         "expected (left, right); -1 = unbounded)") from None
    dropout_p = float(dropout_p)
    if dropout_p == 0.0:
        seed, offset = 0, 0
    elif seed is None:
        if not draw_seed:
            raise ValueError(f"{op}: dropout needs the forward call's seed (seed=None, expected "
                             "the (seed, offset) attncore.get_rng_state() gave before it)")
        seed, offset = _random.default_generator.take(form.batch_size * form.heads_q *
                                                      form.seqlen_q * form.seqlen_k)
    else:
        seed, offset = _random.check_u64("seed", seed), _random.check_u64("offset", offset or 0)
    return Call(scale=None if scale is None else float(scale), causal=causal,
                window_size=(window_left, window_right), softcap=float(softcap),
                dropout_p=dropout_p, seed=seed, offset=offset,
                enable_gqa=bool(enable_gqa), backend=backend_name(backend),
                num_threads=int(num_threads))


class _Form:
    """How one call's arrays map to the library's rank-4 views and back."""

    def __init__(self, lib, op, layout, query, key, value):
        if layout not in LAYOUTS:
            raise ValueError(f"{op}: layout is invalid (layout={layout!r}, expected 'bhld' "
                             "([..., H, L, D]) or 'blhd' ([..., L, H, D]))")
        self.lib, self.op, self.layout = lib, op, layout
        # (L, D) in layout bhld: one sequence, one head.
        self.unbatched = layout == "bhld" and query.ndim == 2
        q, k, v = (self._bhld(x, name) for x, name in
                   ((query, "query"), (key, "key"), (value, "value")))
        self.batch = tuple(q.shape[:-3])
        for x, name in ((k, "key"), (v, "value")):
            if tuple(x.shape[:-3]) != self.batch:
                raise ValueError(f"{op}: {name} has leading dims {list(x.shape[:-3])}, expected "
                                 f"query's {list(self.batch)} (the same batch dims)")
        self.batch_size = math.prod(self.batch)
        self.heads_q, self.seqlen_q = q.shape[-3], q.shape[-2]
        self.seqlen_k = k.shape[-2]
        self.q4, self.k4, self.v4 = self._fold(q), self._fold(k), self._fold(v)

    def _bhld(self, x, name):
        """x as [..., H, L, D]."""
        if self.layout == "blhd":
            if x.ndim < 3:
                raise ValueError(f"{self.op}: {name} has the wrong rank (rank={x.ndim}, expected "
                                 ">= 3: [..., L, H, D])")
            return self.lib.swap(x, -3, -2)
        if x.ndim < 2:
            raise ValueError(f"{self.op}: {name} has the wrong rank (rank={x.ndim}, expected "
                             ">= 2: [..., H, L, D])")
        return x if x.ndim >= 3 else self.lib.reshape(x, (1,) + tuple(x.shape))

    def _fold(self, x):
        """[..., H, L, D] -> [B, H, L, D], unit last stride."""
        x = self.lib.reshape(x, (self.batch_size,) + tuple(x.shape[-3:]))
        return self.lib.unit_last_stride(x)

    def from_caller(self, x, name):
        """An array shaped like the output (dout, out) -> [B, Hq, Lq, Dv]."""
        x = self._bhld(self.lib.asarray(x), name)
        if tuple(x.shape[:-3]) != self.batch:
            raise ValueError(f"{self.op}: {name} has leading dims {list(x.shape[:-3])}, expected "
                             f"query's {list(self.batch)} (the same batch dims)")
        return self._fold(x)

    def to_caller(self, x4):
        """[B, H, L, D] -> the caller's layout."""
        x = self.lib.reshape(x4, self.batch + tuple(x4.shape[1:]))
        if self.unbatched:
            return self.lib.reshape(x, tuple(x.shape[1:]))
        return self.lib.swap(x, -3, -2) if self.layout == "blhd" else x

    def lse_to_caller(self, lse3):
        """[B, Hq, Lq] -> [..., Hq, Lq] ([Lq] for an unbatched call)."""
        shape = (self.seqlen_q,) if self.unbatched else self.batch + tuple(lse3.shape[1:])
        return self.lib.reshape(lse3, shape)

    def lse_from_caller(self, lse):
        """softmax_lse [..., Hq, Lq] ([Lq] for an unbatched call) -> [B, Hq, Lq]."""
        lse = self.lib.asarray(lse)
        expected = (self.seqlen_q,) if self.unbatched else self.batch + (self.heads_q,
                                                                         self.seqlen_q)
        if tuple(lse.shape) != expected:
            raise ValueError(f"{self.op}: softmax_lse has shape {list(lse.shape)}, expected "
                             f"{list(expected)} ([..., Hq, Lq])")
        return self.lib.reshape(lse, (self.batch_size, self.heads_q, self.seqlen_q))

    def _mask_padded_shape(self, mask):
        """The mask's shape with leading 1s up to the scores' rank, checked to broadcast."""
        full = self.batch + (self.heads_q, self.seqlen_q, self.seqlen_k)
        rank = 2 if self.unbatched else len(full)  # an unbatched call's scores are [Lq, Lk]
        if mask.ndim > rank:
            raise ValueError(f"{self.op}: attn_mask has the wrong rank (rank={mask.ndim}, "
                             f"expected <= {rank}: broadcastable to {list(full[-rank:])})")
        shape = (1,) * (len(full) - mask.ndim) + tuple(mask.shape)
        if any(s not in (f, 1) for s, f in zip(shape, full)):
            raise ValueError(f"{self.op}: attn_mask has shape {list(mask.shape)}, expected it to "
                             f"broadcast to {list(full[-rank:])} (each dim equal or 1)")
        return shape

    def mask4(self, mask):
        """The mask (broadcastable to [..., Hq, Lq, Lk]) as [B|1, Hq|1, Lq|1, Lk|1]: batch dims
        collapse to 1 when all are 1, else are expanded (stride 0, no copy where possible)."""
        shape = self._mask_padded_shape(mask)
        mask = self.lib.reshape(mask, shape)
        if all(s == 1 for s in shape[:-3]):
            return self.lib.reshape(mask, (1,) + shape[-3:])
        mask = self.lib.broadcast_to(mask, self.batch + shape[-3:])
        return self.lib.reshape(mask, (self.batch_size,) + shape[-3:])

    def dbias_to_caller(self, dbias4, mask):
        """The gradient of mask4(mask), [B|1, Hq|1, Lq|1, Lk|1], summed back to mask's shape."""
        shape = self._mask_padded_shape(mask)
        if not all(s == 1 for s in shape[:-3]):
            dbias4 = self.lib.sum_to(self.lib.reshape(dbias4, self.batch + shape[-3:]), shape)
        return self.lib.reshape(dbias4, tuple(mask.shape))

    def alibi(self, slopes):
        """ALiBi slopes [Hq] or [..., Hq] -> [Hq] or [B, Hq]."""
        if slopes.ndim >= 2 and tuple(slopes.shape[:-1]) == self.batch:
            return self.lib.reshape(slopes, (self.batch_size, slopes.shape[-1]))
        return slopes


def _times(x, factor):
    """x * factor for factor in (1, -1, 0); a product, so that torch autograd sees it and NaN
    stays NaN."""
    return x if factor == 1 else x * factor


class _Prepared(typing.NamedTuple):
    """One call's arrays and options, brought to the library's form."""

    lib: object  # _arrays.NUMPY or _arrays.TORCH
    give_back: object  # turns results into the caller's type
    form: _Form
    call: Call
    mask: object  # the caller's attn_mask (in lib) or None
    mask4: object  # [B|1, Hq|1, Lq|1, Lk|1] or None
    alibi: object  # [Hq] or [B, Hq] or None


def _prepare(op, query, key, value, *, layout, attn_mask, alibi_slopes, draw_seed, **options):
    lib, query, give_back = _arrays.adopt(query)
    form = _Form(lib, op, layout, query, lib.asarray(key), lib.asarray(value))
    call = _resolve_call(op, form, draw_seed=draw_seed, **options)
    mask = None if attn_mask is None else lib.asarray(attn_mask)
    mask4 = None if mask is None else form.mask4(mask)
    alibi = None if alibi_slopes is None else form.alibi(lib.asarray(alibi_slopes))
    return _Prepared(lib, give_back, form, call, mask, mask4, alibi)


def attention(query, key, value, *, layout="bhld", scale=None, causal=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0, seed=None,
              offset=None, enable_gqa=True, backend=None, num_threads=0, return_lse=False,
              _op="attention"):
    """Exact attention with every attncore option (DESIGN.md section 1).

    query [..., Hq, Lq, D], key [..., Hkv, Lk, D], value [..., Hkv, Lk, Dv] in layout "bhld"
    (torch's; (L, D) is one head), or [..., L, H, D] in layout "blhd" (flash-attn's). Returns
    out (query's layout, library and dtype) and, with return_lse, lse [..., Hq, Lq] (float32;
    float64 for float64 inputs; -inf on rows that see no key).

    scale: default 1/sqrt(D). causal: None, "upper-left" (j <= i) or "lower-right"
    (j <= i + Lk - Lq). window_size: (left, right) around the lower-right diagonal, -1 =
    unbounded. softcap: s = softcap * tanh(s / softcap), 0 = off. alibi_slopes: float32 [Hq] or
    [..., Hq]. attn_mask: broadcastable to [..., Hq, Lq, Lk]; bool (True takes part) or float
    (added to the scores). dropout_p: with (seed, offset) of attncore's generator unless given.
    enable_gqa: allow Hkv dividing Hq. backend: None/"auto", "reference", "math", "flash" or an
    SDPBackend. num_threads: 0 = the library's default.

    torch tensors go through attncore.torch.AttentionFunction, so gradients flow to query, key,
    value and a float attn_mask that requires grad.
    """
    p = _prepare(_op, query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=True, scale=scale, causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                 offset=offset, enable_gqa=enable_gqa, backend=backend, num_threads=num_threads)
    q4 = _times(p.form.q4, p.call.q_factor)
    if p.lib.is_torch:
        # Imported here: _autograd imports torch, which numpy callers need not have.
        from ._autograd import AttentionFunction
        out4, lse3 = AttentionFunction.apply(q4, p.form.k4, p.form.v4, p.mask4, p.alibi, p.call)
    else:
        out4, lse3 = forward4(p.lib, q4, p.form.k4, p.form.v4, p.mask4, p.alibi, p.call)
    out = p.give_back(p.form.to_caller(out4))
    return (out, p.give_back(p.form.lse_to_caller(lse3))) if return_lse else out


def attention_backward(dout, query, key, value, out, softmax_lse, *, layout="bhld", scale=None,
                       causal=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       attn_mask=None, dropout_p=0.0, seed=None, offset=None, enable_gqa=True,
                       backend=None, num_threads=0):
    """Gradients of an attention() call (or of scaled_dot_product_attention / flash_attn_func,
    described with attention()'s options) from its out and softmax_lse: returns (dq, dk, dv),
    and (dq, dk, dv, dbias) when attn_mask is a float mask (dbias has the mask's shape).

    Every option must be the forward call's; with dropout, seed and offset are required: the
    (seed, offset) that attncore.get_rng_state() returned just before the forward call.
    """
    p = _prepare("attention_backward", query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=False, scale=scale, causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                 offset=offset, enable_gqa=enable_gqa, backend=backend, num_threads=num_threads)
    form, factor = p.form, p.call.q_factor
    want_dbias = p.mask is not None and p.lib.dtype_name(p.mask) != "bool"
    dq4, dk4, dv4, dbias4 = backward4(
        p.lib, form.from_caller(dout, "dout"), _times(form.q4, factor), form.k4, form.v4,
        form.from_caller(out, "out"), form.lse_from_caller(softmax_lse), p.mask4, p.alibi,
        p.call, want_dbias)
    grads = [form.to_caller(_times(dq4, factor)), form.to_caller(dk4), form.to_caller(dv4)]
    if want_dbias:
        grads.append(form.dbias_to_caller(dbias4, p.mask))
    return tuple(p.give_back(g) for g in grads)


def explain(query, key, value, *, backward=False, layout="bhld", scale=None, causal=None,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0,
            enable_gqa=True, num_threads=0):
    """What automatic backend selection does with attention()'s call (backward=True: with its
    backward) on this thread, inside the current sdpa_kernel: an Explanation with each
    backend's verdict (enabled, the reasons it cannot run the call, the cost model's estimate)
    and the backend chosen (None when none can run it). The arrays are validated like the
    call's; nothing is computed."""
    p = _prepare("explain", query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=False, scale=scale, causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=0, offset=0,
                 enable_gqa=enable_gqa, backend=None, num_threads=num_threads)
    lib, form, options = p.lib, p.form, p.call.core_options()
    q4 = _times(form.q4, p.call.q_factor)
    mask4, alibi = core_or_none(lib, p.mask4), core_or_none(lib, p.alibi)
    if not backward:
        raw = _core.explain_forward(lib.to_core(q4), lib.to_core(form.k4), lib.to_core(form.v4),
                                    mask4, alibi, options)
    else:  # out and dout shaped as the call's output, lse as its LSE (never read)
        batch, heads_q, seqlen_q, _ = q4.shape
        dtype = lib.dtype_name(q4)
        out = lib.empty((batch, heads_q, seqlen_q, form.v4.shape[-1]), dtype)
        lse = lib.empty((batch, heads_q, seqlen_q), lse_dtype(dtype))
        want_dbias = p.mask is not None and lib.dtype_name(p.mask) != "bool"
        raw = _core.explain_backward(lib.to_core(out), lib.to_core(q4), lib.to_core(form.k4),
                                     lib.to_core(form.v4), lib.to_core(out), lib.to_core(lse),
                                     mask4, alibi, want_dbias, options)
    return explanation_from_core(raw)
