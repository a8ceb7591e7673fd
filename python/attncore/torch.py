"""attncore for torch: its attention as a torch.autograd.Function, so loss.backward() works.

scaled_dot_product_attention, the flash-attn drop-ins (flash_attn_func and its packed and
variable-length forms), attention and attention_varlen in this module are the package's own functions
(they send torch tensors through autograd Functions); importing them from attncore.torch
documents that the caller wants torch semantics and autograd. Gradients reach query, key, value
(a packed qkv or kv as one packed gradient) and a float attn_mask that requires grad (its
gradient is dBias); ALiBi slopes get none. Dropout draws one seed per call from torch's default
CPU generator (so torch.manual_seed reproduces a run), and the backward replays the forward's
seed. Nested tensors passed to scaled_dot_product_attention take no autograd.

AttentionFunction is defined in _autograd, below _attention, which uses it; this module only
gathers the names.
"""

from ._attention import attention, attention_varlen
from ._autograd import AttentionFunction
from ._dropins import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, scaled_dot_product_attention)
from ._kvcache import flash_attn_with_kvcache
from ._merge import merge_attention_states
from ._paged import PagedKVCache
from ._paged_torch import PagedAttention
from . import _torch_ops  # imported for its effect: registers torch.ops.attncore.*

__all__ = [
    "AttentionFunction", "PagedAttention", "PagedKVCache", "attention", "attention_varlen",
    "flash_attn_func",
    "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache", "merge_attention_states", "scaled_dot_product_attention",
]

PagedAttention.__module__ = __name__  # help() names the public module
