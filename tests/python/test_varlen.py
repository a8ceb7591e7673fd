"""Variable-length batches from Python: attention_varlen / attention_varlen_backward and
flash-attn's varlen drop-in, against the torch oracle in float64 run on each sequence alone
(reference.attention), outputs and gradients; their errors. The packed drop-ins and dropout are
in test_varlen_packed.py, with the helpers here; nested tensors in test_nested.py.
"""

import math

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import attncore
import attncore.torch
import reference
from attncore import _core
from conftest import assert_close, randn
from test_arrays import DlpackOnly

# torch 1.13 warns on every nested tensor it builds.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

# Sequences of a batch: Lq below, equal to and above Lk, empty queries, empty keys, one row.
LENS_Q = (5, 0, 13, 1, 8, 33, 4)
LENS_K = (9, 4, 0, 97, 8, 20, 1)
BACKENDS = ((torch.float64, "math"), (torch.float32, "flash"), (torch.float64, "reference"))


def cu_seqlens(lengths):
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)


def packed(lengths, heads, dim, *, seed, pad=0, pad_value=math.nan):
    """[sum(lengths) + pad, heads, dim] float64, the pad rows set to pad_value."""
    x = randn(sum(lengths) + pad, heads, dim, seed=seed)
    if pad:
        x[-pad:] = pad_value
    return x


def alibi_slopes(kind, batch, heads):
    if kind is None:
        return None
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    if kind == "heads":
        return slopes
    return slopes * torch.linspace(1.0, 0.25, batch)[:, None]


def oracle(q, k, v, cu_q, cu_k, *, seqused_k=None, causal=None, window=(-1, -1), softcap=0.0,
           alibi=None, scale=None, keep=None, dropout_p=0.0):
    """(out [rows_q, Hq, Dv], lse [Hq, rows_q]) in float64, each sequence run alone as a dense
    call of its own lengths; rows past cu_q[-1] get 0 and -inf. Differentiable. keep: the
    dropout keep mask [B, Hq, max_q, max_k] (sequence b in the top-left corner)."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    heads_q, dim_v = q.shape[1], v.shape[2]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = k0 + int(seqused_k[b]) if seqused_k is not None else cu_k[b + 1]
        slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
        keep_b = None if keep is None else keep[b, :, :q1 - q0, :k1 - k0]
        out, lse = reference.attention(
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            scale=scale, causal=causal, window=window, softcap=softcap, alibi=slopes,
            keep=keep_b, dropout_p=dropout_p)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    pad = q.shape[0] - cu_q[-1]
    outs.append(torch.zeros(pad, heads_q, dim_v, dtype=torch.float64))
    lses.append(torch.full((heads_q, pad), -math.inf, dtype=torch.float64))
    return torch.cat(outs, 0), torch.cat(lses, 1)


# flash_attn_varlen_func's options, and the oracle's.
VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 2)),
    "window-left-causal": dict(window_size=(4, -1), causal=True),
    "window-zero": dict(window_size=(0, 0)),
    "softcap": dict(softcap=2.5),
    "alibi-heads": dict(alibi="heads"),
    "alibi-batch-heads-causal": dict(alibi="batch-heads", causal=True),
    "scale": dict(softmax_scale=0.21),
    "gqa-softcap-window": dict(heads_kv=2, softcap=4.0, window_size=(2, 5), causal=True),
    "mqa-dim-v": dict(heads_kv=1, dim_v=24),
    "seqused-k-causal": dict(seqused=True, causal=True),
    "padded-rows": dict(pad_q=3, pad_k=5),
    "padded-seqused-alibi": dict(pad_q=2, pad_k=4, seqused=True, alibi="heads"),
}


def make_case(variant, heads_q=4, dim=40):
    """(inputs dict, flash-attn options, oracle options) of one variant."""
    options = dict(VARIANTS[variant])
    heads_kv, dim_v = options.pop("heads_kv", heads_q), options.pop("dim_v", dim)
    pad_q, pad_k = options.pop("pad_q", 0), options.pop("pad_k", 0)
    alibi = alibi_slopes(options.pop("alibi", None), len(LENS_Q), heads_q)
    seqused = options.pop("seqused", False)
    q = packed(LENS_Q, heads_q, dim, seed=1, pad=pad_q)
    k = packed(LENS_K, heads_kv, dim, seed=2, pad=pad_k)
    v = packed(LENS_K, heads_kv, dim_v, seed=3, pad=pad_k)
    used = None
    if seqused:
        used = torch.tensor([(n * 2) // 3 for n in LENS_K], dtype=torch.int32)
        cu = cu_seqlens(LENS_K).tolist()
        for b, n in enumerate(used.tolist()):  # keys past seqused_k are never read
            k[cu[b] + n:cu[b + 1]] = math.nan
            v[cu[b] + n:cu[b + 1]] = math.nan
    inputs = dict(q=q, k=k, v=v, cu_q=cu_seqlens(LENS_Q), cu_k=cu_seqlens(LENS_K),
                  max_q=max(LENS_Q), max_k=max(LENS_K), used=used, alibi=alibi)
    ref = dict(causal="lower-right" if options.get("causal") else None,
               window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
               scale=options.get("softmax_scale"), alibi=alibi, seqused_k=used)
    return inputs, options, ref


def check_grads(named, dtype, what=""):
    for name, got, want in named:
        assert_close(got, want, dtype, f"{what}d{name}")


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_flash_attn_varlen_func(variant, dtype, backend):
    x, options, ref = make_case(variant)
    ins = [x[n].to(dtype).requires_grad_() for n in "qkv"]
    out, lse, probs = attncore.torch.flash_attn_varlen_func(
        *ins, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"], alibi_slopes=x["alibi"],
        return_attn_probs=True, seqused_k=x["used"], backend=backend, **options)
    assert out.dtype == dtype and out.shape == (*x["q"].shape[:2], x["v"].shape[2])
    assert lse.shape == (x["q"].shape[1], x["q"].shape[0])
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert probs.shape == (0,)
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    expected, expected_lse = oracle(*ref_ins, x["cu_q"], x["cu_k"], **ref)
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    # Keys never read (NaN there) get zero gradients in both.
    check_grads(zip("qkv", (t.grad for t in ins),
                     (torch.nan_to_num(t.grad) for t in ref_ins)), dtype)
    for t in ins:
        assert not t.grad.isnan().any()


@pytest.mark.parametrize("variant", ["padded-rows", "padded-seqused-alibi"])
def test_unused_rows(variant):
    """Query rows past cu_seqlens_q[-1] (NaN in them) give out 0, lse -inf and dq 0; key rows
    that belong to no used key (NaN) give dk = dv = 0."""
    x, options, _ = make_case(variant)
    ins = [x[n].requires_grad_() for n in "qkv"]
    out, lse, _ = attncore.torch.flash_attn_varlen_func(
        *ins, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"], alibi_slopes=x["alibi"],
        seqused_k=x["used"], return_attn_probs=True, **options)
    end_q, end_k = int(x["cu_q"][-1]), int(x["cu_k"][-1])
    assert (out[end_q:] == 0).all() and (lse[:, end_q:] == -math.inf).all()
    assert not out.isnan().any()
    out.sum().backward()
    assert (ins[0].grad[end_q:] == 0).all()
    unused = torch.isnan(x["k"][:, 0, 0])
    assert unused[end_k:].all()
    assert (ins[1].grad[unused] == 0).all() and (ins[2].grad[unused] == 0).all()


@pytest.mark.parametrize("dtype,backend", BACKENDS, ids=str)
@pytest.mark.parametrize("causal", ["upper-left", "lower-right"])
def test_attention_varlen_both_alignments(causal, dtype, backend):
    """attncore's own function names the alignment: upper-left (j <= i) and lower-right
    (j <= i + Lk - Lq) per sequence, on sequences with Lq above and below Lk."""
    x, _, _ = make_case("plain")
    ins = [x[n].to(dtype).requires_grad_() for n in "qkv"]
    out, lse = attncore.attention_varlen(*ins, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
                                         causal=causal, backend=backend, return_lse=True)
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    expected, expected_lse = oracle(*ref_ins, x["cu_q"], x["cu_k"], causal=causal)
    assert_close(out.detach(), expected, dtype, "out")
    assert_close(lse, expected_lse, dtype, "lse")
    dout = randn(*out.shape, seed=9)
    (out * dout.to(dtype)).sum().backward()
    (expected * dout).sum().backward()
    check_grads(zip("qkv", (t.grad for t in ins), (t.grad for t in ref_ins)), dtype)


def test_upper_left_and_lower_right_differ():
    """The two alignments agree where Lq == Lk and differ elsewhere (the test above would not
    notice an option that is ignored)."""
    x, _, _ = make_case("plain")
    args = (x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], x["max_q"], x["max_k"])
    upper = attncore.attention_varlen(*args, causal="upper-left")
    lower = attncore.attention_varlen(*args, causal="lower-right")
    cu = x["cu_q"].tolist()
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        rows = slice(cu[b], cu[b + 1])
        same = torch.equal(upper[rows], lower[rows])
        assert same == (lq == lk or lq == 0 or lk == 0 or (lq == 1 and lk == 1)), b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reduced_precision(dtype):
    x, options, ref = make_case("gqa-softcap-window")
    ins = [x[n].to(dtype) for n in "qkv"]
    out = attncore.flash_attn_varlen_func(*ins, x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
                                          **options)
    assert out.dtype == dtype
    expected, _ = oracle(*ins, x["cu_q"], x["cu_k"], **ref)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("variant", ["plain", "alibi-batch-heads-causal", "seqused-k-causal",
                                     "padded-rows", "gqa-softcap-window"])
def test_numpy_forward_and_backward(variant):
    """numpy in (int32 numpy index arrays), numpy out; attention_varlen_backward with the
    forward's options gives the oracle's gradients."""
    x, options, ref = make_case(variant)
    qn, kn, vn = (x[n].float().numpy() for n in "qkv")
    cu_q, cu_k = x["cu_q"].numpy(), x["cu_k"].numpy()
    used = None if x["used"] is None else x["used"].numpy()
    alibi = None if x["alibi"] is None else x["alibi"].numpy()
    out, lse, probs = attncore.flash_attn_varlen_func(
        qn, kn, vn, cu_q, cu_k, x["max_q"], x["max_k"], alibi_slopes=alibi, seqused_k=used,
        return_attn_probs=True, **options)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert isinstance(lse, np.ndarray) and lse.shape == (qn.shape[1], qn.shape[0])
    assert isinstance(probs, np.ndarray) and probs.shape == (0,)
    ref_ins = [torch.from_numpy(t).double().requires_grad_() for t in (qn, kn, vn)]
    expected, expected_lse = oracle(*ref_ins, x["cu_q"], x["cu_k"], **ref)
    assert_close(out, expected, torch.float32, "out")
    assert_close(lse, expected_lse, torch.float32, "lse")
    dout = randn(*out.shape, seed=9)
    (expected * dout).sum().backward()
    grads = attncore.attention_varlen_backward(
        dout.float().numpy(), qn, kn, vn, out, lse, cu_q, cu_k, x["max_q"], x["max_k"],
        seqused_k=used, scale=options.get("softmax_scale"), causal=ref["causal"],
        window_size=ref["window"], softcap=ref["softcap"], alibi_slopes=alibi)
    assert len(grads) == 3
    for got, t in zip(grads, (qn, kn, vn)):
        assert isinstance(got, np.ndarray) and got.shape == t.shape and got.dtype == np.float32
    check_grads(zip("qkv", grads, (torch.nan_to_num(t.grad) for t in ref_ins)),
                 torch.float32)


def test_index_arrays_from_any_library():
    """Index arrays as torch int32 (DLPack), numpy int32 (buffer protocol) and lists of ints
    give the same result; the float tensors may come from another library."""
    x, _, _ = make_case("causal")
    args = (x["max_q"], x["max_k"])
    results = [
        attncore.attention_varlen(x["q"], x["k"], x["v"], cu_q, cu_k, *args, causal="lower-right")
        for cu_q, cu_k in ((x["cu_q"], x["cu_k"]), (x["cu_q"].numpy(), x["cu_k"].numpy()),
                           (x["cu_q"].tolist(), x["cu_k"].tolist()))]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_strided_index_arrays_are_copied():
    """cu_seqlens and seqused_k with a stride of 2 (numpy and torch) are copied, as any input
    the library cannot read in place: the bits of contiguous ones."""
    x, _, _ = make_case("causal")
    args = (x["max_q"], x["max_k"])
    used = (x["cu_k"][1:] - x["cu_k"][:-1]).to(torch.int32) // 2
    plain = attncore.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], *args,
                                            seqused_k=used)

    def spread(t):  # t's values at every other element of a buffer twice as long
        wide = torch.zeros(2 * len(t), dtype=torch.int32)
        wide[::2] = t
        return wide[::2]

    strided = attncore.flash_attn_varlen_func(
        x["q"], x["k"], x["v"], spread(x["cu_q"]).numpy(), spread(x["cu_k"]), *args,
        seqused_k=spread(used).numpy())
    assert torch.equal(strided, plain)


def test_dlpack_producers():
    """Float tensors and int32 index arrays from a library attncore does not know (DLPack
    only): read in place; float32 results come back as numpy."""
    x, _, _ = make_case("causal")
    q, k, v = (x[n].float() for n in "qkv")
    out = attncore.flash_attn_varlen_func(*(DlpackOnly(t) for t in (q, k, v)),
                                          DlpackOnly(x["cu_q"]), DlpackOnly(x["cu_k"]),
                                          x["max_q"], x["max_k"], causal=True)
    addresses = _core._last_call_addresses()
    assert addresses["query"] == q.data_ptr()
    assert addresses["cu_seqlens_k"] == x["cu_k"].data_ptr()
    assert isinstance(out, np.ndarray)
    expected = attncore.flash_attn_varlen_func(q, k, v, x["cu_q"], x["cu_k"], x["max_q"],
                                               x["max_k"], causal=True)
    assert (out == expected.numpy()).all()


def test_concurrent_calls_from_python_threads():
    """Varlen calls release the GIL too: calls from several threads each get their own
    result."""
    from concurrent.futures import ThreadPoolExecutor
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    inputs = [[packed(lens, 2, 16, seed=10 * i + s).float().numpy()
               for lens, s in ((LENS_Q, 1), (LENS_K, 2), (LENS_K, 3))] for i in range(6)]

    def run(arrays):
        return attncore.flash_attn_varlen_func(*arrays, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                               causal=True)

    serial = [run(a) for a in inputs]
    with ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(run, inputs))
    for a, b in zip(serial, parallel):
        assert (a == b).all()


def test_empty_batch_and_empty_sequences():
    """B = 0 (cu_seqlens [0]), and a batch whose every sequence is empty: outputs of the right
    shapes, 0 and -inf; zero gradients."""
    for lens_q, lens_k in (((), ()), ((0, 0), (0, 3)), ((2, 3), (0, 0))):
        q = packed(lens_q, 2, 8, seed=1).requires_grad_()
        k = packed(lens_k, 2, 8, seed=2).requires_grad_()
        out, lse, _ = attncore.torch.flash_attn_varlen_func(
            q, k, k, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q, default=0),
            max(lens_k, default=0), return_attn_probs=True)
        assert out.shape == q.shape and lse.shape == (2, q.shape[0])
        assert (out == 0).all() and (lse == -math.inf).all()
        out.sum().backward()
        assert (q.grad == 0).all() and (k.grad == 0).all()


def test_gradcheck_varlen():
    """Central differences in float64 through attncore.torch.flash_attn_varlen_func."""
    lens_q, lens_k = (2, 0, 3), (3, 2, 1)
    q = packed(lens_q, 2, 4, seed=1, pad=1, pad_value=0.5).requires_grad_()
    k = packed(lens_k, 1, 4, seed=2).requires_grad_()
    v = packed(lens_k, 1, 4, seed=3).requires_grad_()
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    assert gradcheck(lambda q, k, v: attncore.torch.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 3, 3, causal=True, softcap=3.0, softmax_scale=-0.7), (q, k, v))


# --- errors ----------------------------------------------------------------------------------

def _bad_inputs():
    q = np.ones((7, 2, 8), np.float32)
    cu = np.array([0, 3, 7], np.int32)
    return q, cu


def _varlen(**changes):
    q, cu = _bad_inputs()
    args = dict(q=q, k=q, v=q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    args.update(changes)
    return lambda: attncore.flash_attn_varlen_func(**args)


INVALID = {
    "float-cu-seqlens": (_varlen(cu_seqlens_q=np.array([0, 3, 7], np.float32)),
                         r"^forward: cu_seqlens_q has the wrong dtype \(dtype=f32, expected i32\)"),
    "float-list-cu-seqlens": (_varlen(cu_seqlens_k=[0.0, 3.0, 7.0]),
                              r"^forward: cu_seqlens_k has the wrong dtype \(dtype=f64, "),
    "int64-cu-seqlens": (_varlen(cu_seqlens_q=np.array([0, 3, 7])),
                         r"cu_seqlens_q has the wrong dtype \(dtype=int64, expected int32\)"),
    "wrong-length": (_varlen(cu_seqlens_k=np.array([0, 7], np.int32)),
                     r"^forward: cu_seqlens_k has shape \[2\], expected \[3\] \(\[B \+ 1\] like "
                     r"cu_seqlens_q\)"),
    "rank": (_varlen(cu_seqlens_q=np.array([[0, 3, 7]], np.int32)),
             r"^flash_attn_varlen_func: cu_seqlens_q has the wrong rank \(rank=2, expected 1: "
             r"\[B \+ 1\]\)"),
    "decreasing": (_varlen(cu_seqlens_q=np.array([0, 5, 3], np.int32)),
                   r"^forward: cu_seqlens_q is decreasing \(cu_seqlens_q\[2\]=3 < "
                   r"cu_seqlens_q\[1\]=5"),
    "not-from-zero": (_varlen(cu_seqlens_k=np.array([1, 3, 7], np.int32)),
                      r"^forward: cu_seqlens_k does not start at 0"),
    "past-the-rows": (_varlen(cu_seqlens_q=np.array([0, 3, 8], np.int32), max_seqlen_q=5),
                      r"^forward: cu_seqlens_q ends past the rows of query \(cu_seqlens_q\[2\]=8, "
                      r"expected <= 7\)"),
    "max-seqlen-q-too-small": (_varlen(max_seqlen_q=3),
                               r"^forward: max_seqlen_q is smaller than a sequence "
                               r"\(max_seqlen_q=3, expected >= the longest sequence's 4\)"),
    "max-seqlen-k-too-small": (_varlen(max_seqlen_k=0), r"^forward: max_seqlen_k is smaller"),
    "seqused-k": (_varlen(seqused_k=np.array([3, 5], np.int32)),
                  r"^forward: seqused_k is out of range \(seqused_k\[1\]=5, expected "),
    "seqused-k-shape": (_varlen(seqused_k=np.array([3], np.int32)),
                        r"^forward: seqused_k has shape \[1\], expected \[2\]"),
    "index-array-as-query": (_varlen(q=np.ones((7, 2, 8), np.int32)),
                             r"^forward: query has an unsupported dtype \(dtype=i32"),
    "index-array-as-alibi": (_varlen(alibi_slopes=np.ones(2, np.int32)),
                             r"^forward: alibi_slopes has the wrong dtype \(dtype=i32, expected "
                             r"f32\)"),
    "query-rank": (_varlen(q=np.ones((1, 7, 2, 8), np.float32)),
                   r"^flash_attn_varlen_func: q has the wrong rank \(rank=4, expected 3"),
    "key-heads": (_varlen(k=np.ones((7, 3, 8), np.float32), v=np.ones((7, 3, 8), np.float32)),
                  r"^forward: key has shape \[7, 3, 8\], expected \[total_k, Hkv, 8\]"),
    "qkv-packed-shape": (lambda: attncore.flash_attn_varlen_qkvpacked_func(
        np.ones((7, 2, 2, 8), np.float32), _bad_inputs()[1], 4),
        r"^flash_attn_varlen_qkvpacked_func: qkv has shape \[7, 2, 2, 8\], expected "
        r"\[total, 3, H, D\]"),
    "kv-packed-shape": (lambda: attncore.flash_attn_kvpacked_func(
        np.ones((1, 7, 2, 8), np.float32), np.ones((1, 7, 3, 2, 8), np.float32)),
        r"^flash_attn_kvpacked_func: kv has shape \[1, 7, 3, 2, 8\], expected "
        r"\[B, L, 2, H, D\]"),
    "dense-qkv-rank": (lambda: attncore.flash_attn_qkvpacked_func(np.ones((7, 3, 2, 8),
                                                                          np.float32)),
                       r"^flash_attn_qkvpacked_func: qkv has the wrong rank \(rank=4, expected "
                       r"5"),
    # lists: an empty one is a shape problem, a scalar a rank problem, big ints a range one
    "empty-list-cu-seqlens": (_varlen(cu_seqlens_q=[]),
                              r"^forward: cu_seqlens_q has shape \[0\], expected \[1\] "),
    "scalar-cu-seqlens": (_varlen(cu_seqlens_q=8),
                          r"^flash_attn_varlen_func: cu_seqlens_q has the wrong rank \(rank=0, "
                          r"expected 1: \[B \+ 1\]\)$"),
    "past-int64-cu-seqlens": (_varlen(cu_seqlens_k=[0, 3, 10 ** 30]),
                              r"^flash_attn_varlen_func: cu_seqlens_k holds values past int32 "
                              r"\(min=0, max=1e\+30, "),
    "seqused-k-rank": (_varlen(seqused_k=3),
                       r"^flash_attn_varlen_func: seqused_k has the wrong rank \(rank=0, "
                       r"expected 1: \[B\]\)$"),
    "backward-lse-shape": (lambda: attncore.attention_varlen_backward(
        *(_bad_inputs()[0],) * 5, np.zeros((2, 6), np.float32), *(_bad_inputs()[1],) * 2, 4, 4),
        r"^backward: lse has shape \[2, 6\], expected \[2, 7\] \(\[Hq, total_q\]\)"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_arguments_raise_value_error(case):
    call, message = INVALID[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_missing_cu_seqlens_are_type_errors():
    """cu_seqlens None: a TypeError naming the call and the argument, in every varlen call
    (the paged form included)."""
    q, cu = _bad_inputs()
    qkv, kv = np.ones((7, 3, 2, 8), np.float32), np.ones((7, 2, 2, 8), np.float32)
    pages, table = np.ones((2, 4, 2, 8), np.float32), np.array([[0], [1]], np.int32)
    calls = {
        "flash_attn_varlen_func": lambda: attncore.flash_attn_varlen_func(q, q, q, None, cu,
                                                                          4, 4),
        "flash_attn_varlen_qkvpacked_func": lambda: attncore.flash_attn_varlen_qkvpacked_func(
            qkv, None, 4),
        "flash_attn_varlen_kvpacked_func": lambda: attncore.flash_attn_varlen_kvpacked_func(
            q, kv, None, cu, 4, 4),
        "attention_varlen": lambda: attncore.attention_varlen(q, q, q, None, cu, 4, 4),
        "attention_varlen_backward": lambda: attncore.attention_varlen_backward(
            q, q, q, q, q, np.zeros((2, 7), np.float32), None, cu, 4, 4),
    }
    for op, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{op}: cu_seqlens_q is not an array "
                                            r"\(type=NoneType, expected an int32 array "
                                            r"\[B \+ 1\]\)$"):
            call()
    with pytest.raises(TypeError, match=r"^flash_attn_varlen_func: cu_seqlens_k is not an "
                                        r"array \(type=NoneType"):
        attncore.flash_attn_varlen_func(q, pages, pages, cu, None, 4, 4, block_table=table)
    with pytest.raises(TypeError, match=r"^flash_attn_varlen_func: cu_seqlens_q is not an "
                                        r"array \(type=NoneType"):
        attncore.flash_attn_varlen_func(q, pages, pages, None, cu, 4, 4, block_table=table)


def test_alibi_slopes_as_lists_are_float32():
    """A list of slopes is taken as float32 (as a list of ints is int32 for an index array),
    for numpy calls as for torch ones."""
    q, cu = _bad_inputs()
    slopes = np.array([0.5, 0.25], np.float32)
    expected = attncore.attention_varlen(q, q, q, cu, cu, 4, 4, alibi_slopes=slopes)
    for given in ([0.5, 0.25], (0.5, 0.25), [[0.5, 0.25], [0.5, 0.25]]):
        got = attncore.attention_varlen(q, q, q, cu, cu, 4, 4, alibi_slopes=given)
        assert np.array_equal(got, expected)
    assert np.array_equal(attncore.flash_attn_func(q[None], q[None], q[None],
                                                   alibi_slopes=[0.5, 0.25]),
                          attncore.flash_attn_func(q[None], q[None], q[None],
                                                   alibi_slopes=slopes))
    cache = np.ones((1, 7, 2, 8), np.float32)
    assert np.array_equal(
        attncore.flash_attn_with_kvcache(q[None, :1], cache, cache, alibi_slopes=[0.5, 0.25]),
        attncore.flash_attn_with_kvcache(q[None, :1], cache, cache, alibi_slopes=slopes))


def test_max_seqlen_must_be_an_integer():
    with pytest.raises(TypeError, match=r"max_seqlen_q is not an integer \(type=float"):
        _varlen(max_seqlen_q=4.0)()
    assert _varlen(max_seqlen_q=torch.tensor(4))().shape == (7, 2, 8)  # int-like is fine


def test_unsupported_raise_not_implemented_error():
    q, cu = _bad_inputs()
    with pytest.raises(NotImplementedError,
                       match=r"^forward: mask is not supported with variable-length sequences"):
        attncore.attention_varlen(q, q, q, cu, cu, 4, 4, attn_mask=np.ones((4, 4), bool))


def test_index_array_as_mask():
    q = np.ones((1, 2, 5, 8), np.float32)
    with pytest.raises(ValueError, match=r"^forward: mask has the wrong dtype \(dtype=i32"):
        attncore.attention(q, q, q, attn_mask=np.ones((5, 5), np.int32))


def test_public_names():
    for name in ("attention_varlen", "attention_varlen_backward", "flash_attn_varlen_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
                 "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"):
        assert name in attncore.__all__ and getattr(attncore, name).__doc__
        assert name in attncore.__doc__
        if name != "attention_varlen_backward":
            assert getattr(attncore.torch, name) is getattr(attncore, name)
            assert name in attncore.torch.__all__
