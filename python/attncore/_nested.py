"""Nested (jagged) tensors in torch SDPA's convention, [B, H, *, D] with query, key and value
all nested: run as one variable-length batch (attention_varlen) without padding, the result
nested again.

torch 1.13's nested tensors have no DLPack export and no autograd through custom Functions, so
the components are copied into packed [total, H, D] tensors and the output is copied back into
a new nested tensor; inputs that require grad are refused.
"""

import sys

from ._attention import attention_varlen


def _torch():
    return sys.modules["torch"]


def _components(op, name, x):
    """The [H, L_b, D] components of a nested tensor of rank 4."""
    if not getattr(x, "is_nested", False):
        raise NotImplementedError(
            f"{op}: {name} is not a nested tensor (is_nested=False, expected query, key and "
            "value all nested or none); pass them all as nested tensors, or all as dense "
            "tensors")
    if x.dim() != 4:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={x.dim()}, expected 4: "
                         "[B, H, *, D] nested)")
    parts = x.unbind()
    for b, part in enumerate(parts):
        if tuple(part.shape[::2]) != tuple(parts[0].shape[::2]):
            raise ValueError(f"{op}: {name} has components of different heads or head dims "
                             f"({name}[{b}] has shape {list(part.shape)}, expected "
                             f"[{parts[0].shape[0]}, *, {parts[0].shape[2]}] like {name}[0])")
    return parts


def _check_heads(op, query, key, value):
    """Query's, key's and value's components ([H, L_b, D] each, one shape but L_b per tensor)
    fit together, named as the caller passed them (the library would name the packed
    [total, H, D] tensors): key [Hkv, *, E] with Hkv dividing query's Hq and query's E, value
    [Hkv, *, Ev]."""
    (heads_q, _, dim), key_shape, value_shape = (list(x[0].shape) for x in (query, key, value))
    heads = key_shape[0]
    if heads_q == 0:  # (as the library names it for dense calls)
        raise ValueError(f"{op}: query has no heads (Hq=0, expected Hq >= 1)")
    if key_shape[2] != dim or heads == 0 or heads_q % heads:
        raise ValueError(f"{op}: key has components of shape {key_shape}, expected [Hkv, *, "
                         f"{dim}] ([B, Hkv, *, E] nested) with Hq % Hkv == 0 (Hq={heads_q}, "
                         f"Hkv={heads})")
    if value_shape[0] != heads:
        raise ValueError(f"{op}: value has components of shape {value_shape}, expected "
                         f"[{heads}, *, Ev] ([B, Hkv, *, Ev] nested, like key)")


def _packed(parts):
    """([total, H, D] tensor, int32 cu_seqlens [B + 1], max length) of [H, L_b, D] parts."""
    torch = _torch()
    lengths = [part.shape[1] for part in parts]
    cu_seqlens = torch.zeros(len(parts) + 1, dtype=torch.int32)
    if parts:
        cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return (torch.cat([part.transpose(0, 1) for part in parts]), cu_seqlens,
            max(lengths, default=0))


def _no_rows(parts):
    """A packed [0, H, D] tensor of the dtype of [H, L_b, D] parts."""
    heads, _, dim = parts[0].shape
    return _torch().empty((0, heads, dim), dtype=parts[0].dtype)


def scaled_dot_product_attention(op, query, key, value, *, attn_mask, dropout_p, is_causal,
                                 scale, enable_gqa, backend):
    """scaled_dot_product_attention on nested query [B, Hq, *, E], key [B, Hkv, *, E] and
    value [B, Hkv, *, Ev]: each batch entry attends within its own lengths (is_causal
    upper-left per entry). Returns nested [B, Hq, *, Ev]."""
    torch = _torch()
    parts = [_components(op, name, x) for x, name in
             ((query, "query"), (key, "key"), (value, "value"))]
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        raise NotImplementedError(
            f"{op}: nested tensors that require grad are not supported (requires_grad=True, "
            "expected False); torch 1.13 has no autograd for nested tensors through custom "
            "functions: pad the batch (torch.nested.to_padded_tensor) and pass a mask, or run "
            "under torch.no_grad()")
    if attn_mask is not None:
        raise NotImplementedError(
            f"{op}: attn_mask is not supported with nested tensors (attn_mask=given, expected "
            "None); each entry already attends within its own lengths")
    batch = len(parts[0])
    for x, name in zip(parts[1:], ("key", "value")):
        if len(x) != batch:
            raise ValueError(f"{op}: {name} has a different batch size (B={len(x)}, expected "
                             f"query's {batch})")
    if batch == 0:
        return torch.nested.nested_tensor([], dtype=query.dtype)
    _check_heads(op, *parts)
    key_lengths, value_lengths = ([part.shape[1] for part in x] for x in parts[1:])
    if key_lengths != value_lengths:
        raise ValueError(f"{op}: value has other lengths than key (lengths={value_lengths}, "
                         f"expected key's {key_lengths})")
    options = dict(scale=scale, causal="upper-left" if is_causal else None, dropout_p=dropout_p,
                   enable_gqa=enable_gqa or parts[1][0].shape[0] == 1, backend=backend, _op=op)
    # Every dtype, option and the backend checked before the copies, on a batch of as many
    # entries without rows ([0, H, D] stand-ins; its own seed, so that it draws none).
    no_rows = torch.zeros(batch + 1, dtype=torch.int32)
    attention_varlen(*(_no_rows(x) for x in parts), no_rows, no_rows, 0, 0, seed=0, offset=0,
                     **options)
    (q, cu_q, max_q), (k, cu_k, max_k) = _packed(parts[0]), _packed(parts[1])
    v = _packed(parts[2])[0]
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    bounds = cu_q.tolist()
    return torch.nested.nested_tensor([out[bounds[b]:bounds[b + 1]].transpose(0, 1)
                                       for b in range(batch)])
