# Type stubs of attncore.torch: the package's functions (the same objects) for torch users, the
# autograd Function and torch's PagedAttention.
from typing import Any, List, Optional

import torch as _torch

from attncore import PagedKVCache as PagedKVCache
from attncore import attention as attention
from attncore import attention_varlen as attention_varlen
from attncore import merge_attention_states as merge_attention_states
from attncore import scaled_dot_product_attention as scaled_dot_product_attention
from attncore.flash_attn_interface import flash_attn_func as flash_attn_func
from attncore.flash_attn_interface import flash_attn_kvpacked_func as flash_attn_kvpacked_func
from attncore.flash_attn_interface import flash_attn_qkvpacked_func as flash_attn_qkvpacked_func
from attncore.flash_attn_interface import flash_attn_varlen_func as flash_attn_varlen_func
from attncore.flash_attn_interface import (
    flash_attn_varlen_kvpacked_func as flash_attn_varlen_kvpacked_func)
from attncore.flash_attn_interface import (
    flash_attn_varlen_qkvpacked_func as flash_attn_varlen_qkvpacked_func)
from attncore.flash_attn_interface import flash_attn_with_kvcache as flash_attn_with_kvcache

__all__ = [
    "AttentionFunction", "PagedAttention", "PagedKVCache", "attention", "attention_varlen",
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "merge_attention_states",
    "scaled_dot_product_attention"
]

class AttentionFunction(_torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
            ctx: Any, query: _torch.Tensor, key: _torch.Tensor, value: _torch.Tensor,
            mask: Optional[_torch.Tensor], alibi_slopes: Optional[_torch.Tensor],
            call: Any) -> Any: ...
    @staticmethod
    def backward(  # type: ignore[override]
            ctx: Any, dout: _torch.Tensor, _dlse: Any) -> Any: ...

class PagedAttention:
    def __init__(self, n_pages: int, page_size: int, max_batch_size: int,
                 device: str = ...) -> None: ...
    def reserve(self, batch_idx: Any, seq_len: Any) -> Any: ...
    def erase(self, batch_idx: Any) -> Any: ...
    def assign(self, batch_idx: Any, input_pos: Any, k_val: Any, v_val: Any, k_cache: Any,
               v_cache: Any) -> Any: ...
    def convert_logical_block_mask(self, block_mask: Any, batch_idx: Any = ...,
                                   kv_len: Any = ...) -> Any: ...
    def get_mask_mod(self, mask_mod: Any, kv_len: Any = ...) -> Any: ...
    def get_score_mod(self, score_mod: Any, kv_len: Any = ...) -> Any: ...
    def forward(self, query: Any, k_cache: Any, v_cache: Any, kv_len: Any, batch_idx: Any = ...,
                *, causal: bool = ..., scale: Optional[float] = ..., **options: Any) -> Any: ...
