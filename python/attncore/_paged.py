"""Paged KV caches: attncore.PagedKVCache (the C++ PagedKvCache: pages, page table and lengths
as numpy arrays or torch tensors over the cache's own memory). Forward only.
attncore.torch.PagedAttention is in _paged_torch; flash_attn_varlen_func over page pools is the
library's varlen call (_dropins).
"""

import numbers
import re
import sys
import typing

import numpy as np

from . import _arrays, _copies, _core, _writes
from ._merge import refuse_grad
from ._rank4 import INT32_MAX, int_option

_CORE_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


class PagedViews(typing.NamedTuple):
    """A PagedKVCache's arrays, all over its own memory (no copies): k_cache [num_pages,
    page_size, Hkv, D], v_cache [num_pages, page_size, Hkv, Dv], page_table int32
    [max_batch_size, max_pages_per_seq] (-1 unmapped), seqlens int32 [max_batch_size]."""

    k_cache: object
    v_cache: object
    page_table: object
    seqlens: object


def _dtype_name(dtype):
    """("float32" | "float64" | "float16" | "bfloat16", whether a torch dtype was given):
    TypeError for what is no dtype (None included), ValueError for dtypes of no cache."""
    torch = sys.modules.get("torch")
    torch_given = torch is not None and isinstance(dtype, torch.dtype)
    if torch_given:
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = None if dtype is None else np.dtype(dtype).name
        except TypeError:
            name = None
        if name is None:
            raise TypeError(f"PagedKVCache: dtype is not a dtype (type={type(dtype).__name__}, "
                            "expected a string, numpy dtype or torch dtype)")
    if name not in _CORE_DTYPES:
        raise ValueError(f"PagedKVCache: dtype is not a cache dtype (dtype={name}, expected "
                         "float32, float64, float16 or bfloat16)")
    return name, torch_given


def _index(op, name, x):
    """An int argument that may come as a one-element tensor or array (torch's style); a
    tensor attncore cannot read (another device, meta) raises NotImplementedError."""
    if hasattr(x, "shape") and not isinstance(x, np.generic):
        x = _arrays.adopt(x, op, name)[1]
        if tuple(x.shape) in ((), (1,)):
            x = x.reshape(()).item()
    return int_option(op, name, x)


def _positions(op, x, reserved=None):
    """input_pos as a contiguous int32 numpy array [S]; with reserved = (batch_idx, capacity),
    more positions than the capacity are refused first, before they are scanned or converted
    (PagedKvCache::assign's own check, src/paged/paged_kv_cache.cpp, in its words)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        x = _arrays.adopt(x, op, "input_pos")[1].detach().numpy()
    if x is None or isinstance(x, (str, bytes, bytearray, memoryview, numbers.Number)):
        raise TypeError(f"{op}: input_pos is not a sequence of positions (type="
                        f"{type(x).__name__}, expected [S] integers)")
    try:
        array = np.asarray(x)
    except ValueError:  # a ragged sequence
        raise ValueError(f"{op}: input_pos is not a flat sequence of integers (type="
                         f"{type(x).__name__}, expected [S] positions)") from None
    if array.ndim != 1:
        raise ValueError(f"{op}: input_pos has the wrong rank (rank={array.ndim}, expected 1: "
                         "[S])")
    if reserved is not None and array.shape[0] > reserved[1]:
        raise ValueError(f"{op}: input_pos has more entries than batch_idx={reserved[0]} "
                         f"reserved (len(input_pos)={array.shape[0]}, expected <= capacity="
                         f"{reserved[1]}); reserve first")
    if array.size == 0 and isinstance(x, (list, tuple)):
        array = array.astype(np.int32)  # [] holds no positions, of no dtype
    if array.dtype.kind not in "iu":
        raise TypeError(f"{op}: input_pos is not an integer array (dtype={array.dtype}, expected "
                        "int32 or int64)")
    if array.size and (array.min() < -INT32_MAX - 1 or array.max() > INT32_MAX):
        i = int(np.argmax((array < -INT32_MAX - 1) | (array > INT32_MAX)))
        raise ValueError(f"{op}: input_pos is out of range (input_pos[{i}]={array[i]}, expected "
                         "int32 positions)")
    if array.dtype != np.int32 or not array.flags.c_contiguous:
        _copies.check_copy(op, "input_pos", array.shape, "int32", "pass int32 positions")
    return np.ascontiguousarray(array, dtype=np.int32)


# The C++ cache's names in its messages, and this class's (its methods' and arguments' names).
_CORE_NAMES = (
    (re.compile(r"\bPagedKvCache::(\w+)"), r"PagedKVCache.\1"),
    (re.compile(r"\bPagedKvCache\b"), "PagedKVCache"),
    (re.compile(r"\bmax_batch\b"), "max_batch_size"),
    (re.compile(r"\bheads_kv\b"), "num_heads"),
    (re.compile(r"\b([kv])_pages\b"), r"\1_cache"),
    (re.compile(r"\bpositions\b(?=\[| is | repeats| has )|(?<=len\()positions\b"), "input_pos"),
    (re.compile(r"(?<![\w\[])([kv])\b(?![_\[])"), r"\1_val"),  # (assign's k, v)
)


class _CoreNames:
    """Errors of the C++ cache re-raised naming this class, its methods and their arguments
    (PagedKvCache::assign's k -> PagedKVCache.assign's k_val), so that a message names the
    call the user made."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or not isinstance(error, (ValueError, TypeError, MemoryError,
                                                   NotImplementedError)):
            return False
        message = str(error)
        if not message.startswith("PagedKvCache"):
            return False
        for pattern, name in _CORE_NAMES:
            message = pattern.sub(name, message)
        raise type(error)(message) from None


class PagedKVCache:
    """A paged KV cache owning its pages (C++ attncore::PagedKvCache, attncore/paged.h).

    num_pages pages of page_size slots (any page_size >= 1) for num_heads key/value heads of
    head_dim (values head_dim_v, default head_dim), dtype float32, float64, float16 or bfloat16
    (a string, numpy dtype or torch dtype), max_batch_size sequences of up to max_pages_per_seq
    pages each (default num_pages). k_cache, v_cache, page_table and seqlens are views of the
    cache's own memory (no copies; they stay valid while the cache lives), torch tensors when
    dtype was a torch dtype (or bfloat16 by any name), else numpy arrays; views(library) gives
    them in either library (bfloat16 only as torch). Pass them straight to flash_attn_with_kvcache:

        flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k=k, v=v,
                                cache_seqlens=cache.seqlens, block_table=cache.page_table)

    reserve / erase / assign follow torch's PagedAttention with stricter checks (positions
    must lie in what reserve gave and be distinct; out of pages raises MemoryError naming the
    numbers; free_pages() asks first). fork(src, dst, prefix_len) shares src's first
    prefix_len slots with the empty sequence dst without copying; assign copies a shared page
    before writing it (copy-on-write). Appends through flash_attn_with_kvcache(k=, v=) write the
    pages as mapped, bypassing copy-on-write, and leave seqlens to the caller (flash-attn's
    convention). Not thread-safe: one thread at a time may change a cache, and no change may
    overlap an attention call that reads it (calls that only read it may run concurrently).
    """

    def __init__(self, num_pages, page_size, num_heads, head_dim, max_batch_size,
                 dtype="float32", *, head_dim_v=None, max_pages_per_seq=None):
        op = "PagedKVCache"
        self._dtype, torch_given = _dtype_name(dtype)
        if self._dtype == "bfloat16" and not torch_given:  # (numpy has no bfloat16)
            try:
                import torch  # noqa: F401 - its views are the cache's
            except ImportError:
                raise ValueError(f"{op}: dtype bfloat16 needs torch (dtype='bfloat16', expected "
                                 "torch installed, or another dtype): numpy has no "
                                 "bfloat16") from None
            torch_given = True
        self._library = "torch" if torch_given else "numpy"
        sizes = [int_option(op, name, value) for name, value in (
            ("num_pages", num_pages), ("page_size", page_size), ("num_heads", num_heads),
            ("head_dim", head_dim), ("head_dim_v", head_dim if head_dim_v is None else head_dim_v),
            ("max_batch_size", max_batch_size),
            ("max_pages_per_seq", 0 if max_pages_per_seq is None else max_pages_per_seq))]
        with _CoreNames():
            self._core = _core.PagedKvCache(*sizes[:5], _CORE_DTYPES[self._dtype], *sizes[5:])
        self._numpy = PagedViews(*(self._core.array(name)
                                   for name in ("k", "v", "page_table", "seqlens")))
        self._torch = None

    def views(self, library):
        """PagedViews in "numpy" or "torch", over the cache's memory."""
        if library == "torch":
            if self._torch is None:
                import torch
                with torch.inference_mode(False):  # (normal tensors, written anywhere)
                    k, v, table, lens = (torch.from_numpy(x) for x in self._numpy)
                if self._dtype == "bfloat16":  # numpy holds the bits as int16
                    k, v = k.view(torch.bfloat16), v.view(torch.bfloat16)
                self._torch = PagedViews(k, v, table, lens)
            return self._torch
        if library != "numpy":
            raise ValueError(f"PagedKVCache.views: library is unknown (library={library!r}, "
                             "expected 'numpy' or 'torch')")
        if self._dtype == "bfloat16":
            raise ValueError("PagedKVCache.views: numpy has no bfloat16 (dtype=bfloat16, "
                             "expected library='torch')")
        return self._numpy

    k_cache = property(lambda self: self.views(self._library).k_cache,
                       doc="[num_pages, page_size, Hkv, D]")
    v_cache = property(lambda self: self.views(self._library).v_cache,
                      doc="[num_pages, page_size, Hkv, Dv]")
    page_table = property(lambda self: self.views(self._library).page_table,
                          doc="int32 [max_batch_size, max_pages_per_seq], -1 unmapped")
    seqlens = property(lambda self: self.views(self._library).seqlens,
                       doc="int32 [max_batch_size]: each sequence's length")

    def reserve(self, batch_idx, seq_len):
        """Maps free pages until sequence batch_idx holds at least seq_len slots."""
        op = "PagedKVCache.reserve"
        batch_idx, seq_len = _index(op, "batch_idx", batch_idx), _index(op, "seq_len", seq_len)
        with _CoreNames():
            self._core.reserve(batch_idx, seq_len)

    def erase(self, batch_idx):
        """Unmaps the sequence's pages (freeing those no other sequence shares); length 0."""
        batch_idx = _index("PagedKVCache.erase", "batch_idx", batch_idx)
        with _CoreNames():
            self._core.erase(batch_idx)

    def assign(self, batch_idx, input_pos, k_val, v_val):
        """Writes k_val [S, Hkv, D], v_val [S, Hkv, Dv] at slots input_pos [S] of the
        sequence (reserved, distinct), copying shared pages first; its length becomes at least
        max(input_pos) + 1."""
        op = "PagedKVCache.assign"
        refuse_grad(op, (("k_val", k_val), ("v_val", v_val)))
        b = _index(op, "batch_idx", batch_idx)
        try:
            with _CoreNames():
                reserved = (b, self._core.capacity(b))
        except ValueError as error:  # (a bad batch_idx: named as this call's)
            message = str(error).replace("PagedKVCache.capacity:", f"{op}:", 1)
            raise ValueError(message) from None
        arrays = []
        for name, x in (("k_val", k_val), ("v_val", v_val)):
            lib, arr, _ = _arrays.adopt(x, op, name)
            arrays.append(lib.to_core(arr))  # (any strides: the library reads them)
        positions = _positions(op, input_pos, reserved)
        with _CoreNames():
            self._core.assign(b, positions, *arrays)
        if self._torch is not None:  # (views a graph may have saved: as after an in-place op)
            _writes.mark_written(self._torch.k_cache, self._torch.v_cache)

    def fork(self, src, dst, prefix_len):
        """Gives the empty sequence dst the first prefix_len slots of src, sharing pages."""
        op = "PagedKVCache.fork"
        sizes = [_index(op, name, x) for name, x in (("src", src), ("dst", dst),
                                                     ("prefix_len", prefix_len))]
        with _CoreNames():
            self._core.fork(*sizes)

    def free_pages(self):
        """How many pages no sequence holds (what reserve and copy-on-write can still take)."""
        return self._core.free_pages()

    def capacity(self, batch_idx):
        """Slots the sequence has reserved (its pages times page_size)."""
        batch_idx = _index("PagedKVCache.capacity", "batch_idx", batch_idx)
        with _CoreNames():
            return self._core.capacity(batch_idx)

    def references(self, page):
        """How many sequences map this page (0: free)."""
        page = _index("PagedKVCache.references", "page", page)
        with _CoreNames():
            return self._core.references(page)
