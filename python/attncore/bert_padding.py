"""flash-attn 2.8.3's `flash_attn.bert_padding` helpers, written here in plain torch: they turn
a padded batch [B, L, ...] with a key-padding mask into the packed rows [total, ...] that the
variable-length functions take, and back. All are differentiable through torch's own indexing.

    index_first_axis(x, indices)             x[indices] along the first dim
    index_put_first_axis(values, indices, n) zeros [n, ...] with rows `indices` set to values
    unpad_input(hidden, attention_mask, unused_mask=None)
        -> (packed [total, ...], indices [total], cu_seqlens int32 [B + 1], max_seqlen,
            seqused int32 [B])
    pad_input(packed, indices, batch, seqlen) -> [batch, seqlen, ...], zeros where padded
"""

import torch


def index_first_axis(input, indices):
    """The rows `indices` (int64 [n]) of input [N, ...] along its first dim: [n, ...]. The
    gradient is scattered back to those rows (summed where an index repeats)."""
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """A tensor [first_axis_dim, ...] of zeros whose rows `indices` (int64 [n], distinct) hold
    values [n, ...]."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of a padded batch, packed. hidden_states [B, L, ...]; attention_mask [B, L]
    (bool or 0/1 ints; nonzero: a real token); unused_mask [B, L] or None: slots that are
    allocated but unused, kept in the packed rows (after each sequence's real tokens, as
    flash-attn expects) without counting as used.

    Returns (packed [total, ...], indices int64 [total] (the kept positions of the flattened
    [B * L] batch, in order), cu_seqlens int32 [B + 1] (from 0; sequence b owns packed rows
    cu_seqlens[b]:cu_seqlens[b + 1]), max_seqlen (a Python int), seqused int32 [B] (the real
    tokens of each sequence: the varlen functions' seqused_k))."""
    kept = attention_mask.bool()
    if unused_mask is not None:
        kept = kept | unused_mask.bool()
    lengths = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten()).flatten()
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """unpad_input's inverse: packed rows [total, ...] put back at `indices` of a [batch, seqlen,
    ...] batch, zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape((batch, seqlen) + tuple(hidden_states.shape[1:]))


__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]
