"""Arrays in and out: numpy (float32/16/64), torch (bf16 too) and other DLPack producers, read in
place where the strides allow (only the last stride must be 1), results in the caller's type."""

import numpy as np
import pytest
import torch

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import assert_close, randn


def _address(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


def _bhld(seed, batch=2, heads=3, length=9, dim=16, dtype=torch.float64):
    return randn(batch, heads, length, dim, seed=seed).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=str)
@pytest.mark.parametrize("backend", ["flash", "math", "reference"])
def test_torch_reduced_precision(dtype, backend):
    q, k, v = (_bhld(s, dtype=dtype) for s in (1, 2, 3))
    mask = randn(9, 9, seed=4)  # float32 mask with a reduced-precision query: as torch allows
    out = attncore.scaled_dot_product_attention(q, k, v, attn_mask=mask.float(),
                                                backend=backend)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    expected, _ = reference.attention(q, k, v, mask=mask.float())
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=str)
def test_numpy_dtypes(dtype):
    q, k, v = (_bhld(s).numpy().astype(dtype) for s in (1, 2, 3))
    out, lse = attncore.attention(q, k, v, causal="lower-right", return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    expected, expected_lse = reference.attention(
        *(torch.from_numpy(x) for x in (q, k, v)), causal="lower-right")
    tdtype = {np.float16: torch.float16, np.float32: torch.float32,
              np.float64: torch.float64}[dtype]
    assert_close(out, expected, tdtype)
    assert_close(lse, expected_lse, tdtype)


def test_bf16_gradients_through_autograd():
    q, k, v = (_bhld(s, dtype=torch.bfloat16).requires_grad_() for s in (1, 2, 3))
    out = attncore.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, _ = reference.attention(*ref, causal="upper-left")
    expected.sum().backward()
    for got, want in zip((q, k, v), ref):
        assert got.grad.dtype == torch.bfloat16
        assert_close(got.grad, want.grad, torch.bfloat16)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_transposed_views_are_read_in_place(library):
    """A [B, L, H, D] buffer passed as its [B, H, L, D] transpose gives the contiguous copy's
    result, and the kernels get the buffer's own address (no copy)."""
    blhd = [randn(2, 9, 3, 16, seed=s) for s in (1, 2, 3)]
    if library == "numpy":
        blhd = [x.numpy() for x in blhd]
        views = [x.swapaxes(1, 2) for x in blhd]
        copies = [np.ascontiguousarray(x) for x in views]
    else:
        views = [x.transpose(1, 2) for x in blhd]
        copies = [x.contiguous() for x in views]
    out = attncore.scaled_dot_product_attention(*views, is_causal=True)
    addresses = _core._last_call_addresses()
    assert [addresses[name] for name in ("query", "key", "value")] == [
        _address(x) for x in blhd]
    expected = attncore.scaled_dot_product_attention(*copies, is_causal=True)
    assert (np.asarray(out) == np.asarray(expected)).all()  # bitwise: same math


def test_sliced_and_expanded_views_are_read_in_place():
    """Heads sliced out of a packed QKV buffer [B, L, 3, H, D] and a stride-0 broadcast mask."""
    qkv = randn(2, 9, 3, 4, 16, seed=1)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, L, D] views
    mask = randn(9, 9, seed=2).expand(2, 4, 9, 9)
    out = attncore.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    addresses = _core._last_call_addresses()
    assert addresses["query"] == q.data_ptr() and addresses["value"] == v.data_ptr()
    assert addresses["mask"] == mask.data_ptr()
    expected, _ = reference.attention(q, k, v, mask=mask)
    assert_close(out, expected, torch.float64)


def test_flash_layout_in_place_and_contiguous_out():
    q, k, v = (randn(2, 9, 3, 16, seed=s).float() for s in (1, 2, 3))
    out = attncore.flash_attn_func(q, k, v, causal=True)
    assert _core._last_call_addresses()["query"] == q.data_ptr()
    # The result is written in place, in the caller's [B, L, H, D] layout.
    assert out.is_contiguous() and _core._last_call_addresses()["out"] == out.data_ptr()


def test_broadcast_inputs_give_outputs_with_unit_last_stride():
    """Inputs broadcast along the batch (stride 0) are read in place; the outputs and the
    gradients are still laid out with the head dim innermost."""
    q = randn(1, 3, 9, 16, seed=1).numpy()
    out = attncore.scaled_dot_product_attention(*(np.broadcast_to(q, (2, 3, 9, 16)),) * 3)
    assert out.shape == (2, 3, 9, 16) and out.strides[-1] == out.itemsize
    expected, _ = reference.attention(*(torch.from_numpy(q),) * 3)
    assert_close(out, expected.expand(2, 3, 9, 16), torch.float64)
    base = randn(1, 3, 9, 16, seed=2, requires_grad=True)
    view = base.expand(2, 3, 9, 16)
    attncore.torch.scaled_dot_product_attention(view, view, view).sum().backward()
    assert base.grad.shape == base.shape


# Expansions of a [2, 4, 9, 16] input: which dims of the base have size 1.
EXPANDED = {"batch": (1, 4, 9, 16), "heads": (2, 1, 9, 16), "rows": (2, 4, 1, 16),
            "batch-and-heads": (1, 1, 9, 16), "head-dim": (2, 4, 9, 1), "all": (1, 1, 1, 1)}


@pytest.mark.parametrize("which", ["query", "key", "value", "all three"])
@pytest.mark.parametrize("expansion", EXPANDED)
def test_gradients_of_expanded_inputs(which, expansion):
    """torch inputs expanded with stride-0 dims (and a broadcast dout): the backward writes
    gradients into buffers of its own, and they reach the bases summed over the expanded dims,
    as torch autograd's are."""
    shape = (2, 4, 9, 16)
    names = ("query", "key", "value") if which == "all three" else (which,)
    bases = [randn(*(EXPANDED[expansion] if name in names else shape), seed=s,
                   requires_grad=True) for s, name in enumerate(("query", "key", "value"))]
    out = attncore.torch.scaled_dot_product_attention(*(b.expand(shape) for b in bases),
                                                      is_causal=True)
    out.backward(randn(1, 1, 1, 16, seed=7).expand(shape))  # dout: stride 0 but the head dim
    ref = [b.detach().clone().requires_grad_() for b in bases]
    expected, _ = reference.attention(*(r.expand(shape) for r in ref), causal="upper-left")
    expected.backward(randn(1, 1, 1, 16, seed=7).expand(shape))
    assert_close(out.detach(), expected, torch.float64, "out")
    for got, want, name in zip(bases, ref, ("query", "key", "value")):
        assert got.grad.shape == got.shape
        assert_close(got.grad, want.grad, torch.float64, name)


def test_numpy_broadcast_inputs_through_the_backward():
    """np.broadcast_to queries, keys and dout in attention_backward: the gradients, laid out
    with the head dim innermost, are the full-shape gradients of the broadcast views."""
    shape = (2, 4, 9, 16)
    q = np.broadcast_to(randn(2, 1, 9, 16, seed=1).numpy(), shape)
    k = np.broadcast_to(randn(1, 4, 9, 16, seed=2).numpy(), shape)
    v = randn(*shape, seed=3).numpy()
    dout = np.broadcast_to(randn(1, 1, 9, 16, seed=4).numpy(), shape)
    out, lse = attncore.attention(q, k, v, return_lse=True)
    grads = attncore.attention_backward(dout, q, k, v, out, lse)
    ref = [torch.from_numpy(np.ascontiguousarray(x)).requires_grad_() for x in (q, k, v)]
    expected, _ = reference.attention(*ref)
    expected.backward(torch.from_numpy(np.ascontiguousarray(dout)))
    for got, want in zip(grads, ref):
        assert got.shape == shape and got.strides[-1] == got.itemsize
        assert_close(got, want.grad, torch.float64)
    # The same through flash-attn's layout and the packed drop-ins.
    flash = [x.swapaxes(1, 2) for x in (q, k, v)]
    out = attncore.flash_attn_func(*flash)
    assert_close(out.swapaxes(1, 2), expected.detach(), torch.float64)


def test_expanded_packed_inputs_through_autograd():
    """A qkv packed tensor expanded along the batch, and a kv expanded along the heads: each
    packed gradient is the sum over the expanded dims."""
    qkv = randn(1, 9, 3, 4, 16, seed=1, requires_grad=True)
    out = attncore.torch.flash_attn_qkvpacked_func(qkv.expand(2, 9, 3, 4, 16), causal=True)
    out.sum().backward()
    ref = qkv.detach().clone().requires_grad_()
    q, k, v = (ref.expand(2, 9, 3, 4, 16)[:, :, i].transpose(1, 2) for i in range(3))
    expected, _ = reference.attention(q, k, v, causal="lower-right")
    expected.sum().backward()
    assert_close(qkv.grad, ref.grad, torch.float64, "qkv")
    q = randn(2, 9, 4, 16, seed=2, requires_grad=True)
    kv = randn(2, 9, 2, 1, 16, seed=3, requires_grad=True)
    attncore.torch.flash_attn_kvpacked_func(q, kv.expand(2, 9, 2, 4, 16)).sum().backward()
    ref = kv.detach().clone().requires_grad_()
    k, v = (ref.expand(2, 9, 2, 4, 16)[:, :, i].transpose(1, 2) for i in range(2))
    expected, _ = reference.attention(q.detach().transpose(1, 2), k, v)
    expected.sum().backward()
    assert_close(kv.grad, ref.grad, torch.float64, "kv")


def test_copies_only_what_the_strides_forbid():
    """A last stride other than 1 (numpy: also negative strides) is copied; results stay right."""
    base = randn(2, 3, 9, 32, seed=1).numpy()
    q = base[..., ::2]  # last stride 2 elements
    k = randn(2, 3, 9, 16, seed=2).numpy()[:, :, ::-1]  # negative stride
    v = randn(2, 3, 9, 16, seed=3).numpy()
    out = attncore.scaled_dot_product_attention(q, k, v)
    addresses = _core._last_call_addresses()
    assert addresses["query"] != _address(base) and addresses["value"] == _address(v)
    expected, _ = reference.attention(*(torch.from_numpy(np.ascontiguousarray(x))
                                        for x in (q, k, v)))
    assert_close(out, expected, torch.float64)


def test_negative_strides_are_copied_for_every_array():
    """Masks, ALiBi slopes, softmax_lse, dout and index arrays with negative strides are copied
    like query, key and value: the results equal those of contiguous copies."""
    q, k, v = (randn(2, 4, 9, 16, seed=s).numpy() for s in (1, 2, 3))
    mask = randn(9, 9, seed=4).numpy()[::-1]
    slopes = np.linspace(0.1, 0.8, 4, dtype=np.float32)[::-1]
    for kwargs in ({"attn_mask": mask}, {"alibi_slopes": slopes}):
        reversed_out, lse = attncore.attention(q, k, v, return_lse=True, **kwargs)
        copied = {name: np.ascontiguousarray(x) for name, x in kwargs.items()}
        assert (reversed_out == attncore.attention(q, k, v, **copied)).all()
        dout = randn(2, 4, 9, 16, seed=5).numpy()
        grads = attncore.attention_backward(dout[:, ::-1][:, ::-1], q, k, v, reversed_out,
                                            lse[..., ::-1][..., ::-1], **kwargs)
        lse_reversed = np.ascontiguousarray(lse[..., ::-1])[..., ::-1]
        assert lse_reversed.strides[-1] < 0
        again = attncore.attention_backward(dout, q, k, v, reversed_out, lse_reversed, **copied)
        for a, b in zip(grads, again):
            assert (a == b).all()
    packed = randn(12, 4, 16, seed=6).numpy()
    cu_seqlens = np.array([12, 5, 0], np.int32)[::-1]
    out = attncore.attention_varlen(packed, packed, packed, cu_seqlens, cu_seqlens, 7, 7)
    expected = attncore.attention_varlen(packed, packed, packed, cu_seqlens.copy(),
                                         cu_seqlens.copy(), 7, 7)
    assert (out == expected).all()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # numpy's about np.matrix
def test_numpy_subclasses_are_read_as_plain_arrays():
    """np.matrix (2-D whatever it is reshaped to) is read as the plain array it views."""
    base = randn(9, 16, seed=1).numpy()
    matrix = np.matrix(base)
    out = attncore.scaled_dot_product_attention(matrix, matrix, matrix,
                                                attn_mask=np.matrix(np.zeros((9, 9))))
    assert type(out) is np.ndarray and out.shape == (9, 16)
    assert (out == attncore.scaled_dot_product_attention(base, base, base)).all()


def test_read_only_numpy_arrays():
    q, k, v = (_bhld(s).numpy() for s in (1, 2, 3))
    for x in (q, k, v):
        x.flags.writeable = False
    out = attncore.scaled_dot_product_attention(q, k, v)
    expected, _ = reference.attention(*(torch.from_numpy(x.copy()) for x in (q, k, v)))
    assert_close(out, expected, torch.float64)


class DlpackOnly:
    """An array of some other library: nothing but the DLPack protocol."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        return self._tensor.__dlpack__()

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_other_dlpack_producers(dtype):
    q, k, v = (_bhld(s, dtype=dtype) for s in (1, 2, 3))
    out = attncore.scaled_dot_product_attention(*(DlpackOnly(x) for x in (q, k, v)))
    assert _core._last_call_addresses()["query"] == q.data_ptr()
    # float32 comes back as numpy; bfloat16, which numpy lacks, as torch.
    assert isinstance(out, np.ndarray if dtype == torch.float32 else torch.Tensor)
    expected, _ = reference.attention(q, k, v)
    assert_close(torch.as_tensor(out), expected, dtype)


class CapsuleOnly:
    """A producer of the older protocol: __dlpack__ without __dlpack_device__."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, stream=None):
        return self._tensor.__dlpack__()


def test_dlpack_producers_without_a_device_or_an_importable_module():
    """torch reads a producer without __dlpack_device__ through its capsule (a key of a torch
    query, a bfloat16 query); a producer whose class names a module that cannot be imported
    gets its results as numpy arrays."""
    q, k, v = (_bhld(s, dtype=torch.float32) for s in (1, 2, 3))
    expected, _ = reference.attention(q, k, v)
    out = attncore.scaled_dot_product_attention(q, CapsuleOnly(k), CapsuleOnly(v))
    assert isinstance(out, torch.Tensor)
    assert_close(out, expected, torch.float32)
    bf16 = [x.to(torch.bfloat16) for x in (q, k, v)]
    out = attncore.scaled_dot_product_attention(*(CapsuleOnly(x) for x in bf16))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_close(out, reference.attention(*bf16)[0], torch.bfloat16)

    class Elsewhere(DlpackOnly):
        pass
    Elsewhere.__module__ = "no_such_module_of_attncore_tests.arrays"
    out = attncore.scaled_dot_product_attention(*(Elsewhere(x) for x in (q, k, v)))
    assert isinstance(out, np.ndarray)
    assert_close(torch.from_numpy(out), expected, torch.float32)


def test_mixed_libraries_follow_the_query():
    q, k, v = (_bhld(s) for s in (1, 2, 3))
    out = attncore.scaled_dot_product_attention(q, k.numpy(), v.numpy())
    assert isinstance(out, torch.Tensor)
    out = attncore.scaled_dot_product_attention(q.numpy(), k, v)
    assert isinstance(out, np.ndarray)


def test_empty_sizes():
    """Lq = 0, Lk = 0 and B = 0 give outputs of the right shapes (Lk = 0: zeros, LSE -inf)."""
    for batch, seqlen_q, seqlen_k in ((2, 0, 5), (2, 4, 0), (0, 4, 5)):
        q = np.ones((batch, 3, seqlen_q, 8))
        k = np.ones((batch, 3, seqlen_k, 8))
        out, lse = attncore.attention(q, k, k, return_lse=True)
        assert out.shape == (batch, 3, seqlen_q, 8) and lse.shape == (batch, 3, seqlen_q)
        assert (out == 0).all() and (lse == -np.inf).all()


def test_version_and_backend_names():
    assert attncore.__version__.count(".") == 2
    assert attncore.SDPBackend("flash") is attncore.SDPBackend.FLASH
    assert attncore.SDPBackend.FLASH_ATTENTION is attncore.SDPBackend.FLASH
    q = _bhld(1)
    for backend in ("reference", "math", attncore.SDPBackend.REFERENCE, None, "auto"):
        attncore.scaled_dot_product_attention(q, q, q, backend=backend)


def test_concurrent_calls_from_python_threads():
    """The module releases the GIL while it computes: calls from several threads run side by
    side and each gets its own result."""
    from concurrent.futures import ThreadPoolExecutor
    inputs = [[randn(2, 3, 33, 16, seed=10 * i + s).numpy() for s in range(3)] for i in range(6)]
    serial = [attncore.scaled_dot_product_attention(*x, is_causal=True) for x in inputs]
    with ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(
            lambda x: attncore.scaled_dot_product_attention(*x, is_causal=True), inputs))
    for a, b in zip(serial, parallel):
        assert (a == b).all()
