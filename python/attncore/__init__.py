"""attncore: exact scaled-dot-product attention on CPUs, for numpy arrays and torch tensors.

    scaled_dot_product_attention  torch.nn.functional's, as a drop-in
    flash_attn_func               flash_attn's, as a drop-in
    attention, attention_backward attncore's own, with every option; the backward for numpy
    attncore.torch                the same functions with torch autograd (AttentionFunction)
    manual_seed, get_rng_state, set_rng_state   attncore's dropout generator
    SDPBackend                    backend names for the backend= keyword

Invalid arguments raise ValueError and unsupported combinations NotImplementedError, with the
C++ library's message.
"""

from . import _core
from ._attention import attention, attention_backward
from ._dropins import flash_attn_func, scaled_dot_product_attention
from ._random import get_rng_state, manual_seed, set_rng_state
from .backends import SDPBackend

__version__ = _core.version()

__all__ = [
    "SDPBackend", "attention", "attention_backward", "flash_attn_func", "get_rng_state",
    "manual_seed", "scaled_dot_product_attention", "set_rng_state",
]
