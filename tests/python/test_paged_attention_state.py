"""attncore.torch.PagedAttention's state is public (page_table, capacity, empty_pages,
physical_to_logical), as torch's is: a caller may write over it. Each method checks what it
reads of that state before it changes anything, so a written-over state is refused in
attncore's form, and never maps one page to two sequences or writes through another's page."""

import pytest
import torch

import attncore
import attncore.torch
from conftest import raises


def test_paged_attention_assign_and_erase_check_the_public_page_table():
    """page_table and capacity are public tensors: assign refuses entries it would write
    through (-1 wrapped around into another sequence's page) and a capacity past the table,
    erase a page named twice or already free (it would be handed to two sequences)."""
    attn = attncore.torch.PagedAttention(4, 4, 2)
    attn.reserve(0, 4)
    attn.reserve(1, 4)
    page, free = int(attn.page_table[0, 0]), attn.empty_pages[0]
    one = torch.full((1, 1, 1, 2), 7.0)
    cache = torch.zeros(1, 1, 16, 2)
    attn.page_table[0, 0] = -1
    raises(ValueError, lambda: attn.assign([0], [[0]], one, one, cache, cache.clone()),
           r"page_table is out of range where input_pos writes (page_table[0][0]=-1 for "
           r"input_pos[0][0]=0, expected a page index in [0, n_pages=4)); nothing was written")
    attn.page_table[0, 0] = 100
    raises(ValueError, lambda: attn.assign([0], [[0]], one, one, cache, cache.clone()),
           "page_table[0][0]=100 for input_pos[0][0]=0")
    attn.page_table[0, 0] = page
    attn.capacity[0] = 100
    raises(ValueError, lambda: attn.assign([0], [[50]], one, one, cache, cache.clone()),
           "capacity is past the page table (capacity[0]=100, expected <= n_pages * "
           "page_size=16)")
    assert not cache.any()
    attn.capacity[0] = 4
    attn.page_table[0, 1] = attn.page_table[0, 0]
    raises(ValueError, lambda: attn.erase(0),
           f"page_table maps a page twice (page_table[0][1]={page}, expected each of the "
           "sequence's pages once, at the place reserve gave it); nothing was erased")
    attn.page_table[0, 1] = free
    raises(ValueError, lambda: attn.erase(0), "page_table maps a page that is free "
           f"(page_table[0][1]={free}")
    attn.page_table[0, 1] = -1
    attn.erase(0)
    attn.erase(1)
    assert sorted(attn.empty_pages) == [0, 1, 2, 3]


def _paged_state(pa):
    return (pa.page_table.clone(), pa.capacity.clone(), list(pa.empty_pages),
            pa.physical_to_logical.clone())


def _same_state(pa, state):
    return (torch.equal(pa.page_table, state[0]) and torch.equal(pa.capacity, state[1]) and
            pa.empty_pages == state[2] and torch.equal(pa.physical_to_logical, state[3]))


@pytest.mark.parametrize("case", ["negative capacity", "capacity off a page", "page out of range",
                                  "page in use", "page twice", "float page",
                                  "table mapped past capacity"])
def test_paged_attention_reserve_checks_the_public_state_reserving_nothing(case):
    """reserve reads capacity, empty_pages and page_table, all public: written over, it raised
    torch's errors after taking pages off the free list, or mapped a page in use to a second
    sequence; now a ValueError in attncore's form, with nothing changed."""
    pa = attncore.torch.PagedAttention(6, 4, 2)
    pa.reserve(0, 4)
    used = int(pa.page_table[0, 0])
    if case == "negative capacity":
        pa.capacity[0] = -5
        message = "capacity is out of range (capacity[0]=-5, expected a multiple of page_size=4"
    elif case == "capacity off a page":
        pa.capacity[0] = 3
        message = "capacity is out of range (capacity[0]=3"
    elif case == "table mapped past capacity":
        pa.page_table[0, 1] = pa.empty_pages[0]
        message = "page_table maps a page past the sequence's capacity (page_table[0][1]="
    else:
        bad = {"page out of range": 100, "page in use": used, "page twice": pa.empty_pages[-1],
               "float page": 1.5}[case]
        pa.empty_pages[-2] = bad
        at = len(pa.empty_pages) - (1 if case == "page twice" else 2)  # (a repeat: the second)
        message = (f"empty_pages holds a page that is not free (empty_pages[{at}]={bad!r}, "
                   "expected distinct")
    state = _paged_state(pa)
    raises(ValueError, lambda: pa.reserve(0, 12), f"PagedAttention.reserve: {message}")
    assert _same_state(pa, state)


def test_paged_attention_erase_refuses_a_page_of_another_sequence():
    """A page table row written to name another sequence's page: erase freed it while that
    sequence held it (and reserve then gave it to a third); now refused, nothing erased."""
    pa = attncore.torch.PagedAttention(4, 4, 3)
    pa.reserve(0, 4)
    pa.reserve(1, 4)
    own, other = int(pa.page_table[0, 0]), int(pa.page_table[1, 0])
    pa.page_table[0, 0] = other
    state = _paged_state(pa)
    raises(ValueError, lambda: pa.erase(0),
           f"PagedAttention.erase: page_table maps a page this sequence was not given "
           f"(page_table[0][0]={other}, expected each of the sequence's pages once, at the "
           "place reserve gave it); nothing was erased")
    assert _same_state(pa, state)
    pa.page_table[0, 0] = own
    pa.erase(0)
    pa.reserve(2, 8)
    assert other not in pa.page_table[2].tolist()


def test_paged_attention_erase_refuses_a_table_entry_past_the_pages_erasing_nothing():
    pa = attncore.torch.PagedAttention(4, 2, 1)
    pa.reserve(torch.tensor(0), torch.tensor(4))
    held = pa.page_table[0, 1].item()
    pa.page_table[0, 1] = 99  # the public table, written by a caller
    state = (pa.capacity.clone(), list(pa.empty_pages), pa.physical_to_logical.clone())
    raises(ValueError, lambda: pa.erase(torch.tensor(0)),
           "PagedAttention.erase: page_table is out of range (page_table[0][1]=99, expected -1 "
           "or a page index in [0, n_pages=4)); nothing was erased")
    assert torch.equal(pa.capacity, state[0]) and pa.empty_pages == state[1]
    assert torch.equal(pa.physical_to_logical, state[2])
    pa.page_table[0, 1] = held
    pa.erase(torch.tensor(0))
    assert sorted(pa.empty_pages) == [0, 1, 2, 3] and int(pa.capacity[0]) == 0


def test_paged_attention_a_table_entry_naming_another_sequences_page_is_refused():
    """A page table entry written to name another sequence's page: assign wrote into that page,
    and after reserve gave the written-over page to a second sequence, both held it; assign and
    erase now refuse such an entry (reserve's own check is of the free list: a search of every
    row of the table cost milliseconds a call)."""
    pa = attncore.torch.PagedAttention(4, 2, 2)
    pa.reserve(0, 2)
    pa.reserve(1, 2)
    own, other = int(pa.page_table[1, 0]), int(pa.page_table[0, 0])
    pa.page_table[1, 0] = other
    one = torch.full((1, 1, 1, 2), 7.0)
    cache = torch.zeros(1, 1, 8, 2)
    state = _paged_state(pa)
    raises(ValueError, lambda: pa.assign([1], [[1]], one, one, cache, cache.clone()),
           f"PagedAttention.assign: page_table names a page this sequence was not given where "
           f"input_pos writes (page_table[1][0]={other} for input_pos[0][0]=1, expected the page "
           "reserve gave it); nothing was written")
    assert not cache.any() and _same_state(pa, state)
    pa.page_table[1, 0] = own
    pa.assign([1], [[1]], one, one, cache, cache.clone())
    assert cache[0, 0, own * 2 + 1].eq(7).all() and int(cache.ne(0).sum()) == 2
    # A free page written into a row, then handed out by reserve: the row that was written over
    # can neither write through it nor erase it.
    pa.erase(1)
    free = pa.empty_pages[-1]
    pa.page_table[0, 1] = free
    pa.reserve(1, 2)
    assert int(pa.page_table[1, 0]) == free
    pa.capacity[0] = 4  # (written over too, to reach the page)
    raises(ValueError, lambda: pa.assign([0], [[2]], one, one, cache, cache.clone()),
           f"page_table[0][1]={free} for input_pos[0][0]=2")
    raises(ValueError, lambda: pa.erase(0), "page_table maps a page this sequence was not given")


def test_reserve_refuses_an_empty_pages_entry_past_int64():
    """empty_pages is a public list: an int past int64 in it is a page that is not free, refused
    as any other such entry (torch.tensor raised its own overflow error)."""
    pa = attncore.torch.PagedAttention(4, 4, 2)
    pa.empty_pages[-1] = 2 ** 70
    state = _paged_state(pa)
    raises(ValueError, lambda: pa.reserve(0, 4),
           f"PagedAttention.reserve: empty_pages holds a page that is not free (empty_pages[3]="
           f"{2 ** 70}, expected distinct page indices in [0, n_pages=4) that no sequence maps); "
           "nothing was reserved")
    assert _same_state(pa, state)


def test_forward_checks_a_batch_before_anything_of_its_size():
    """A broadcast query of empty rows (Lq = 0) has empty outputs for any B; forward gathers a
    page table row per query row (B x n_pages), refused in attncore's form past the memory
    before anything of B entries is made (a Python loop over B, then a bare MemoryError, before);
    without batch_idx, B past max_batch_size is named as such; batch_idx and kv_len are checked
    as whole tensors."""
    pa = attncore.torch.PagedAttention(4, 4, 2)
    pa.reserve(0, 4)
    cache = torch.zeros(1, 2, 16, 8)
    batch = 2 ** 36
    q = torch.zeros(1, 2, 0, 8).expand(batch, 2, 0, 8)
    kv_len = torch.zeros(1, dtype=torch.int32).expand(batch)
    idx = torch.zeros(1, dtype=torch.int64).expand(batch)
    for call in (lambda: pa.forward(q, cache, cache, kv_len, batch_idx=idx),
                 lambda: pa.forward(q, cache, cache, kv_len)):
        raises(MemoryError, call,
               "PagedAttention.forward: page_table[batch_idx] needs a contiguous copy larger "
               f"than the memory this process may use (shape=[{batch}, 4]",
               "attend fewer query rows at once")
    q3 = torch.zeros(3, 2, 1, 8)
    raises(ValueError, lambda: pa.forward(q3, cache, cache, torch.tensor([1, 1, 1])),
           "PagedAttention.forward: query has more rows than the cache has sequences (B=3, "
           "expected B <= max_batch_size=2, the default batch_idx being 0..B-1); pass batch_idx")
    raises(ValueError, lambda: pa.forward(q3, cache, cache, torch.tensor([1, 1, 1]),
                                          batch_idx=torch.tensor([0, 2, -1])),
           "PagedAttention.forward: batch_idx is out of range (batch_idx=2, expected 0 <= "
           "batch_idx < max_batch_size=2)")
    raises(ValueError, lambda: pa.forward(q3, cache, cache, torch.tensor([1, 5, 1]),
                                          batch_idx=torch.tensor([0, 0, 0])),
           "PagedAttention.forward: kv_len is past what the sequence reserved (kv_len[1]=5, "
           "batch_idx[1]=0, expected <= its capacity=4); reserve first")
    out = pa.forward(q3, cache, cache, torch.tensor([1, 4, 2]), batch_idx=torch.tensor([0, 0, 0]))
    assert out.shape == (3, 2, 1, 8)
