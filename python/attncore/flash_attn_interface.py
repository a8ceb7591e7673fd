"""flash-attn 2.8.3's `flash_attn.flash_attn_interface`: its seven public functions with their
signatures and semantics, on CPU numpy arrays and torch tensors (differentiable, except
flash_attn_with_kvcache, which is forward only, as upstream). This module only gathers them;
each is defined once in the package (attncore._dropins, attncore._kvcache).

attncore.install_flash_attn_alias() makes `import flash_attn` and
`from flash_attn.flash_attn_interface import ...` resolve to this module.
"""

from ._dropins import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from ._kvcache import flash_attn_with_kvcache

# The flash-attn release whose API this module follows (signatures, return values, defaults).
FLASH_ATTN_VERSION = "2.8.3"

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
