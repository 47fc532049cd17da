"""Pick the graph backend for an adapter: vLLM's manager when it can be used, else torch."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from omnitrace.graphs.backends.base import GraphBackend
from omnitrace.graphs.backends.torch import TorchGraphBackend

__all__ = ["select_backend"]

logger = logging.getLogger(__name__)


def select_backend(vllm_config: Any = None) -> GraphBackend:
    """Return the vLLM backend when vLLM is importable and ``vllm_config`` is given.

    Otherwise return the pure-torch backend and log one line saying why. vLLM is imported
    only on the first branch, so choosing the torch backend never imports it.

    Raises:
        UnsupportedVllmError: vLLM is importable and a config was given, but the installed
            vLLM's encoder graph API is not supported (the message names the version).
    """
    if vllm_config is None:
        logger.info("omnitrace: using the torch graph backend (no vllm_config was given)")
        return TorchGraphBackend()
    if importlib.util.find_spec("vllm") is None:
        logger.info("omnitrace: using the torch graph backend (vLLM is not importable)")
        return TorchGraphBackend()
    from omnitrace.graphs.backends.vllm import VllmGraphBackend

    return VllmGraphBackend(vllm_config)
