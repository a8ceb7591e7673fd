"""attncore: exact scaled-dot-product attention on CPUs, for numpy arrays and torch tensors.

    scaled_dot_product_attention  torch.nn.functional's, as a drop-in (nested tensors too)
    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
    flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func
                                  flash_attn's, as drop-ins (packed inputs read in place)
    attention, attention_backward attncore's own, with every option; the backward for numpy
    attention_varlen, attention_varlen_backward
                                  the same for variable-length batches packed along the rows
    attncore.torch                the same functions with torch autograd (AttentionFunction)
    manual_seed, get_rng_state, set_rng_state   attncore's dropout generator (numpy calls;
                                  calls on torch tensors draw from torch's)
    set_num_threads, get_num_threads   the process-wide thread count of calls
    SDPBackend                    backend names for the backend= keyword
    sdpa_kernel, enabled_backends the backends automatic selection may choose, per thread
    explain                       each backend's verdict on a call, and the choice
    flash_attn_with_kvcache       flash_attn's attention over a KV cache (appends in place)
    attncore.flash_attn_interface flash-attn 2.8.3's seven functions as one module;
    install_flash_attn_alias      `import flash_attn` (and .flash_attn_interface, .bert_padding)
                                  served by attncore in this process
    merge_attention_states        two results over disjoint key sets merged into one
    PagedKVCache                  a paged KV cache owning its pages (fork, copy-on-write)

Invalid arguments raise ValueError, arguments of the wrong Python type TypeError, and
unsupported combinations and devices NotImplementedError, all in the C++ library's message form
(`<op>: <what> <problem> (<name>=<value>, expected <constraint>)`). Ctrl-C during a call made
on the main thread is seen within about 20 ms and stops the call at its next work item or
flash key tile, raising KeyboardInterrupt; `Cancelled` (a
RuntimeError) is the error of a call stopped through the C++ library's cancel flag.
"""

import importlib as _importlib

from . import _core, flash_attn_interface
from ._core import Cancelled
from ._alias import install_flash_attn_alias
from ._attention import (attention, attention_backward, attention_varlen,
                         attention_varlen_backward, explain)
from ._dropins import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, scaled_dot_product_attention)
from ._kvcache import flash_attn_with_kvcache
from ._merge import merge_attention_states
from ._paged import PagedKVCache
from ._random import get_rng_state, manual_seed, set_rng_state
from ._threads import get_num_threads, set_num_threads
from .backends import BackendVerdict, Explanation, SDPBackend, enabled_backends, sdpa_kernel

__version__ = _core.version()

__all__ = [
    "BackendVerdict", "Cancelled", "Explanation", "PagedKVCache", "SDPBackend", "attention",
    "attention_backward",
    "attention_varlen", "attention_varlen_backward", "enabled_backends", "explain",
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "get_num_threads",
    "get_rng_state", "install_flash_attn_alias", "manual_seed", "merge_attention_states", "scaled_dot_product_attention",
    "sdpa_kernel", "set_num_threads", "set_rng_state",
]


Cancelled.__doc__ = ("A call whose cancel flag was set stopped before it finished; its outputs "
                     "are incomplete. (Ctrl-C raises KeyboardInterrupt instead.)")

# help() and reprs name the package, not the private module that defines a function or class.
for _name in __all__:
    _object = globals()[_name]
    if getattr(_object, "__module__", "").startswith(__name__ + "._"):
        _object.__module__ = __name__
del _name, _object

def __getattr__(name):
    # attncore.torch, the submodule, on first use as an attribute (importing it needs torch).
    # Once imported it is bound here as `torch`, so this file never names the torch library so.
    if name == "torch":
        return _importlib.import_module(".torch", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
