"""attention() and attention_backward(), attention_varlen() and attention_varlen_backward():
attncore's own Python functions, on which the torch-SDPA and flash-attn drop-ins (_dropins) are
built, over the rank-4 calls of _rank4 and the packed calls of _varlen.

Arrays are numpy arrays, torch tensors or other DLPack producers (see _arrays). Each argument is
brought to the rank-4 views the C++ library takes, without a copy where its strides allow (only
the last stride must be 1):
    q [..., Hq, Lq, D]  (layout "bhld", torch)  or  [..., Lq, Hq, D]  (layout "blhd", flash-attn)
    ->  [B, Hq, Lq, D]  with B the product of the leading (batch) dims,
and results come back in the caller's layout, library and dtype. Variable-length calls take the
packed views as they are: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv].
"""

import math
import typing

import numpy as np

from . import _arrays, _copies, _core, _random
from ._rank4 import (INT32_MAX, Call, DenseKernel, alibi_array, backward4, bool_option,
                     core_or_none, forward4, int_option, lse_dtype, pair, real_option,
                     scale_option, times)
from ._varlen import Seqs, VarlenKernel
from .backends import backend_name, explanation_from_core

LAYOUTS = ("bhld", "blhd")
CAUSAL = ("none", "upper-left", "lower-right")


def _window(op, window_size):
    """(left, right) of window_size: TypeError unless a pair of ints, ValueError outside what
    the library takes (-1 = unbounded)."""
    left_right = pair(op, "window_size", window_size, "(left, right); -1 = unbounded")
    return tuple(int_option(op, name, w, meaning="; -1 = unbounded")
                 for name, w in zip(("window_left", "window_right"), left_right))


def _resolve_call(op, *, scale, causal, window_size, softcap, dropout_p, seed, offset,
                  enable_gqa, backend, num_threads, draw_seed):
    """The Call of one call's options, each checked for its Python type and for what the
    library's options can hold (the library checks the rest). A call with dropout and no seed
    gets seed None when it may draw one (draw_seed; _random.seeded draws it)."""
    causal = "none" if causal is None or causal is False else causal
    if not isinstance(causal, str):  # (True: which diagonal is not said)
        raise TypeError(f"{op}: causal is not a string (type={type(causal).__name__}, expected "
                        "None, 'upper-left' or 'lower-right')")
    if causal not in CAUSAL:
        raise ValueError(f"{op}: causal is invalid (causal={causal!r}, expected None, "
                         "'upper-left' or 'lower-right')")
    window = _window(op, window_size)
    scale = scale_option(op, scale)
    softcap = real_option(op, "softcap", softcap)
    dropout_p = real_option(op, "dropout_p", dropout_p)
    enable_gqa = bool_option(op, "enable_gqa", enable_gqa)
    backend = backend_name(op, backend)
    num_threads = int_option(op, "num_threads", num_threads, -INT32_MAX - 1, INT32_MAX,
                             "; 0 = default")
    seed = None if seed is None else _random.check_u64(op, "seed", seed)
    offset = None if offset is None else _random.check_u64(op, "offset", offset)
    if dropout_p == 0.0:
        seed, offset = 0, 0
    elif seed is None:
        if not draw_seed:
            raise ValueError(f"{op}: dropout needs the forward call's seed (seed=None, expected "
                             "the (seed, offset) attncore.get_rng_state() gave before it)")
        if offset is not None:  # (the generator gives both, or the caller does)
            raise ValueError(f"{op}: offset is set without seed (offset={offset}, expected "
                             "seed with it, or neither: then the generator gives both)")
    elif offset is None:
        offset = 0
    return Call(scale=scale, causal=causal, window_size=window, softcap=softcap,
                dropout_p=dropout_p, seed=seed, offset=offset, enable_gqa=enable_gqa,
                backend=backend, num_threads=num_threads)


class _Form:
    """How one call's arrays map to the library's rank-4 views and back.

    An input the library cannot read in place (its last stride is not 1, or its batch dims do
    not fold into one) is copied only after the call's checks: until then the form holds a
    stand-in (late: _copies.LateCopies)."""

    def __init__(self, lib, op, layout, query, key, value):
        if not isinstance(layout, str):
            raise TypeError(f"{op}: layout is not a string (type={type(layout).__name__}, "
                            "expected 'bhld' or 'blhd')")
        if layout not in LAYOUTS:
            raise ValueError(f"{op}: layout is invalid (layout={layout!r}, expected 'bhld' "
                             "([..., H, L, D]) or 'blhd' ([..., L, H, D]))")
        self.lib, self.op, self.layout = lib, op, layout
        self.late = _copies.LateCopies(op)
        # (L, D) in layout bhld: one sequence, one head; unbatched when all three are (the
        # result then has no batch or head dim; else it has the batch dims they broadcast to).
        self.caller_ranks = (query.ndim, key.ndim, value.ndim)
        self.unbatched = layout == "bhld" and self.caller_ranks == (2, 2, 2)
        q, k, v = (self._bhld(x, name) for x, name in
                   ((query, "query"), (key, "key"), (value, "value")))
        # Batch dims broadcast between query, key and value, as in torch's math path; the
        # inputs are expanded (stride 0, no copy where one batch dim is broadcast).
        self.input_batches = [tuple(x.shape[:-3]) for x in (q, k, v)]
        self.batch = self.input_batches[0]
        for x, name in ((k, "key"), (v, "value")):
            try:
                self.batch = tuple(np.broadcast_shapes(self.batch, tuple(x.shape[:-3])))
            except ValueError:
                raise ValueError(f"{op}: {name} has leading dims {list(x.shape[:-3])}, expected "
                                 f"them to broadcast with query's {list(q.shape[:-3])} (each "
                                 "dim equal or 1)") from None
        q, k, v = (self._broadcast(x) for x in (q, k, v))
        self.batch_size = math.prod(self.batch)
        self.heads_q, self.seqlen_q = q.shape[-3], q.shape[-2]
        self.seqlen_k = k.shape[-2]
        self.q4, self.k4, self.v4 = (self._fold(q, "query"), self._fold(k, "key"),
                                      self._fold(v, "value"))

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

    def _broadcast(self, x):
        """x [..., H, L, D] expanded to the call's batch dims."""
        if tuple(x.shape[:-3]) == self.batch:
            return x
        lead = (1,) * (len(self.batch) + 3 - x.ndim)
        x = self.lib.reshape(x, lead + tuple(x.shape))
        return self.lib.broadcast_to(x, self.batch + tuple(x.shape[-3:]))

    def reduce_to_input(self, grad, index):
        """The gradient of input `index` (0 query, 1 key, 2 value) in the caller's layout,
        summed over the batch dims that input was broadcast along."""
        batch = self.input_batches[index]
        if self.unbatched:
            return grad
        if batch != self.batch:
            rest = tuple(grad.shape[len(self.batch):])
            padded = (1,) * (len(self.batch) - len(batch)) + batch
            grad = self.lib.reshape(self.lib.sum_to(grad, padded + rest), batch + rest)
        if self.caller_ranks[index] == 2:  # (L, D) among batched inputs: [1, L, D] back
            grad = self.lib.reshape(grad, tuple(grad.shape[-2:]))
        return grad

    def _fold(self, x, name, unit_last=True):
        """[..., H, L, D] -> [B, H, L, D] (unit_last: with a last stride of 1): a view, or a
        stand-in for its copy."""
        return self.late.fold(self.lib, x, (self.batch_size,) + tuple(x.shape[-3:]), name,
                              unit_last)

    def from_caller(self, x, name):
        """An array shaped like the output (dout, out) -> [B, Hq, Lq, Dv]."""
        x = self._bhld(self.lib.asarray(x, self.op, name), name)
        if tuple(x.shape[:-3]) != self.batch:
            raise ValueError(f"{self.op}: {name} has leading dims {list(x.shape[:-3])}, expected "
                             f"query's {list(self.batch)} (the same batch dims)")
        return self._fold(x, name)

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
        lse = self.lib.asarray(lse, self.op, "softmax_lse")
        expected = (self.seqlen_q,) if self.unbatched else self.batch + (self.heads_q,
                                                                         self.seqlen_q)
        if tuple(lse.shape) != expected:
            raise ValueError(f"{self.op}: softmax_lse has shape {list(lse.shape)}, expected "
                             f"{list(expected)} ([..., Hq, Lq])")
        shape = (self.batch_size, self.heads_q, self.seqlen_q)
        if self.unbatched:
            return self.lib.reshape(lse, shape)  # [Lq] -> [1, 1, Lq]: a view
        return self.late.fold(self.lib, lse, shape, "softmax_lse", unit_last=False)

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
        mask = self.lib.reshape(mask, shape)  # (leading 1s added: a view)
        if all(s == 1 for s in shape[:-3]):
            return self.lib.reshape(mask, (1,) + shape[-3:])
        return self._fold(self.lib.broadcast_to(mask, self.batch + shape[-3:]), "attn_mask",
                          unit_last=False)

    def dbias_to_caller(self, dbias4, mask):
        """The gradient of mask4(mask), [B|1, Hq|1, Lq|1, Lk|1], summed back to mask's shape."""
        shape = self._mask_padded_shape(mask)
        if not all(s == 1 for s in shape[:-3]):
            dbias4 = self.lib.sum_to(self.lib.reshape(dbias4, self.batch + shape[-3:]), shape)
        return self.lib.reshape(dbias4, tuple(mask.shape))

    def alibi(self, slopes):
        """ALiBi slopes [Hq] or [..., Hq] -> [Hq] or [B, Hq]: a view, or a stand-in for its
        copy (batch dims that fold into one only in a copy)."""
        if slopes.ndim >= 2 and tuple(slopes.shape[:-1]) == self.batch:
            return self.late.fold(self.lib, slopes, (self.batch_size, slopes.shape[-1]),
                                  "alibi_slopes", unit_last=False)
        return slopes


class _Prepared(typing.NamedTuple):
    """One call's arrays and options, brought to the library's form."""

    lib: object  # _arrays.NUMPY or _arrays.TORCH
    give_back: object  # turns results into the caller's type
    form: _Form
    call: Call
    mask: object  # the caller's attn_mask (in lib) or None
    mask4: object  # [B|1, Hq|1, Lq|1, Lk|1] or None
    alibi: object  # [Hq] or [B, Hq] or None


def _prepare(op, query, key, value, *, layout, attn_mask, alibi_slopes, draw_seed,
             check_forward=False, **options):
    """The call's arrays in the query's library and its options. A forward (draw_seed) refuses
    torch inputs whose gradients a non-torch query would drop. With check_forward, inputs that
    wait for a copy (_Form) get it after the library's checks of the forward call: such a call
    is refused before anything of its size is copied. Without, they stay stand-ins (the
    caller checks and copies: form.late)."""
    lib, query, give_back = _arrays.adopt(query, op, "query")
    if draw_seed:
        _arrays.refuse_lost_gradients(lib, op, (("key", key), ("value", value),
                                                ("attn_mask", attn_mask)))
    call = _resolve_call(op, draw_seed=draw_seed, **options)
    form = _Form(lib, op, layout, query, lib.asarray(key, op, "key"),
                 lib.asarray(value, op, "value"))
    mask = None if attn_mask is None else lib.asarray(attn_mask, op, "attn_mask")
    mask4 = None if mask is None else form.mask4(mask)
    alibi = alibi_array(lib, op, alibi_slopes)
    alibi = None if alibi is None else form.alibi(alibi)
    if check_forward and form.late.waiting:
        _core.explain_forward(lib.to_core(form.q4), lib.to_core(form.k4), lib.to_core(form.v4),
                              core_or_none(lib, mask4), core_or_none(lib, alibi),
                              call.checked_options())
    if check_forward:
        form.q4, form.k4, form.v4 = (form.late.real(x) for x in (form.q4, form.k4, form.v4))
        mask4, alibi = form.late.real(mask4), form.late.real(alibi)
    return _Prepared(lib, give_back, form, call, mask, mask4, alibi)


def attention(query, key, value, *, layout="bhld", scale=None, causal=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0, seed=None,
              offset=None, enable_gqa=True, backend=None, num_threads=0, return_lse=False,
              _op="attention"):
    """Exact attention with every attncore option (docs/design.md section 1).

    query [..., Hq, Lq, D], key [..., Hkv, Lk, D], value [..., Hkv, Lk, Dv] in layout "bhld"
    (torch's; (L, D) is one head), or [..., L, H, D] in layout "blhd" (flash-attn's). Returns
    out (query's layout, library and dtype) and, with return_lse, lse [..., Hq, Lq] (float32;
    float64 for float64 inputs; -inf on rows that see no key).

    scale: default 1/sqrt(D). causal: None, "upper-left" (j <= i) or "lower-right"
    (j <= i + Lk - Lq). window_size: (left, right) around the lower-right diagonal, -1 =
    unbounded. softcap: s = softcap * tanh(s / softcap), 0 = off. alibi_slopes: float32 [Hq] or
    [..., Hq]. attn_mask: broadcastable to [..., Hq, Lq, Lk]; bool (True takes part) or float
    (added to the scores). dropout_p: with the given (seed, offset), else torch tensors draw one
    seed from torch's default generator (offset 0) and other arrays take (seed, offset) from
    attncore's generator.
    enable_gqa: allow Hkv dividing Hq. backend: None/"auto", "reference", "math", "flash" or an
    SDPBackend. num_threads: 0 = the library's default.

    torch tensors go through attncore.torch.AttentionFunction, so gradients flow to query, key,
    value and a float attn_mask that requires grad.
    """
    return_lse = bool_option(_op, "return_lse", return_lse)
    p = _prepare(_op, query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=True, check_forward=True, scale=scale,
                 causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                 offset=offset, enable_gqa=enable_gqa, backend=backend, num_threads=num_threads)
    q4 = times(p.form.q4, p.call.q_factor, _op)
    positions = p.form.batch_size * p.form.heads_q * p.form.seqlen_q * p.form.seqlen_k
    with _random.seeded(p.call, positions, p.lib.is_torch) as call:
        if p.lib.is_torch:
            # Imported here: _autograd imports torch, which numpy callers need not have.
            from ._autograd import AttentionFunction
            out4, lse3 = AttentionFunction.apply(q4, p.form.k4, p.form.v4, p.mask4, p.alibi, call)
        else:
            out4, lse3 = forward4(p.lib, q4, p.form.k4, p.form.v4, p.mask4, p.alibi, call)
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
    (seed, offset) that attncore.get_rng_state() returned just before a forward call on numpy
    arrays. (A forward on torch tensors replays its own seed through autograd.)
    """
    p = _prepare("attention_backward", query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=False, scale=scale, causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                 offset=offset, enable_gqa=enable_gqa, backend=backend, num_threads=num_threads)
    lib, form, factor = p.lib, p.form, p.call.q_factor
    want_dbias = p.mask is not None and lib.dtype_name(p.mask) != "bool"
    arrays = (form.from_caller(dout, "dout"), form.q4, form.k4, form.v4,
              form.from_caller(out, "out"), form.lse_from_caller(softmax_lse), p.mask4)
    if form.late.waiting:  # the call's checks before any input's copy
        _core.explain_backward(*(lib.to_core(x) for x in arrays[:6]),
                               core_or_none(lib, p.mask4), core_or_none(lib, p.alibi),
                               want_dbias, p.call.checked_options())
    dout4, q4, k4, v4, out4, lse3, mask4, alibi = (form.late.real(x)
                                                   for x in arrays + (p.alibi,))
    dq4, dk4, dv4, dbias4 = backward4(lib, dout4, times(q4, factor, "attention_backward"), k4,
                                      v4, out4, lse3, mask4, alibi, p.call, want_dbias)
    grads = [form.reduce_to_input(form.to_caller(g), i)
             for i, g in enumerate((times(dq4, factor, "attention_backward", "dq"), dk4,
                                                   dv4))]
    if want_dbias:
        grads.append(form.dbias_to_caller(dbias4, p.mask))
    return tuple(p.give_back(g) for g in grads)


class Packed(typing.NamedTuple):
    """One call on views of packed (or separate) sources: its results and what made them."""

    out: object  # [B, Hq, Lq, Dv] (dense) or [total_q, Hq, Dv] (varlen), in lib
    lse: object  # [B, Hq, Lq] or [Hq, total_q]
    lib: object
    give_back: object
    kernel: object  # DenseKernel or VarlenKernel: its call, slopes and sequences
    views: tuple  # (q, k, v) as the kernel took them
    op: str  # the call's name, for errors of work done after it (S_dmask)


def separate(query, key, value):
    """The split of three separate sources: each is its own view."""
    return query, key, value


def _adopt_sources(op, sources, forward=True):
    """(lib, give_back, late, sources) with every source ({name: array}, the first the
    query's) in the first one's library, each with a unit last stride: where it has none, a
    stand-in for its copy, which late.real makes after the call's checks. A forward refuses
    torch sources whose gradients a non-torch first source would drop."""
    (first_name, first), *rest = sources.items()
    lib, first, give_back = _arrays.adopt(first, op, first_name)
    if forward:
        _arrays.refuse_lost_gradients(lib, op, rest)
    arrays = (first,) + tuple(lib.asarray(s, op, name) for name, s in rest)
    names = (first_name,) + tuple(name for name, _ in rest)
    late = _copies.LateCopies(op)
    return lib, give_back, late, tuple(late.unit_last_stride(lib, s, name)
                                       for name, s in zip(names, arrays))


def _run(lib, kernel, split, sources):
    """(out, lse) of the kernel on split(*sources); torch tensors through
    PackedAttentionFunction, so that gradients reach the sources."""
    if lib.is_torch:
        # Imported here: _autograd imports torch, which numpy callers need not have.
        from ._autograd import PackedAttentionFunction
        return PackedAttentionFunction.apply(kernel, split, *sources)
    return kernel.forward(lib, *split(*sources))


def dense_packed(op, sources, split, *, alibi_slopes, extra_outputs=None, **options):
    """A dense call on rank-4 views split(*sources) = (q4 [B, Hq, Lq, D], k4 [B, Hkv, Lk, D],
    v4 [B, Hkv, Lk, Dv]) with attention()'s options (no mask): a Packed with out4 and lse3.
    sources: {name: array} in split's argument order, named as in error messages.
    extra_outputs(lib, views, seqs): (shape, dtype name) specs of arrays the caller makes
    from the result (flash-attn's S_dmask), checked against the memory this process may use
    before the call runs or draws a seed."""
    call = _resolve_call(op, draw_seed=True, **options)
    lib, give_back, late, sources = _adopt_sources(op, sources)
    alibi = alibi_array(lib, op, alibi_slopes)
    if late.waiting:  # the call's checks before any source's copy
        _core.explain_forward(*(lib.to_core(x) for x in split(*sources)), None,
                              core_or_none(lib, alibi), call.checked_options())
    if extra_outputs is not None:  # (stand-ins have the shapes and dtypes of their copies)
        _copies.check_new_arrays(op, *extra_outputs(lib, split(*sources), None))
    sources = tuple(late.real(s) for s in sources)
    q4, k4, _ = views = split(*sources)
    batch, heads_q, seqlen_q, _ = q4.shape
    with _random.seeded(call, batch * heads_q * seqlen_q * k4.shape[2], lib.is_torch) as call:
        kernel = DenseKernel(alibi, call)
        out, lse = _run(lib, kernel, split, sources)
    return Packed(out, lse, lib, give_back, kernel, views, op)


def varlen_packed(op, sources, split, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                  seqused_k, attn_mask, alibi_slopes, extra_outputs=None, block_table=None,
                  **options):
    """A variable-length call on views split(*sources) = (q [total_q, Hq, D],
    k [total_k, Hkv, D], v [total_k, Hkv, Dv]; with block_table page pools [num_pages,
    page_size, Hkv, D], forward only) with attention_varlen()'s options: a Packed. sources and
    extra_outputs as for dense_packed."""
    call = _resolve_call(op, draw_seed=True, **options)
    lib, give_back, late, sources = _adopt_sources(op, sources)
    seqs = Seqs.of(op, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                   block_table)
    mask = None if attn_mask is None else lib.asarray(attn_mask, op, "attn_mask")
    alibi = alibi_array(lib, op, alibi_slopes)
    if late.waiting:  # the call's checks before any source's copy
        _core.explain_forward_varlen(*(lib.to_core(x) for x in split(*sources)),
                                     *seqs.core_args(), core_or_none(lib, mask),
                                     core_or_none(lib, alibi), call.checked_options(),
                                     block_table=seqs.block_table)
    if extra_outputs is not None:  # (stand-ins have the shapes and dtypes of their copies)
        _copies.check_new_arrays(op, *extra_outputs(lib, split(*sources), seqs))
    sources = tuple(late.real(s) for s in sources)
    q, _, _ = views = split(*sources)
    heads_q = q.shape[1] if q.ndim == 3 else 0
    positions = (seqs.batch_size * heads_q * max(seqs.max_seqlen_q, 0) *
                 max(seqs.max_seqlen_k, 0))
    with _random.seeded(call, positions, lib.is_torch) as call:
        kernel = VarlenKernel(seqs, alibi, call, mask)
        out, lse = _run(lib, kernel, split, sources)
    return Packed(out, lse, lib, give_back, kernel, views, op)


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     *, seqused_k=None, scale=None, causal=None, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0, seed=None,
                     offset=None, enable_gqa=True, backend=None, num_threads=0,
                     return_lse=False, _op="attention_varlen"):
    """Exact attention over a variable-length batch packed along the rows (docs/design.md section 1,
    "Variable-length batches"), with attention()'s options.

    query [total_q, Hq, D], key [total_k, Hkv, D], value [total_k, Hkv, Dv]: sequence b owns
    query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1]
    (int32 [B + 1], from 0, non-decreasing); with seqused_k (int32 [B]) only the first
    seqused_k[b] of its keys take part, for every purpose. max_seqlen_q and max_seqlen_k bound
    the lengths (they may be larger) and address dropout as a batch padded to them would.
    Returns out [total_q, Hq, Dv] (query's library and dtype) and, with return_lse,
    lse [Hq, total_q]. Query rows past cu_seqlens_q[-1] get out 0 and lse -inf.

    causal, window_size, softcap and alibi_slopes ([Hq] or [B, Hq]) apply within each sequence
    on its own lengths (the lower-right diagonal is i + Lk_b - Lq_b). attn_mask is not
    supported with variable-length batches (NotImplementedError). Without seed and offset,
    dropout on torch tensors draws one seed from torch's default generator (offset 0), and on
    other arrays takes B * Hq * max_seqlen_q * max_seqlen_k positions of attncore's generator.
    torch tensors are differentiable (query, key, value).
    """
    return_lse = bool_option(_op, "return_lse", return_lse)
    r = varlen_packed(_op, {"query": query, "key": key, "value": value}, separate,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_k=seqused_k, attn_mask=attn_mask,
                      alibi_slopes=alibi_slopes, scale=scale, causal=causal,
                      window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                      offset=offset, enable_gqa=enable_gqa, backend=backend,
                      num_threads=num_threads)
    out = r.give_back(r.out)
    return (out, r.give_back(r.lse)) if return_lse else out


def attention_varlen_backward(dout, query, key, value, out, softmax_lse, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                              scale=None, causal=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, attn_mask=None, dropout_p=0.0, seed=None,
                              offset=None, enable_gqa=True, backend=None, num_threads=0):
    """Gradients (dq, dk, dv), shaped like query, key and value, of an attention_varlen() call
    (or a flash_attn_varlen_* call described with its options) from its out
    [total_q, Hq, Dv] and softmax_lse [Hq, total_q]. Rows of dk and dv that belong to no used
    key, and rows of dq past cu_seqlens_q[-1], are 0.

    Every option must be the forward call's; with dropout, seed and offset are required: the
    (seed, offset) that attncore.get_rng_state() returned just before a forward call on numpy
    arrays. (A forward on torch tensors replays its own seed through autograd.)
    """
    op = "attention_varlen_backward"
    call = _resolve_call(op, draw_seed=False, scale=scale, causal=causal,
                         window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                         seed=seed, offset=offset, enable_gqa=enable_gqa, backend=backend,
                         num_threads=num_threads)
    lib, give_back, late, (query, key, value) = _adopt_sources(
        op, {"query": query, "key": key, "value": value}, forward=False)
    seqs = Seqs.of(op, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)
    mask = None if attn_mask is None else lib.asarray(attn_mask, op, "attn_mask")
    alibi = alibi_array(lib, op, alibi_slopes)
    arrays = (late.unit_last_stride(lib, lib.asarray(dout, op, "dout"), "dout"), query, key,
              value, late.unit_last_stride(lib, lib.asarray(out, op, "out"), "out"),
              lib.asarray(softmax_lse, op, "softmax_lse"))
    if late.waiting:  # the call's checks before any input's copy
        _core.explain_backward_varlen(*(lib.to_core(x) for x in arrays), *seqs.core_args(),
                                      core_or_none(lib, mask), core_or_none(lib, alibi),
                                      call.checked_options())
        arrays = tuple(late.real(x) for x in arrays)
    grads = VarlenKernel(seqs, alibi, call, mask).backward(lib, *arrays)
    return tuple(give_back(g) for g in grads)


def explain(query, key, value, *, backward=False, layout="bhld", scale=None, causal=None,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0,
            seed=None, offset=None, enable_gqa=True, backend=None, num_threads=0,
            _op="explain"):
    """What automatic backend selection does with attention()'s call (backward=True: with its
    backward) on this thread, inside the current sdpa_kernel: an Explanation with each
    backend's verdict (enabled, the reasons it cannot run the call, the cost model's estimate)
    and the backend chosen (None when none can run it). The arrays are validated like the
    call's, a backend it names too (NotImplementedError where that one cannot run it); nothing
    is computed and no seed is drawn."""
    backward = bool_option(_op, "backward", backward)
    if seed is None and offset is None:  # (the call would draw them: any stands for them)
        seed = offset = 0
    p = _prepare(_op, query, key, value, layout=layout, attn_mask=attn_mask,
                 alibi_slopes=alibi_slopes, draw_seed=True, scale=scale, causal=causal,
                 window_size=window_size, softcap=softcap, dropout_p=dropout_p, seed=seed,
                 offset=offset, enable_gqa=enable_gqa, backend=backend, num_threads=num_threads)
    lib, form, options = p.lib, p.form, p.call.core_options()
    # The query as given: the call negates or zeroes it for a scale <= 0 (a copy), which
    # changes no verdict.
    q4 = form.q4
    mask4, alibi = core_or_none(lib, p.mask4), core_or_none(lib, p.alibi)
    if not backward:
        raw = _core.explain_forward(lib.to_core(q4), lib.to_core(form.k4), lib.to_core(form.v4),
                                    mask4, alibi, options)
    else:  # out and dout shaped as the call's output, lse as its LSE: stride-0 views of one
        # zero each (never read), so that nothing of the call's size is allocated
        batch, heads_q, seqlen_q, _ = q4.shape
        dtype = lib.dtype_name(q4)
        out = lib.broadcast_to(lib.zeros((1, 1, 1, form.v4.shape[-1]), dtype),
                               (batch, heads_q, seqlen_q, form.v4.shape[-1]))
        lse = lib.broadcast_to(lib.zeros((1, 1, 1), lse_dtype(dtype)), (batch, heads_q, seqlen_q))
        want_dbias = p.mask is not None and lib.dtype_name(p.mask) != "bool"
        raw = _core.explain_backward(lib.to_core(out), lib.to_core(q4), lib.to_core(form.k4),
                                     lib.to_core(form.v4), lib.to_core(out), lib.to_core(lse),
                                     mask4, alibi, want_dbias, options)
    return explanation_from_core(raw)
