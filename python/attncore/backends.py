"""Backends: attncore.SDPBackend, what the `backend=` keyword accepts, the sdpa_kernel context
manager (which backends automatic selection may choose on this thread) and explain()'s
answer (attncore.explain: each backend's verdict on a call)."""

import contextlib
import dataclasses
import enum
from typing import Optional

from . import _core
from ._rank4 import bool_option


class SDPBackend(enum.Enum):
    """attncore's backends, named as in the C++ library and the attncore program, declared in
    the library's default priority order. Where a function takes a backend, the strings
    "flash", "math" and "reference" work as well."""

    FLASH = "flash"  # fused tiled online softmax, SIMD (f32, bf16, f16)
    MATH = "math"  # scores materialised, GEMMs through OpenBLAS (torch's "math")
    REFERENCE = "reference"  # plain loops in fp64: obviously correct, slow
    FLASH_ATTENTION = "flash"  # torch's name for the fused kernel: the same member as FLASH


# torch 2.x's torch.nn.attention.SDPBackend: each member's (name, value) and attncore's backend
# for it; None where attncore has no such backend (CUDA-only kernels), so that naming it alone
# is NotImplementedError.
TORCH_SDP_BACKENDS = {
    ("MATH", 0): "math",
    ("FLASH_ATTENTION", 1): "flash",
    ("EFFICIENT_ATTENTION", 2): "flash",  # fused and memory-efficient: attncore's flash
    ("CUDNN_ATTENTION", 3): None,
    ("OVERRIDEABLE", 4): None,
}


def _torch_backend_name(op, backend):
    """attncore's name for a member of torch's SDPBackend (an object of a type named SDPBackend
    or _SDPBackend, not attncore's, with torch's name and value), None where attncore has no
    such backend, or False when `backend` is no such member."""
    if isinstance(backend, SDPBackend):
        return False
    kind = type(backend).__name__
    name, value = getattr(backend, "name", None), getattr(backend, "value", None)
    if kind not in ("SDPBackend", "_SDPBackend") or not isinstance(name, str):
        return False
    try:
        return TORCH_SDP_BACKENDS[(name, int(value))]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{op}: backend is not one torch's SDPBackend has (backend={name}, "
                         f"value={value!r}, expected one of "
                         f"{', '.join(f'{n}={v}' for n, v in TORCH_SDP_BACKENDS)})") from None


def backend_names(op, backends):
    """The library's names of backends (names, attncore's or torch's SDPBackend members), in
    order; torch's members for which attncore has no backend (CUDNN_ATTENTION, OVERRIDEABLE) are
    left out unless all are such, which is NotImplementedError."""
    names = []
    for backend in backends:
        mapped = _torch_backend_name(op, backend)
        if mapped is False:
            names.append(backend_name(op, backend))
        elif mapped is not None:
            names.append(mapped)
    if backends and not names:
        raise NotImplementedError(f"{op}: backend is not available (backend="
                                  f"{', '.join(str(b) for b in backends)}, expected one attncore "
                                  "runs on CPUs: MATH, FLASH_ATTENTION or EFFICIENT_ATTENTION)")
    return names


def backend_name(op, backend):
    """The library's name of a backend: "auto" for None or "auto", else "reference", "math" or
    "flash" for such a name, an attncore.SDPBackend or a member of torch 2.x's SDPBackend
    (EFFICIENT_ATTENTION and FLASH_ATTENTION -> "flash", MATH -> "math"; CUDNN_ATTENTION and
    OVERRIDEABLE, CUDA kernels: NotImplementedError). TypeError for other types, ValueError for
    other names; `op` names the call in the message."""
    if backend is None:
        return "auto"
    if isinstance(backend, SDPBackend):
        return backend.value
    if _torch_backend_name(op, backend) is not False:
        return backend_names(op, [backend])[0]
    expected = ("None, 'auto', 'reference', 'math', 'flash', an attncore.SDPBackend or a "
                "torch SDPBackend")
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend is not a backend name (type={type(backend).__name__}, "
                        f"expected {expected})")
    if backend == "auto" or backend in SDPBackend._value2member_map_:
        return backend
    raise ValueError(f"{op}: backend is invalid (backend={backend!r}, expected {expected})")


def enabled_backends():
    """The backends automatic selection may choose on this thread, in priority order."""
    return [SDPBackend(name) for name in _core.enabled_backends()]


@contextlib.contextmanager
def sdpa_kernel(backends, set_priority=False):
    """Within the block, calls on this thread that name no backend choose among `backends`
    only (an SDPBackend, torch's or attncore's, or a name, or a list of them; torch's CUDA-only
    members in a list are left out), like torch.nn.attention.sdpa_kernel: in
    the library's default priority order, or in the given order with set_priority=True. The
    previous list comes back on exit, exceptions included. Calls that name a backend run it
    regardless."""
    if isinstance(backends, (SDPBackend, str)) or _torch_backend_name("sdpa_kernel",
                                                                      backends) is not False:
        backends = [backends]
    try:
        # (bytes and mappings: iterable, but of ints and of keys, not of backends)
        if isinstance(backends, (bytes, bytearray, dict)):
            raise TypeError
        backends = list(backends)
    except TypeError:
        raise TypeError(f"sdpa_kernel: backends is not a backend or a list of them "
                        f"(type={type(backends).__name__}, expected an SDPBackend, a name or a "
                        "list of them)") from None
    set_priority = bool_option("sdpa_kernel", "set_priority", set_priority)
    names = list(dict.fromkeys(backend_names("sdpa_kernel", backends)))  # torch's two -> flash
    # (Refused here: the library's check would name its own call.)
    if "auto" in names:
        raise ValueError(f"sdpa_kernel: backends has an entry that is no backend (backend="
                         "auto, expected flash, math or reference: 'auto' is the choice among "
                         "those enabled)")
    if not names:
        raise ValueError(f"sdpa_kernel: backends has no backend to enable (backends="
                         f"{backends!r}, expected at least one of flash, math, reference)")
    if not set_priority:
        order = [b.value for b in SDPBackend]
        names = sorted(names, key=lambda n: order.index(n) if n in order else -1)
    previous = _core.set_enabled_backends(names)
    try:
        yield
    finally:
        _core.set_enabled_backends(previous)


@dataclasses.dataclass(frozen=True)
class BackendVerdict:
    """One backend's verdict on one call, as explain() reports it."""

    backend: SDPBackend
    enabled: bool  # in this thread's enabled list (sdpa_kernel)
    reasons: tuple  # why it cannot run the call, one sentence each; empty: it can
    estimated_seconds: Optional[float]  # the library's cost model; None where it has none

    @property
    def can_run(self):
        """Whether the backend can run the call (it has no reasons against it)."""
        return not self.reasons


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What automatic selection does with a call on this thread."""

    verdicts: tuple  # BackendVerdict of the enabled backends in priority order, then the rest
    chosen: Optional[SDPBackend]  # None when no backend can run the call
    summary: str  # the same, as text

    def __str__(self):
        return self.summary

    def __getitem__(self, backend):
        """The verdict of one backend (an SDPBackend or name)."""
        name = backend_name("Explanation", backend)
        for verdict in self.verdicts:
            if verdict.backend.value == name:
                return verdict
        raise KeyError(f"Explanation: backend has no verdict (backend={backend!r}, expected "
                       "'reference', 'math', 'flash' or an attncore.SDPBackend)")


def explanation_from_core(raw):
    """Explanation from _core.explain_forward / explain_backward's
    ([(name, enabled, reasons, estimated_seconds)], chosen name or None, summary; the module
    names sdpa_kernel where the library names its C++ scope)."""
    verdicts, chosen, summary = raw
    return Explanation(
        verdicts=tuple(BackendVerdict(SDPBackend(name), enabled, tuple(reasons),
                                      seconds if seconds >= 0 else None)
                       for name, enabled, reasons, seconds in verdicts),
        chosen=None if chosen is None else SDPBackend(chosen), summary=summary)
