"""scaled_dot_product_attention against the torch oracle in float64: outputs and gradients on a
grid of shapes and for every variant torch's API has (masks, causal, GQA, scale, batch dims)."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from conftest import assert_close, randn

HEAD_DIMS = (16, 40, 59, 64, 111, 128, 256)
# (Lq, Lk): Lq below, equal to and above Lk, empty, single rows and keys; 1025 in a few only.
LENGTHS = ((0, 7), (1, 1), (1, 97), (7, 0), (7, 7), (7, 97), (97, 7), (97, 97), (1025, 97),
           (7, 1025))
# float64 runs on the math and reference backends, float32 on the fused one.
BACKENDS = ((torch.float64, "math"), (torch.float32, "flash"))


def check_sdpa(dtype, backend, q, k, v, *, mask=None, causal=False, scale=None,
               enable_gqa=False, ref_kwargs=None):
    """attncore's output and gradients (through attncore.torch) against the oracle's."""
    ins = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    mask_in = mask
    if mask is not None and mask.is_floating_point():
        mask_in = mask.detach().to(dtype).requires_grad_()
    out = attncore.torch.scaled_dot_product_attention(
        *ins, attn_mask=mask_in, is_causal=causal, scale=scale, enable_gqa=enable_gqa,
        backend=backend)
    assert out.dtype == dtype
    ref_ins = [x.detach().double().requires_grad_() for x in ins]
    ref_mask = None if mask_in is None else mask_in.detach()
    if ref_mask is not None and ref_mask.is_floating_point():
        ref_mask = ref_mask.double().requires_grad_()
    kv = ref_ins[1:]  # the oracle repeats key/value heads (Hkv = 1 without GQA included)
    ref_q = ref_ins[0] if q.dim() >= 3 else ref_ins[0][None]
    if q.dim() < 3:
        kv = [x[None] for x in kv]
    expected, _ = reference.attention(ref_q, *kv, scale=scale, mask=ref_mask,
                                      causal="upper-left" if causal else None,
                                      **(ref_kwargs or {}))
    if q.dim() < 3:
        expected = expected[0]
    assert_close(out.detach(), expected, dtype, "out")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    for name, got, want in zip("qkv", ins, ref_ins):
        assert_close(got.grad, want.grad, dtype, "d" + name)
    if ref_mask is not None and ref_mask.requires_grad:
        assert mask_in.grad.shape == mask.shape
        assert_close(mask_in.grad, ref_mask.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda t: f"Lq{t[0]}-Lk{t[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_grid(dtype, backend, lengths, head_dim):
    seqlen_q, seqlen_k = lengths
    causal = (seqlen_q + head_dim) % 2 == 0  # half the cells causal, spread over the grid
    q = randn(1, 2, seqlen_q, head_dim, seed=1)
    k = randn(1, 2, seqlen_k, head_dim, seed=2)
    v = randn(1, 2, seqlen_k, head_dim, seed=3)
    check_sdpa(dtype, backend, q, k, v, causal=causal)


# Variants, each on three shapes: Lq below, equal to and above Lk.
VARIANT_LENGTHS = ((5, 9), (8, 8), (13, 4))


def _variant_inputs(seqlen_q, seqlen_k, batch=(2,), heads_q=4, heads_kv=4, dim=40, dim_v=40):
    return (randn(*batch, heads_q, seqlen_q, dim, seed=1),
            randn(*batch, heads_kv, seqlen_k, dim, seed=2),
            randn(*batch, heads_kv, seqlen_k, dim_v, seed=3))


def _bool_mask(*shape, seed=4, fully_masked_row=False):
    mask = randn(*shape, seed=seed) > -0.5
    if fully_masked_row and shape[-2] > 1:
        mask[..., 1, :] = False
    return mask


VARIANTS = {
    "bool-mask-2d": lambda lq, lk: dict(mask=_bool_mask(lq, lk)),
    "bool-mask-4d-masked-row": lambda lq, lk: dict(mask=_bool_mask(2, 4, lq, lk,
                                                                    fully_masked_row=True)),
    "bool-mask-broadcast": lambda lq, lk: dict(mask=_bool_mask(1, 4, 1, lk)),
    "float-mask-2d": lambda lq, lk: dict(mask=randn(lq, lk, seed=5)),
    "float-mask-1d": lambda lq, lk: dict(mask=randn(lk, seed=5)),
    "float-mask-3d": lambda lq, lk: dict(mask=randn(4, 1, lk, seed=5)),
    "float-mask-4d": lambda lq, lk: dict(mask=randn(2, 1, lq, lk, seed=5)),
    "float-mask-neg-inf": lambda lq, lk: dict(
        mask=torch.where(_bool_mask(lq, lk), randn(lq, lk, seed=5), torch.tensor(-torch.inf))),
    "causal": lambda lq, lk: dict(causal=True),
    "scale": lambda lq, lk: dict(scale=0.3),
    "scale-negative": lambda lq, lk: dict(scale=-0.7),
    "scale-zero": lambda lq, lk: dict(scale=0.0),
}


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", VARIANT_LENGTHS, ids=lambda t: f"Lq{t[0]}-Lk{t[1]}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant(dtype, backend, lengths, variant):
    q, k, v = _variant_inputs(*lengths)
    check_sdpa(dtype, backend, q, k, v, **VARIANTS[variant](*lengths))


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", VARIANT_LENGTHS, ids=lambda t: f"Lq{t[0]}-Lk{t[1]}")
def test_gqa(dtype, backend, lengths):
    check_sdpa(dtype, backend, *_variant_inputs(*lengths, heads_q=6, heads_kv=2),
               enable_gqa=True, causal=True)


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("heads", [(8, 2, 4), (6, 2, 3), (8, 4, 1)], ids=str)
def test_gqa_key_and_value_of_different_head_counts(dtype, backend, heads):
    """With enable_gqa, key and value heads that each divide the query's, as torch's math path
    takes them (it repeats each to the query's heads)."""
    heads_q, heads_k, heads_v = heads
    check_sdpa(dtype, backend, randn(2, heads_q, 7, 40, seed=1), randn(2, heads_k, 9, 40, seed=2),
               randn(2, heads_v, 9, 24, seed=3), enable_gqa=True, causal=True)


def test_gqa_heads_repeated_as_their_distinct_elements():
    """The repeated key of a numpy call broadcast over its batch stays broadcast: the results of
    a contiguous key, and refusals where the heads do not divide the query's."""
    q = randn(64, 8, 3, 16, seed=1).numpy()
    k = np.broadcast_to(randn(1, 2, 5, 16, seed=2).numpy(), (64, 2, 5, 16))
    v = randn(64, 4, 5, 16, seed=3).numpy()
    want = attncore.scaled_dot_product_attention(q, np.ascontiguousarray(k).repeat(2, axis=1), v,
                                                 enable_gqa=True)
    np.testing.assert_array_equal(
        attncore.scaled_dot_product_attention(q, k, v, enable_gqa=True), want)
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: key and value have "
                                         r"head counts that do not divide the query's \(Hq=6, "
                                         r"Hk=2, Hv=4, expected Hq % Hk == 0 and Hq % Hv == 0 "
                                         r"with enable_gqa\)$"):
        attncore.scaled_dot_product_attention(q[:, :6], k, v, enable_gqa=True)


def test_gqa_heads_are_repeated_only_after_the_calls_checks(monkeypatch):
    """Key and value of different head counts are repeated (copied) only once the call has
    passed every check: a call refused for its dropout, scale, backend or mask copies nothing."""
    def no_copy(*args):
        raise AssertionError("the heads were repeated before the call's checks")
    monkeypatch.setattr(attncore._copies, "repeat_heads", no_copy)
    q, k, v = randn(1, 8, 2, 16, seed=1), randn(1, 2, 5, 16, seed=2), randn(1, 4, 5, 16, seed=3)
    for kwargs, error, message in [
            ({"dropout_p": 2.0}, ValueError, "dropout_p"),
            ({"scale": float("nan")}, ValueError, "scale"),
            ({"backend": "nope"}, ValueError, "nope"),
            ({"attn_mask": torch.zeros(3, 4)}, ValueError, "mask")]:
        with pytest.raises(error, match=message):
            attncore.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
def test_mqa_broadcasts_without_enable_gqa(dtype, backend):
    check_sdpa(dtype, backend, *_variant_inputs(7, 9, heads_q=4, heads_kv=1))


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
@pytest.mark.parametrize("batch", [(), (3,), (2, 3), (2, 1, 3)], ids=str)
def test_leading_dims(dtype, backend, batch):
    """Any number of batch dims (none: [H, L, E]), with a mask broadcast over some of them."""
    q, k, v = _variant_inputs(6, 11, batch=batch, heads_q=2, heads_kv=2)
    mask = randn(*[1 if d % 2 else n for d, n in enumerate(batch)], 1, 6, 11, seed=5)
    check_sdpa(dtype, backend, q, k, v, mask=mask)


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
def test_unbatched_2d(dtype, backend):
    """(L, E) inputs: one sequence, one head."""
    check_sdpa(dtype, backend, randn(6, 16, seed=1), randn(9, 16, seed=2), randn(9, 24, seed=3),
               mask=randn(6, 9, seed=5))


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=lambda x: str(x))
def test_value_head_dim_differs(dtype, backend):
    check_sdpa(dtype, backend, *_variant_inputs(7, 9, dim=40, dim_v=24), causal=True)


def test_reference_backend_and_auto_agree_with_math():
    q, k, v = _variant_inputs(7, 9)
    outs = [attncore.scaled_dot_product_attention(q, k, v, is_causal=True, backend=b)
            for b in (None, "reference", attncore.SDPBackend.MATH)]
    for out in outs[1:]:
        assert_close(out, outs[0], torch.float64)


def test_matches_torch_113_private_sdpa():
    """torch 1.13's own (private) math SDPA: bool mask and is_causal on [N, L, E]."""
    sdpa = getattr(torch.nn.functional, "_scaled_dot_product_attention", None)
    if sdpa is None:
        pytest.skip("this torch has no _scaled_dot_product_attention")
    q, k, v = randn(6, 8, 16, seed=1), randn(6, 8, 16, seed=2), randn(6, 8, 16, seed=3)
    mask = _bool_mask(8, 8)
    mask[:, 0] = True  # torch 1.13 gives NaN on rows with no visible key
    for kwargs in (dict(attn_mask=mask), dict(is_causal=True)):
        expected = sdpa(q, k, v, kwargs.get("attn_mask"), 0.0, False,
                        kwargs.get("is_causal", False))[0]
        assert_close(attncore.scaled_dot_product_attention(q, k, v, **kwargs), expected,
                     torch.float64)


def test_masks_of_finfo_min_as_torch():
    # Padding masked with torch.finfo(dtype).min, as Hugging Face models mask it: rows masked
    # entirely average V as torch's math path does (flash once read such scores as keys masked
    # out, giving 0), keys masked beside visible ones get nothing; the default backend and
    # each named one agree with torch.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, :, :, :2] = torch.finfo(torch.float32).min  # left padding of sequence 0
    mask[0, :, :2, :] = torch.finfo(torch.float32).min  # its padded query rows: all masked
    want = torch.nn.functional.softmax(q @ k.transpose(-1, -2) / 4 + mask, dim=-1) @ v
    for backend in (None, "flash", "math"):
        got = attncore.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          backend=backend)
        assert_close(got, want, torch.float32, f"backend {backend}")


def test_a_query_of_one_head_broadcasts_over_the_kv_heads():
    # As torch's product broadcasts it without enable_gqa: a query [L, E], [1, L, E] or
    # [B, 1, L, E] against key and value of 3 heads attends as 3 heads, its gradient summed
    # over them; through the function, the operator and numpy alike. With enable_gqa, Hq % Hkv
    # must hold (torch refuses it too).
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    for shape in ((5, 8), (1, 5, 8), (2, 1, 5, 8)):
        q = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
        want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1) @ v
        got = attncore.torch.scaled_dot_product_attention(q, k, v)
        assert_close(got, want.detach(), torch.float64, f"{shape} out")
        grad, = torch.autograd.grad(got.sum(), q)
        want_grad, = torch.autograd.grad(want.sum(), q)
        assert_close(grad, want_grad, torch.float64, f"{shape} dq")
        assert_close(torch.ops.attncore.scaled_dot_product_attention(q.detach(), k, v),
                     want.detach(), torch.float64, f"{shape} operator")
        assert_close(attncore.scaled_dot_product_attention(q.detach().numpy(), k.numpy(),
                                                           v.numpy()),
                     want.detach(), torch.float64, f"{shape} numpy")
    with pytest.raises(ValueError, match=r"Hq % Hkv == 0 \(Hq=1, Hkv=3\)"):
        attncore.torch.scaled_dot_product_attention(q, k, v, enable_gqa=True)
