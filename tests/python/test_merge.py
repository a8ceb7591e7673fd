"""attncore.merge_attention_states: attention over two disjoint key sets, merged, equals
attention over all keys (float64 torch oracle), in numpy and torch, dense and flash layouts."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
from conftest import assert_close, randn
from reference import attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_two_key_halves_merge_to_all_keys(dtype):
    q, k, v = randn(2, 4, 5, 16, seed=1), randn(2, 4, 12, 16, seed=2), randn(2, 4, 12, 8, seed=3)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out_a, lse_a = attncore.attention(q, k[:, :, :7], v[:, :, :7], return_lse=True)
    out_b, lse_b = attncore.attention(q, k[:, :, 7:], v[:, :, 7:], return_lse=True)
    out, lse = attncore.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = attention(q, k, v)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, torch.float32 if dtype != torch.float64 else dtype, "lse")


@pytest.mark.parametrize("level", [0.0, 1e5, 1e7, 2e7])
def test_equal_sides_weigh_half_however_large_the_lse(level):
    out_a = np.ones((1, 1, 2, 4), np.float32)
    out_b = np.full((1, 1, 2, 4), 3.0, np.float32)
    lse = np.full((1, 1, 2), level, np.float32)
    out, merged = attncore.merge_attention_states(out_a, lse, out_b, lse)
    assert np.all(out == 2.0)
    assert np.allclose(merged, level + np.log(2.0), rtol=1e-7, atol=1e-6)


def test_numpy_flash_layout_with_transposed_lse():
    q, k, v = randn(2, 6, 3, 8, seed=4), randn(2, 10, 3, 8, seed=5), randn(2, 10, 3, 8, seed=6)
    qn, kn, vn = (x.float().numpy() for x in (q, k, v))
    out_a, lse_a, _ = attncore.flash_attn_func(qn, kn[:, :4], vn[:, :4], return_attn_probs=True)
    out_b, lse_b, _ = attncore.flash_attn_func(qn, kn[:, 4:], vn[:, 4:], return_attn_probs=True)
    out, lse = attncore.merge_attention_states(out_a, lse_a.swapaxes(1, 2), out_b,
                                               lse_b.swapaxes(1, 2))
    assert isinstance(out, np.ndarray) and out.shape == (2, 6, 3, 8) and lse.shape == (2, 6, 3)
    ref_out, ref_lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert_close(out, ref_out.transpose(1, 2), torch.float32, "out")
    assert_close(lse.swapaxes(1, 2), ref_lse, torch.float32, "lse")
    assert lse.swapaxes(1, 2).flags.c_contiguous  # laid out like the LSE passed in


def test_minus_infinity_sides():
    """A side with LSE -inf adds nothing, even when its output holds NaN; both -inf give 0."""
    q, k, v = randn(1, 2, 4, 8, seed=7), randn(1, 2, 6, 8, seed=8), randn(1, 2, 6, 8, seed=9)
    out_a, lse_a = attncore.attention(q, k, v, return_lse=True)
    out_b = torch.full_like(out_a, float("nan"))
    lse_b = torch.full_like(lse_a, -float("inf"))
    lse_b[0, 0, 1] = 0.5
    out_b[0, 0, 1] = 2.0
    out, lse = attncore.merge_attention_states(out_a, lse_a, out_b, lse_b)
    total = torch.logaddexp(lse_a.double(), lse_b.double())
    expected = (torch.exp(lse_a.double() - total)[..., None] * out_a.double()
                + torch.exp(lse_b.double() - total)[..., None] * torch.nan_to_num(out_b.double()))
    assert_close(out, expected, torch.float64, "out")
    assert_close(lse, total, torch.float64, "lse")
    # Head 1 has LSE -inf on both sides (and NaN outputs): out 0, lse -inf.
    both = attncore.merge_attention_states(out_b, lse_b, out_b.clone(), lse_b.clone())
    assert torch.equal(both[0][0, 1], torch.zeros(4, 8, dtype=torch.float64))
    assert torch.isneginf(both[1][0, 1]).all()
    # Key halves where one half is entirely masked for some rows (causal lower-right, -inf LSE).
    qc, kc, vc = randn(1, 2, 3, 8, seed=10), randn(1, 2, 5, 8, seed=11), randn(1, 2, 5, 8, seed=12)
    ref_out, ref_lse = attention(qc, kc, vc, causal="lower-right")
    # Row i sees key j when j <= i + 2: all of the first half [0, 3).
    a = attncore.attention(qc, kc[:, :, :3], vc[:, :, :3], return_lse=True)
    # Of the second half [3, 5), row 0 sees none (LSE -inf).
    mask = torch.arange(3, 5)[None, :] <= torch.arange(3)[:, None] + 2
    b = attncore.attention(qc, kc[:, :, 3:], vc[:, :, 3:], attn_mask=mask, return_lse=True)
    assert torch.isneginf(b[1][0, :, 0]).all()
    out, lse = attncore.merge_attention_states(a[0], a[1], b[0], b[1])
    assert_close(out, ref_out, torch.float64, "out")
    assert_close(lse, ref_lse, torch.float64, "lse")


def test_nan_and_plus_infinity_lse_give_nan_in_their_row_alone():
    """NaN inputs give NaN, and so does an LSE of +inf (no attention gives one), in that row
    only (README)."""
    out = np.ones((3, 4), np.float32)
    lse_a = np.array([np.inf, np.nan, 0.0], np.float32)
    merged, lse = attncore.merge_attention_states(out, lse_a, out, np.zeros(3, np.float32))
    assert np.isnan(merged[:2]).all() and np.isnan(lse[:2]).all()
    assert np.array_equal(merged[2], np.ones(4, np.float32)) and lse[2] == np.float32(np.log(2))


def test_torch_grad_mode_refused_and_no_grad_works():
    out_a, lse_a = randn(1, 2, 3, 4, requires_grad=True), randn(1, 2, 3)
    out_b, lse_b = randn(1, 2, 3, 4), randn(1, 2, 3)
    with pytest.raises(NotImplementedError, match="merge_attention_states: out_a requires grad"):
        attncore.torch.merge_attention_states(out_a, lse_a, out_b, lse_b)
    with torch.no_grad():
        out, _ = attncore.torch.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.shape == (1, 2, 3, 4)
    assert attncore.torch.merge_attention_states is attncore.merge_attention_states


def test_shape_errors_name_the_argument():
    out = np.zeros((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="merge_attention_states"):
        attncore.merge_attention_states(out, np.zeros((1, 2, 4), np.float32), out,
                                        np.zeros((1, 2, 3), np.float32))
