# Type stubs of attncore.bert_padding (flash-attn 2.8.3's padding helpers, in plain torch).
from typing import List, Optional, Tuple

import torch

__all__ = [
    "index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"
]

def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor: ...
def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor: ...
def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor,
    unused_mask: Optional[torch.Tensor] = ...,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]: ...
def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor: ...
