"""flash-attn 2.8.3's `flash_attn.bert_padding` helpers, written here in plain torch: they turn
a padded batch [B, L, ...] with a key-padding mask into the packed rows [total, ...] that the
variable-length functions take, and back. All are differentiable through torch's own indexing.

    index_first_axis(x, indices)             x[indices] along the first dim
    index_put_first_axis(values, indices, n) zeros [n, ...] with rows `indices` set to values
    unpad_input(hidden, attention_mask, unused_mask=None)
        -> (packed [total, ...], indices [total], cu_seqlens int32 [B + 1], max_seqlen,
            seqused int32 [B])
    pad_input(packed, indices, batch, seqlen) -> [batch, seqlen, ...], zeros where padded

Like flash-attn's, they take torch tensors only (TypeError for anything else) and run on any
device. Unlike flash-attn's, they check their arguments in attncore's message form: masks
[B, L] matching hidden_states, indices 1-D integer tensors (int32 taken as int64) inside the
rows they address, one per row given (distinct where rows are written), batch and seqlen
non-negative ints; new tensors past the memory this process may use raise MemoryError.
"""

import torch

from . import _copies
from ._rank4 import INT32_MAX, int_option


def _tensor(op, name, x, rank, layout):
    """x, a dense torch tensor of rank >= `rank`: TypeError for anything else,
    NotImplementedError for a nested or sparse tensor, ValueError for a lower rank (the message
    shows the expected shape as `layout`, such as "[B, L, ...]")."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} is not a torch tensor (type={type(x).__name__}, expected "
                        f"torch.Tensor); pass torch.as_tensor({name})")
    if getattr(x, "is_nested", False) or x.layout != torch.strided:
        raise NotImplementedError(f"{op}: {name} is not a dense tensor (layout="
                                  f"{'nested' if x.is_nested else x.layout}, expected "
                                  "torch.strided)")
    if x.dim() < rank:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={x.dim()}, expected >= {rank}: "
                         f"{layout})")
    return x


def _dtype_name(x):
    return str(x.dtype).removeprefix("torch.")


def _on_device_of(op, name, x, like, like_name):
    if x.device != like.device:
        raise ValueError(f"{op}: {name} is on another device (device={x.device}, expected "
                         f"{like_name}'s {like.device})")


def _mask(op, name, mask, hidden_states):
    """A [B, L] mask of hidden_states [B, L, ...] as bool (nonzero: True)."""
    mask = _tensor(op, name, mask, 0, "[B, L]")
    expected = list(hidden_states.shape[:2])
    if list(mask.shape) != expected:
        raise ValueError(f"{op}: {name} has shape {list(mask.shape)}, expected {expected} "
                         "([B, L] of hidden_states)")
    _on_device_of(op, name, mask, hidden_states, "hidden_states")
    return mask.bool()


def _indices(op, indices, values, values_name, rows, rows_text, distinct=False):
    """indices as int64 [n], each in [0, rows) (rows_text names that bound); n = the rows of
    values [n, ...] (values_name) unless values is None; distinct: no index repeats."""
    indices = _tensor(op, "indices", indices, 1, "[n]")
    if indices.dim() != 1:
        raise ValueError(f"{op}: indices has the wrong rank (rank={indices.dim()}, expected 1: "
                         "[n])")
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise ValueError(f"{op}: indices has the wrong dtype (dtype={_dtype_name(indices)}, "
                         "expected int64 or int32)")
    if values is not None and indices.shape[0] != values.shape[0]:
        raise ValueError(f"{op}: indices has the wrong length (len={indices.shape[0]}, expected "
                         f"{values.shape[0]}: one per row of {values_name})")
    # (Their int64 copy, and the copies torch's min, max and unique make of a broadcast one,
    # refused first where they would not fit: MemoryError in attncore's form.)
    _copies.check_copy(op, "indices", (indices.shape[0],), "int64", "pass fewer indices")
    indices = indices.long()
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= rows:
            raise ValueError(f"{op}: indices is out of range (min={low}, max={high}, expected "
                             f"0 <= index < {rows_text}={rows})")
    if distinct and indices.numel():
        unique = torch.unique(indices).numel()
        if unique != indices.numel():
            raise ValueError(f"{op}: indices has repeated entries (distinct={unique}, "
                             f"len={indices.numel()}, expected all distinct)")
    return indices


def index_first_axis(input, indices):
    """The rows `indices` (integer [n]) of input [N, ...] along its first dim: [n, ...]. The
    gradient is scattered back to those rows (summed where an index repeats)."""
    op = "index_first_axis"
    input = _tensor(op, "input", input, 1, "[N, ...]")
    indices = _indices(op, indices, None, "input", input.shape[0], "N")
    _on_device_of(op, "indices", indices, input, "input")
    _copies.check_new_arrays(op, ((indices.shape[0],) + tuple(input.shape[1:]),
                                  _dtype_name(input)))
    return input.index_select(0, indices)


def _put_rows(op, values, values_name, indices, rows, rows_text):
    """A tensor [rows, ...] (rows: an int >= 0) of zeros whose rows `indices` hold values
    [n, ...]; errors name `op`, values as values_name and rows as rows_text."""
    values = _tensor(op, values_name, values, 1, "[total, ...]")
    shape = (rows,) + tuple(values.shape[1:])
    _copies.check_new_arrays(op, (shape, _dtype_name(values)))
    indices = _indices(op, indices, values, values_name, rows, rows_text, distinct=True)
    _on_device_of(op, "indices", indices, values, values_name)
    return values.new_zeros(shape).index_copy(0, indices, values)


def index_put_first_axis(values, indices, first_axis_dim):
    """A tensor [first_axis_dim, ...] of zeros whose rows `indices` (integer [n], distinct)
    hold values [n, ...]."""
    op = "index_put_first_axis"
    first_axis_dim = int_option(op, "first_axis_dim", first_axis_dim, low=0)
    return _put_rows(op, values, "values", indices, first_axis_dim, "first_axis_dim")


# Elements of a mask counted at a time (torch sums a bool tensor through an int64 copy of it:
# 64 MiB a piece).
_COUNT_PIECE = 1 << 23


def _row_counts(mask):
    """The True elements of each row of a bool [B, L] mask, int64 [B], counted in pieces."""
    batch, seqlen = mask.shape
    # A broadcast dim (stride 0) is counted once: rows alike, or each row's columns alike (a
    # mask expanded to 2^30 elements took 8 s to count).
    if batch > 1 and mask.stride(0) == 0:
        return _row_counts(mask[:1]).expand(batch).clone()
    if seqlen > 1 and mask.stride(1) == 0:
        return mask[:, 0].to(torch.int64) * seqlen
    counts = torch.zeros(batch, dtype=torch.int64, device=mask.device)
    columns = max(1, min(seqlen, _COUNT_PIECE))
    rows = max(1, _COUNT_PIECE // columns)
    for r0 in range(0, batch, rows):
        for c0 in range(0, seqlen, columns):
            counts[r0:r0 + rows] += mask[r0:r0 + rows, c0:c0 + columns].sum(dim=-1)
    return counts


def _check_unused_last(op, used, kept):
    """ValueError unless each sequence's unused slots (kept, not used) all come after its
    real tokens: the varlen functions read a sequence's first seqused tokens as its keys."""
    if used.shape[-1] == 0:
        return
    unused = (kept & ~used).to(torch.uint8)  # [B, L]
    first_unused = unused.argmax(dim=-1)  # (0 where none)
    last_used = used.shape[-1] - 1 - used.to(torch.uint8).flip(-1).argmax(dim=-1)
    bad = unused.any(dim=-1) & used.any(dim=-1) & (first_unused < last_used)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"{op}: unused_mask marks a slot before a real token (sequence {b}: "
                         f"unused_mask[{b}][{int(first_unused[b])}] is before attention_mask"
                         f"[{b}][{int(last_used[b])}], expected each sequence's unused slots "
                         "after its real tokens)")


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of a padded batch, packed. hidden_states [B, L, ...]; attention_mask [B, L]
    (bool or 0/1 numbers; nonzero: a real token); unused_mask [B, L] or None: slots that are
    allocated but unused, kept in the packed rows (after each sequence's real tokens, as
    flash-attn expects) without counting as used.

    Returns (packed [total, ...], indices int64 [total] (the kept positions of the flattened
    [B * L] batch, in order), cu_seqlens int32 [B + 1] (from 0; sequence b owns packed rows
    cu_seqlens[b]:cu_seqlens[b + 1]), max_seqlen (a Python int), seqused int32 [B] (the real
    tokens of each sequence: the varlen functions' seqused_k))."""
    op = "unpad_input"
    hidden_states = _tensor(op, "hidden_states", hidden_states, 2, "[B, L, ...]")
    batch, seqlen = hidden_states.shape[:2]
    # The masks as bool, their union, and (with unused_mask) two byte copies for its check.
    _copies.check_new_arrays(op, *[((batch, seqlen), "bool")] * (5 if unused_mask is not None
                                                                 else 2))
    used = _mask(op, "attention_mask", attention_mask, hidden_states)
    kept = used
    if unused_mask is not None:
        kept = used | _mask(op, "unused_mask", unused_mask, hidden_states)
        _check_unused_last(op, used, kept)
    lengths = _row_counts(kept)
    starts = torch.cumsum(lengths, dim=0)
    total = int(starts[-1]) if batch else 0
    if total > INT32_MAX:
        raise ValueError(f"{op}: attention_mask keeps too many tokens (total={total}, expected "
                         f"<= {INT32_MAX}: cu_seqlens are int32)")
    seqused = _row_counts(used).to(torch.int32)
    cu_seqlens = torch.zeros(batch + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = starts.to(torch.int32)
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    _copies.check_new_arrays(op, ((total,), "int64"),
                             ((total,) + tuple(hidden_states.shape[2:]),
                              _dtype_name(hidden_states)))
    indices = torch.nonzero(kept.flatten()).flatten()
    try:  # [B * L, ...] as a view: only the kept rows are copied
        flat = hidden_states.view((-1,) + tuple(hidden_states.shape[2:]))
    except RuntimeError:  # (B and L fold into one only in a copy of the whole batch, as of a
        # broadcast batch: the kept rows gathered by their two indices instead)
        packed = hidden_states[indices // seqlen, indices % seqlen]
        return packed, indices, cu_seqlens, max_seqlen, seqused
    return flat.index_select(0, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """unpad_input's inverse: packed rows [total, ...] put back at `indices` (integer [total],
    distinct, in [0, batch * seqlen)) of a [batch, seqlen, ...] batch, zeros elsewhere."""
    op = "pad_input"
    batch = int_option(op, "batch", batch, low=0)
    seqlen = int_option(op, "seqlen", seqlen, low=0)
    out = _put_rows(op, hidden_states, "hidden_states", indices, batch * seqlen,
                    "batch * seqlen")
    return out.reshape((batch, seqlen) + tuple(out.shape[1:]))


__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]
