"""The array libraries attncore accepts, behind one small interface.

numpy arrays and torch tensors are used as they are. Any other object with ``__dlpack__`` is
wrapped without a copy as a numpy array (or, for dtypes numpy lacks such as bfloat16, as a torch
tensor) and the results go back through its own library's ``from_dlpack`` where it has one.
Sequences and buffer-protocol objects become numpy arrays; numpy subclasses (np.matrix) are
read as plain arrays, and numpy arrays with negative strides are copied.

Every conversion names the call and the argument in its errors: tensors outside CPU memory, not
strided or nested raise NotImplementedError; objects that are no arrays of numbers TypeError.

torch is never imported here: a tensor can only exist once its caller imported torch.
"""

import importlib
import math
import numbers
import sys

import numpy as np

from . import _copies


def _torch():
    return sys.modules.get("torch")


_NUMBER_KINDS = "biufc"  # numpy dtype kinds of numbers (b: bool)
_ARRAY_TYPES = "a numpy array, a torch tensor, an object with __dlpack__ or a sequence of numbers"


def number_text(x):
    """x as a message shows it: an integer (Python's or numpy's) in full, but one of more than 20
    digits (Python refuses to print one of more than 4300, and a message of thousands of digits
    helps no one) as its leading digits and power of ten, such as 1.23e+4000; anything else as
    its repr."""
    if not isinstance(x, numbers.Integral) or isinstance(x, (bool, np.bool_)):
        return repr(x)
    x = int(x)
    if abs(x) < 10 ** 20:
        return str(x)
    power = math.log10(abs(x))
    exponent = math.floor(power)
    digits = f"{10 ** (power - exponent):.3g}"
    if float(digits) >= 10:  # (rounded up to the next power)
        exponent, digits = exponent + 1, "1"
    return f"{'-' if x < 0 else ''}{digits}e+{exponent}"


def _folded_stride(sizes, strides):
    """The stride of dims (sizes, strides) folded into one (row-major order), or None where
    their elements lie in no single stride (a dim broadcast against another)."""
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    if not dims or any(n == 0 for n, _ in dims):
        return 0
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:
            return None
    return dims[-1][1]


def _type_name(x):
    return type(x).__name__


def _checked_tensor(x, op, name):
    """A torch tensor attncore can read, else NotImplementedError: in CPU memory, strided, not
    nested. A lazily negated or conjugated view is resolved (a copy)."""
    torch = _torch()
    if x.device.type != "cpu":
        raise NotImplementedError(f"{op}: {name} is not in CPU memory (device={x.device.type}, "
                                  "expected cpu); attncore has CPU backends only")
    if getattr(x, "is_nested", False):
        raise NotImplementedError(f"{op}: {name} is a nested tensor (is_nested=True, expected a "
                                  "dense tensor); the function "
                                  "attncore.torch.scaled_dot_product_attention takes nested "
                                  "query, key and value, all three")
    if x.is_quantized:
        raise ValueError(f"{op}: {name} is a quantized tensor (dtype="
                         f"{str(x.dtype).removeprefix('torch.')}, expected float32, float64, "
                         f"float16 or bfloat16); pass {name}.dequantize()")
    if x.layout != torch.strided:
        raise NotImplementedError(f"{op}: {name} has an unsupported layout (layout={x.layout}, "
                                  f"expected torch.strided); pass {name}.to_dense()")
    if x.is_neg() or x.is_conj():  # resolved into a copy, refused first where it would not fit
        x = _copies.compact_copy(TORCH, x, op, name, unit_last=False,
                         remedy=f"pass {name} resolved (its .resolve_neg() or .resolve_conj())")
    return x


def _checked_ndarray(x, op, name):
    """A numpy array as a plain ndarray (np.matrix and other subclasses viewed as ndarray;
    masked arrays and arrays of no numbers refused), copied where its strides are negative or
    not whole elements (check_copy first)."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{op}: {name} is a masked array (type={_type_name(x)}, expected a plain "
                        f"array); pass {name}.filled() or {name}.data")
    _refuse_no_numbers(x.dtype, op, name)
    if type(x) is not np.ndarray:
        x = x.view(np.ndarray)
    if any(s < 0 or s % x.itemsize for s in x.strides):
        x = _copies.compact_copy(NUMPY, x, op, name, unit_last=False)
    return x


def _refuse_no_numbers(dtype, op, name):
    """TypeError for a numpy dtype whose elements are no numbers: records (structured dtypes),
    Python objects, strings, bytes, dates. Numbers attncore does not take (int64, complex) are
    the library's ValueError."""
    if dtype.kind in _NUMBER_KINDS:
        return
    if dtype.fields is not None:
        remedy = f"; pass one field, such as {name}[{dtype.names[0]!r}]"
    elif dtype.kind == "O":
        remedy = f"; convert it with {name}.astype(dtype)"
    else:
        remedy = ""
    raise TypeError(f"{op}: {name} is not an array of numbers (dtype={dtype}, expected a numeric "
                    f"dtype){remedy}")


def leaves(x):
    """(index, entry) of nested lists and tuples x, in order, index the tuple of positions
    (iteratively: any depth). A list that holds itself is yielded as an entry where it recurs
    (numpy then refuses it as ragged)."""
    stack, path, open_ids = [iter(x)], [-1], {id(x)}
    containers = [x]
    while stack:
        for v in stack[-1]:
            path[-1] += 1
            if isinstance(v, (list, tuple)) and id(v) not in open_ids:
                stack.append(iter(v))
                path.append(-1)
                open_ids.add(id(v))
                containers.append(v)
                break
            yield tuple(path), v
        else:
            stack.pop()
            path.pop()
            open_ids.discard(id(containers.pop()))


def index_text(name, at):
    """name[i][j]... for the index tuple at."""
    return name + "".join(f"[{i}]" for i in at)


def _from_sequence(x, op, name):
    """A numpy array of numbers made from a non-array object (a sequence, a scalar, a buffer),
    else TypeError (not numbers) or ValueError (ragged, numpy's words as its cause). An error
    the object itself raises while it is read (MemoryError, RuntimeError, ...) is left as it
    is."""
    try:
        array = np.asarray(x)
    except ValueError as e:
        raise ValueError(f"{op}: {name} is a ragged sequence (type={_type_name(x)}, expected "
                         "nested sequences of equal lengths)") from e
    except TypeError:
        array = None
    if array is not None and array.dtype.kind == "O" and isinstance(x, (list, tuple)):
        ints = [v for _, v in leaves(x)]
        if ints and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                        for v in ints):  # (numpy holds no integer past 64 bits)
            low, high = int(min(ints)), int(max(ints))
            if low < -2 ** 63 or high >= 2 ** 63:
                raise ValueError(f"{op}: {name} holds integers past int64 (min="
                                 f"{number_text(low)}, max={number_text(high)}, expected "
                                 "-2^63 <= value < 2^63)")
    if array is None or array.dtype.kind not in _NUMBER_KINDS:
        raise TypeError(f"{op}: {name} is not an array (type={_type_name(x)}, expected "
                        f"{_ARRAY_TYPES})")
    return array


def _dlpack_on_cpu(x, op, name):
    """NotImplementedError unless a DLPack producer says its memory is the CPU's."""
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return
    try:
        device_type = int(device()[0])
    except Exception as e:
        raise ValueError(f"{op}: {name} cannot be read through DLPack "
                         f"(type={_type_name(x)}, error={str(e)!r}, expected an array in CPU "
                         "memory)") from None
    if device_type not in (1, 3):  # kDLCPU, kDLCUDAHost
        raise NotImplementedError(f"{op}: {name} is not in CPU memory (dlpack device_type="
                                  f"{device_type}, expected 1 (CPU)); attncore has CPU backends "
                                  "only")


def refuse_lost_gradients(lib, op, named):
    """TypeError where a torch tensor that requires grad would be read as a numpy array (the
    call's library is the query's), which would drop its gradient without a word.
    named: (name, array or None) pairs as the caller passed them."""
    torch = _torch()
    if lib.is_torch or torch is None or not torch.is_grad_enabled():
        return
    for name, x in named:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise TypeError(f"{op}: {name} requires grad but the query is no torch tensor "
                            f"({name}.requires_grad=True, expected a torch query for gradients "
                            f"to flow); pass the query as a torch tensor, or {name}.detach()")


class _Numpy:
    """numpy arrays: read by attncore._core through the buffer protocol."""

    is_torch = False

    @staticmethod
    def asarray(x, op, name):
        """x as a numpy array (no copy where it is one, or a CPU tensor numpy can view)."""
        torch = _torch()
        if torch is not None and isinstance(x, torch.Tensor):
            x = _checked_tensor(x, op, name)
            if x.dtype == torch.bfloat16:
                raise ValueError(f"{op}: {name} has a dtype numpy lacks (dtype=bfloat16, "
                                 "expected a numpy dtype, as the query is no torch tensor); "
                                 "pass the query as a torch tensor")
            return _checked_ndarray(x.detach().numpy(), op, name)
        if isinstance(x, np.ndarray):
            return _checked_ndarray(x, op, name)
        if hasattr(x, "__dlpack__"):
            _dlpack_on_cpu(x, op, name)
            try:
                return _checked_ndarray(np.from_dlpack(x), op, name)
            except (BufferError, TypeError, RuntimeError, ValueError) as e:
                raise ValueError(f"{op}: {name} cannot be read as a numpy array through DLPack "
                                 f"(type={_type_name(x)}, error={str(e)!r}, expected a "
                                 "dtype numpy has); pass the query as a torch tensor") from None
        return _from_sequence(x, op, name)

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
    def unit_last_stride(x, op, name):
        """x, or a copy of it that attncore reads in place (compact_copy) where it cannot read x:
        a last stride other than 1, negative strides or strides that are not whole elements."""
        if not _Numpy.unit_last_stride_needs_copy(x):
            return x
        return _copies.compact_copy(NUMPY, x, op, name, remedy="pass it with a last stride of 1")

    @staticmethod
    def contiguous(x):
        return np.ascontiguousarray(x)

    @staticmethod
    def repeat_heads(x, r):
        return np.repeat(x, r, axis=-3)

    @staticmethod
    def broadcast(x, shape):
        """x [shape with 1s] broadcast to shape, as a writable view (np.broadcast_to's are
        read-only, which torch.from_numpy warns about): the call only reads it."""
        strides = tuple(0 if n != m else st for n, m, st in zip(shape, x.shape, x.strides))
        return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=True)

    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)  # a view unless the strides forbid one

    @staticmethod
    def fold(x, shape, unit_last=True):
        """x reshaped to `shape` as a view, or None where that takes a copy: strides that do
        not merge (a batch dim broadcast against another) or, with unit_last, a last stride
        attncore cannot read in place (as unit_last_stride)."""
        lead = x.ndim - (len(shape) - 1)  # x's dims folded into shape[0]
        stride = _folded_stride(x.shape[:lead], x.strides[:lead])
        if stride is None or tuple(x.shape[lead:]) != tuple(shape[1:]):
            return None
        y = np.lib.stride_tricks.as_strided(x, shape, (stride,) + x.strides[lead:],
                                            writeable=x.flags.writeable)
        if unit_last and _Numpy.unit_last_stride_needs_copy(y):
            return None
        return y

    @staticmethod
    def unit_last_stride_needs_copy(x):
        return not (all(s >= 0 and s % x.itemsize == 0 for s in x.strides) and (
            x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize))

    @staticmethod
    def standin(x, shape):
        """An array of this shape and x's dtype (byte order included) with a last stride of 1
        and no memory of its size (one row of zeros, broadcast): what the library's checks of a
        call read in place of x's copy (it is never computed with)."""
        return np.broadcast_to(np.zeros(shape[-1:], dtype=x.dtype), shape)

    @staticmethod
    def folded_copy(x, shape):
        """A contiguous copy of x with `shape` (x's elements in order)."""
        return np.ascontiguousarray(x).reshape(shape)

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
    def asarray(x, op, name):
        """x as a torch tensor (no copy where it is one, or an array torch can view)."""
        torch = _torch()
        if isinstance(x, torch.Tensor):
            return _checked_tensor(x, op, name)
        if isinstance(x, np.ndarray):
            return _torch_from_numpy(_checked_ndarray(x, op, name), op, name)
        if hasattr(x, "__dlpack__"):
            _dlpack_on_cpu(x, op, name)
            try:
                # torch asks a producer for __dlpack_device__; one without it is read through
                # its capsule, which names the device (checked below).
                source = x if hasattr(x, "__dlpack_device__") else x.__dlpack__()
                tensor = torch.utils.dlpack.from_dlpack(source)
            except (BufferError, TypeError, RuntimeError, ValueError) as e:
                raise ValueError(f"{op}: {name} cannot be read through DLPack "
                                 f"(type={_type_name(x)}, error={str(e)!r}, expected a "
                                 "strided CPU array)") from None
            return _checked_tensor(tensor, op, name)
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            return _torch_from_numpy(_from_sequence(x, op, name), op, name)

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
    def unit_last_stride(x, op, name):
        if not _Torch.unit_last_stride_needs_copy(x):
            return x
        return _copies.compact_copy(TORCH, x, op, name, remedy="pass it with a last stride of 1")

    @staticmethod
    def contiguous(x):
        return x.resolve_neg().resolve_conj().contiguous()

    @staticmethod
    def repeat_heads(x, r):
        return x.repeat_interleave(r, dim=-3)

    @staticmethod
    def broadcast(x, shape):
        return x.expand(shape)

    @staticmethod
    def reshape(x, shape):
        return x.reshape(shape)

    @staticmethod
    def fold(x, shape, unit_last=True):
        """As _Numpy.fold."""
        try:
            y = x.view(shape)  # refused where only a copy has that shape
        except RuntimeError:
            return None
        if unit_last and _Torch.unit_last_stride_needs_copy(y):
            return None
        return y

    @staticmethod
    def unit_last_stride_needs_copy(x):
        return not (x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1)

    @staticmethod
    def standin(x, shape):
        """As _Numpy.standin."""
        return _torch().zeros(shape[-1:], dtype=x.dtype).expand(shape)

    @staticmethod
    def folded_copy(x, shape):
        """As _Numpy.folded_copy (a copy autograd sees)."""
        return x.contiguous().reshape(shape)

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
        require grad); bool as uint8 (torch 1.13 cannot export bool through DLPack), so a
        uint8 tensor of the caller's goes as a numpy view (the buffer protocol: refused as
        uint8, never taken for a bool mask)."""
        x = x.detach()
        torch = _torch()
        if x.dtype == torch.uint8:
            return x.numpy()
        return x.view(torch.uint8) if x.dtype == torch.bool else x


def _torch_from_numpy(x, op, name):
    try:
        return _torch().from_numpy(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{op}: {name} has an unsupported element type (dtype={x.dtype.str}, "
                         "expected float32, float64 or float16 for values, bool for masks, "
                         "int32 for indices, in native byte order)") from None


NUMPY = _Numpy()
TORCH = _Torch()


def adopt(x, op, name):
    """(library, array, give_back) for a caller's array: the library that holds it, the array
    in that library (no copy where attncore can read it in place) and the function that turns
    results into the caller's type. Errors name `name` and the call `op`."""
    torch = _torch()
    if isinstance(x, np.ndarray):
        return NUMPY, NUMPY.asarray(x, op, name), _same
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH, TORCH.asarray(x, op, name), _same
    if hasattr(x, "__dlpack__"):
        _dlpack_on_cpu(x, op, name)
        back = _back_through_dlpack(type(x))
        try:
            return NUMPY, _checked_ndarray(np.from_dlpack(x), op, name), back
        except (BufferError, TypeError, RuntimeError, ValueError):
            if torch is None:
                return NUMPY, NUMPY.asarray(x, op, name), back  # raises attncore's error
            return TORCH, TORCH.asarray(x, op, name), back
    return NUMPY, _from_sequence(x, op, name), _same


def shape_of(x, op, name):
    """The shape of any array adopt() takes."""
    return tuple(adopt(x, op, name)[1].shape)


def _same(result):
    return result


def _back_through_dlpack(cls):
    """The function that gives a result back in the library of a producer of class `cls`: the
    from_dlpack of its top-level module (the one already imported, else imported here);
    results stay as they are where there is none or that module cannot be imported."""
    module = getattr(cls, "__module__", None)
    root_name = module.split(".")[0] if isinstance(module, str) else ""
    root = sys.modules.get(root_name)
    if root is None and root_name:
        try:
            root = importlib.import_module(root_name)
        except ImportError:
            pass
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
    if lib.is_torch:
        # A tensor of its own, not a view of one laid out in order (autograd refuses in-place
        # operations on views that a custom Function returns, as attncore.torch's outputs).
        placed, running = [0] * rank, 1
        for d in reversed(order):
            placed[d], running = running, running * max(shape[d], 1)
        torch = _torch()
        return torch.empty_strided(tuple(shape), tuple(placed), dtype=getattr(torch, dtype_name))
    buffer = lib.empty(tuple(shape[d] for d in order), dtype_name)
    return lib.permute(buffer, tuple(order.index(d) for d in range(len(shape))))
