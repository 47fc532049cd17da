"""Graph adapters: admission policy, pools and backends around an encoder forward.

The names below load on first access (PEP 562): the admission policy is pure Python, and
``omnitrace advise`` replays it without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnitrace.graphs.adapter import EncoderCudaGraph
    from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend

__all__ = ["CapturedGraph", "EncoderCudaGraph", "GraphBackend"]

_MODULE_OF = {
    "CapturedGraph": "omnitrace.graphs.backends.base",
    "EncoderCudaGraph": "omnitrace.graphs.adapter",
    "GraphBackend": "omnitrace.graphs.backends.base",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'omnitrace.graphs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
