"""flash_attn_with_kvcache: flash-attn 2.8.3's attention over a KV cache (decode and chunked
prefill, with new keys and values appended to the cache in place), over the C++
forward_kvcache. Forward only.

Arrays are in flash-attn's layout and reach the library as transposed(1, 2) views, without a
copy: q [B, Lq, Hq, D], caches [B_cache, capacity, Hkv, D] (paged: page pools
[num_pages, page_size, Hkv, D] with block_table [B, max_pages_per_seq]), new k / v
[B, L_new, Hkv, D].
"""

import dataclasses
import sys

import numpy as np

from . import _arrays, _copies, _core, _writes
from ._attention import _resolve_call
from ._merge import refuse_grad
from ._rank4 import (INT32_MAX, alibi_array, bool_option, check_blhd, int_option,
                     is_slope_list, lse_dtype, real_option, times)
from ._varlen import index_array


class _Adopted:
    """A call's arrays, each adopted (_arrays.adopt) once, by name. (Each check of a shape
    converted its array again: a decode step's time around the library, Hq 32, Hkv 8, D 64,
    200 keys, 1 thread, took ~100 us that way against ~87.)"""

    def __init__(self, op):
        self.op, self.arrays = op, {}

    def __call__(self, name, x):
        if name not in self.arrays:
            self.arrays[name] = _arrays.adopt(x, self.op, name)
        return self.arrays[name]

    def shape(self, name, x):
        return tuple(self(name, x)[1].shape)


def _writing(appending, caches, run, declines=False):
    """run()'s result; where the call appends (writes the caches in place), torch caches are
    marked written (_writes.mark_written) once it has returned, or raised other than as a refusal
    (a ValueError, TypeError or NotImplementedError comes before anything is written): stopped
    while it wrote, perhaps (out of memory, cancelled). With `declines`, run() returns None for a
    call it declined, having written nothing (the fast path)."""
    try:
        result = run()
    except (ValueError, TypeError, NotImplementedError):
        raise
    except BaseException:
        if appending:
            _writes.mark_written(*caches)
        raise
    if appending and not (declines and result is None):
        _writes.mark_written(*caches)
    return result


def _rank4(op, name, shape, layout):
    if len(shape) != 4:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={len(shape)}, expected 4: "
                         f"{layout})")


def _writable_cache(op, name, x):
    """(library, x) for a cache the library can write in place: a numpy array or torch tensor
    in CPU memory whose own memory attncore reaches without a copy. Anything else raises, as an
    append into a copy would be lost."""
    torch = sys.modules.get("torch")
    remedy = (f"; pass {name} as a writable numpy array or CPU torch tensor with unit last "
              "stride (an append into a copy would be lost)")
    if isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray):
        x = x.view(np.ndarray) if type(x) is not np.ndarray else x
        if not x.flags.writeable:
            raise ValueError(f"{op}: {name} is read-only (writeable=False, expected a writable "
                             f"array){remedy}")
        strides_ok = all(s >= 0 and s % x.itemsize == 0 for s in x.strides)
        if x.size and (not strides_ok or (x.ndim and x.shape[-1] > 1 and
                                          x.strides[-1] != x.itemsize)):
            raise ValueError(f"{op}: {name} would need a copy (strides={list(x.strides)} bytes, "
                             f"expected non-negative multiples of itemsize={x.itemsize} and a "
                             f"unit last stride){remedy}")
        return _arrays.NUMPY, x
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise NotImplementedError(f"{op}: {name} is not in CPU memory (device="
                                      f"{x.device.type}, expected cpu); attncore has CPU "
                                      "backends only")
        if getattr(x, "is_nested", False) or x.layout != torch.strided:
            raise ValueError(f"{op}: {name} is not a strided tensor (layout={x.layout}, "
                             f"expected torch.strided){remedy}")
        if x.is_neg() or x.is_conj():
            raise ValueError(f"{op}: {name} is a lazily negated or conjugated view (expected "
                             f"a plain tensor){remedy}")
        if x.numel() and x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{op}: {name} would need a copy (stride={list(x.stride())}, "
                             f"expected a unit last stride){remedy}")
        _writes.check_written_tensor(op, name, x)
        return _arrays.TORCH, x
    raise TypeError(f"{op}: {name} cannot be written in place (type={type(x).__name__}, "
                    f"expected a numpy array or a torch tensor){remedy}")


def _float32(lib, x, op, name):
    """A rotary table as float32 (the library's dtype for them): a copy only where needed, and
    refused first where it would not fit (a broadcast table stands for more than its memory).
    Tables of a dtype other than a float one (complex, integer, bool) raise ValueError."""
    dtype = lib.dtype_name(x)
    if dtype not in ("float32", "float64", "float16", "bfloat16"):
        raise ValueError(f"{op}: {name} has the wrong dtype (dtype={dtype}, expected a float "
                         "dtype: rotary tables are taken as float32)")
    if dtype == "float32":
        return x
    _copies.check_copy(op, name, tuple(x.shape), "float32", "pass it as float32")
    return x.detach().float() if lib.is_torch else x.astype(np.float32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, backend=None):
    """flash_attn.flash_attn_with_kvcache (2.8.3) on numpy arrays or CPU torch tensors.

    q [B, Lq, Hq, D] attends to slots [cache_leftpad[b], cache_seqlens[b]) of cache row
    cache_batch_idx[b] (or b) of k_cache, v_cache [B_cache, capacity, Hkv, D]. cache_seqlens:
    an int (the same for every sequence), an int32 array [B], or None (the whole capacity).
    With k, v [B, L_new, Hkv, D], the new rows are first written into the caches in place at
    slots cache_seqlens[b] + j (so the caches must be arrays attncore can write without a
    copy; others raise), then attended as if cache_seqlens had grown by L_new (the caller's
    cache_seqlens is not changed). rotary_cos, rotary_sin [positions, rotary_dim / 2] (taken as
    float32) rotate the first rotary_dim dims of the new keys and of q at their positions:
    pairs (2i, 2i + 1) when rotary_interleaved, else (i, i + rotary_dim / 2); they need k, v.
    causal is lower-right (against each sequence's length); softcap <= 0 is off; window_size
    and alibi_slopes ([Hq] or [B, Hq], float32) as in flash_attn_func.

    block_table (int32 [B, max_pages_per_seq]) makes the caches page pools
    [num_pages, page_size, Hkv, D] (any page_size >= 1): slot s of sequence b is row
    s % page_size of page block_table[b][s // page_size]; every page a sequence's slots use must
    be a page of the pool (-1 elsewhere is fine). cache_batch_idx is refused with it, as
    flash-attn refuses it; cache_leftpad works. Appends write the pages as mapped (a page two
    sequences share is written for both: PagedKVCache.assign copies shared pages first).

    num_splits (0 = planned from the problem and the CPU count, 1 = no split, 2 to 256 forced,
    capped to the 128-key tiles of the longest sequence) is how many parts the flash backend
    cuts each kv head's keys into (split-KV decode, merged afterwards): it changes the rounding
    within the oracle's tolerance, never the result's meaning, and never depends on the thread
    count; other backends ignore it. backend (keyword only, not in flash-attn's function) picks
    an attncore backend as in attention().
    Forward only: a torch input that requires grad under grad mode raises
    NotImplementedError.

    Returns out [B, Lq, Hq, D] in q's library, and with return_softmax_lse (out, lse
    [B, Hq, Lq] float32).
    """
    op = "flash_attn_with_kvcache"
    if (alibi_slopes is None and type(return_softmax_lse) is bool
            and type(rotary_interleaved) is bool):
        # The fast path (attncore._core.attend_kvcache: its comment says which calls it takes),
        # None for the others. Its results are the general path's, bit for bit.
        result = _writing(k is not None, (k_cache, v_cache), lambda: _core.attend_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved,
            cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
            window_size, softcap, num_splits, backend, return_softmax_lse), declines=True)
        if result is not None:
            return result
    causal = bool_option(op, "causal", causal)
    rotary_interleaved = bool_option(op, "rotary_interleaved", rotary_interleaved)
    return_softmax_lse = bool_option(op, "return_softmax_lse", return_softmax_lse)
    num_splits = int_option(op, "num_splits", num_splits, -INT32_MAX - 1, INT32_MAX)
    refuse_grad(op, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                     ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                     ("alibi_slopes", alibi_slopes)))
    if (k is None) != (v is None):
        raise ValueError(f"{op}: k and v must be given together (k is "
                         f"{'None' if k is None else 'set'}, v is "
                         f"{'None' if v is None else 'set'})")
    if (rotary_cos is not None or rotary_sin is not None) and k is None:
        raise ValueError(f"{op}: rotary_cos / rotary_sin are set without k and v (expected the "
                         "new keys and values the rotary embedding applies to)")
    appending = k is not None
    adopted = _Adopted(op)
    q_shape = ("q", adopted.shape("q", q))
    _rank4(op, "q", q_shape[1], "[B, Lq, Hq, D]")
    paged = block_table is not None
    cache_shape = adopted.shape("k_cache", k_cache)
    _rank4(op, "k_cache", cache_shape, "[num_pages, page_size, Hkv, D]" if paged
           else "[B_cache, capacity, Hkv, D]")
    v_cache_shape = adopted.shape("v_cache", v_cache)
    _rank4(op, "v_cache", v_cache_shape, "[num_pages, page_size, Hkv, Dv]" if paged
           else "[B_cache, capacity, Hkv, Dv]")
    check_blhd(op, q_shape, ("k_cache", cache_shape), ("v_cache", v_cache_shape),
               "[num_pages, page_size, Hkv, D]" if paged else "[B_cache, capacity, Hkv, D]",
               same_batch=False)
    # (Named here in the caller's layout: the library sees [B_cache, Hkv, capacity, D] and the
    # pools as [num_pages, Hkv, page_size, D].)
    if not paged and cache_batch_idx is None and cache_shape[0] != q_shape[1][0]:
        raise ValueError(f"{op}: k_cache has shape {list(cache_shape)}, expected a batch of "
                         f"{q_shape[1][0]} like q (B_cache={cache_shape[0]}, expected B_cache == "
                         "B without cache_batch_idx)")
    if paged and cache_shape[1] == 0:
        raise ValueError(f"{op}: k_cache has shape {list(cache_shape)}, expected [num_pages, "
                         "page_size, Hkv, D] with page_size >= 1 (page_size=0)")
    if appending:
        for name, x in (("k", k), ("v", v)):
            _rank4(op, name, adopted.shape(name, x), "[B, L_new, Hkv, D]")
        new_k, new_v = adopted.shape("k", k), adopted.shape("v", v)
        check_blhd(op, q_shape, ("k", new_k), ("v", new_v), "[B, L_new, Hkv, D]")
        cache_heads = cache_shape[2]
        if new_k[2] != cache_heads:
            raise ValueError(f"{op}: k has shape {list(new_k)}, expected [{new_k[0]}, "
                             f"{new_k[1]}, {cache_heads}, {new_k[3]}] ([B, L_new, Hkv, D] with "
                             "k_cache's Hkv)")
        dim_v = v_cache_shape[3]
        if new_v[3] != dim_v:
            raise ValueError(f"{op}: v has shape {list(new_v)}, expected [{new_v[0]}, "
                             f"{new_v[1]}, {new_v[2]}, {dim_v}] ([B, L_new, Hkv, Dv] with "
                             "v_cache's Dv)")
    lib, q_arr, give_back = adopted("q", q)
    # Inputs the library cannot read in place are copied after its checks (check_forward_kvcache,
    # on stand-ins: _copies.LateCopies); an append's caches are written in place, never copied.
    late = _copies.LateCopies(op)
    if appending:
        k_lib, kc = _writable_cache(op, "k_cache", k_cache)
        v_lib, vc = _writable_cache(op, "v_cache", v_cache)
    else:
        k_lib, kc, _ = adopted("k_cache", k_cache)
        v_lib, vc, _ = adopted("v_cache", v_cache)
        kc = late.unit_last_stride(k_lib, kc, "k_cache")
        vc = late.unit_last_stride(v_lib, vc, "v_cache")
    call = _resolve_call(op, scale=softmax_scale,
                         causal="lower-right" if causal else None, window_size=window_size,
                         softcap=max(real_option(op, "softcap", softcap), 0.0), dropout_p=0.0,
                         seed=None, offset=None, enable_gqa=True, backend=backend, num_threads=0,
                         draw_seed=False)
    call = dataclasses.replace(call, num_splits=num_splits)  # checked by the library
    batch, seqlen_q, heads_q, _ = q_arr.shape
    capacity, dim_v = kc.shape[1], vc.shape[3]
    dtype = lib.dtype_name(q_arr)
    # The outputs first: a batch of broadcast inputs can be too large for them, and index
    # arrays broadcast over it are copied below (B entries each).
    _copies.check_new_arrays(op, ((batch, seqlen_q, heads_q, dim_v), dtype),
                             ((batch, heads_q, seqlen_q), lse_dtype(dtype)))
    table = index_array(op, "block_table", block_table)
    if paged and len(table.shape) == 2:
        capacity *= table.shape[1]  # pages per sequence * page_size
    if cache_seqlens is None:  # every slot: the capacity, which int32 lengths must hold
        if capacity > INT32_MAX:
            raise ValueError(f"{op}: k_cache has more slots than cache_seqlens' default can "
                             f"count (capacity={capacity}, expected <= {INT32_MAX}: lengths "
                             "are int32); pass cache_seqlens")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        length = int_option(op, "cache_seqlens", cache_seqlens, -INT32_MAX - 1, INT32_MAX)
        # (Checked here where no sequence would carry it to the library's check: B = 0.)
        if batch == 0 and not 0 <= length <= capacity and (not paged or len(table.shape) == 2):
            raise ValueError(f"{op}: cache_seqlens is out of range (cache_seqlens={length}, "
                             f"expected 0 <= cache_seqlens <= capacity={capacity})")
        # (B int32 entries: a broadcast batch of empty outputs, Lq = 0, passes the outputs'
        # check above however large it is.)
        _copies.check_copy(op, "cache_seqlens", (batch,), "int32",
                           "pass cache_seqlens as an int32 array of B entries, or a smaller batch")
        seqlens = np.full((batch,), length, np.int32)
    elif isinstance(cache_seqlens, (float, bool, np.floating, np.bool_)):
        raise TypeError(f"{op}: cache_seqlens is not an integer (type="
                        f"{type(cache_seqlens).__name__}, expected an int or an int32 array)")
    else:
        seqlens = index_array(op, "cache_seqlens", cache_seqlens)
    batch_idx = index_array(op, "cache_batch_idx", cache_batch_idx)
    leftpad = index_array(op, "cache_leftpad", cache_leftpad)
    new = [None, None]  # (library, array): k, v [B, L_new, Hkv, D]
    if appending:
        for i, (name, x) in enumerate((("k", k), ("v", v))):
            x_lib, arr, _ = adopted(name, x)
            new[i] = (x_lib, late.unit_last_stride(x_lib, arr, name))
    tables = [None, None]  # (library, array): rotary_cos, rotary_sin [positions, rotary_dim / 2]
    for i, (name, x) in enumerate((("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin))):
        if x is not None:
            t_lib, arr, _ = _arrays.adopt(x, op, name)
            tables[i] = (t_lib, late.unit_last_stride(t_lib, _float32(t_lib, arr, op, name),
                                                            name))

    def core(pairs, swap=False):  # the library's views of new / tables (None where absent)
        return [None if pair is None else
                pair[0].to_core(pair[1].swapaxes(1, 2) if swap else pair[1]) for pair in pairs]

    alibi = None
    if is_slope_list(alibi_slopes):
        alibi = alibi_array(_arrays.NUMPY, op, alibi_slopes)
    elif alibi_slopes is not None:
        a_lib, alibi, _ = _arrays.adopt(alibi_slopes, op, "alibi_slopes")
        alibi = a_lib.to_core(alibi)
    q_arr = late.unit_last_stride(lib, q_arr, "q")
    if late.waiting:
        _core.check_forward_kvcache(lib.to_core(q_arr.swapaxes(1, 2)),
                                    k_lib.to_core(kc.swapaxes(1, 2)),
                                    v_lib.to_core(vc.swapaxes(1, 2)), seqlens, batch_idx, leftpad,
                                    table, *core(new, swap=True), *core(tables),
                                    rotary_interleaved, alibi, call.checked_options())
        q_arr, kc, vc = (late.real(x) for x in (q_arr, kc, vc))
        new, tables = ([None if pair is None else (pair[0], late.real(pair[1])) for pair in pairs]
                       for pairs in (new, tables))
    q4 = times(q_arr, call.q_factor, op, "q").swapaxes(1, 2)
    out = lib.empty((batch, seqlen_q, heads_q, dim_v), dtype)
    lse = lib.empty((batch, heads_q, seqlen_q), lse_dtype(dtype))
    _writing(appending, (kc, vc), lambda: _core.forward_kvcache(
        lib.to_core(q4), k_lib.to_core(kc.swapaxes(1, 2)), v_lib.to_core(vc.swapaxes(1, 2)),
        seqlens, batch_idx, leftpad, table, *core(new, swap=True), *core(tables),
        rotary_interleaved, lib.to_core(out.swapaxes(1, 2)), lib.to_core(lse), alibi,
        call.core_options()))
    return (give_back(out), give_back(lse)) if return_softmax_lse else give_back(out)
