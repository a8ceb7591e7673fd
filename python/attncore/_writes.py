"""Torch tensors the package writes in place (a KV cache appended to, a paged cache's pages): the
writes torch itself would refuse, and the version counters torch's own in-place ops move.
Numpy arrays and other objects pass through both untouched.

torch is never imported here: a tensor can only exist once its caller imported torch.
"""

from ._arrays import _torch


def check_written_tensor(op, name, x):
    """ValueError where torch refuses an in-place write that the package would make into torch
    tensor x (a KV cache appended to, a paged cache's pages): an inference tensor outside
    inference mode. Anything else: nothing."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and x.is_inference() and \
            not torch.is_inference_mode_enabled():
        raise ValueError(f"{op}: {name} is an inference tensor written outside inference mode "
                         "(is_inference=True, expected a normal tensor, or the call inside "
                         "torch.inference_mode()); torch refuses such in-place writes too")


def mark_written(*tensors):
    """Tells autograd that the package wrote these torch tensors in place, as torch's in-place
    ops do (their version counters, which their views share, move): a graph that saved one
    refuses its backward instead of computing it from the new values. Others: nothing."""
    torch = _torch()
    if torch is None:
        return
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and not x.is_inference():
            # (An inference tensor has no version counter.) transpose_(0, 0): an in-place op
            # that changes nothing but the counter. Torch 1.13, two caches, in a loop with an
            # append: 29.5 us per step against 46.9 with a zero_ of an empty view of each
            # (views made and freed, torch._foreach_zero_ over them). Under no_grad where the
            # tensor requires grad: an in-place op on it refuses under grad mode.
            if x.requires_grad:
                with torch.no_grad():
                    x.transpose_(0, 0)
            else:
                x.transpose_(0, 0)
