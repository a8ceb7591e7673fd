"""Backend names: attncore.SDPBackend and what the `backend=` keyword accepts."""

import enum


class SDPBackend(enum.Enum):
    """attncore's backends, named as in the C++ library and the attncore program. Where a
    function takes a backend, the strings "reference", "math" and "flash" work as well."""

    REFERENCE = "reference"  # plain loops in fp64: obviously correct, slow
    MATH = "math"  # scores materialised, GEMMs through OpenBLAS (torch's "math")
    FLASH = "flash"  # fused tiled online softmax, SIMD (f32, bf16, f16)
    FLASH_ATTENTION = "flash"  # torch's name for the fused kernel: the same member as FLASH


def backend_name(backend):
    """The library's name of a backend: "auto" for None or "auto", else "reference", "math" or
    "flash" for such a name or an SDPBackend."""
    if backend is None:
        return "auto"
    if isinstance(backend, SDPBackend):
        return backend.value
    if isinstance(backend, str) and (backend == "auto" or backend in SDPBackend._value2member_map_):
        return backend
    raise ValueError(f"backend is invalid (backend={backend!r}, expected None, 'auto', "
                     "'reference', 'math', 'flash' or an attncore.SDPBackend)")
