"""Graph adapters: admission policy, pools and backends around an encoder forward."""

from omnitrace.graphs.adapter import EncoderCudaGraph
from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend

__all__ = ["CapturedGraph", "EncoderCudaGraph", "GraphBackend"]
