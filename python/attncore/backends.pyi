# Type stubs of attncore.backends: backend names, sdpa_kernel and explain()'s answer.
import enum
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import Any, Iterable, List, Optional, Tuple, Union

_BackendName = Union[str, "SDPBackend"]

class SDPBackend(enum.Enum):
    FLASH: str
    MATH: str
    REFERENCE: str
    FLASH_ATTENTION: str

TORCH_SDP_BACKENDS: dict[Tuple[str, int], Optional[str]]

def backend_name(op: str, backend: Any) -> str: ...
def backend_names(op: str, backends: Iterable[Any]) -> List[str]: ...
def enabled_backends() -> List[SDPBackend]: ...
def sdpa_kernel(backends: Union[_BackendName, Iterable[_BackendName]],
                set_priority: bool = ...) -> AbstractContextManager[None]: ...

@dataclass(frozen=True)
class BackendVerdict:
    backend: SDPBackend
    enabled: bool
    reasons: Tuple[str, ...]
    estimated_seconds: Optional[float]
    @property
    def can_run(self) -> bool: ...

@dataclass(frozen=True)
class Explanation:
    verdicts: Tuple[BackendVerdict, ...]
    chosen: Optional[SDPBackend]
    summary: str
    def __getitem__(self, backend: _BackendName) -> BackendVerdict: ...

def explanation_from_core(raw: Any) -> Explanation: ...
