"""Hostile inputs to the dense, packed and variable-length surfaces found in a probe: each
refused in attncore's form (docs/design.md section 4) before work of its size, or taken as
torch or flash-attn takes it."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from attncore import bert_padding
from conftest import raises


def test_no_query_row_gathers_no_key():
    # The math backend gathers each head's K and V into contiguous rows; with no query row it
    # gathers nothing: a query of Lq = 0 over 2^22 broadcast keys (1 GiB each as copies), in a
    # fresh process, keeps its peak memory far below one copy, forward and backward.
    code = """
import resource, numpy as np, attncore
k = np.broadcast_to(np.ones((1, 1, 1, 64), np.float32), (1, 1, 2 ** 22, 64))
q = np.zeros((1, 1, 0, 64), np.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = attncore.attention(q, k, k, backend="math")
dq, dk, dv = attncore.attention_backward(q, q, k[:, :, :4096], k[:, :, :4096], q,
                                         np.zeros((1, 1, 0), np.float32), backend="math")
assert out.shape == (1, 1, 0, 64) and not dk.any() and not dv.any()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert int(run.stdout.split()[-1]) < 200 * 1024, run.stdout  # KiB: below 200 MiB


def test_broadcast_slopes_and_lse_are_copied_only_where_the_copy_fits():
    # Batch dims [N, 2] of a broadcast query fold into one as a view (stride 0 both); slopes
    # [N, 2, Hq] and an LSE [N, 2, Hq, Lq] that hold two real rows broadcast along N fold only
    # in a copy, here past the memory this process may use: refused before it is made.
    limit = attncore._core.memory_limit()[0]
    n = int(limit // 8) + 1
    q = np.broadcast_to(np.ones((1, 1, 1, 1, 4), np.float32), (n, 2, 1, 1, 4))
    slopes = np.broadcast_to(np.ones((1, 2, 1), np.float32), (n, 2, 1))
    raises(MemoryError, lambda: attncore.attention(q, q, q, alibi_slopes=slopes),
           "attention: alibi_slopes needs a contiguous copy larger than")
    lse = np.broadcast_to(np.zeros((1, 2, 1, 1), np.float32), (n, 2, 1, 1))
    raises(MemoryError, lambda: attncore.attention_backward(q, q, q, q, q, lse),
           "attention_backward: softmax_lse needs a contiguous copy larger than")
    # Such slopes and LSE where the copy fits: the results of contiguous ones.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 2, 5, 8)).astype(np.float32)
    few = np.broadcast_to(np.float32([[0.5, 0.25], [0.125, 1.0]]), (3, 2, 2))
    dense = np.ascontiguousarray(few)
    got, lse_got = attncore.attention(x, x, x, alibi_slopes=few, return_lse=True)
    want, lse_want = attncore.attention(x, x, x, alibi_slopes=dense, return_lse=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse_got, lse_want)
    lse_spread = np.broadcast_to(lse_got[:1], lse_got.shape)  # row 0's LSE for every batch
    grads = attncore.attention_backward(x, x, x, x, got, lse_spread, alibi_slopes=few)
    want_grads = attncore.attention_backward(x, x, x, x, got, np.ascontiguousarray(lse_spread),
                                             alibi_slopes=dense)
    for g, w in zip(grads, want_grads):
        np.testing.assert_array_equal(g, w)


def test_copies_keep_broadcast_dims_broadcast():
    # An input read only through a copy (numpy negative strides, a lazily negated tensor, a last
    # stride other than 1) is copied as its distinct elements, its broadcast dims kept broadcast:
    # a view standing for 4 GiB of q is refused for its shape at once, in a fresh process whose
    # peak memory stays far below a copy; where the call is valid, the results of a contiguous
    # input, bit for bit.
    code = """
import resource, numpy as np, attncore
row = np.random.default_rng(0).standard_normal(64).astype(np.float32)[::-1]
q = np.broadcast_to(row, (1 << 22, 1, 4, 64))
k = np.zeros((1, 16, 1, 64), np.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for call in (lambda: attncore.flash_attn_with_kvcache(q, k, k, cache_seqlens=3),
             lambda: attncore.flash_attn_func(q, k, k)):
    try:
        call()
        raise SystemExit("accepted")
    except ValueError as e:
        assert "has shape [1, 16, 1, 64]" in str(e), e
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert int(run.stdout.split()[-1]) < 200 * 1024, run.stdout  # KiB: below 200 MiB
    rng = np.random.default_rng(1)
    row = rng.standard_normal((1, 1, 2, 16)).astype(np.float32)[..., ::-1]
    q = np.broadcast_to(row, (3, 5, 2, 16))
    k = rng.standard_normal((3, 7, 2, 16)).astype(np.float32)
    lens = np.int32([4, 4, 4, 9])[2::-1]  # [4, 4, 4], stride -4 bytes
    want = attncore.flash_attn_with_kvcache(np.ascontiguousarray(q), k, k, cache_seqlens=4)
    np.testing.assert_array_equal(attncore.flash_attn_with_kvcache(q, k, k, cache_seqlens=lens),
                                  want)
    np.testing.assert_array_equal(attncore.flash_attn_func(q, k, k),
                                  attncore.flash_attn_func(np.ascontiguousarray(q), k, k))
    # A stride that is no whole element (2 bytes of a float32: dim 0's items overlap) is no
    # broadcast: the copy holds each item as it reads.
    words = rng.choice(np.float32([1.0, 1.5, -2.0, 0.5]), 3 * 5 * 2 * 16 + 8)
    odd = np.lib.stride_tricks.as_strided(words, (3, 5, 2, 16), (2, 128, 64, 4))
    assert odd.strides[0] == 2 and not np.array_equal(odd[0], odd[1])
    np.testing.assert_array_equal(attncore.flash_attn_func(odd, k, k),
                                  attncore.flash_attn_func(np.ascontiguousarray(odd), k, k))
    # A last stride of 2 elements, broadcast: copied after the checks, as its distinct rows.
    every_other = np.broadcast_to(np.repeat(row, 2, axis=-1)[..., ::2], q.shape)
    assert every_other.strides[-1] == 8 and every_other.strides[0] == 0
    np.testing.assert_array_equal(attncore.flash_attn_func(every_other, k, k),
                                  attncore.flash_attn_func(np.ascontiguousarray(q), k, k))
    t = torch.from_numpy(np.ascontiguousarray(row)).expand(3, 5, 2, 16)
    negated = torch._neg_view(t)
    assert negated.is_neg()
    np.testing.assert_array_equal(
        attncore.torch.flash_attn_func(negated, torch.from_numpy(k), torch.from_numpy(k)).numpy(),
        attncore.torch.flash_attn_func(-t.contiguous(), torch.from_numpy(k),
                                       torch.from_numpy(k)).numpy())
    # A broadcast leaf that requires grad, lazily negated: copied whole, so that each of its
    # elements gets its own gradient, as from the negated values.
    kt = torch.from_numpy(k)
    grads = []
    for negate in (torch._neg_view, torch.neg):
        leaf = torch.from_numpy(np.ascontiguousarray(row)).expand(3, 5, 2, 16).requires_grad_()
        out = attncore.torch.flash_attn_func(negate(leaf), kt, kt)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        grads.append(leaf.grad)
    assert grads[0].abs().sum() > 0 and bool(grads[0][1:].ne(0).any())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_packed_backward_checks_its_gradients_memory(monkeypatch):
    kv = torch.randn(1, 6, 2, 2, 8, requires_grad=True)
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    out = attncore.flash_attn_kvpacked_func(q, kv)
    monkeypatch.setattr(attncore._core, "memory_limit", lambda: (64.0, "a test's limit"))
    raises(MemoryError, lambda: out.sum().backward(),
           "backward: the outputs exceed the memory this process may use")


def test_uint8_masks_and_offsets_without_seeds_are_refused():
    q = torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[1, 0, 2]], dtype=torch.uint8).expand(3, 3)
    raises(ValueError, lambda: attncore.attention(q, q, q, attn_mask=mask),
           "mask has an unsupported element type")
    raises(ValueError, lambda: attncore.attention(q.numpy(), q.numpy(), q.numpy(), dropout_p=0.5,
                                                  offset=123456),
           "offset is set without seed (offset=123456")


def test_an_unbatched_query_takes_the_batch_of_key_and_value():
    # torch's math path broadcasts a [L, E] query against [2, 1, S, E] keys: [2, 1, L, Ev].
    torch.manual_seed(0)
    q = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 6, 3, dtype=torch.float64, requires_grad=True)
    want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    dout = torch.randn_like(want)
    want.backward(dout)
    out, lse = attncore.attention(*(x.detach().numpy() for x in (q, k, v)), return_lse=True)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=1e-12)
    grads = attncore.attention_backward(dout.numpy(), *(x.detach().numpy() for x in (q, k, v)),
                                        out, lse)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == tuple(x.shape)
        np.testing.assert_allclose(g, x.grad.numpy(), atol=1e-12)
    got = attncore.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    assert got.shape == (2, 1, 5, 3)


def test_the_torch_operator_broadcasts_one_kv_head_as_the_function_does():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4)
    torch.testing.assert_close(torch.ops.attncore.scaled_dot_product_attention(q, k, k),
                               attncore.torch.scaled_dot_product_attention(q, k, k))


def test_errors_of_the_callers_sequences_keep_their_kind():
    class Failing:
        def __init__(self, error):
            self.error = error

        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise self.error

    k = np.zeros((1, 1, 3, 4), np.float32)
    for error in (MemoryError("out of memory"), RuntimeError("remote read failed")):
        with pytest.raises(type(error)) as info:
            attncore.attention(Failing(error), k, k)
        assert info.value is error
    with pytest.raises(ValueError) as info:
        attncore.attention(Failing(ValueError("element 0 is corrupt")), k, k)
    assert "query is a ragged sequence" in str(info.value)
    assert str(info.value.__cause__) == "element 0 is corrupt"


def test_unpad_input_refuses_unused_slots_before_real_tokens_and_int32_overflow(monkeypatch):
    hidden = torch.arange(8.0).reshape(2, 4, 1)
    used = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # row 1: slot 0 first
    raises(ValueError, lambda: bert_padding.unpad_input(hidden, used, unused),
           "unused_mask marks a slot before a real token (sequence 1: unused_mask[1][0] is "
           "before attention_mask[1][2]")
    unused[1] = torch.tensor([0, 0, 0, 1], dtype=torch.bool)  # after the real tokens: taken
    packed, indices, cu, longest, seqused = bert_padding.unpad_input(hidden, used, unused)
    assert indices.tolist() == [0, 1, 2, 5, 6, 7] and cu.tolist() == [0, 3, 6]
    assert seqused.tolist() == [2, 2] and longest == 3
    empty = torch.zeros(2, 0, 1)  # no slot at all: nothing to check, nothing packed
    none = torch.zeros(2, 0, dtype=torch.bool)
    assert bert_padding.unpad_input(empty, none, none)[2].tolist() == [0, 0, 0]
    monkeypatch.setattr(bert_padding, "INT32_MAX", 5)  # (2^31 tokens, made small)
    raises(ValueError, lambda: bert_padding.unpad_input(hidden, used, unused),
           "attention_mask keeps too many tokens (total=6, expected <= 5")


def test_bert_padding_copies_only_what_it_keeps():
    # A broadcast batch [4096, 16384, 1024] (64 GiB as a copy) of which 3 tokens are kept: only
    # those rows are gathered (the whole batch was flattened through a copy first); indices
    # broadcast past what their copy could hold are refused in attncore's form (torch's min and
    # max copied them: an allocator error).
    hidden = torch.arange(16384 * 1024, dtype=torch.float32).reshape(1, 16384, 1024)
    hidden = hidden.expand(4096, 16384, 1024)
    used = torch.zeros(4096, 16384, dtype=torch.bool)
    used[0, :2] = True
    used[4095, 7] = True
    packed, indices, cu, longest, seqused = bert_padding.unpad_input(hidden, used)
    assert packed.shape == (3, 1024) and longest == 2 and cu[-1] == 3
    assert torch.equal(packed, hidden[[0, 0, 4095], [0, 1, 7]])
    many = torch.zeros(1, dtype=torch.long).expand(1 << 42)
    raises(MemoryError, lambda: bert_padding.index_first_axis(torch.zeros(4, 3), many),
           "index_first_axis: indices needs a contiguous copy larger than")
