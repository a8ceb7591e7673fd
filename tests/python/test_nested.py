"""Nested tensors ([B, H, *, D], torch.nested) through scaled_dot_product_attention: one
variable-length batch without padding, against the torch oracle in float64 on each entry alone
(reference.attention); dropout as the varlen call's; refusals, and checks before any copy."""

import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, randn
from test_varlen import BACKENDS, cu_seqlens

# torch 1.13 warns on every nested tensor it builds.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


def _nested(lengths, heads, dim, seed, dtype=torch.float64):
    parts = [randn(heads, n, dim, seed=seed + 10 * b).to(dtype) for b, n in enumerate(lengths)]
    return torch.nested.nested_tensor(parts), parts


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_nested_tensors(is_causal, dtype, backend):
    """Nested [B, H, *, D] query, key and value (GQA: 2 key heads for 4 query heads) run without
    padding and come back nested [B, Hq, *, Dv]; is_causal is upper-left per entry."""
    lens_q, lens_k = (5, 0, 13, 1, 8), (9, 4, 0, 9, 8)
    q, qs = _nested(lens_q, 4, 32, 1, dtype)
    k, ks = _nested(lens_k, 2, 32, 2, dtype)
    v, vs = _nested(lens_k, 2, 24, 3, dtype)
    out = attncore.torch.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                      enable_gqa=True, backend=backend)
    assert out.is_nested and out.dtype == dtype
    parts = out.unbind()
    assert [tuple(t.shape) for t in parts] == [(4, n, 24) for n in lens_q]
    for b in range(len(lens_q)):
        expected, _ = reference.attention(qs[b], ks[b], vs[b],
                                          causal="upper-left" if is_causal else None)
        assert_close(parts[b], expected, dtype, f"entry {b}")


def test_nested_dropout_follows_the_varlen_mask():
    """A nested call with dropout draws the varlen call's mask (same seed and offset)."""
    lens = (3, 6, 2)
    q, qs = _nested(lens, 2, 8, 1)
    torch.manual_seed(9)
    out = attncore.scaled_dot_product_attention(q, q, q, dropout_p=0.4)
    packed_q = torch.cat([t.transpose(0, 1) for t in qs])
    torch.manual_seed(9)
    expected = attncore.attention_varlen(packed_q, packed_q, packed_q, cu_seqlens(lens),
                                         cu_seqlens(lens), 6, 6, dropout_p=0.4)
    cu = cu_seqlens(lens).tolist()
    for b, part in enumerate(out.unbind()):
        assert torch.equal(part, expected[cu[b]:cu[b + 1]].transpose(0, 1))


def test_nested_refusals():
    q, _ = _nested((3, 4), 2, 8, 1)
    dense = torch.ones(2, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="key is not a nested tensor"):
        attncore.scaled_dot_product_attention(q, dense, dense)
    with pytest.raises(NotImplementedError, match="attn_mask is not supported with nested"):
        attncore.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=bool))
    grad_q = torch.nested.nested_tensor([torch.ones(2, 3, 8), torch.ones(2, 4, 8)],
                                        requires_grad=True)
    with pytest.raises(NotImplementedError, match="nested tensors that require grad are not "
                                                  "supported"):
        attncore.torch.scaled_dot_product_attention(grad_q, grad_q, grad_q)
    with torch.no_grad():
        out = attncore.torch.scaled_dot_product_attention(grad_q, grad_q, grad_q)
    assert out.is_nested
    k, _ = _nested((3,), 2, 8, 2)
    with pytest.raises(ValueError, match=r"key has a different batch size \(B=1, expected "
                                         r"query's 2\)"):
        attncore.scaled_dot_product_attention(q, k, k)
    # Components that do not fit together are named as passed, [H, L_b, D] of [B, H, *, D].
    k, _ = _nested((3, 4), 2, 4, 2)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: key has components "
                                         r"of shape \[2, 3, 4\], expected \[Hkv, \*, 8\] "
                                         r"\(\[B, Hkv, \*, E\] nested\) with Hq % Hkv == 0 "
                                         r"\(Hq=2, Hkv=2\)$"):
        attncore.scaled_dot_product_attention(q, k, k)
    k3, _ = _nested((3, 4), 3, 8, 2)
    with pytest.raises(ValueError, match=r"key has components of shape \[3, 3, 8\].*\(Hq=2, "
                                         r"Hkv=3\)$"):
        attncore.scaled_dot_product_attention(q, k3, k3, enable_gqa=True)
    k, _ = _nested((3, 4), 2, 8, 2)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: value has components "
                                         r"of shape \[3, 3, 8\], expected \[2, \*, Ev\] "
                                         r"\(\[B, Hkv, \*, Ev\] nested, like key\)$"):
        attncore.scaled_dot_product_attention(q, k, k3)
    v, _ = _nested((3, 5), 2, 8, 2)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: value has other "
                                         r"lengths than key \(lengths=\[3, 5\], expected key's "
                                         r"\[3, 4\]\)$"):
        attncore.scaled_dot_product_attention(q, k, v)
    # A query of no heads is the query's fault, as in dense calls (it blamed key: Hkv=0).
    none = torch.nested.nested_tensor([torch.ones(0, 3, 8), torch.ones(0, 4, 8)])
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: query has no heads "
                                         r"\(Hq=0, expected Hq >= 1\)$"):
        attncore.scaled_dot_product_attention(none, none, none)
    # torch.ops' operator takes dense tensors only: its refusal names the function that takes
    # nested ones.
    with pytest.raises(NotImplementedError, match=r"key is a nested tensor \(is_nested=True, "
                                                  r"expected a dense tensor\); the function "
                                                  r"attncore.torch.scaled_dot_product_attention "
                                                  r"takes nested query, key and value, all three$"):
        torch.ops.attncore.scaled_dot_product_attention(dense, q, q)


def test_nested_checks_before_copying(monkeypatch):
    """Dtypes, options and the backend of a nested call are refused before its components are
    copied into packed tensors."""
    import attncore._nested as nested
    copies = []
    packed = nested._packed
    monkeypatch.setattr(nested, "_packed", lambda parts: copies.append(1) or packed(parts))
    q, _ = _nested((3, 4), 2, 8, 1)
    k32, _ = _nested((3, 4), 2, 8, 2, torch.float32)
    for call, error, text in (
            (lambda: attncore.scaled_dot_product_attention(q, k32, k32), ValueError, "dtype"),
            (lambda: attncore.scaled_dot_product_attention(q, q, q, dropout_p=1.5), ValueError,
             "dropout_p"),
            (lambda: attncore.scaled_dot_product_attention(q, q, q, scale=float("nan")),
             ValueError, "scale"),
            (lambda: attncore.scaled_dot_product_attention(q, q, q, backend="flash"),
             NotImplementedError, "f64")):
        with pytest.raises(error, match=text):
            call()
    assert copies == []
    out = attncore.scaled_dot_product_attention(q, q, q)
    assert out.is_nested and len(copies) == 3
