"""attncore for torch: its attention as a torch.autograd.Function, so loss.backward() works.

scaled_dot_product_attention, flash_attn_func and attention here are the package's own
functions (they send torch tensors through AttentionFunction); importing them from
attncore.torch documents that the caller wants torch semantics and autograd. Gradients reach
query, key, value and a float attn_mask that requires grad (its gradient is dBias); ALiBi
slopes get none. A backward with dropout replays the forward's (seed, offset).

AttentionFunction is defined in _autograd, below _attention, which uses it; this module only
gathers the names.
"""

from ._attention import attention
from ._autograd import AttentionFunction
from ._dropins import flash_attn_func, scaled_dot_product_attention

__all__ = ["AttentionFunction", "attention", "flash_attn_func", "scaled_dot_product_attention"]
