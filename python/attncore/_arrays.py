"""The array libraries attncore accepts, behind one small interface.

numpy arrays and torch tensors are used as they are. Any other object with ``__dlpack__`` is
wrapped without a copy as a numpy array (or, for dtypes numpy lacks such as bfloat16, as a torch
tensor) and the results go back through its own library's ``from_dlpack`` where it has one.
Sequences and buffer-protocol objects become numpy arrays.

torch is never imported here: a tensor can only exist once its caller imported torch.
"""

import importlib
import sys

import numpy as np


def _torch():
    return sys.modules.get("torch")


class _Numpy:
    """numpy arrays: read by attncore._core through the buffer protocol."""

    is_torch = False

    @staticmethod
    def asarray(x):
        torch = _torch()
        if torch is not None and isinstance(x, torch.Tensor):
            return x.detach().numpy()
        if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
            return np.from_dlpack(x)
        return np.asarray(x)

    @staticmethod
    def dtype_name(x):
        return x.dtype.name  # "float32", "float64", "float16", "bool"

    @staticmethod
    def empty(shape, dtype_name):
        return np.empty(shape, dtype=dtype_name)

    @staticmethod
    def zeros(shape, dtype_name):
        return np.zeros(shape, dtype=dtype_name)

    @staticmethod
    def strides(x):
        """Strides in elements (numpy counts bytes)."""
        return tuple(s // x.itemsize for s in x.strides)

    @staticmethod
    def unit_last_stride(x):
        """x, or a contiguous copy where attncore cannot read it in place: a last stride other
        than 1, negative strides or strides that are not whole elements."""
        ok = all(s >= 0 and s % x.itemsize == 0 for s in x.strides) and (
            x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize)
        return x if ok else np.ascontiguousarray(x)

    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)  # a view unless the strides forbid one

    @staticmethod
    def swap(x, a, b):
        return x.swapaxes(a, b)

    @staticmethod
    def permute(x, axes):
        return x.transpose(axes)

    @staticmethod
    def broadcast_to(x, shape):
        return np.broadcast_to(x, shape)

    @staticmethod
    def sum_to(x, shape):
        """x summed over the dims where `shape` (of the same rank) has size 1 and x has not."""
        axes = tuple(d for d, n in enumerate(shape) if n == 1 and x.shape[d] != 1)
        return x.sum(axis=axes, keepdims=True) if axes else x

    @staticmethod
    def to_core(x):
        return x


class _Torch:
    """torch tensors: read by attncore._core through DLPack (bf16 included)."""

    is_torch = True

    @staticmethod
    def asarray(x):
        torch = _torch()
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)
        if hasattr(x, "__dlpack__"):
            return torch.utils.dlpack.from_dlpack(x)
        return torch.as_tensor(x)

    @staticmethod
    def dtype_name(x):
        return str(x.dtype).removeprefix("torch.")  # "float32", ..., "bfloat16", "bool"

    @staticmethod
    def empty(shape, dtype_name):
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype_name))

    @staticmethod
    def zeros(shape, dtype_name):
        torch = _torch()
        return torch.zeros(shape, dtype=getattr(torch, dtype_name))

    @staticmethod
    def strides(x):
        return x.stride()

    @staticmethod
    def unit_last_stride(x):
        ok = x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1
        return x if ok else x.contiguous()

    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)

    @staticmethod
    def swap(x, a, b):
        return x.transpose(a, b)

    @staticmethod
    def permute(x, axes):
        return x.permute(axes)

    @staticmethod
    def broadcast_to(x, shape):
        return x.expand(shape)

    @staticmethod
    def sum_to(x, shape):
        dims = tuple(d for d, n in enumerate(shape) if n == 1 and x.shape[d] != 1)
        return x.sum(dim=dims, keepdim=True) if dims else x

    @staticmethod
    def to_core(x):
        """What attncore._core reads: the tensor without autograd (DLPack refuses tensors that
        require grad); bool as uint8 (torch 1.13 cannot export bool through DLPack)."""
        x = x.detach()
        return x.view(_torch().uint8) if x.dtype == _torch().bool else x


NUMPY = _Numpy()
TORCH = _Torch()


def adopt(x):
    """(library, array, give_back) for a caller's array: the library that holds it, the array
    in that library (no copy) and the function that turns results into the caller's type."""
    torch = _torch()
    if isinstance(x, np.ndarray):
        return NUMPY, x, _same
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH, x, _same
    if hasattr(x, "__dlpack__"):
        back = _back_through_dlpack(type(x))
        try:
            return NUMPY, np.from_dlpack(x), back
        except (BufferError, TypeError, RuntimeError, ValueError):
            if torch is None:
                raise
            return TORCH, torch.utils.dlpack.from_dlpack(x), back
    return NUMPY, np.asarray(x), _same


def shape_of(x):
    """The shape of any array adopt() takes."""
    return tuple(adopt(x)[1].shape)


def _same(result):
    return result


def _back_through_dlpack(cls):
    root = importlib.import_module(cls.__module__.split(".")[0])
    from_dlpack = getattr(root, "from_dlpack", None)
    if from_dlpack is None:
        return _same
    return lambda result: from_dlpack(result) if result is not None else None


def empty_in_order_of(lib, like, shape, dtype_name):
    """A new array of `shape` whose dims lie in memory in the order of `like`'s strides (largest
    first), so that the result of a [B, L, H, D] input viewed as [B, H, L, D] is itself a
    [B, L, H, D] buffer seen as [B, H, L, D]. The last dim stays innermost (attncore writes
    head dims with unit stride), also where `like` has a stride-0 (broadcast) dim."""
    strides = lib.strides(like)
    rank = len(shape)
    order = sorted(range(rank - 1), key=lambda d: -strides[d]) + ([rank - 1] if rank else [])
    buffer = lib.empty(tuple(shape[d] for d in order), dtype_name)
    return lib.permute(buffer, tuple(order.index(d) for d in range(len(shape))))
