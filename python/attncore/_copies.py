"""The memory of a call's new arrays and of its inputs' copies, refused (MemoryError, named)
before anything is allocated; the copies of inputs the library cannot read in place, of their
distinct elements only, and made only after the call's checks (LateCopies). Each function takes
the input's array library (_arrays.NUMPY or _arrays.TORCH) as `lib`."""

import math

from . import _core

_ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "bool": 1,
               "int32": 4, "int64": 8}


def _refuse_past_memory(op, what, count, size, remedy):
    """MemoryError where `size` bytes exceed the memory this process may use (memory_limit of
    attncore/info.h: the smallest of physical memory, the cgroup limit and RLIMIT_AS)."""
    limit, limit_name = _core.memory_limit()
    if size > limit:
        raise MemoryError(f"{op}: {what} the memory this process may use ({count}={size:.4g} "
                          f"bytes, expected <= {limit:.4g} bytes, {limit_name}); {remedy}")


def _bytes(shape, dtype_name):
    # (A dtype no call takes counts 8 bytes an element: the library refuses it after this.)
    return math.prod(shape) * _ITEM_BYTES.get(dtype_name, 8)


def check_new_arrays(op, *specs):
    """Refuses (MemoryError, docs/design.md section 4) new arrays of these (shape, dtype name)
    specs that together exceed the memory this process may use, before any is allocated: a
    call's outputs are checked here, its workspace by the library."""
    _refuse_past_memory(op, "the outputs exceed", "outputs",
                        sum(_bytes(shape, dtype) for shape, dtype in specs), "reduce the sizes")


def check_copy(op, name, shape, dtype_name, remedy="pass it with a last stride of 1"):
    """Refuses (MemoryError) a copy of an input of this shape that exceeds the memory this
    process may use, before it is made: an input attncore cannot read in place (a last stride
    other than 1, negative strides, a broadcast view) is copied, and a broadcast view can stand
    for far more elements than its memory holds."""
    _refuse_past_memory(op, f"{name} needs a contiguous copy larger than",
                        f"shape={list(shape)}, copy", _bytes(shape, dtype_name), remedy)


def _distinct_part(lib, x, whole_dims):
    """x with each broadcast dim (stride 0, size > 1) but `whole_dims` (negative indices) taken
    once: its distinct elements, which a copy holds in place of x's every element. A tensor that
    requires grad whole: each of its elements has a gradient of its own."""
    if getattr(x, "requires_grad", False):
        return x
    shape, strides = tuple(x.shape), x.stride() if lib.is_torch else x.strides
    rank = len(shape)
    return x[tuple(slice(0, 1) if st == 0 and n > 1 and d - rank not in whole_dims
                   else slice(None) for d, (n, st) in enumerate(zip(shape, strides)))]


def compact_copy(lib, x, op, name, unit_last=True,
                 remedy="pass it with non-negative strides of whole elements"):
    """A copy of x that the library reads in place (non-negative strides, the last one 1 with
    unit_last: that dim whole), of its distinct elements only (_distinct_part): its broadcast
    dims stay broadcast (stride 0), so that a view standing for far more elements than its
    memory holds is never expanded: a copy takes at most the memory of x's own elements
    (check_copy first)."""
    part = _distinct_part(lib, x, (-1,) if unit_last else ())
    check_copy(op, name, tuple(part.shape), lib.dtype_name(x), remedy)
    return lib.broadcast(lib.contiguous(part), tuple(x.shape))


def repeat_heads(lib, x, r, op, name, remedy):
    """x [..., H, L, E] with each head repeated r times in place ([..., H * r, L, E], as torch's
    repeat_interleave on dim -3): a copy of x's distinct elements (_distinct_part, the heads and
    the last dim whole) r times, its other broadcast dims kept broadcast, refused first where it
    would not fit (check_copy)."""
    part = _distinct_part(lib, x, (-3, -1))
    shape, part_shape = tuple(x.shape), tuple(part.shape)
    check_copy(op, name, part_shape[:-3] + (part_shape[-3] * r,) + part_shape[-2:],
               lib.dtype_name(x), remedy)
    return lib.broadcast(lib.repeat_heads(part, r), shape[:-3] + (shape[-3] * r,) + shape[-2:])


class LateCopies:
    """Inputs of one call copied only after its checks. An input the library cannot read in
    place (its last stride is not 1, or dims that fold into one only in a copy) is first
    replaced by a stand-in of its shape and dtype (one row of zeros broadcast: no memory of its
    size), which the library's checks of the call read (its explain_* entry); `real` then makes
    the copy, refused first where it would not fit (check_copy). Each method takes the input's
    array library (NUMPY or TORCH)."""

    def __init__(self, op):
        self.op = op
        self._copies = {}  # id(stand-in) -> (stand-in, lib, source, shape, name, remedy)

    def fold(self, lib, x, shape, name, unit_last=True):
        """x as `shape` (its leading dims folded into shape[0]; unit_last: with a last stride
        of 1): a view, or a stand-in for the copy."""
        view = lib.fold(x, shape, unit_last)
        if view is not None:
            return view
        if unit_last and lib.unit_last_stride_needs_copy(x):
            return self._standin(lib, x, shape, name)
        return self._standin(lib, x, shape, name, "reduce the sizes (its batch dims, broadcast "
                             "against another input's, fold into one only in a copy)")

    def unit_last_stride(self, lib, x, name):
        """x, or a stand-in for its copy where the library cannot read it in place."""
        if not lib.unit_last_stride_needs_copy(x):
            return x
        return self._standin(lib, x, tuple(x.shape), name)

    def _standin(self, lib, x, shape, name, remedy="pass it with a last stride of 1"):
        # (The stand-in holds one row: refused first where even that would not fit.)
        check_copy(self.op, name, tuple(shape[-1:]), lib.dtype_name(x), remedy)
        standin = lib.standin(x, shape)
        self._copies[id(standin)] = (standin, lib, x, shape, name, remedy)
        return standin

    @property
    def waiting(self):
        """Whether an input waits for its copy."""
        return bool(self._copies)

    def real(self, x):
        """x, or the copy of the input whose stand-in x is (made here, after the checks)."""
        if x is None or id(x) not in self._copies:
            return x
        _, lib, source, shape, name, remedy = self._copies.pop(id(x))
        if tuple(source.shape) == tuple(shape):  # (a last stride other than 1: compact)
            return compact_copy(lib, source, self.op, name, remedy=remedy)
        check_copy(self.op, name, shape, lib.dtype_name(source), remedy)
        return lib.folded_copy(source, shape)
