"""attncore.torch.PagedAttention: torch's experimental PagedAttention (torch >= 2.5,
torch.nn.attention.experimental._paged_attention) with its class and method signatures, its
page bookkeeping and K/V layout ([1, H, n_pages * page_size, D]), attending through
flash_attn_with_kvcache with a block table. Imported by attncore.torch only (needs torch).
"""

import operator

import torch as _torch

from . import _arrays, _copies, _writes
from ._kvcache import flash_attn_with_kvcache
from ._merge import refuse_grad
from ._paged import _index
from ._rank4 import INT32_MAX, bool_option, int_option, scale_option


def _integers(op, name, x, shape, layout):
    """An int64 torch tensor of indices from a tensor, array or sequence of integers:
    TypeError for other dtypes (floats are not truncated), NotImplementedError for tensors
    attncore cannot read (another device, meta), ValueError for another shape."""
    t = _arrays.TORCH.asarray(x, op, name)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == _torch.bool:
        raise TypeError(f"{op}: {name} is not an integer tensor (dtype={t.dtype}, expected "
                        "int32 or int64)")
    if tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} has shape {list(t.shape)}, expected {list(shape)} "
                         f"({layout})")
    return t.long()


def _index_tensor(op, name, x, size, size_name):
    """An int or integer tensor of indices into a dim of `size` as a tensor: TypeError for other
    dtypes, IndexError (as indexing raises, in attncore's form) for an index outside
    [0, size), negative ones included (they would wrap to another sequence or slot). Not
    checked where the values cannot be read, as under vmap."""
    t = _arrays.TORCH.asarray(x, op, name)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == _torch.bool:
        raise TypeError(f"{op}: {name} is not an integer tensor (dtype={t.dtype}, expected "
                        "int32 or int64)")
    bad = (t < 0) | (t >= size)
    try:
        outside = bool(bad.any())
    except RuntimeError:  # a batched tensor (vmap): no data-dependent check
        return t
    if outside:
        raise IndexError(f"{op}: {name} is out of range ({name}={int(t[bad][0])}, expected "
                         f"0 <= {name} < {size_name}={size})")
    return t


def _lengths(op, kv_len):
    """kv_len [B] of get_mask_mod and get_score_mod as an integer tensor (or None)."""
    if kv_len is None:
        return None
    t = _arrays.TORCH.asarray(kv_len, op, "kv_len")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == _torch.bool:
        raise TypeError(f"{op}: kv_len is not an integer tensor (dtype={t.dtype}, expected "
                        "int32 or int64)")
    if t.dim() != 1:
        raise ValueError(f"{op}: kv_len has the wrong rank (rank={t.dim()}, expected 1: [B])")
    return t


def _floating(op, name, x, rank, layout):
    """A CPU torch tensor of a floating dtype and the given rank, else attncore's error."""
    if not isinstance(x, _torch.Tensor):
        raise TypeError(f"{op}: {name} is not a torch tensor (type={type(x).__name__}, expected "
                        "torch.Tensor)")
    x = _arrays.TORCH.asarray(x, op, name)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} has the wrong dtype (dtype={x.dtype}, expected float32, "
                         "float64, float16 or bfloat16)")
    if x.dim() != rank:
        raise ValueError(f"{op}: {name} has the wrong rank (rank={x.dim()}, expected {rank}: "
                         f"{layout})")
    return x


def _span(x):
    """The bytes a strided tensor can touch: [first, end)."""
    reach = sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0)
    return x.data_ptr(), x.data_ptr() + (reach + 1) * x.element_size()


def _writable(op, name, x, others):
    """x is written: each element at its own address (no zero stride on a dim of size > 1, and
    strides that nest: taken by size, each past the extent of the smaller ones), and no byte in
    common with the tensors `others` ((name, tensor) pairs; by their spans, so interleaved
    views of one buffer are refused too)."""
    if x.numel() == 0:
        return
    for d, (n, st) in enumerate(zip(x.shape, x.stride())):
        if n > 1 and st == 0:
            raise ValueError(f"{op}: {name} is an output with a zero stride (stride[{d}]=0, "
                             "expected > 0 on dims of size > 1)")
    extent = 0  # of the dims with smaller strides, in elements
    for st, n in sorted((st, n) for n, st in zip(x.shape, x.stride()) if n > 1):
        if st <= extent:
            raise ValueError(f"{op}: {name} is an output whose elements may overlap (shape="
                             f"{list(x.shape)}, strides={list(x.stride())}, expected each "
                             "stride past the extent of the smaller ones)")
        extent += (n - 1) * st
    first, end = _span(x)
    for other_name, other in others:
        if other.numel() == 0:
            continue
        other_first, other_end = _span(other)
        if first < other_end and other_first < end:
            raise ValueError(f"{op}: {name} overlaps {other_name} (expected no byte in common); "
                             "an output may share memory with no other output and no input")


class PagedAttention:
    """torch.nn.attention.experimental._paged_attention.PagedAttention (torch >= 2.5) on
    attncore: the same constructor and methods over the same state (page_table int64
    [max_batch_size, n_pages], capacity [max_batch_size], empty_pages, physical_to_logical),
    with stricter checks (positions outside what reserve gave, out of pages: errors in
    attncore's form), plus forward() to attend over the pages without flex_attention.

    K/V live in the caller's k_cache, v_cache [1, H, n_pages * page_size, D], as in torch.
    device must be "cpu" (attncore has CPU backends only). convert_logical_block_mask needs
    flex_attention's BlockMask and raises NotImplementedError. Not thread-safe, as torch's
    class is not: one thread at a time may use an instance.
    """

    def __init__(self, n_pages, page_size, max_batch_size, device="cpu"):
        op = "PagedAttention"
        try:
            device = _torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{op}: device is not a device (device={device!r}, expected "
                             "'cpu')") from None
        if device.type != "cpu":
            raise NotImplementedError(f"{op}: device is not cpu (device={device}, expected cpu); "
                                      "attncore has CPU backends only")
        self.n_pages = int_option(op, "n_pages", n_pages)
        self.page_size = int_option(op, "page_size", page_size)
        max_batch_size = int_option(op, "max_batch_size", max_batch_size)
        for name, value in (("n_pages", self.n_pages), ("page_size", self.page_size),
                            ("max_batch_size", max_batch_size)):
            if value < 1:
                raise ValueError(f"{op}: {name} is out of range ({name}={value}, expected >= 1)")
        if self.n_pages * self.page_size > INT32_MAX:
            raise ValueError(f"{op}: n_pages * page_size is too large (n_pages={self.n_pages}, "
                             f"page_size={self.page_size}, expected n_pages * page_size <= "
                             f"{INT32_MAX}: positions are int32)")
        # page_table and physical_to_logical (int64), and the free list (a list of ints)
        _copies.check_new_arrays(op, ((max_batch_size, self.n_pages), "int64"),
                                 ((max_batch_size, self.n_pages), "int64"),
                                 ((self.n_pages, 4), "int64"))
        self.page_table = -_torch.ones((max_batch_size, self.n_pages), dtype=_torch.int64)
        self.capacity = _torch.zeros(max_batch_size, dtype=_torch.int64)
        self.empty_pages = list(range(self.n_pages - 1, -1, -1))
        self.physical_to_logical = -_torch.ones((max_batch_size, self.n_pages), dtype=_torch.int64)

    def _batch(self, op, batch_idx):
        b = _index(op, "batch_idx", batch_idx)
        if not 0 <= b < self.page_table.shape[0]:
            raise ValueError(f"{op}: batch_idx is out of range (batch_idx={b}, expected 0 <= "
                             f"batch_idx < max_batch_size={self.page_table.shape[0]})")
        return b

    def _given(self, batch_idx, pages, logical):
        """Whether reserve gave sequence batch_idx[i] page pages[i, j] as its logical page
        logical[j] (or logical[i, j]): the public page table, written over, may name another's;
        pages inside [0, n_pages)."""
        return self.physical_to_logical[batch_idx[:, None], pages.clamp(0, self.n_pages - 1)] \
            == logical

    def reserve(self, batch_idx, seq_len):
        """Maps free pages to sequence batch_idx until it holds at least seq_len slots (taken
        from the end of the free list, as torch's); MemoryError when too few are free,
        ValueError for a seq_len past n_pages * page_size."""
        op = "PagedAttention.reserve"
        b, n = self._batch(op, batch_idx), _index(op, "seq_len", seq_len)
        if not 0 <= n <= self.n_pages * self.page_size:
            raise ValueError(f"{op}: seq_len is out of range (seq_len={n}, expected 0 <= "
                             f"seq_len <= n_pages * page_size={self.n_pages * self.page_size})")
        # capacity, empty_pages and page_table are public, and may have been written over: each
        # is checked before anything changes.
        have, slots = int(self.capacity[b]), self.n_pages * self.page_size
        if not 0 <= have <= slots or have % self.page_size:
            raise ValueError(f"{op}: capacity is out of range (capacity[{b}]={have}, expected a "
                             f"multiple of page_size={self.page_size} from 0 to n_pages * "
                             f"page_size={slots}); nothing was reserved")
        if n <= have:
            return
        want = -(-(n - have) // self.page_size)
        if want > len(self.empty_pages):
            raise MemoryError(f"{op}: requested {want} pages but only {len(self.empty_pages)} "
                              f"are free (batch_idx={b}, seq_len={n}, expected at most "
                              f"{len(self.empty_pages)} pages); erase sequences first")
        start = have // self.page_size
        tail = self.empty_pages[-want:]
        indices = []
        for page in tail:  # (anything but a page index in the pool reads as -1: not free)
            try:
                index = -1 if isinstance(page, bool) else operator.index(page)
            except TypeError:
                index = -1
            indices.append(index if 0 <= index < self.n_pages else -1)
        pages = _torch.tensor(indices, dtype=_torch.int64)
        # Not free: outside the pool, listed twice, or given to a sequence (physical_to_logical;
        # a search of every row of the table took 3 ms a call at 64 x 16000 pages).
        bad = (pages < 0) | (pages >= self.n_pages)
        bad |= (self.physical_to_logical[:, pages.clamp(0, self.n_pages - 1)] != -1).any(0)
        order = pages.argsort(stable=True)
        bad[order[1:]] |= pages[order[1:]] == pages[order[:-1]]
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"{op}: empty_pages holds a page that is not free (empty_pages"
                             f"[{len(self.empty_pages) - want + i}]={tail[i]!r}, expected "
                             f"distinct page indices in [0, n_pages={self.n_pages}) that no "
                             "sequence maps); nothing was reserved")
        mapped = (self.page_table[b, start:start + want] != -1).nonzero()
        if mapped.numel():
            j = start + int(mapped[0])
            raise ValueError(f"{op}: page_table maps a page past the sequence's capacity "
                             f"(page_table[{b}][{j}]={int(self.page_table[b, j])}, expected -1 "
                             f"from capacity[{b}] / page_size={start} on); nothing was reserved")
        self.page_table[b, start:start + want] = pages
        self.physical_to_logical[b, pages] = _torch.arange(start, start + want)
        self.capacity[b] += want * self.page_size
        self.empty_pages = self.empty_pages[:-want]

    def erase(self, batch_idx):
        """Returns sequence batch_idx's pages to the free list and unmaps them."""
        op = "PagedAttention.erase"
        b = self._batch(op, batch_idx)
        pages = self.page_table[b][self.page_table[b] != -1]
        bad = (pages < 0) | (pages >= self.n_pages)  # (the public table, written by a caller)
        if bool(bad.any()):
            j = int((self.page_table[b] == pages[bad][0]).nonzero()[0])
            raise ValueError(f"{op}: page_table is out of range (page_table[{b}][{j}]="
                             f"{int(pages[bad][0])}, expected -1 or a page index in "
                             f"[0, n_pages={self.n_pages})); nothing was erased")
        # A page named twice, or one already free, would enter the free list twice and then be
        # handed to two sequences.
        row = self.page_table[b]
        mapped = row != -1
        values, order = row.sort(stable=True)
        twice = _torch.zeros_like(mapped)
        twice[order[1:]] = values[1:] == values[:-1]  # (each repeat after its first place)
        twice &= mapped
        free = mapped & _torch.isin(row, _torch.tensor(self.empty_pages, dtype=row.dtype))
        # A page reserve gave another sequence (or none) would be freed while that one holds it.
        given = self._given(_torch.tensor([b]), row[None], _torch.arange(row.numel()))[0]
        foreign = mapped & ~given
        if bool((twice | free | foreign).any()):
            j = int((twice | free | foreign).nonzero()[0])
            what = "twice" if twice[j] else "that is free" if free[j] else \
                "this sequence was not given"
            raise ValueError(f"{op}: page_table maps a page {what} (page_table[{b}][{j}]="
                             f"{int(row[j])}, expected each of the sequence's pages once, at "
                             "the place reserve gave it); nothing was erased")
        self.capacity[b] = 0
        self.empty_pages += pages.tolist()
        self.physical_to_logical[b, pages] = -1
        self.page_table[b] = -1

    def assign(self, batch_idx, input_pos, k_val, v_val, k_cache, v_cache):
        """k_val, v_val [B, H, S, D] into k_cache, v_cache [1, H, n_pages * page_size, D] at
        input_pos [B, S] of the sequences batch_idx [B]."""
        op = "PagedAttention.assign"
        refuse_grad(op, (("k_val", k_val), ("v_val", v_val), ("k_cache", k_cache),
                         ("v_cache", v_cache)))
        k_val = _floating(op, "k_val", k_val, 4, "[B, H, S, D]")
        v_val = _floating(op, "v_val", v_val, 4, "[B, H, S, Dv]")
        k_cache = _floating(op, "k_cache", k_cache, 4, "[1, H, n_pages * page_size, D]")
        v_cache = _floating(op, "v_cache", v_cache, 4, "[1, H, n_pages * page_size, Dv]")
        B, H, S, _ = k_val.shape
        batch_idx = _integers(op, "batch_idx", batch_idx, (B,), "[B] like k_val")
        input_pos = _integers(op, "input_pos", input_pos, (B, S), "[B, S] like k_val")
        slots = self.n_pages * self.page_size
        expected = {"v_val": ((B, H, S), "[B, H, S, Dv] like k_val"),
                    "k_cache": ((1, H, slots, k_val.shape[3]), "[1, H, n_pages * page_size, D]"),
                    "v_cache": ((1, H, slots, v_val.shape[3]), "[1, H, n_pages * page_size, Dv]")}
        for name, (want, layout) in expected.items():
            got = tuple({"v_val": v_val, "k_cache": k_cache, "v_cache": v_cache}[name].shape)
            if want != got[:len(want)]:
                raise ValueError(f"{op}: {name} has shape {list(got)}, expected "
                                 f"{list(want)}{'' if len(want) == 4 else ' + [Dv]'} ({layout})")
        _writable(op, "k_cache", k_cache, (("k_val", k_val), ("v_val", v_val)))
        _writable(op, "v_cache", v_cache, (("k_cache", k_cache), ("k_val", k_val),
                                           ("v_val", v_val)))
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):  # (both, before either)
            _writes.check_written_tensor(op, name, cache)
        rows = _torch.stack([self.capacity[self._batch(op, b)] for b in batch_idx.tolist()]) \
            if B else _torch.zeros(0, dtype=_torch.int64)
        bad = (input_pos < 0) | (input_pos >= rows[:, None])
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{op}: input_pos is out of what was reserved (input_pos[{i}][{j}]="
                             f"{int(input_pos[i, j])}, expected 0 <= position < capacity="
                             f"{int(rows[i])}); reserve first")
        logical = (input_pos // self.page_size).long()
        if bool((logical >= self.page_table.shape[1]).any()):  # (capacity, public, written over)
            i, j = (int(x) for x in (logical >= self.page_table.shape[1]).nonzero()[0])
            raise ValueError(f"{op}: capacity is past the page table (capacity[{int(batch_idx[i])}]"
                             f"={int(rows[i])}, expected <= n_pages * page_size="
                             f"{self.n_pages * self.page_size})")
        physical = _torch.gather(self.page_table[batch_idx], 1, logical)
        # The public table, written over: an entry out of range, or naming a page reserve did
        # not give this sequence there.
        outside = (physical < 0) | (physical >= self.n_pages)
        bad = outside | ~self._given(batch_idx, physical, logical)
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            what, expected = (("is out of range", f"a page index in [0, n_pages={self.n_pages})")
                              if outside[i, j] else
                              ("names a page this sequence was not given",
                               "the page reserve gave it"))
            raise ValueError(f"{op}: page_table {what} where input_pos writes (page_table"
                             f"[{int(batch_idx[i])}][{int(logical[i, j])}]={int(physical[i, j])} "
                             f"for input_pos[{i}][{j}]={int(input_pos[i, j])}, expected "
                             f"{expected}); nothing was written")
        addr = (physical * self.page_size + input_pos % self.page_size).reshape(-1)
        if addr.unique().numel() != addr.numel():
            raise ValueError(f"{op}: input_pos writes one slot twice (expected distinct slots)")
        if addr.numel() == 0:
            return
        k_cache[0, :, addr, :] = k_val.permute(1, 0, 2, 3).reshape(H, B * S, -1).to(k_cache.dtype)
        v_cache[0, :, addr, :] = v_val.permute(1, 0, 2, 3).reshape(H, B * S, -1).to(v_cache.dtype)

    def convert_logical_block_mask(self, block_mask, batch_idx=None, kv_len=None):
        """torch's flex_attention BlockMask conversion: not supported (NotImplementedError)."""
        raise NotImplementedError("PagedAttention.convert_logical_block_mask: flex_attention's "
                                  "BlockMask is not supported (expected PagedAttention.forward "
                                  "or flash_attn_with_kvcache with block_table)")

    def get_mask_mod(self, mask_mod, kv_len=None):
        """mask_mod over logical positions as one over physical slots, as torch's. The result
        raises IndexError for a b or physical_kv_idx outside the cache (negative ones too)."""
        op = "PagedAttention.get_mask_mod"
        kv_len = _lengths(op, kv_len)
        mask_mod = mask_mod or (lambda b, h, q_idx, kv_idx:
                                _torch.ones_like(kv_idx, dtype=_torch.bool))

        def new_mask_mod(b, h, q_idx, physical_kv_idx):
            logical = self._logical(op, b, physical_kv_idx, kv_len)
            return _torch.where(logical >= 0, mask_mod(b, h, q_idx, logical.clamp(min=0)), False)
        return new_mask_mod

    def get_score_mod(self, score_mod, kv_len=None):
        """score_mod over logical positions as one over physical slots (-inf off the pages);
        IndexError for indices outside the cache, as get_mask_mod's."""
        op = "PagedAttention.get_score_mod"
        kv_len = _lengths(op, kv_len)
        score_mod = score_mod or (lambda score, b, h, q_idx, kv_idx: score)

        def new_score_mod(score, b, h, q_idx, physical_kv_idx):
            logical = self._logical(op, b, physical_kv_idx, kv_len)
            return _torch.where(logical >= 0,
                               score_mod(score, b, h, q_idx, logical.clamp(min=0)),
                               float("-inf"))
        return new_score_mod

    def _logical(self, op, b, physical_kv_idx, kv_len):
        """The logical position of a physical slot of sequence b, -1 where it has none."""
        b = _index_tensor(op, "b", b, self.page_table.shape[0], "max_batch_size")
        physical_kv_idx = _index_tensor(op, "physical_kv_idx", physical_kv_idx,
                                        self.n_pages * self.page_size, "n_pages * page_size")
        if kv_len is not None:
            _index_tensor(op, "b", b, kv_len.shape[0], "len(kv_len)")
        block = self.physical_to_logical[b, physical_kv_idx // self.page_size]
        logical = block * self.page_size + physical_kv_idx % self.page_size
        valid = block >= 0
        if kv_len is not None:
            valid = valid & (logical < kv_len[b])
        return _torch.where(valid, logical, _torch.full_like(logical, -1))

    def forward(self, query, k_cache, v_cache, kv_len, batch_idx=None, *, causal=False,
                scale=None, **options):
        """Attention of query [B, Hq, Lq, D] (torch's layout) over the first kv_len[b] logical
        positions of sequences batch_idx (default 0..B-1) held in k_cache, v_cache
        [1, H, n_pages * page_size, D]; causal is lower-right. Returns [B, Hq, Lq, Dv] (with
        return_softmax_lse, also lse [B, Hq, Lq]). Other options as flash_attn_with_kvcache's
        (new rows k, v in its layout [B, L_new, H, D], appended at slots kv_len[b] of what
        reserve gave); block_mask=None is taken, a flex_attention BlockMask is not. Forward
        only."""
        op = "PagedAttention.forward"
        causal = bool_option(op, "causal", causal)
        options = _options(op, options)
        refuse_grad(op, (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)))
        query = _floating(op, "query", query, 4, "[B, Hq, Lq, D]")
        scale = scale_option(op, scale)
        batch = query.shape[0]
        slots = self.n_pages * self.page_size
        caches = [_floating(op, name, c, 4, f"[1, H, n_pages * page_size={slots}, D]")
                  for name, c in (("k_cache", k_cache), ("v_cache", v_cache))]
        for name, c in zip(("k_cache", "v_cache"), caches):
            if c.shape[0] != 1 or c.shape[2] != slots:
                raise ValueError(f"{op}: {name} has shape {list(c.shape)}, expected [1, "
                                 f"{c.shape[1]}, {slots}, {c.shape[3]}] ([1, H, n_pages * "
                                 "page_size, D])")
        # The pools' shapes are the library's to check, but its messages would name the pools
        # (views of the caches) instead of the caller's caches and query.
        heads_q, dim = query.shape[1], query.shape[3]
        heads = caches[0].shape[1]
        if caches[0].shape[3] != dim or not heads or heads_q % heads:
            raise ValueError(f"{op}: k_cache has shape {list(caches[0].shape)}, expected [1, H, "
                             f"{slots}, {dim}] with Hq % H == 0 (Hq={heads_q}, H={heads}; "
                             "query [B, Hq, Lq, D])")
        if caches[1].shape[1] != heads:
            raise ValueError(f"{op}: v_cache has shape {list(caches[1].shape)}, expected [1, "
                             f"{heads}, {slots}, Dv] ([1, H, n_pages * page_size, Dv] with "
                             "k_cache's H)")
        # Each query row's sequence gets its row of the page table (B x n_pages entries, int64
        # until narrowed): refused before anything of B entries is made, since a broadcast
        # query of empty rows (Lq = 0) has empty outputs however large B is.
        _copies.check_copy(op, "page_table[batch_idx]", (batch, self.n_pages), "int64",
                           "attend fewer query rows at once")
        sequences = self.page_table.shape[0]
        if batch_idx is None:
            if batch > sequences:
                raise ValueError(f"{op}: query has more rows than the cache has sequences (B="
                                 f"{batch}, expected B <= max_batch_size={sequences}, the "
                                 "default batch_idx being 0..B-1); pass batch_idx")
            batch_idx = _torch.arange(batch)
        else:
            batch_idx = _integers(op, "batch_idx", batch_idx, (batch,), "[B] like query")
            outside = (batch_idx < 0) | (batch_idx >= sequences)
            if bool(outside.any()):
                self._batch(op, int(batch_idx[outside][0]))  # (raises)
        lengths = _integers(op, "kv_len", kv_len, (batch,), "[B] like query")
        if batch and (int(lengths.min()) < 0 or int(lengths.max()) > INT32_MAX):
            raise ValueError(f"{op}: kv_len is out of range (kv_len={lengths.tolist()[:8]}, "
                             "expected 0 <= kv_len[b] <= the sequence's capacity)")
        new = _new_rows(op, options, batch, heads, dim, caches[1].shape[3])
        capacity = _torch.as_tensor(self.capacity)[batch_idx]
        past = (lengths + new > capacity).nonzero()
        if past.numel():
            i = int(past[0])
            b, n = int(batch_idx[i]), int(lengths[i])
            what = f"kv_len[{i}]={n}" if not new else f"kv_len[{i}] + L_new={n + new}"
            raise ValueError(f"{op}: kv_len{' with the new rows' if new else ''} is past "
                             f"what the sequence reserved ({what}, batch_idx[{i}]={b}, "
                             f"expected <= its capacity={int(capacity[i])}); reserve first")
        rows = self.page_table[batch_idx]  # int64, narrowed to the library's int32 below
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) > INT32_MAX):
            i, j = (int(x) for x in ((rows < -1) | (rows > INT32_MAX)).nonzero()[0])
            raise ValueError(f"{op}: page_table is out of range (page_table[{int(batch_idx[i])}]"
                             f"[{j}]={int(rows[i, j])}, expected -1 or a page index in "
                             f"[0, n_pages={self.n_pages}))")
        table = rows.to(_torch.int32)
        pools = [c[0].unflatten(1, (self.n_pages, self.page_size)).permute(1, 2, 0, 3)
                 for c in caches]  # [n_pages, page_size, H, D] views, no copy
        try:
            out = flash_attn_with_kvcache(
                query.transpose(1, 2), pools[0], pools[1],
                cache_seqlens=lengths.to(_torch.int32), block_table=table,
                softmax_scale=scale, causal=causal, **options)
        except (ValueError, TypeError, NotImplementedError, MemoryError) as error:
            raise _naming(op, error) from None
        if options.get("return_softmax_lse"):
            return out[0].transpose(1, 2), out[1]
        return out.transpose(1, 2)


# flash_attn_with_kvcache's options PagedAttention.forward passes on, and those it sets from its
# own arguments (with what the caller passes instead).
_OPTIONS = ("k", "v", "rotary_cos", "rotary_sin", "rotary_interleaved", "cache_leftpad",
            "window_size", "softcap", "alibi_slopes", "num_splits", "return_softmax_lse",
            "backend")
_OWN_OPTIONS = {"q": "query", "cache_seqlens": "kv_len", "block_table": "batch_idx",
                "cache_batch_idx": "batch_idx", "softmax_scale": "scale"}


def _options(op, options):
    """PagedAttention.forward's **options for flash_attn_with_kvcache: TypeError for a name
    forward sets itself or that function lacks, NotImplementedError for a block_mask other than
    None (flex_attention's BlockMask)."""
    options = dict(options)
    block_mask = options.pop("block_mask", None)
    if block_mask is not None:
        raise NotImplementedError(f"{op}: block_mask is not supported (type="
                                  f"{type(block_mask).__name__}, expected None); "
                                  "flex_attention's BlockMask is not: pass causal=True or "
                                  "window_size=(left, right)")
    for name, value in options.items():
        if name in _OWN_OPTIONS:
            raise TypeError(f"{op}: {name} is set from forward's own arguments (type="
                            f"{type(value).__name__}, expected {_OWN_OPTIONS[name]} instead)")
        if name not in _OPTIONS:
            raise TypeError(f"{op}: {name} is not an option (type={type(value).__name__}, "
                            f"expected one of {', '.join(_OPTIONS)})")
    return options


def _new_rows(op, options, batch, heads, dim, dim_v):
    """L_new of the rows k, v [B, L_new, H, D] that options append (0 without them), checked
    against the caller's query and caches."""
    if options.get("k") is None or options.get("v") is None:
        return 0  # none, or one without the other: flash_attn_with_kvcache refuses it
    shapes = [tuple(_arrays.shape_of(options[name], op, name)) for name in ("k", "v")]
    for name, shape, d in zip(("k", "v"), shapes, (dim, dim_v)):
        if len(shape) != 4 or shape[0] != batch or shape[1] != shapes[0][1] or \
                shape[2] != heads or shape[3] != d:
            raise ValueError(f"{op}: {name} has shape {list(shape)}, expected [{batch}, L_new, "
                             f"{heads}, {d}] ([B, L_new, H, {'D' if name == 'k' else 'Dv'}], "
                             "flash_attn_with_kvcache's layout, with query's B and the caches' "
                             "H)")
    return shapes[0][1]


def _naming(op, error):
    """`error` (raised by a flash_attn_with_kvcache call `op` makes) with its message's leading
    "<call>: " replaced by "<op>: ", so that it names the call the user made."""
    head, sep, rest = str(error).partition(": ")
    message = f"{op}: {rest}" if sep and " " not in head else str(error)
    for kind in type(error).__mro__:  # its own type, else the nearest one built from a message
        try:                          # (numpy's MemoryError subclass takes more arguments)
            return kind(message)
        except TypeError:
            continue
    return RuntimeError(message)  # (not reached: Exception takes a message)
