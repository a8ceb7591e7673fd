"""attncore.flash_attn_interface (flash-attn 2.8.3's seven functions, one definition each),
attncore.bert_padding and attncore.install_flash_attn_alias(): a small transformer block written
against `flash_attn` runs unchanged through the alias and matches the same block in torch
float64 (outputs and gradients)."""

import copy
import importlib.metadata
import importlib.util
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import attncore
import attncore.torch
import reference

# flash-attn 2.8.3's parameters, in order (attncore adds keyword-only ones after them).
SIGNATURES = {
    "flash_attn_func": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes "
                       "deterministic return_attn_probs",
    "flash_attn_qkvpacked_func": "qkv dropout_p softmax_scale causal window_size softcap "
                                 "alibi_slopes deterministic return_attn_probs",
    "flash_attn_kvpacked_func": "q kv dropout_p softmax_scale causal window_size softcap "
                                "alibi_slopes deterministic return_attn_probs",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k "
                              "dropout_p softmax_scale causal window_size softcap alibi_slopes "
                              "deterministic return_attn_probs block_table",
    "flash_attn_varlen_qkvpacked_func": "qkv cu_seqlens max_seqlen dropout_p softmax_scale "
                                        "causal window_size softcap alibi_slopes deterministic "
                                        "return_attn_probs",
    "flash_attn_varlen_kvpacked_func": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                       "max_seqlen_k dropout_p softmax_scale causal "
                                       "window_size softcap alibi_slopes deterministic "
                                       "return_attn_probs",
    "flash_attn_with_kvcache": "q k_cache v_cache k v rotary_cos rotary_sin cache_seqlens "
                               "cache_batch_idx cache_leftpad block_table softmax_scale causal "
                               "window_size softcap rotary_interleaved alibi_slopes num_splits "
                               "return_softmax_lse",
}


def test_the_interface_has_flash_attns_seven_functions_once():
    interface = attncore.flash_attn_interface
    assert sorted(interface.__all__) == sorted(SIGNATURES)
    for name, params in SIGNATURES.items():
        function = getattr(interface, name)
        # One definition: the package's, attncore.torch's and the interface's are one object.
        assert function is getattr(attncore, name) is getattr(attncore.torch, name)
        positional = [p.name for p in inspect.signature(function).parameters.values()
                      if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == params.split(), name


BLOCK = textwrap.dedent('''
    import torch
    from torch import nn

    from flash_attn import flash_attn_func, flash_attn_varlen_qkvpacked_func
    from flash_attn.bert_padding import pad_input, unpad_input


    class Block(nn.Module):
        """A pre-norm transformer block, causal self-attention through flash-attn."""

        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def attend(self, x, attention_mask):
            b, l, d = x.shape
            h = self.heads
            if attention_mask is None:
                q, k, v = self.qkv(x).view(b, l, 3, h, d // h).unbind(2)
                return flash_attn_func(q, k, v, causal=True).reshape(b, l, d)
            x_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, attention_mask)
            qkv = self.qkv(x_unpad).view(-1, 3, h, d // h)
            out = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, causal=True)
            return pad_input(out.reshape(-1, d), indices, b, l)

        def forward(self, x, attention_mask=None):
            x = x + self.proj(self.attend(self.norm1(x), attention_mask))
            return x + self.mlp(self.norm2(x))
''')


def _oracle_attend(block, x, attention_mask):
    """The block's attention in torch float64 (the tests' oracle): dense, causal, padded keys
    masked, padded query rows 0 (as pad_input leaves them)."""
    b, l, d = x.shape
    q, k, v = block.qkv(x).view(b, l, 3, block.heads, d // block.heads).permute(2, 0, 3, 1, 4)
    keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
    out, _ = reference.attention(q, k, v, causal="upper-left", mask=keep)
    out = out.transpose(1, 2).reshape(b, l, d)
    return out if attention_mask is None else out * attention_mask[..., None]


@pytest.mark.parametrize("padded", [False, True])
def test_a_block_written_for_flash_attn_runs_through_the_alias(padded):
    attncore.install_flash_attn_alias()
    namespace = {}
    exec(compile(BLOCK, "block.py", "exec"), namespace)
    torch.manual_seed(0)
    block = namespace["Block"](dim=48, heads=4)
    oracle = copy.deepcopy(block).double()
    oracle.attend = lambda x, mask: _oracle_attend(oracle, x, mask)

    x = torch.randn(3, 11, 48)
    mask = None
    if padded:  # right padding: sequences of 11, 6 and 1 tokens
        mask = torch.arange(11)[None, :] < torch.tensor([11, 6, 1])[:, None]
    weight = torch.randn(3, 11, 48, dtype=torch.float64)

    xs = x.clone().requires_grad_()
    out = block(xs, mask)
    (out.double() * weight).sum().backward()
    x64 = x.double().requires_grad_()
    expected = oracle(x64, None if mask is None else mask.double())
    (expected * weight).sum().backward()

    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(xs.grad.double(), x64.grad, atol=1e-4, rtol=1e-4)
    for (name, p), p64 in zip(block.named_parameters(), oracle.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, atol=2e-4, rtol=2e-4, msg=name)


def test_the_alias_modules():
    package = attncore.install_flash_attn_alias()
    import flash_attn
    import flash_attn.bert_padding
    import flash_attn.flash_attn_interface
    assert flash_attn is package is attncore.install_flash_attn_alias()  # idempotent
    assert flash_attn.__version__ == "2.8.3"
    assert flash_attn.flash_attn_interface is attncore.flash_attn_interface
    assert flash_attn.bert_padding is attncore.bert_padding
    for name in SIGNATURES:
        assert getattr(flash_attn, name) is getattr(attncore.flash_attn_interface, name)
    # What the alias does not fool: package metadata, and flash-attn's other modules.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash_attn")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("flash_attn.layers.rotary")


def test_the_alias_never_replaces_another_flash_attn():
    code = textwrap.dedent("""
        import sys, types
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")
        import attncore
        try:
            attncore.install_flash_attn_alias()
        except RuntimeError as e:
            print(e)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert "install_flash_attn_alias: flash_attn is already imported" in result.stdout


def test_unpad_and_pad_input():
    from attncore.bert_padding import index_put_first_axis, pad_input, unpad_input
    x = torch.randn(3, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert packed.shape == (9, 2, 4)
    assert indices.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 4, 9, 9]
    assert max_seqlen == 5 and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and seqused.tolist() == [3, 5, 0]
    assert torch.equal(packed, x.reshape(15, 2, 4)[indices])
    kept = (mask + unused).bool()
    back = pad_input(packed, indices, 3, 5)
    assert torch.equal(back, x * kept[..., None, None])
    back.sum().backward()
    assert torch.equal(x.grad, kept[..., None, None].expand_as(x).double())
    assert torch.equal(index_put_first_axis(torch.ones(2, 3), torch.tensor([3, 0]), 4),
                       torch.tensor([[1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0] * 3]))


def test_the_alias_package_has_a_module_spec():
    """importlib finds the alias (libraries probe for flash-attn with find_spec), also after a
    reload; its submodules are attncore's own modules, found with their specs."""
    package = attncore.install_flash_attn_alias()
    spec = importlib.util.find_spec("flash_attn")
    assert spec is package.__spec__ and spec.name == "flash_attn"
    assert spec.submodule_search_locations == [] and package.__path__ == []
    for name in ("bert_padding", "flash_attn_interface"):
        module = getattr(attncore, name)
        assert importlib.util.find_spec(f"flash_attn.{name}") is module.__spec__
    assert importlib.reload(package) is package
    assert importlib.util.find_spec("flash_attn").name == "flash_attn"
    assert package.flash_attn_func is attncore.flash_attn_func


def _padded(batch=2, seqlen=4, width=3):
    hidden = torch.arange(batch * seqlen * width, dtype=torch.float32).reshape(batch, seqlen,
                                                                              width)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    return hidden, mask


def _bert_padding_case(name):
    """One refused call of attncore.bert_padding: (call, error type, message pattern)."""
    from attncore import bert_padding as bp
    hidden, mask = _padded()
    rows, indices, _, _, _ = bp.unpad_input(hidden, mask)
    cases = {
        # masks [B, L] of hidden_states [B, L, ...]: another shape packed the wrong rows
        "mask-shorter": (lambda: bp.unpad_input(hidden, mask[:, :3]), ValueError,
                         r"^unpad_input: attention_mask has shape \[2, 3\], expected \[2, 4\] "
                         r"\(\[B, L\] of hidden_states\)$"),
        "mask-one-row": (lambda: bp.unpad_input(hidden, mask[:1]), ValueError,
                         r"attention_mask has shape \[1, 4\], expected \[2, 4\]"),
        "mask-rank-1": (lambda: bp.unpad_input(hidden, mask[0]), ValueError,
                        r"attention_mask has shape \[4\]"),
        "mask-rank-3": (lambda: bp.unpad_input(hidden, mask[None]), ValueError,
                        r"attention_mask has shape \[1, 2, 4\]"),
        "unused-mask-shape": (lambda: bp.unpad_input(hidden, mask, mask[:1]), ValueError,
                              r"^unpad_input: unused_mask has shape \[1, 4\], expected \[2, 4\]"),
        "mask-numpy": (lambda: bp.unpad_input(hidden, mask.numpy()), TypeError,
                       r"^unpad_input: attention_mask is not a torch tensor \(type=ndarray, "
                       r"expected torch.Tensor\); pass torch.as_tensor\(attention_mask\)$"),
        "mask-list": (lambda: bp.unpad_input(hidden, mask.tolist()), TypeError,
                      r"attention_mask is not a torch tensor \(type=list"),
        "mask-none": (lambda: bp.unpad_input(hidden, None), TypeError,
                      r"attention_mask is not a torch tensor \(type=NoneType"),
        "hidden-numpy": (lambda: bp.unpad_input(hidden.numpy(), mask), TypeError,
                         r"^unpad_input: hidden_states is not a torch tensor"),
        "hidden-rank-1": (lambda: bp.unpad_input(hidden[0, 0], mask), ValueError,
                          r"^unpad_input: hidden_states has the wrong rank \(rank=1, expected "
                          r">= 2: \[B, L, ...\]\)$"),
        "hidden-rank-0": (lambda: bp.unpad_input(hidden[0, 0, 0], mask), ValueError,
                          r"hidden_states has the wrong rank \(rank=0"),
        # pad_input: indices inside [0, batch * seqlen), one per row, distinct
        "pad-batch-too-small": (lambda: bp.pad_input(rows, indices, 1, 4), ValueError,
                                r"^pad_input: indices is out of range \(min=0, max=6, expected "
                                r"0 <= index < batch \* seqlen=4\)$"),
        "pad-seqlen-too-small": (lambda: bp.pad_input(rows, indices, 2, 2), ValueError,
                                 r"indices is out of range"),
        "pad-negative-indices": (lambda: bp.pad_input(rows, -indices - 1, 2, 4), ValueError,
                                 r"indices is out of range \(min=-7"),
        "pad-too-few-indices": (lambda: bp.pad_input(rows, indices[:3], 2, 4), ValueError,
                                r"^pad_input: indices has the wrong length \(len=3, expected 5: "
                                r"one per row of hidden_states\)$"),
        "pad-float-indices": (lambda: bp.pad_input(rows, indices.float(), 2, 4), ValueError,
                              r"^pad_input: indices has the wrong dtype \(dtype=float32"),
        "pad-indices-rank-2": (lambda: bp.pad_input(rows, indices[None], 2, 4), ValueError,
                               r"indices has the wrong rank \(rank=2, expected 1"),
        "pad-repeated-indices": (lambda: bp.pad_input(rows, torch.zeros_like(indices), 2, 4),
                                 ValueError, r"indices has repeated entries \(distinct=1, len=5"),
        "pad-negative-batch": (lambda: bp.pad_input(rows, indices, -1, 4), ValueError,
                               r"^pad_input: batch is out of range \(batch=-1, expected "
                               r"batch >= 0\)$"),
        "pad-float-seqlen": (lambda: bp.pad_input(rows, indices, 2, 4.0), TypeError,
                             r"^pad_input: seqlen is not an integer \(type=float"),
        "pad-indices-numpy": (lambda: bp.pad_input(rows, indices.numpy(), 2, 4), TypeError,
                              r"^pad_input: indices is not a torch tensor"),
        "pad-rows-rank-0": (lambda: bp.pad_input(rows[0, 0], indices[:1], 2, 4), ValueError,
                            r"hidden_states has the wrong rank \(rank=0, expected >= 1"),
        "index-first-axis-out-of-range": (
            lambda: bp.index_first_axis(rows, torch.tensor([5])), ValueError,
            r"^index_first_axis: indices is out of range \(min=5, max=5, expected "
            r"0 <= index < N=5\)$"),
        "index-first-axis-list": (lambda: bp.index_first_axis(rows, [0, 1]), TypeError,
                                  r"^index_first_axis: indices is not a torch tensor"),
        "index-put-out-of-range": (
            lambda: bp.index_put_first_axis(rows, indices + 4, 8), ValueError,
            r"^index_put_first_axis: indices is out of range \(min=4, max=10, expected "
            r"0 <= index < first_axis_dim=8\)$"),
        "nested-hidden": (lambda: bp.unpad_input(torch.nested.nested_tensor(list(hidden)), mask),
                          NotImplementedError, r"^unpad_input: hidden_states is not a dense "
                                               r"tensor \(layout=nested"),
    }
    return cases[name]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("case", [
    "mask-shorter", "mask-one-row", "mask-rank-1", "mask-rank-3", "unused-mask-shape",
    "mask-numpy", "mask-list", "mask-none", "hidden-numpy", "hidden-rank-1", "hidden-rank-0",
    "pad-batch-too-small", "pad-seqlen-too-small", "pad-negative-indices",
    "pad-too-few-indices", "pad-float-indices", "pad-indices-rank-2", "pad-repeated-indices",
    "pad-negative-batch", "pad-float-seqlen", "pad-indices-numpy", "pad-rows-rank-0",
    "index-first-axis-out-of-range", "index-first-axis-list", "index-put-out-of-range",
    "nested-hidden"])
def test_bert_padding_refuses_bad_arguments(case):
    """Each refused in attncore's form (the helpers would pack the wrong rows, or fail inside
    torch)."""
    call, error, message = _bert_padding_case(case)
    with pytest.raises(error, match=message) as raised:
        call()
    assert type(raised.value) is error


def test_bert_padding_int32_indices_and_sizes_checked_before_allocating():
    from attncore.bert_padding import pad_input, unpad_input
    hidden, mask = _padded()
    rows, indices, _, _, _ = unpad_input(hidden, mask)
    assert torch.equal(pad_input(rows, indices.int(), 2, 4), pad_input(rows, indices, 2, 4))
    # 2^40 rows of 3 float32: refused with attncore's MemoryError before any allocation.
    with pytest.raises(MemoryError, match=r"^pad_input: the outputs exceed the memory this "
                                          r"process may use \(outputs=1.319e\+13 bytes"):
        pad_input(rows, indices, 2 ** 20, 2 ** 20)


def test_softcap_at_or_below_zero_is_off():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, 16, generator=g) for _ in range(3))
    fa = attncore.flash_attn_interface
    for softcap in (0.0, -1.0, -1e30):
        assert torch.equal(fa.flash_attn_func(q, k, v, softcap=softcap),
                           fa.flash_attn_func(q, k, v))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [x.reshape(10, 4, 16) for x in (q, k, v)]
    assert torch.equal(fa.flash_attn_varlen_func(*flat, cu, cu, 5, 5, softcap=-2.0),
                       fa.flash_attn_varlen_func(*flat, cu, cu, 5, 5))
    seqlens = torch.tensor([5, 5], dtype=torch.int32)
    assert torch.equal(
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softcap=-2.0),
        fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens))


def test_unpad_input_counts_broadcast_masks_once():
    """A mask broadcast over the batch or along each row (stride 0) is counted once per
    distinct element (a mask expanded to 2^30 elements took 8 s to count before the refusal of
    its outputs): the same results as from the mask made contiguous."""
    from attncore.bert_padding import unpad_input
    hidden = torch.randn(3, 5, 2)
    row = torch.tensor([[True, True, False, True, False]])
    column = torch.tensor([[True], [False], [True]])
    for mask in (row.expand(3, 5), column.expand(3, 5)):
        assert mask.stride().count(0) == 1
        for got, want in zip(unpad_input(hidden, mask), unpad_input(hidden, mask.contiguous())):
            assert (got == want) if isinstance(want, int) else torch.equal(got, want)
