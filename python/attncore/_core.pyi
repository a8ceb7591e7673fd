# The extension module attncore._core is private: the package's modules are its only callers.
from typing import Any

def __getattr__(name: str) -> Any: ...
