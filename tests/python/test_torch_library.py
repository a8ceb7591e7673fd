"""The torch operators (attncore._torch_ops): one node under torch.jit.trace and script, the
same results and gradients as attncore.torch's function, dropout reproduced by
torch.manual_seed."""

import pytest
import torch

import attncore.torch  # registers torch.ops.attncore.*
import reference
from conftest import assert_close, randn

OP = "attncore::scaled_dot_product_attention"


def attend(q, k, v):
    return torch.ops.attncore.scaled_dot_product_attention(q, k, v, None, 0.0, True, None, False)


def node_kinds(graph):
    return [n.kind() for n in graph.nodes() if n.kind() != "prim::Constant"]


def inputs(dtype=torch.float32, requires_grad=False):
    return [randn(2, 4, 33, 24, dtype=dtype, seed=s, requires_grad=requires_grad)
            for s in range(3)]


def test_trace_records_one_node():
    traced = torch.jit.trace(attend, tuple(inputs()))
    assert node_kinds(traced.graph) == [OP]
    fresh = inputs()
    assert torch.equal(traced(*fresh), attend(*fresh))
    traced_grad = torch.jit.trace(attend, tuple(inputs(requires_grad=True)))
    assert node_kinds(traced_grad.graph) == [OP]


def test_script_holds_the_operator():
    @torch.jit.script
    def scripted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.attncore.scaled_dot_product_attention(q, k, v, is_causal=True)

    assert OP in node_kinds(scripted.graph)
    q, k, v = inputs()
    assert torch.equal(scripted(q, k, v), attend(q, k, v))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("causal", (False, True))
def test_matches_the_function_and_the_oracle(dtype, causal):
    mask = randn(33, 33, dtype=dtype, seed=7) if not causal else None
    ins = inputs(dtype, requires_grad=True)
    out = torch.ops.attncore.scaled_dot_product_attention(*ins, mask, 0.0, causal, 0.3, False)
    out.backward(randn(*out.shape, dtype=dtype, seed=9))
    same = [x.detach().clone().requires_grad_() for x in ins]
    expected = attncore.torch.scaled_dot_product_attention(*same, attn_mask=mask,
                                                           is_causal=causal, scale=0.3)
    expected.backward(randn(*out.shape, dtype=dtype, seed=9))
    assert torch.equal(out, expected)
    for a, b in zip(ins, same):
        assert torch.equal(a.grad, b.grad)
    oracle_ins = [x.detach().double().requires_grad_() for x in ins]
    oracle, _ = reference.attention(*oracle_ins, scale=0.3,
                                    mask=None if mask is None else mask.double(),
                                    causal="upper-left" if causal else None)
    oracle.backward(randn(*out.shape, dtype=torch.float64, seed=9))
    assert_close(out.detach(), oracle.detach(), dtype, "out")
    for a, b, name in zip(ins, oracle_ins, "qkv"):
        assert_close(a.grad, b.grad, dtype, "d" + name)


def test_dropout_follows_torch_manual_seed():
    q, k, v = inputs()
    torch.manual_seed(5)
    first = torch.ops.attncore.scaled_dot_product_attention(q, k, v, None, 0.3)
    second = torch.ops.attncore.scaled_dot_product_attention(q, k, v, None, 0.3)
    torch.manual_seed(5)
    again = torch.ops.attncore.scaled_dot_product_attention(q, k, v, None, 0.3)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dropout_gradients_replay_the_forward_mask():
    ins = inputs(torch.float64, requires_grad=True)
    torch.manual_seed(11)
    out = torch.ops.attncore.scaled_dot_product_attention(*ins, None, 0.4)
    out.sum().backward()
    same = [x.detach().clone().requires_grad_() for x in ins]
    torch.manual_seed(11)
    expected = attncore.torch.scaled_dot_product_attention(*same, dropout_p=0.4)
    expected.sum().backward()
    assert torch.equal(out, expected)
    for a, b in zip(ins, same):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_mask_requiring_grad_is_refused():
    mask = randn(33, 33, seed=3, dtype=torch.float32, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        torch.ops.attncore.scaled_dot_product_attention(*inputs(), mask)
    with torch.no_grad():  # (no gradient asked for: it runs, as attncore.torch's function does)
        out = torch.ops.attncore.scaled_dot_product_attention(*inputs(), mask)
        assert torch.equal(out, attncore.torch.scaled_dot_product_attention(*inputs(),
                                                                            attn_mask=mask))


def test_inference_mode_runs_the_cpu_kernel():
    q, k, v = inputs()
    with torch.inference_mode():
        out = attend(q, k, v)
    assert torch.equal(out, attend(q, k, v))


@pytest.mark.parametrize("grad", [False, True])
def test_masks_follow_torchs_rules(grad):
    """As torch's function (and attncore's): no attn_mask with is_causal=True (the two were
    combined), and a mask of bool, float32 or the query's dtype (a float64 mask was taken)."""
    q = randn(1, 2, 3, 4, dtype=torch.float32, requires_grad=grad)
    op = torch.ops.attncore.scaled_dot_product_attention
    with pytest.raises(ValueError, match=r"^scaled_dot_product_attention: attn_mask is set with "
                                         r"is_causal=True"):
        op(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask has the wrong dtype \(dtype=float64, "
                                         r"expected bool, float32 or query's float32\)"):
        op(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.float64))
    assert op(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool)).shape == (1, 2, 3, 4)


def test_a_refused_dropout_call_leaves_torchs_generator_alone():
    # The seed is drawn after the call's checks (explain's, named as the forward's).
    q = torch.randn(1, 2, 4, 8)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    op = torch.ops.attncore.scaled_dot_product_attention
    with pytest.raises(ValueError, match=r"^forward: key has shape"):
        op(q, q[..., :7], q, dropout_p=0.5)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"^forward: key has shape"):
        op(q, q[..., :7], q, dropout_p=0.5)
    assert torch.equal(state, torch.get_rng_state())
    op(q, q, q, dropout_p=0.5)
    assert not torch.equal(state, torch.get_rng_state())
