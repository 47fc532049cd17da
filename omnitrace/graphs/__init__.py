"""Graph adapters: admission policy, pools and backends around an encoder forward; the names
load on first access, so the pure-Python admission policy is usable without torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnitrace._lazy import lazy_getattr

if TYPE_CHECKING:
    from omnitrace.graphs.adapter import EncoderCudaGraph
    from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend

__all__ = ["CapturedGraph", "EncoderCudaGraph", "GraphBackend"]

_MODULE_OF = {
    "CapturedGraph": "omnitrace.graphs.backends.base",
    "EncoderCudaGraph": "omnitrace.graphs.adapter",
    "GraphBackend": "omnitrace.graphs.backends.base",
}


__getattr__ = lazy_getattr(__name__, globals(), _MODULE_OF)
