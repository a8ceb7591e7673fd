"""The variable-length calls into attncore._core: Seqs (a call's index arrays and maximum
lengths) and VarlenKernel (forward and backward on packed views q [total_q, Hq, D],
k [total_k, Hkv, D], v [total_k, Hkv, Dv]; out [total_q, Hq, Dv], lse [Hq, total_q]; with a
block_table, forward only, k and v are page pools [num_pages, page_size, Hkv, D]).

Index arrays (cu_seqlens_q, cu_seqlens_k [B + 1], seqused_k [B], block_table [B,
max_pages_per_seq]) are int32 arrays of any
library the package takes, read in place where their last stride is 1 (else copied; a table
that repeats one entry along its last dim, a broadcast the copy would expand, is refused); a list
or tuple of ints becomes an int32 numpy array.
Their ranks and integer dtypes are checked here, the rest by the library.
"""

import math
import numbers
import sys
import typing

import numpy as np

from . import _arrays, _copies, _core
from ._rank4 import core_or_none, int_option, lse_dtype, times


def index_array(op, name, x, rank=None, layout=""):
    """An index array as _core reads it: numpy arrays and torch tensors as they are (copied
    where their last stride is not 1, numpy arrays with negative strides too; ValueError for a
    broadcast last dim of a table, which the copy would expand), other DLPack
    producers through numpy (else torch), lists and tuples of ints (and empty ones) as int32
    numpy. With `rank`, ValueError for another rank (layout, such as "[B + 1]", ends the
    message) before the dtype is checked."""
    if x is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        lib, array = _arrays.TORCH, _arrays.TORCH.asarray(x, op, name).detach()
    elif isinstance(x, (list, tuple)):
        lib, array = _arrays.NUMPY, _int_sequence(op, name, x)
    else:
        lib, array, _ = _arrays.adopt(x, op, name)
    if rank is not None and len(array.shape) != rank:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={len(array.shape)}, expected "
                         f"{rank}: {layout})")
    # (The library reads an index array's last dim with unit stride; a table's rows may lie
    # anywhere: block_table[:, :n] is read in place. A table whose rows repeat one entry, a
    # broadcast last dim, would be expanded by that copy: refused instead.)
    array = _int32(op, name, array)
    shape, strides = tuple(array.shape), lib.strides(array)
    if len(shape) >= 2 and shape[-1] > 1 and strides[-1] == 0 and math.prod(shape) > 0:
        raise ValueError(f"{op}: {name} repeats one entry along its last dim, a broadcast that "
                         f"a copy would expand (shape={list(shape)}, strides={list(strides)}, "
                         "expected a last stride of 1); pass it with its entries in memory")
    return lib.unit_last_stride(array, op, name)


def _is_bool(v):
    return isinstance(v, (bool, np.bool_))


def _int_sequence(op, name, x):
    """A list or tuple (nested: a table) as a numpy array: integers as int32 (ValueError past
    int32, Python ints of any size included), an empty one as int32 [0], floats and bools alone
    as they are (refused by the library); TypeError for a bool among integers (which numpy
    would read as 0 or 1)."""
    entries = list(_arrays.leaves(x))
    bools = [(at, v) for at, v in entries if _is_bool(v)]
    if bools and len(bools) < len(entries):
        at, v = bools[0]
        raise TypeError(f"{op}: {name} holds a bool among integers "
                        f"({_arrays.index_text(name, at)}={v}, expected integers)")
    values = [v for _, v in entries]
    if values and not bools and all(isinstance(v, numbers.Integral) for v in values):
        _check_int32(op, name, [int(v) for v in values])  # (before numpy reads them)
        array = np.array(x, dtype=object)  # (Python ints, or other Integral types)
        if array.size == len(values):  # (else ragged: refused below)
            return array.astype(np.int32)
    array = _arrays.NUMPY.asarray(x, op, name)
    if array.size == 0:
        return array.astype(np.int32)
    if array.dtype.kind not in "iu":
        return array
    _check_int32(op, name, (array.min(), array.max()))
    return array.astype(np.int32)


def _check_int32(op, name, values):
    low, high = min(values), max(values)
    if low < -2 ** 31 or high >= 2 ** 31:
        raise ValueError(f"{op}: {name} holds values past int32 (min="
                         f"{_arrays.number_text(low)}, max={_arrays.number_text(high)}, "
                         "expected -2^31 <= value < 2^31)")


def cu_seqlens_array(op, name, x):
    """cu_seqlens (int32 [B + 1]) as index_array gives it: TypeError for None, ValueError for
    another rank."""
    if x is None:
        raise TypeError(f"{op}: {name} is not an array (type=NoneType, expected an int32 "
                        "array [B + 1])")
    return index_array(op, name, x, 1, "[B + 1]")


def _int32(op, name, array):
    """array, or ValueError for an integer dtype other than int32 (the library has no other
    integer dtype; floats go on to its own refusal)."""
    dtype = str(array.dtype).removeprefix("torch.")
    if dtype != "int32" and dtype.startswith(("int", "uint")):
        raise ValueError(f"{op}: {name} has the wrong dtype (dtype={dtype}, expected int32)")
    return array


def max_seqlen(op, name, value):
    """A maximum length as an int: TypeError for anything but an integer, ValueError past what
    the library's int64 holds."""
    return int_option(op, name, value)


class Seqs(typing.NamedTuple):
    """One varlen call's sequences: int32 cu_seqlens_q, cu_seqlens_k [B + 1], seqused_k [B] or
    None, the maximum lengths (which address dropout as a padded batch would), and an int32
    block_table [B, max_pages_per_seq] or None (k and v are then page pools, forward only)."""

    cu_seqlens_q: object
    cu_seqlens_k: object
    seqused_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: object = None

    @classmethod
    def of(cls, op, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None,
           block_table=None):
        """The sequences of call `op` (named in errors)."""
        return cls(cu_seqlens_array(op, "cu_seqlens_q", cu_seqlens_q),
                   cu_seqlens_array(op, "cu_seqlens_k", cu_seqlens_k),
                   index_array(op, "seqused_k", seqused_k, 1, "[B]"),
                   max_seqlen(op, "max_seqlen_q", max_seqlen_q),
                   max_seqlen(op, "max_seqlen_k", max_seqlen_k),
                   index_array(op, "block_table", block_table, 2, "[B, max_pages_per_seq]"))

    @property
    def batch_size(self):
        """B, from cu_seqlens_q's length (0 where its shape is wrong: the library says so)."""
        shape = tuple(self.cu_seqlens_q.shape)
        return shape[0] - 1 if len(shape) == 1 and shape[0] >= 1 else 0

    def lengths(self):
        """(cu_seqlens_q, cu_seqlens_k, seqused_k or None) as numpy int arrays, for host-side
        bookkeeping after a call has validated them."""
        def host(x):
            if x is None:
                return None
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(x, torch.Tensor):
                return x.cpu().numpy().astype(np.int64)
            return np.asarray(x).astype(np.int64)
        return host(self.cu_seqlens_q), host(self.cu_seqlens_k), host(self.seqused_k)

    def core_args(self):
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, self.max_seqlen_q,
                self.max_seqlen_k)


def _dims(x, rank):
    """x's shape when it has this rank, else None (the library names the problem)."""
    shape = tuple(x.shape)
    return shape if len(shape) == rank else None


class VarlenKernel:
    """Forward and backward of one variable-length call: its sequences, ALiBi slopes ([Hq] or
    [B, Hq]) or None, options (an attncore._rank4.Call) and attn_mask (always refused by the
    library, passed on for its message). Call.q_factor is applied here."""

    def __init__(self, seqs, alibi, call, mask=None):
        self.seqs, self.alibi, self.call, self.mask = seqs, alibi, call, mask

    def forward(self, lib, q, k, v):
        """(out [total_q, Hq, Dv] laid out like q, lse [Hq, total_q])."""
        q_dims = _dims(q, 3)
        v_dims = _dims(v, 3 if self.seqs.block_table is None else 4)  # (page pools: rank 4)
        total_q, heads_q = q_dims[:2] if q_dims else (0, 0)
        dim_v = v_dims[-1] if v_dims else 0
        dtype = lib.dtype_name(q)
        _copies.check_new_arrays("forward", ((total_q, heads_q, dim_v), dtype),
                                 ((heads_q, total_q), lse_dtype(dtype)))
        out = (_arrays.empty_in_order_of(lib, q, (total_q, heads_q, dim_v), dtype) if q_dims
               else lib.empty((0, 0, 0), dtype))
        lse = lib.empty((heads_q, total_q), lse_dtype(dtype))
        _core.forward_varlen(lib.to_core(times(q, self.call.q_factor, "forward")), lib.to_core(k),
                             lib.to_core(v), *self.seqs.core_args(), lib.to_core(out),
                             lib.to_core(lse), core_or_none(lib, self.mask),
                             core_or_none(lib, self.alibi), self.call.core_options(),
                             block_table=self.seqs.block_table)
        return out, lse

    def backward(self, lib, dout, q, k, v, out, lse):
        """(dq, dk, dv), shaped and laid out like q, k, v."""
        dtype = lib.dtype_name(q)
        _copies.check_new_arrays("backward", *((tuple(x.shape), dtype) for x in (q, k, v)))
        grads = [_arrays.empty_in_order_of(lib, x, tuple(x.shape), dtype) if _dims(x, 3)
                 else lib.empty((0, 0, 0), dtype) for x in (q, k, v)]
        self.backward_into(lib, dout, q, k, v, out, lse, *grads)
        return tuple(grads)

    def backward_into(self, lib, dout, q, k, v, out, lse, dq, dk, dv):
        """The gradients written into dq, dk, dv (views shaped like q, k, v)."""
        factor = self.call.q_factor
        _core.backward_varlen(lib.to_core(dout), lib.to_core(times(q, factor, "backward")),
                              lib.to_core(k),
                              lib.to_core(v), lib.to_core(out), lib.to_core(lse),
                              *self.seqs.core_args(), lib.to_core(dq), lib.to_core(dk),
                              lib.to_core(dv), core_or_none(lib, self.mask),
                              core_or_none(lib, self.alibi), self.call.core_options())
        if factor != 1:
            dq[...] = dq * factor
