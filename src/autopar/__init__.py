"""autopar: plan and run parallel training of large PyTorch models.

The public names load on first use (PEP 562), so that ``import autopar`` and the command line start without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CaptureError": "autopar.capture",
    "Graph": "autopar.capture",
    "trace": "autopar.capture",
    "ModelConfig": "autopar.zoo",
    "load": "autopar.zoo",
    "parallelize": "autopar.runtime.apply",
    "ParallelModel": "autopar.runtime.apply",
}

__all__ = ["CaptureError", "Graph", "ModelConfig", "ParallelModel", "__version__", "load", "parallelize", "trace"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
