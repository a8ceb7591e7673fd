"""Drop-ins for torch.nn.functional.scaled_dot_product_attention and flash_attn.flash_attn_func:
their signatures and semantics, mapped onto attention()."""

from . import _arrays
from ._attention import attention


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, *, scale=None, enable_gqa=False, backend=None):
    """torch.nn.functional.scaled_dot_product_attention's semantics on numpy arrays, torch
    tensors (differentiable) or DLPack producers.

    query [..., Hq, L, E], key [..., Hkv, S, E], value [..., Hkv, S, Ev] -> [..., Hq, L, Ev].
    is_causal keeps j <= i (upper-left). attn_mask broadcasts to [..., Hq, L, S]: bool (True
    takes part), float32 or query's dtype (added). scale defaults to 1/sqrt(E). Without
    enable_gqa, key/value with one head serve every query head (as torch's broadcasting does).
    Dropout draws from attncore's generator (attncore.manual_seed), not torch's.
    backend (not in torch): None (automatic), "reference", "math", "flash" or an SDPBackend.
    """
    op = "scaled_dot_product_attention"
    if attn_mask is not None:
        if is_causal:
            raise ValueError(f"{op}: attn_mask is set with is_causal=True (expected at most one "
                             "of them)")
        mask_lib, mask, _ = _arrays.adopt(attn_mask)
        query_lib, query, _ = _arrays.adopt(query)
        mask_dtype, query_dtype = mask_lib.dtype_name(mask), query_lib.dtype_name(query)
        if mask_dtype not in ("bool", "float32", query_dtype):
            raise ValueError(f"{op}: attn_mask has the wrong dtype (dtype={mask_dtype}, "
                             f"expected bool, float32 or query's {query_dtype})")
    heads_kv = {s[-3] if len(s) >= 3 else 1 for s in (_arrays.shape_of(key),
                                                        _arrays.shape_of(value))}
    return attention(query, key, value, layout="bhld", scale=scale,
                     causal="upper-left" if is_causal else None, attn_mask=attn_mask,
                     dropout_p=dropout_p, enable_gqa=enable_gqa or heads_kv == {1},
                     backend=backend, _op=op)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, backend=None):
    """flash_attn.flash_attn_func's semantics on numpy arrays, torch tensors (differentiable)
    or DLPack producers.

    q [B, Lq, Hq, D], k [B, Lk, Hkv, D], v [B, Lk, Hkv, Dv] -> out [B, Lq, Hq, Dv], with
    Hkv dividing Hq. causal keeps j <= i + Lk - Lq (lower-right); window_size (left, right)
    around that diagonal, -1 = unbounded; softcap: s = softcap * tanh(s / softcap);
    alibi_slopes float32 [Hq] or [B, Hq]: s -= slope * |i + Lk - Lq - j|. With
    return_attn_probs returns (out, softmax_lse [B, Hq, Lq] float32, None). deterministic is
    accepted and has no effect: attncore's backward is deterministic. Dropout draws from
    attncore's generator (attncore.manual_seed).
    """
    op = "flash_attn_func"
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        rank = len(_arrays.shape_of(x))
        if rank != 4:
            raise ValueError(f"{op}: {name} has the wrong rank (rank={rank}, expected 4: "
                             "[B, L, H, D])")
    out, lse = attention(q, k, v, layout="blhd", scale=softmax_scale,
                         causal="lower-right" if causal else None, window_size=window_size,
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         enable_gqa=True, backend=backend, return_lse=True, _op=op)
    return (out, lse, None) if return_attn_probs else out
