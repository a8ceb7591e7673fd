"""Hostile inputs to attncore.torch.PagedAttention (torch's class and method signatures over
attncore's paged cache): every refusal in attncore's message form and type (docs/design.md
section 4) before anything is written, and the good neighbours of each refused call still right
against a float64 oracle. The other paged and cache surfaces: test_paged_hostile.py."""

import numpy as np
import torch

import attncore
import attncore.torch
from conftest import raises
from test_paged_hostile import oracle


def paged_attention():
    attn = attncore.torch.PagedAttention(6, 4, 3)
    k_cache, v_cache = torch.zeros(1, 2, 24, 8), torch.zeros(1, 2, 24, 8)
    attn.reserve(0, 7)
    attn.reserve(1, 5)
    return attn, k_cache, v_cache


def test_paged_attention_refuses_bad_indices_without_truncating_them():
    attn, k_cache, v_cache = paged_attention()
    rows = torch.randn(1, 2, 3, 8)
    raises(TypeError, lambda: attn.assign(torch.tensor([0]), torch.tensor([[0.5, 1.5, 2.5]]),
                                          rows, rows, k_cache, v_cache),
           "input_pos is not an integer tensor")
    raises(TypeError, lambda: attn.assign([0], [[0, 1, 2]], rows.numpy(), rows, k_cache,
                                          v_cache), "k_val is not a torch tensor")
    raises(ValueError, lambda: attn.assign([0], [[0, 1, 2]], rows.int(), rows, k_cache,
                                           v_cache), "k_val has the wrong dtype")
    raises(ValueError, lambda: attn.reserve(2, -5), "seq_len is out of range")
    raises(ValueError, lambda: attncore.torch.PagedAttention(4, 4, 2, device="bogus"),
           "device is not a device")
    assert not k_cache.any()
    q = torch.randn(2, 4, 1, 8)
    lens = torch.tensor([7, 5])
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, lens, batch_idx=[0, 3]),
           "batch_idx is out of range (batch_idx=3")
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, lens, batch_idx=[0, -1]),
           "batch_idx is out of range (batch_idx=-1")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens.double()),
           "kv_len is not an integer tensor")
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, torch.tensor([2 ** 40, 5])),
           "kv_len is out of range")
    raises(ValueError, lambda: attn.forward(q, k_cache[:, :, :20], v_cache[:, :, :20], lens),
           "k_cache has shape [1, 2, 20, 8], expected [1, 2, 24, 8]")
    raises(NotImplementedError, lambda: attn.forward(q.requires_grad_(), k_cache, v_cache,
                                                     lens), "query requires grad")


def test_paged_attention_forward_is_right_after_the_checks():
    attn, k_cache, v_cache = paged_attention()
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    attn.assign([0, 1], [list(range(7)), list(range(7))], k, v, k_cache, v_cache)
    q = torch.randn(2, 4, 1, 8)
    out = attn.forward(q, k_cache, v_cache, [7, 5], batch_idx=np.array([1, 0]))
    for i, (b, n) in enumerate(((1, 7), (0, 5))):
        want = oracle(q[i].transpose(0, 1), k[b, :, :n].transpose(0, 1).repeat_interleave(2, 1),
                      v[b, :, :n].transpose(0, 1).repeat_interleave(2, 1))
        np.testing.assert_allclose(out[i].transpose(0, 1).numpy(), want, atol=1e-5)


def test_paged_attention_assign_refuses_caches_it_would_write_wrongly():
    attn = attncore.torch.PagedAttention(4, 4, 1)
    attn.reserve(0, 4)
    one = torch.ones(1, 1, 1, 2)
    cache = torch.zeros(1, 1, 16, 2)
    raises(ValueError, lambda: attn.assign([0], [[0]], one, one * 7, cache, cache),
           "v_cache overlaps k_cache")
    expanded = torch.zeros(1, 1, 1, 2).expand(1, 2, 16, 2)
    raises(ValueError, lambda: attn.assign([0], [[0]], torch.ones(1, 2, 1, 2),
                                           torch.ones(1, 2, 1, 2), expanded, expanded.clone()),
           "k_cache is an output with a zero stride")
    assert not cache.any()
    raises(NotImplementedError, lambda: attn.assign(
        [0], [[0]], one, one, torch.zeros(1, 1, 16, 2, requires_grad=True), cache),
           "k_cache requires grad")
    attn.assign(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64),
                torch.ones(0, 1, 1, 2), torch.ones(0, 1, 1, 2), cache, cache.clone())
    assert not cache.any()


def test_paged_attention_refuses_sizes_past_what_it_can_hold():
    raises(ValueError, lambda: attncore.torch.PagedAttention(8, 2 ** 62, 3),
           "n_pages * page_size is too large")
    raises(ValueError, lambda: attncore.torch.PagedAttention(2 ** 40, 4, 3),
           "n_pages * page_size is too large")
    raises(MemoryError, lambda: attncore.torch.PagedAttention(2 ** 29, 2, 2 ** 40),
           "exceed the memory this process may use")


def test_paged_attention_forward_names_kv_len_past_the_reservation():
    attn, k_cache, v_cache = paged_attention()
    q = torch.randn(2, 4, 1, 8)
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, torch.tensor([7, 9])),
           "kv_len is past what the sequence reserved (kv_len[1]=9, batch_idx[1]=1, "
           "expected <= its capacity=8)")


def test_paged_attention_mods_name_indices_outside_the_cache():
    """The mods index the page bookkeeping: an index outside it raises IndexError (as indexing
    does) naming the index and its range; a negative one is refused rather than wrapped to
    another sequence or page."""
    attn = attncore.torch.PagedAttention(4, 2, 3)
    attn.reserve(0, 3)
    mask = attn.get_mask_mod(None)
    slots = torch.arange(8)
    expected = (attn.physical_to_logical[0, slots // 2] >= 0).tolist()
    assert mask(torch.tensor(0), 0, 0, slots).tolist() == expected
    raises(IndexError, lambda: mask(torch.tensor(3), 0, 0, slots),
           "PagedAttention.get_mask_mod: b is out of range (b=3, expected 0 <= b < "
           "max_batch_size=3)")
    raises(IndexError, lambda: mask(torch.tensor(-1), 0, 0, slots), "b is out of range (b=-1")
    raises(IndexError, lambda: mask(0, 0, 0, torch.tensor([0, 8])),
           "physical_kv_idx is out of range (physical_kv_idx=8, expected 0 <= physical_kv_idx "
           "< n_pages * page_size=8)")
    raises(IndexError, lambda: mask(0, 0, 0, -1), "physical_kv_idx is out of range "
                                                  "(physical_kv_idx=-1")
    raises(TypeError, lambda: mask(0, 0, 0, torch.tensor([0.5])),
           "physical_kv_idx is not an integer tensor")
    score = attn.get_score_mod(None, kv_len=torch.tensor([3]))
    assert score(torch.zeros(8), 0, 0, 0, slots).isfinite().sum() == 3
    raises(IndexError, lambda: score(torch.zeros(2), torch.tensor(1), 0, 0, slots[:2]),
           "PagedAttention.get_score_mod: b is out of range (b=1, expected 0 <= b < "
           "len(kv_len)=1)")
    raises(IndexError, lambda: score(torch.zeros(1), 0, 0, 0, torch.tensor([9])),
           "physical_kv_idx=9")


def test_paged_attention_forward_names_the_callers_tensors_and_options():
    """Errors name query, k_cache, v_cache, kv_len and forward's options as passed, never the
    page pools (views of the caches) or the arguments forward passes on for the caller."""
    attn, k_cache, v_cache = paged_attention()
    q = torch.randn(2, 4, 1, 8)
    lens = torch.tensor([7, 5])
    for message in (
            raises(ValueError, lambda: attn.forward(torch.randn(2, 4, 1, 7), k_cache, v_cache,
                                                    lens),
                   "PagedAttention.forward: k_cache has shape [1, 2, 24, 8], expected "
                   "[1, H, 24, 7] with Hq % H == 0 (Hq=4, H=2"),
            raises(ValueError, lambda: attn.forward(torch.randn(2, 3, 1, 8), k_cache, v_cache,
                                                    lens), "(Hq=3, H=2"),
            raises(ValueError, lambda: attn.forward(q, k_cache, v_cache[:, :1], lens),
                   "v_cache has shape [1, 1, 24, 8], expected [1, 2, 24, Dv]")):
        assert "[6, " not in message and "num_pages" not in message, message
    raises(NotImplementedError, lambda: attn.forward(q, k_cache, v_cache, lens,
                                                     block_mask=object()),
           "PagedAttention.forward: block_mask is not supported (type=object, expected None)")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens, cache_seqlens=lens),
           "PagedAttention.forward: cache_seqlens is set from forward's own arguments",
           "expected kv_len instead")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens, softmax_scale=0.5),
           "expected scale instead")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens, sliding_window=4),
           "PagedAttention.forward: sliding_window is not an option")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens, scale="0.5"),
           "PagedAttention.forward: scale is not a real number")
    raises(TypeError, lambda: attn.forward(q, k_cache, v_cache, lens, causal="no"),
           "PagedAttention.forward: causal is not a bool (type=str")
    new = torch.randn(2, 2, 2, 8)  # [B, L_new, H, D]: slots 7, 8 of sequence 0 are past 8
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, lens, k=new, v=new),
           "kv_len with the new rows is past what the sequence reserved (kv_len[0] + "
           "L_new=9, batch_idx[0]=0, expected <= its capacity=8)")
    three_heads = torch.randn(2, 1, 3, 8)
    raises(ValueError, lambda: attn.forward(q, k_cache, v_cache, lens, k=three_heads,
                                            v=three_heads),
           "PagedAttention.forward: k has shape [2, 1, 3, 8], expected [2, L_new, 2, 8]")
    assert not k_cache.any() and not v_cache.any()
    out, lse = attn.forward(q, k_cache, v_cache, lens, return_softmax_lse=True, block_mask=None)
    assert torch.equal(out, attn.forward(q, k_cache, v_cache, lens))
    assert lse.shape == (2, 4, 1)
