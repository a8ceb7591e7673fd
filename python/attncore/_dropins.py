"""Drop-ins for torch.nn.functional.scaled_dot_product_attention and flash-attn 2.8.3's
flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
flash_attn_varlen_qkvpacked_func and flash_attn_varlen_kvpacked_func: their signatures and
semantics, mapped onto attncore's calls (_attention). Packed inputs (qkv, kv) are read in place
through views of their slices; under torch autograd their gradient is one packed tensor."""

import dataclasses
import numbers

import numpy as np

from . import _arrays, _copies, _core, _nested
from ._attention import attention, dense_packed, explain, separate, varlen_packed
from ._rank4 import (Call, DenseKernel, bool_option, check_blhd, check_sdpa_mask, forward4,
                     real_option, sdpa_enable_gqa, sdpa_kv_heads, sdpa_query_heads)
from ._merge import refuse_grad
from ._varlen import VarlenKernel


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False, backend=None):
    """torch.nn.functional.scaled_dot_product_attention's semantics on numpy arrays, torch
    tensors (differentiable) or DLPack producers.

    query [..., Hq, L, E], key [..., Hkv, S, E], value [..., Hkv, S, Ev] -> [..., Hq, L, Ev].
    is_causal keeps j <= i (upper-left). attn_mask broadcasts to [..., Hq, L, S]: bool (True
    takes part), float32 or query's dtype (added). scale defaults to 1/sqrt(E). Without
    enable_gqa, key/value with one head serve every query head, and a query of one head attends
    as every kv head (as torch's broadcasting does); with it, key and value may have different
    head counts, each dividing the query's (as torch's math path takes them).
    Dropout on torch tensors draws one seed per call from torch's default generator
    (torch.manual_seed reproduces it); on other arrays from attncore's (attncore.manual_seed).
    Nested tensors (torch.nested, [B, H, *, D] with query, key and value all nested) run as one
    variable-length batch, without padding, and the result is nested [B, Hq, *, Ev]; they take
    no attn_mask and no autograd.
    backend (not in torch): None (automatic), "reference", "math", "flash" or an SDPBackend.
    """
    if is_causal is False or (is_causal is True and attn_mask is None):
        out = _fast(query, key, value, attn_mask, False, "upper-left" if is_causal else "none",
                    scale, None, 0.0, dropout_p, enable_gqa, backend)
        if out is not None:
            return out
    op = "scaled_dot_product_attention"
    is_causal = bool_option(op, "is_causal", is_causal)
    causal = "upper-left" if is_causal else "none"
    if any(getattr(x, "is_nested", False) for x in (query, key, value)):
        return _nested.scaled_dot_product_attention(
            op, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, backend=backend)
    if attn_mask is not None:
        mask_lib, mask, _ = _arrays.adopt(attn_mask, op, "attn_mask")
        query_lib, query, _ = _arrays.adopt(query, op, "query")
        check_sdpa_mask(op, is_causal, mask_lib.dtype_name(mask), query_lib.dtype_name(query))
    enable_gqa = sdpa_enable_gqa(op, key, value, enable_gqa)
    key, value = sdpa_kv_heads(
        op, query, key, value, enable_gqa,
        lambda k, v: explain(query, k, v, scale=scale, causal=causal, attn_mask=attn_mask,
                             dropout_p=dropout_p, enable_gqa=enable_gqa, backend=backend, _op=op))
    query = sdpa_query_heads(op, query, key, value, enable_gqa)
    return attention(query, key, value, layout="bhld", scale=scale, causal=causal,
                     attn_mask=attn_mask, dropout_p=dropout_p, enable_gqa=enable_gqa,
                     backend=backend, _op=op)


def _fast(query, key, value, mask, blhd, causal, scale, window_size, softcap, dropout_p,
          enable_gqa, backend):
    """The call through attncore._core.attend, the fast path for plain calls (its comment
    says which), recorded for autograd where a torch input requires grad; None for other
    calls, which take the general path."""
    if (str(getattr(query, "dtype", "")) in ("torch.float16", "torch.bfloat16")
            and any(getattr(x, "requires_grad", False) for x in (query, key, value))):
        return None  # AttentionFunction keeps an f32 out for the backward (16-bit gradients)
    r = _core.attend(query, key, value, mask, blhd, causal, scale, window_size, softcap,
                     dropout_p, enable_gqa, backend)
    if type(r) is not tuple:
        return r
    from ._autograd import FastAttentionFunction  # torch inputs: torch is imported
    call = Call(scale=scale, causal=causal, window_size=window_size or (-1, -1),
                softcap=max(softcap, 0.0), enable_gqa=True,
                backend="auto" if backend is None else backend)
    return FastAttentionFunction.apply(query, key, value, mask, r[0], r[1], call, blhd)


def _flash_flags(op, causal, deterministic, return_attn_probs):
    """causal and return_attn_probs of a flash-attn call as bools, deterministic checked (it has
    no effect): TypeError for anything but a bool, as flash-attn's own ops raise (a string such
    as causal='false' would otherwise read as True)."""
    bool_option(op, "deterministic", deterministic)
    return bool_option(op, "causal", causal), bool_option(op, "return_attn_probs",
                                                          return_attn_probs)


def _flash_options(op, softmax_scale, causal, window_size, softcap, dropout_p, backend):
    """attncore's options of a flash-attn call: causal is lower-right; softcap <= 0 is off."""
    softcap = real_option(op, "softcap", softcap)
    return dict(scale=softmax_scale, causal="lower-right" if causal else None,
                window_size=window_size, softcap=0.0 if softcap <= 0 else softcap,
                dropout_p=dropout_p, seed=None, offset=None, enable_gqa=True, backend=backend,
                num_threads=0)


def _check_shape(op, name, x, layout, rank, packed_dim=None, packed=None):
    """ValueError unless x has this rank (and, for a packed tensor, `packed` at packed_dim)."""
    shape = _arrays.shape_of(x, op, name)
    if len(shape) != rank:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={len(shape)}, expected {rank}: "
                         f"{layout})")
    if packed_dim is not None and shape[packed_dim] != packed:
        raise ValueError(f"{op}: {name} has shape {list(shape)}, expected {layout}")


# The splits of the sources into (q, k, v) views: rank-4 [B, H, L, D] for dense calls, the
# packed [total, H, D] for varlen ones. swapaxes and basic indexing make views in numpy and
# torch alike.
def _dense_separate(q, k, v):
    return q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)


def _dense_qkv(qkv):  # [B, L, 3, H, D]
    return tuple(qkv[:, :, i].swapaxes(1, 2) for i in range(3))


def _dense_q_kv(q, kv):  # [B, Lq, Hq, D], [B, Lk, 2, Hkv, D]
    return q.swapaxes(1, 2), kv[:, :, 0].swapaxes(1, 2), kv[:, :, 1].swapaxes(1, 2)


def _varlen_qkv(qkv):  # [total, 3, H, D]
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


def _varlen_q_kv(q, kv):  # [total_q, Hq, D], [total_k, 2, Hkv, D]
    return q, kv[:, 0], kv[:, 1]


def _dense_result(r, return_attn_probs):
    """out [B, Lq, Hq, Dv], or flash-attn's (out, softmax_lse [B, Hq, Lq], S_dmask)."""
    out = r.give_back(r.out.swapaxes(1, 2))
    if not return_attn_probs:
        return out
    probs = _probs_dense if r.kernel.call.dropout_p else None
    return out, r.give_back(r.lse), r.give_back(_s_dmask(r, probs))


def _varlen_result(r, return_attn_probs):
    """out [total_q, Hq, Dv], or (out, softmax_lse [Hq, total_q], S_dmask)."""
    out = r.give_back(r.out)
    if not return_attn_probs:
        return out
    probs = _probs_varlen if r.kernel.call.dropout_p else None
    return out, r.give_back(r.lse), r.give_back(_s_dmask(r, probs))


def _s_dmask_specs(lib, views, seqs):
    """The arrays _s_dmask makes with dropout ((shape, dtype name) specs, checked before the
    call: a refused call draws no seed): the identity or unit rows (varlen: and the rows of
    its probabilities), the probabilities, the keep mask's identity, output and bools, the
    negated probabilities and S_dmask itself. seqs: a varlen call's, else None (dense)."""
    q, k, _ = views
    dtype = lib.dtype_name(q)
    if seqs is None:  # q [B, Hq, Lq, D], k [B, Hkv, Lk, D]
        scores = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        inputs = [((k.shape[2], k.shape[2]), dtype)]
    else:  # q [total_q, Hq, D], k [total_k, Hkv, D]
        heads_q = q.shape[1] if len(q.shape) == 3 else 0
        scores = (seqs.batch_size, heads_q, max(seqs.max_seqlen_q, 0), max(seqs.max_seqlen_k, 0))
        inputs = [((k.shape[0] if len(k.shape) == 3 else 0, 1, scores[3]), dtype),
                  ((q.shape[0] if len(q.shape) == 3 else 0, heads_q, scores[3]), dtype)]
    return inputs + [(scores, dtype), ((scores[3], scores[3]), "float32"),
                     (scores, "float32"), (scores, "bool"), (scores, dtype), (scores, dtype)]


def _s_dmask_check(dropout_p, return_attn_probs):
    """extra_outputs for dense_packed / varlen_packed: S_dmask's arrays, with dropout."""
    # (A dropout_p of another type is refused by the call's own checks.)
    if return_attn_probs and isinstance(dropout_p, numbers.Real) and dropout_p > 0:
        return _s_dmask_specs
    return None


def _s_dmask(r, probs):
    """flash-attn's S_dmask: an empty array without dropout; with dropout the attention
    probabilities [B, Hq, Lq, Lk] (varlen: [B, Hq, max_seqlen_q, max_seqlen_k], sequence b in
    the top-left corner of entry b, zeros elsewhere) with the dropped entries negated. Computed
    by extra calls (v = the identity gives the probabilities; q = k = 0 the keep mask), so
    meant for tests, not for speed; the identity matrices, unit rows and outputs they allocate
    are checked first against the memory this process may use (MemoryError)."""
    lib = r.lib
    if probs is None:
        return lib.empty((0,), lib.dtype_name(r.out))
    p = probs(r)
    keep = _keep_mask(r.op, lib, r.kernel.call, *p.shape)
    if lib.is_torch:
        return _arrays._torch().where(keep, p, -p)
    return np.where(keep, p, -p)


def _eye(lib, n, dtype_name):
    if lib.is_torch:
        torch = _arrays._torch()
        return torch.eye(n, dtype=getattr(torch, dtype_name))
    return np.eye(n, dtype=dtype_name)


def _without_dropout(call):
    return dataclasses.replace(call, dropout_p=0.0, seed=0, offset=0)


def _keep_mask(op, lib, call, batch, heads, seqlen_q, seqlen_k):
    """The dropout keep mask [B, H, Lq, Lk] of call's (dropout_p, seed, offset) for a dense
    batch of these sizes: with q = k = 0 every row attends uniformly, and v = the identity
    makes out[b, h, i, j] = keep_ij / (Lk (1 - p)), exactly 0 where dropped."""
    if seqlen_k == 0:
        return lib.zeros((batch, heads, seqlen_q, 0), "bool")
    _copies.check_new_arrays(op, ((seqlen_k, seqlen_k), "float32"))
    zero = lib.zeros((1, 1, 1, 1), "float32")
    q = lib.broadcast_to(zero, (batch, heads, seqlen_q, 1))
    k = lib.broadcast_to(zero, (batch, heads, seqlen_k, 1))
    v = lib.broadcast_to(_eye(lib, seqlen_k, "float32"), (batch, heads, seqlen_k, seqlen_k))
    uniform = Call(dropout_p=call.dropout_p, seed=call.seed, offset=call.offset,
                   backend=call.backend, num_threads=call.num_threads)
    out, _ = forward4(lib, q, k, v, None, None, uniform)
    return out > 0


def _probs_dense(r):
    """The probabilities [B, Hq, Lq, Lk] of a dense call, without dropout."""
    lib = r.lib
    q4, k4, _ = (lib.to_core(x) for x in r.views)
    batch, heads_q, seqlen_q, _ = q4.shape
    heads_kv, seqlen_k = k4.shape[1], k4.shape[2]
    dtype = lib.dtype_name(q4)
    if seqlen_k == 0:
        return lib.zeros((batch, heads_q, seqlen_q, 0), dtype)
    _copies.check_new_arrays(r.op, ((seqlen_k, seqlen_k), dtype),
                             ((batch, heads_q, seqlen_q, seqlen_k), dtype))
    v = lib.broadcast_to(_eye(lib, seqlen_k, dtype), (batch, heads_kv, seqlen_k, seqlen_k))
    kernel = DenseKernel(r.kernel.alibi, _without_dropout(r.kernel.call))
    return kernel.forward(lib, q4, k4, v)[0]


def _probs_varlen(r):
    """The probabilities [B, Hq, max_seqlen_q, max_seqlen_k] of a varlen call, without
    dropout: v's row of key j of sequence b is the unit vector e_j."""
    lib, seqs = r.lib, r.kernel.seqs
    q, k, _ = (lib.to_core(x) for x in r.views)
    cu_q, cu_k, used = seqs.lengths()
    batch, heads_q, heads_kv = len(cu_q) - 1, q.shape[1], k.shape[1]
    dtype = lib.dtype_name(q)
    _copies.check_new_arrays(r.op,
                             ((batch, heads_q, seqs.max_seqlen_q, seqs.max_seqlen_k), dtype),
                             ((k.shape[0], 1, seqs.max_seqlen_k), dtype))
    probs = lib.zeros((batch, heads_q, seqs.max_seqlen_q, seqs.max_seqlen_k), dtype)
    if seqs.max_seqlen_k == 0:
        return probs
    unit = lib.zeros((k.shape[0], 1, seqs.max_seqlen_k), dtype)
    for b in range(batch):
        n = used[b] if used is not None else cu_k[b + 1] - cu_k[b]
        unit[cu_k[b] + np.arange(n), 0, np.arange(n)] = 1.0
    v = lib.broadcast_to(unit, (k.shape[0], heads_kv, seqs.max_seqlen_k))
    kernel = VarlenKernel(seqs, r.kernel.alibi, _without_dropout(r.kernel.call))
    rows = kernel.forward(lib, q, k, v)[0]  # [total_q, Hq, max_seqlen_k]
    for b in range(batch):
        probs[b, :, :cu_q[b + 1] - cu_q[b]] = rows[cu_q[b]:cu_q[b + 1]].swapaxes(0, 1)
    return probs


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, backend=None):
    """flash_attn.flash_attn_func's semantics on numpy arrays, torch tensors (differentiable)
    or DLPack producers.

    q [B, Lq, Hq, D], k [B, Lk, Hkv, D], v [B, Lk, Hkv, Dv] -> out [B, Lq, Hq, Dv], with
    Hkv dividing Hq. causal keeps j <= i + Lk - Lq (lower-right); window_size (left, right)
    around that diagonal, -1 = unbounded; softcap: s = softcap * tanh(s / softcap), <= 0 = off;
    alibi_slopes float32 [Hq] or [B, Hq]: s -= slope * |i + Lk - Lq - j|. With
    return_attn_probs returns (out, softmax_lse [B, Hq, Lq] float32, S_dmask): S_dmask is
    empty without dropout, and with dropout the probabilities [B, Hq, Lq, Lk] with the dropped
    ones negated (computed by extra calls, for tests). deterministic is accepted and has no
    effect: attncore's backward is deterministic. Dropout draws from torch's default generator
    for torch tensors, else from attncore's (attncore.manual_seed). backend (not in
    flash-attn): as for attention().
    """
    if (alibi_slopes is None and return_attn_probs is False and (causal is True or causal is False)
            and (deterministic is False or deterministic is True)):
        out = _fast(q, k, v, None, True, "lower-right" if causal else "none", softmax_scale,
                    window_size, softcap, dropout_p, True, backend)
        if out is not None:
            return out
    op = "flash_attn_func"
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_shape(op, name, x, "[B, L, H, D]", 4)
    check_blhd(op, *((name, _arrays.shape_of(x, op, name)) for x, name in
                     ((q, "q"), (k, "k"), (v, "v"))), "[B, Lk, Hkv, D]")
    r = dense_packed(op, {"q": q, "k": k, "v": v}, _dense_separate, alibi_slopes=alibi_slopes,
                     extra_outputs=_s_dmask_check(dropout_p, return_attn_probs),
                     **_flash_options(op, softmax_scale, causal, window_size, softcap, dropout_p,
                                      backend))
    return _dense_result(r, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, backend=None):
    """flash_attn.flash_attn_qkvpacked_func: flash_attn_func on one packed tensor
    qkv [B, L, 3, H, D] (q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], read in place).
    Returns out [B, L, H, D], or (out, softmax_lse [B, H, L], S_dmask) with return_attn_probs;
    under torch autograd the gradient is one tensor shaped like qkv. Options as
    flash_attn_func's.
    """
    op = "flash_attn_qkvpacked_func"
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    _check_shape(op, "qkv", qkv, "[B, L, 3, H, D]", 5, 2, 3)
    r = dense_packed(op, {"qkv": qkv}, _dense_qkv, alibi_slopes=alibi_slopes,
                     extra_outputs=_s_dmask_check(dropout_p, return_attn_probs),
                     **_flash_options(op, softmax_scale, causal, window_size, softcap, dropout_p,
                                      backend))
    return _dense_result(r, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, backend=None):
    """flash_attn.flash_attn_kvpacked_func: flash_attn_func with keys and values packed in one
    tensor kv [B, Lk, 2, Hkv, D] (k, v = kv[:, :, 0], kv[:, :, 1], read in place) and
    q [B, Lq, Hq, D], Hkv dividing Hq. Returns out [B, Lq, Hq, D], or (out,
    softmax_lse [B, Hq, Lq], S_dmask) with return_attn_probs; under torch autograd kv's
    gradient is one tensor shaped like kv. Options as flash_attn_func's.
    """
    op = "flash_attn_kvpacked_func"
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    _check_shape(op, "q", q, "[B, L, H, D]", 4)
    _check_shape(op, "kv", kv, "[B, L, 2, H, D]", 5, 2, 2)
    check_blhd(op, ("q", _arrays.shape_of(q, op, "q")), ("kv", _arrays.shape_of(kv, op, "kv")),
               None, "[B, Lk, 2, Hkv, D]")
    r = dense_packed(op, {"q": q, "kv": kv}, _dense_q_kv, alibi_slopes=alibi_slopes,
                     extra_outputs=_s_dmask_check(dropout_p, return_attn_probs),
                     **_flash_options(op, softmax_scale, causal, window_size, softcap, dropout_p,
                                      backend))
    return _dense_result(r, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           backend=None):
    """flash_attn.flash_attn_varlen_func: a batch of sequences of different lengths packed
    along the rows, q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; sequence b
    owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of
    k and v (int32 [B + 1]); max_seqlen_q and max_seqlen_k bound the lengths. Returns
    out [total_q, Hq, Dv], or (out, softmax_lse [Hq, total_q], S_dmask) with
    return_attn_probs (S_dmask [B, Hq, max_seqlen_q, max_seqlen_k] with dropout).

    causal (lower-right), window_size, softcap and alibi_slopes ([Hq] or [B, Hq]) apply per
    sequence on its own lengths; query rows past cu_seqlens_q[-1] get out 0 and lse -inf.
    seqused_k (int32 [B], keyword only, not in flash-attn's function): sequence b uses only its
    first seqused_k[b] keys. block_table (int32 [B, max_pages_per_seq]) makes k and v page
    pools [num_pages, page_size, Hkv, D] (flash-attn's paged varlen call, forward only):
    sequence b's keys are its first seqused_k[b] (else cu_seqlens_k[b+1] - cu_seqlens_k[b])
    slots of its pages; dropout is refused with it. Other options as flash_attn_func's.
    """
    op = "flash_attn_varlen_func"
    if (alibi_slopes is None and type(causal) is bool and type(deterministic) is bool
            and return_attn_probs is False):
        # The fast path (attncore._core.attend_varlen: its comment says which calls it takes),
        # None for the others. Its results are the general path's, bit for bit.
        out = _core.attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, seqused_k, block_table, softmax_scale, causal,
                                  window_size, softcap, dropout_p, backend)
        if out is not None:
            return out
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    paged = block_table is not None
    if paged:  # (page pools: forward only)
        refuse_grad(op, (("q", q), ("k", k), ("v", v)))
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_shape(op, name, x, "[num_pages, page_size, H, D]" if paged and name != "q"
                     else "[total, H, D]", 4 if paged and name != "q" else 3)
    r = varlen_packed(op, {"q": q, "k": k, "v": v}, separate, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, seqused_k=seqused_k, attn_mask=None,
                      alibi_slopes=alibi_slopes, block_table=block_table,
                      extra_outputs=None if paged else _s_dmask_check(dropout_p,
                                                                      return_attn_probs),
                      **_flash_options(op, softmax_scale, causal, window_size, softcap,
                                       dropout_p, backend))
    return _varlen_result(r, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, seqused_k=None, backend=None):
    """flash_attn.flash_attn_varlen_qkvpacked_func: flash_attn_varlen_func on one packed
    tensor qkv [total, 3, H, D] (q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2], read in place)
    whose queries and keys share cu_seqlens (int32 [B + 1]) and max_seqlen. Returns
    out [total, H, D], or (out, softmax_lse [H, total], S_dmask) with return_attn_probs; under
    torch autograd the gradient is one tensor shaped like qkv. Options as
    flash_attn_varlen_func's.
    """
    op = "flash_attn_varlen_qkvpacked_func"
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    _check_shape(op, "qkv", qkv, "[total, 3, H, D]", 4, 1, 3)
    r = varlen_packed(op, {"qkv": qkv}, _varlen_qkv, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                      seqused_k=seqused_k, attn_mask=None, alibi_slopes=alibi_slopes,
                      extra_outputs=_s_dmask_check(dropout_p, return_attn_probs),
                      **_flash_options(op, softmax_scale, causal, window_size, softcap,
                                       dropout_p, backend))
    return _varlen_result(r, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, seqused_k=None, backend=None):
    """flash_attn.flash_attn_varlen_kvpacked_func: flash_attn_varlen_func with keys and values
    packed in one tensor kv [total_k, 2, Hkv, D] (k, v = kv[:, 0], kv[:, 1], read in place)
    and q [total_q, Hq, D]. Returns out [total_q, Hq, D], or (out, softmax_lse [Hq, total_q],
    S_dmask) with return_attn_probs; under torch autograd kv's gradient is one tensor shaped
    like kv. Options as flash_attn_varlen_func's.
    """
    op = "flash_attn_varlen_kvpacked_func"
    causal, return_attn_probs = _flash_flags(op, causal, deterministic, return_attn_probs)
    _check_shape(op, "q", q, "[total, H, D]", 3)
    _check_shape(op, "kv", kv, "[total, 2, H, D]", 4, 1, 2)
    r = varlen_packed(op, {"q": q, "kv": kv}, _varlen_q_kv, cu_seqlens_q, cu_seqlens_k,
                      max_seqlen_q, max_seqlen_k, seqused_k=seqused_k, attn_mask=None,
                      alibi_slopes=alibi_slopes,
                      extra_outputs=_s_dmask_check(dropout_p, return_attn_probs),
                      **_flash_options(op, softmax_scale, causal, window_size, softcap,
                                       dropout_p, backend))
    return _varlen_result(r, return_attn_probs)
