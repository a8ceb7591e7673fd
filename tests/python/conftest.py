"""Shared helpers of the Python tests: random inputs, the comparisons with the oracle and the
form of attncore's errors."""

import re

import pytest
import torch

# attncore's message form (docs/design.md section 4): <op>: <what> <problem> (<name>=<value>,
# expected ..)
ERROR_FORM = re.compile(r"^[\w.:]+: .+ \(.*\)")


def raises(exc, fn, *fragments):
    """fn() raises exactly exc (not a subclass of another library's) in attncore's form, with
    every fragment in its message; returns the message."""
    with pytest.raises(exc) as info:
        fn()
    assert type(info.value) is exc, type(info.value)
    message = str(info.value)
    assert ERROR_FORM.match(message), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def randn(*shape, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad)


# Largest error, relative to the oracle's largest magnitude, each input dtype is held to:
# float64 differs from the oracle by summation order only; float32 by float32 rounding of
# products over up to 1025 keys; bf16/f16 by their 8/11-bit mantissas (inputs are rounded
# before the oracle sees them, so only the computation's own roundings count).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2,
             torch.float16: 4e-3}


def assert_close(actual, expected, dtype, what=""):
    actual = torch.as_tensor(actual).double()
    expected = expected.double()
    assert actual.shape == expected.shape, what
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    # -inf LSE rows (no visible key) must match exactly.
    both_inf = torch.isinf(expected) & (actual == expected)
    err = torch.where(both_inf, torch.zeros(()), (actual - expected).abs())
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= TOLERANCE[dtype] * scale, f"{what}: max error {worst:.3g} (scale {scale:.3g})"


def assert_same_bits(a, b):
    """a and b (arrays or tensors, or tuples of them) of one type, shape and dtype, bit for bit
    (bf16 compared as its bits)."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) and tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        assert torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                           y.view(torch.int16) if y.dtype == torch.bfloat16 else y)


# The options of a flash-attn call that its fast-path tests run on every path.
FLASH_OPTION_CASES = {
    "plain": {},
    "causal": {"causal": True},
    "scale": {"softmax_scale": 0.3},
    "window": {"window_size": (5, 0), "causal": True},
    "softcap": {"softcap": 2.0},
}


def in_library(lib, arrays, options):
    """(arrays, options) as numpy arrays where lib is "numpy" (torch tensors among the options
    too), else as they are."""
    if lib != "numpy":
        return arrays, options
    return ([x.numpy() for x in arrays],
            {n: x.numpy() if isinstance(x, torch.Tensor) else x for n, x in options.items()})


def next_torch_seed():
    """The dropout seed the next call on torch tensors draws (offset 0): one 64-bit value of
    torch's default CPU generator, read here without consuming it."""
    state = torch.get_rng_state()
    seed = torch.empty((), dtype=torch.int64).random_(-2 ** 63, None).item() % 2 ** 64
    torch.set_rng_state(state)
    return seed


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same dropout streams (attncore's and torch's)."""
    import attncore
    attncore.manual_seed(0)
    torch.manual_seed(0)
