"""Paged KV caches: attncore.PagedKVCache (the C++ PagedKvCache: pages, page table and lengths
as numpy arrays or torch tensors over the cache's own memory) and the paged form of
flash_attn_varlen_func. Forward only. attncore.torch.PagedAttention is in _paged_torch.
"""

import numbers
import re
import sys
import typing

import numpy as np

from . import _arrays, _core, _writes
from ._kvcache import flash_attn_with_kvcache
from ._merge import refuse_grad
from ._rank4 import INT32_MAX, int_option
from ._varlen import cu_seqlens_array, index_array

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
        raise ValueError(f"{op}: input_pos is out of range (max={array.max()}, expected int32 "
                         "positions)")
    if array.dtype != np.int32 or not array.flags.c_contiguous:
        _arrays.check_copy(op, "input_pos", array.shape, "int32", "pass int32 positions")
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


def _int32_index(op, name, x):
    """index_array(x); ValueError for a dtype other than int32, as the library gives."""
    array = index_array(op, name, x)
    dtype = str(array.dtype).removeprefix("torch.")
    if dtype != "int32":
        raise ValueError(f"{op}: {name} has the wrong dtype (dtype={dtype}, expected int32)")
    return array


def _host_index(op, name, x):
    """An int32 index array of a batch's offsets or lengths (index_array's forms) as an int64
    numpy copy for the checks here, refused first where it would not fit."""
    if x is None:
        return None
    array = _int32_index(op, name, x)
    _arrays.check_copy(op, name, tuple(array.shape), "int64")
    return np.array(array.numpy() if hasattr(array, "detach") else array, np.int64)


# Elements of an index table or of the queries read or gathered at a time (the pages' check,
# a call over several sequences): inputs broadcast over millions of rows claim far more than
# they hold, and are never copied whole.
_CHUNK_ELEMENTS = 1 << 20


def _check_pages(op, lengths, table, k_shape):
    """Every sequence's keys 0:L_b lie in pages of the pool (checked for all sequences before
    any is attended): first every L_b >= 0 and within block_table's row (the first sequence
    that breaks that is named), then every page used in [0, num_pages) (likewise). Only the
    columns in use of each chunk of rows are read from the table as it is (int32, numpy or
    torch): a table broadcast over its rows is never expanded whole."""
    if len(k_shape) != 4:
        raise ValueError(f"{op}: k has the wrong rank (rank={len(k_shape)}, expected 4: "
                         "[num_pages, page_size, Hkv, D])")
    num_pages, page_size = k_shape[0], k_shape[1]
    lengths = np.asarray(lengths, np.int64)
    pages = -(-lengths // page_size) if page_size else np.zeros_like(lengths)
    bad = np.flatnonzero((lengths < 0) | (pages > table.shape[1]))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{op}: sequence {b} has {int(lengths[b])} keys (expected 0 <= keys <= "
                         f"max_pages_per_seq * page_size={table.shape[1] * page_size})")
    chunk = max(1, _CHUNK_ELEMENTS // max(table.shape[1], 1))
    for b0 in range(0, len(lengths), chunk):
        used = pages[b0:b0 + chunk]
        width = int(used.max()) if used.size else 0
        if width == 0:
            continue
        rows = table[b0:b0 + len(used), :width]
        rows = np.asarray(rows.numpy() if hasattr(rows, "detach") else rows, np.int64)
        bad = np.argwhere((np.arange(width) < used[:, None]) & ((rows < 0) | (rows >= num_pages)))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise ValueError(f"{op}: block_table names no page of the pool where sequence "
                             f"{b0 + i} has keys (block_table[{b0 + i}][{j}]={rows[i, j]}, "
                             f"expected 0 <= page < num_pages={num_pages})")


def _check_max_seqlen(op, name, value, longest):
    """max_seqlen_q / max_seqlen_k of the paged varlen call, checked as the library checks the
    non-paged call's (src/core/validate_varlen.cpp, check_max) with the same messages."""
    value = int_option(op, name, value)
    if value > INT32_MAX:
        raise ValueError(f"{op}: {name} is too large ({name}={value}, expected <= {INT32_MAX})")
    if value < longest:
        raise ValueError(f"{op}: {name} is smaller than a sequence ({name}={value}, expected >= "
                         f"the longest sequence's {longest})")


def _naming(op, error, pools="k, v"):
    """`error` (raised by a flash_attn_with_kvcache call `op` makes) with its message's leading
    "<call>: " replaced by "<op>: " and, with pools "k, v", the pools named as `op` names them
    (k_cache, v_cache -> k, v), so that it names the call the user made."""
    head, sep, rest = str(error).partition(": ")
    message = f"{op}: {rest}" if sep and " " not in head else str(error)
    if pools == "k, v":
        message = re.sub(r"\b([kv])_cache\b", r"\1", message)
    for kind in type(error).__mro__:  # its own type, else the nearest one built from a message
        try:                          # (numpy's MemoryError subclass takes more arguments)
            return kind(message)
        except TypeError:
            continue
    return RuntimeError(message)  # (not reached: Exception takes a message)


def _attend_rows(op, lib, q_arr, k, v, rows, seqs, length, lengths, table, slopes, per_sequence,
                 kvcache_options):
    """One flash_attn_with_kvcache call over sequences `seqs` (each of `length` queries, at
    q_arr's rows `rows`) of the paged varlen call: (out [n, length, Hq, Dv], lse [n, Hq,
    length]). One sequence reads its queries, table row and slopes ([B, Hq] where
    `per_sequence`) as views; several gather them."""
    b, first = int(seqs[0]), int(rows[0])

    def rows_of(x):  # x's rows of the sequences: a slice of one, a gathered copy of several
        if len(seqs) == 1:
            return x[b:b + 1]
        return [x[i] for i in seqs.tolist()] if isinstance(x, (list, tuple)) else x[seqs]
    queries = q_arr[first:first + length] if len(seqs) == 1 else q_arr[rows]
    if per_sequence:
        slopes = rows_of(slopes)
    try:
        return flash_attn_with_kvcache(
            lib.reshape(queries, (len(seqs), length) + tuple(q_arr.shape[1:])), k, v,
            cache_seqlens=np.asarray(lengths[seqs], np.int32), block_table=rows_of(table),
            alibi_slopes=slopes, return_softmax_lse=True, **kvcache_options)
    except (ValueError, TypeError, NotImplementedError, MemoryError) as error:
        raise _naming(op, error) from None


def varlen_paged(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                 block_table, alibi_slopes, kvcache_options):
    """flash_attn_varlen_func with block_table: packed queries q [total_q, Hq, D] over page
    pools k [num_pages, page_size, Hkv, D], v [.., Dv]; sequence b has queries
    cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys 0:L_b of its pages block_table[b], L_b =
    seqused_k[b] or cu_seqlens_k[b+1] - cu_seqlens_k[b]. One flash_attn_with_kvcache call per
    sequence with queries, or per query length over sequences short enough never to be split
    (the same bits as one call each); rows past cu_seqlens_q[-1] get out 0 and lse -inf.
    max_seqlen_q / max_seqlen_k are checked as the library checks the non-paged call's
    (integers, at least the longest sequence, below 2^31); errors of the cache calls name `op`.
    Returns (out, lse [Hq, total_q], S_dmask: empty, as without dropout)."""
    lib, q_arr, give_back = _arrays.adopt(q, op, "q")
    cu_q, cu_k = (_host_index(op, name, cu_seqlens_array(op, name, x)) for name, x in (
        ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    used = _host_index(op, "seqused_k", seqused_k)
    if cu_q.ndim != 1 or cu_k.shape != cu_q.shape or len(cu_q) < 1:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k have shapes {list(cu_q.shape)} "
                         f"and {list(cu_k.shape)} (expected [B + 1] both)")
    batch = len(cu_q) - 1
    if len(q_arr.shape) != 3:
        raise ValueError(f"{op}: q has the wrong rank (rank={len(q_arr.shape)}, expected 3: "
                         "[total_q, Hq, D])")
    for name, cu, end in (("cu_seqlens_q", cu_q, q_arr.shape[0]), ("cu_seqlens_k", cu_k, None)):
        if cu[0] != 0 or np.any(np.diff(cu) < 0) or (end is not None and cu[-1] > end):
            raise ValueError(f"{op}: {name} is not a valid offset array ({name}="
                             f"{cu.tolist()[:8]}, expected 0 = cu[0] <= cu[1] <= ..."
                             f"{'' if end is None else f' <= total_q={end}'})")
    if used is not None and used.shape != (batch,):
        raise ValueError(f"{op}: seqused_k has shape {list(used.shape)} (expected [{batch}])")
    lengths = used if used is not None else np.diff(cu_k)
    table = _int32_index(op, "block_table", block_table)  # (lists of ints as int32)
    if len(table.shape) != 2 or table.shape[0] != batch:
        raise ValueError(f"{op}: block_table has shape {list(table.shape)}, expected "
                         f"[{batch}, max_pages_per_seq] ([B, max_pages_per_seq])")
    _check_pages(op, lengths, table, _arrays.shape_of(k, op, "k"))
    for name, value, longest in (("max_seqlen_q", max_seqlen_q, np.diff(cu_q)),
                                 ("max_seqlen_k", max_seqlen_k, lengths)):
        _check_max_seqlen(op, name, value, int(longest.max()) if len(longest) else 0)
    heads_q = q_arr.shape[1]
    slopes = alibi_slopes
    per_sequence = False
    if alibi_slopes is not None:  # checked whole: each call below sees one sequence's row
        a_shape = list(_arrays.shape_of(alibi_slopes, op, "alibi_slopes"))
        if a_shape not in ([heads_q], [batch, heads_q]):
            raise ValueError(f"{op}: alibi_slopes has shape {a_shape}, expected [{heads_q}] or "
                             f"[{batch}, {heads_q}] ([Hq] or [B, Hq])")
        per_sequence = len(a_shape) == 2
    # Every other argument (dtypes, shapes, options, backend) checked before any work, also
    # where no sequence makes a call below (B = 0): a call over no queries and no keys, through
    # a block table row of unmapped pages. Inputs the library cannot read in place are copied
    # once, after it (stand-ins in the check: _arrays.LateCopies), not once per sequence.
    late = _arrays.LateCopies(op)
    q_arr = late.unit_last_stride(lib, q_arr, "q")
    pools = []
    for name, x in (("k", k), ("v", v)):
        pool_lib, pool, _ = _arrays.adopt(x, op, name)
        pools.append(late.unit_last_stride(pool_lib, pool, name))
    k, v = pools
    # The dry run has every sequence, with no queries (B = 0: one, so that every option is
    # read), so that each sequence's row of ALiBi slopes is checked too.
    dry = max(batch, 1)
    columns = max(table.shape[1], 1)
    try:
        flash_attn_with_kvcache(
            lib.broadcast_to(q_arr[0:0][None], (dry, 0) + tuple(q_arr.shape[1:])), k, v,
            cache_seqlens=np.zeros(dry, np.int32),
            block_table=np.broadcast_to(np.full((1, columns), -1, np.int32), (dry, columns)),
            alibi_slopes=(alibi_slopes if batch else None) if per_sequence else alibi_slopes,
            return_softmax_lse=True, **kvcache_options)
    except (ValueError, TypeError, NotImplementedError, MemoryError) as error:
        raise _naming(op, error) from None
    q_arr, k, v = (late.real(x) for x in (q_arr, k, v))
    total_q = q_arr.shape[0]
    dim_v = _arrays.shape_of(v, op, "v")[-1]
    dtype = lib.dtype_name(q_arr)
    _arrays.check_new_arrays(op, ((total_q, heads_q, dim_v), dtype),
                             ((heads_q, total_q), "float64" if dtype == "float64" else "float32"))
    out = lib.zeros((total_q, heads_q, dim_v), dtype)
    lse = lib.empty((heads_q, total_q), "float64" if dtype == "float64" else "float32")
    lse[...] = -np.inf
    # A call per sequence with queries, as the non-paged call plans each sequence's split-KV
    # alone, except that sequences of at most MIN_SPLIT_KEYS keys (never split, alone or in a
    # batch: the same bits) of one query length make one call together, their queries
    # gathered and their results scattered back (20000 one-query sequences: 6.7 s -> 0.14 s).
    query_lengths = np.diff(cu_q)
    short = (query_lengths > 0) & (lengths <= _core.MIN_SPLIT_KEYS)
    calls = [np.flatnonzero(short & (query_lengths == n))
             for n in np.unique(query_lengths[short]).tolist()]
    calls += [np.array([b]) for b in np.flatnonzero((query_lengths > 0) & ~short).tolist()]
    row_elements = int(np.prod(q_arr.shape[1:]))
    for group in calls:
        length = int(query_lengths[group[0]])
        # (Gathered copies of the table's rows and the queries stay within _CHUNK_ELEMENTS.)
        per_call = max(1, min(_CHUNK_ELEMENTS // max(table.shape[1], 1),
                              _CHUNK_ELEMENTS // max(length * row_elements, 1)))
        for s0 in range(0, len(group), per_call):
            seqs = group[s0:s0 + per_call]
            rows = (cu_q[seqs][:, None] + np.arange(length)).reshape(-1)  # [n * length]
            o_g, lse_g = _attend_rows(op, lib, q_arr, k, v, rows, seqs, length, lengths, table,
                                      alibi_slopes, per_sequence, kvcache_options)
            out[rows] = lib.reshape(o_g, (len(rows), heads_q, dim_v))
            lse[:, rows] = lib.reshape(lib.permute(lse_g, (1, 0, 2)), (heads_q, len(rows)))
    return give_back(out), give_back(lse), give_back(lib.empty((0,), dtype))
