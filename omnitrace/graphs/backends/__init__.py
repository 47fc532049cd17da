"""Graph backends: pure torch (default), simulated (tests), vLLM's manager (optional)."""

from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend
from omnitrace.graphs.backends.torch import TorchGraphBackend

__all__ = ["CapturedGraph", "GraphBackend", "TorchGraphBackend"]
