"""Backend control: sdpa_kernel restricts and orders the backends automatic selection may
choose, per thread, and restores the previous list on exit and on exceptions; explain() reports
each backend's verdict on a call and the choice, with the library's reasons."""

import threading

import numpy as np
import pytest
import torch

import attncore
from attncore import SDPBackend, sdpa_kernel
from conftest import raises

DEFAULT = [SDPBackend.FLASH, SDPBackend.MATH, SDPBackend.REFERENCE]


def qkv(dtype=np.float32, seqlen=64, head_dim=32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, seqlen, head_dim)).astype(dtype)
    k = rng.standard_normal((1, 2, seqlen, head_dim)).astype(dtype)
    v = rng.standard_normal((1, 2, seqlen, head_dim)).astype(dtype)
    return q, k, v


def test_default_list_and_restore():
    assert attncore.enabled_backends() == DEFAULT
    with sdpa_kernel(SDPBackend.MATH):
        assert attncore.enabled_backends() == [SDPBackend.MATH]
        with sdpa_kernel(["reference", SDPBackend.FLASH]):  # the library's priority order
            assert attncore.enabled_backends() == [SDPBackend.FLASH, SDPBackend.REFERENCE]
        with sdpa_kernel(["reference", "flash"], set_priority=True):  # the given order
            assert attncore.enabled_backends() == [SDPBackend.REFERENCE, SDPBackend.FLASH]
        assert attncore.enabled_backends() == [SDPBackend.MATH]
    assert attncore.enabled_backends() == DEFAULT


def test_restores_on_exception():
    with pytest.raises(KeyError):
        with sdpa_kernel([SDPBackend.REFERENCE]):
            raise KeyError("inside")
    assert attncore.enabled_backends() == DEFAULT


def test_thread_local():
    seen = []
    with sdpa_kernel(SDPBackend.REFERENCE):
        t = threading.Thread(target=lambda: seen.append(attncore.enabled_backends()))
        t.start()
        t.join()
        assert attncore.enabled_backends() == [SDPBackend.REFERENCE]
    assert seen == [DEFAULT]


def test_invalid_backends_raise_value_error():
    for bad in ([], "cuda", ["flash", "bogus"]):
        with pytest.raises(ValueError, match="^sdpa_kernel: "):
            with sdpa_kernel(bad):
                pass
    for bad in ([3], 3, None, b"math", {"flash": 1}):
        with pytest.raises(TypeError, match=r"^sdpa_kernel: backends? is not a backend"):
            with sdpa_kernel(bad):
                pass
    with pytest.raises(ValueError, match=r"^sdpa_kernel: backends has an entry that is no "
                                         r"backend \(backend=auto"):
        with sdpa_kernel("auto"):
            pass
    assert attncore.enabled_backends() == DEFAULT


def test_scope_decides_automatic_calls():
    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.MATH):
        assert attncore.explain(q, k, v).chosen == SDPBackend.MATH
        out = attncore.scaled_dot_product_attention(q, k, v)
    want = attncore.scaled_dot_product_attention(q, k, v, backend="math")
    assert np.array_equal(out, want)  # the math backend is bitwise reproducible


def test_nothing_enabled_can_run():
    q, k, v = qkv(np.float64)
    with sdpa_kernel(SDPBackend.FLASH):  # flash has no f64
        e = attncore.explain(q, k, v)
        assert e.chosen is None
        assert any("dtype f64 is not supported" in r for r in e[SDPBackend.FLASH].reasons)
        with pytest.raises(NotImplementedError, match="flash: dtype f64 is not supported"):
            attncore.scaled_dot_product_attention(q, k, v)
        # a call that names a backend runs it whatever the scope says
        attncore.scaled_dot_product_attention(q, k, v, backend="math")


def test_explain_verdicts():
    q, k, v = qkv()
    e = attncore.explain(q, k, v)
    assert [verdict.backend for verdict in e.verdicts] == DEFAULT
    assert e.chosen in (SDPBackend.FLASH, SDPBackend.MATH)
    for verdict in e.verdicts:
        assert verdict.enabled and verdict.can_run and verdict.reasons == ()
    assert e[SDPBackend.FLASH].estimated_seconds > 0
    assert "flash" in str(e) and "chosen" in str(e)
    with sdpa_kernel(SDPBackend.REFERENCE):
        e = attncore.explain(q, k, v, backward=True, causal="lower-right")
        assert e.chosen == SDPBackend.REFERENCE
        assert e[SDPBackend.REFERENCE].enabled and not e[SDPBackend.FLASH].enabled
        assert any("not enabled" in r for r in e[SDPBackend.MATH].reasons)


def test_explain_names_pythons_scope():
    """A backend left out by sdpa_kernel is explained in Python's terms, not the C++ scope's."""
    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.MATH):
        e = attncore.explain(q, k, v)
    assert e[SDPBackend.FLASH].reasons == (
        "flash: backend is not enabled on this thread (enabled=[math], expected flash among "
        "them); see attncore.sdpa_kernel",)
    assert "BackendScope" not in str(e) and str(e).count("see attncore.sdpa_kernel") == 2


def test_errors_name_pythons_scope():
    """An automatic call no enabled backend can run (flash takes no float64) is refused in
    Python's terms too: the backends sdpa_kernel left out point to it."""
    q, k, v = qkv(np.float64)
    with sdpa_kernel(SDPBackend.FLASH):
        with pytest.raises(NotImplementedError) as error:
            attncore.attention(q, k, v)
    assert "math: backend is not enabled on this thread" in str(error.value), str(error.value)
    assert "see attncore.sdpa_kernel" in str(error.value), str(error.value)
    assert "BackendScope" not in str(error.value)


def test_explain_backward_allocates_nothing_of_the_calls_size():
    """The backward's out, dout and LSE that explain hands the library are stride-0 views: a
    broadcast query of 2^36 rows (out 2^41 bytes) is explained, not allocated."""
    row = np.ones((1, 2, 1, 8), np.float32)
    q = np.broadcast_to(row, (1, 2, 2**36, 8))
    e = attncore.explain(q, row, row, backward=True, scale=-0.5)
    assert len(e.verdicts) == 3


def test_explain_torch_and_masks():
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in qkv())
    mask = torch.zeros(64, 64, dtype=torch.bfloat16)
    e = attncore.explain(q, k, v, attn_mask=mask, backward=True)
    assert e[SDPBackend.FLASH].can_run
    assert e.chosen is not None


def test_explain_validates_like_the_call():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key has shape"):
        attncore.explain(q, k[:, :, :, :16], v)
    # attention()'s other options too: a backend it names is refused as the call refuses it
    # (flash has no float64), seeds are taken and none is drawn.
    q64 = np.zeros((1, 2, 4, 8))
    raises(NotImplementedError, lambda: attncore.explain(q64, q64, q64, backend="flash"),
           "forward: backend flash cannot run this call")
    assert attncore.explain(q64, q64, q64, backend="math").chosen is not None
    assert attncore.explain(q, k, v, dropout_p=0.5, seed=1, offset=2).chosen is not None
    raises(ValueError, lambda: attncore.explain(q, k, v, dropout_p=0.5, offset=2),
           "explain: offset is set without seed (offset=2, expected seed with it, or neither")
