"""Pick the graph backend for an adapter: vLLM's manager when it can be used, else torch."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from omnitrace.graphs.backends.base import GraphBackend
from omnitrace.graphs.backends.torch import TorchGraphBackend

__all__ = ["select_backend"]

logger = logging.getLogger(__name__)


def select_backend(vllm_config: Any = None, *, background_capture: bool = False) -> GraphBackend:
    """Return the vLLM backend when vLLM is importable and ``vllm_config`` is given.

    Otherwise return the pure-torch backend and log one line saying why. vLLM is imported
    only on the first branch, so choosing the torch backend never imports it.

    Args:
        vllm_config: the engine's ``VllmConfig``; default None (the torch backend).
        background_capture: the adapter prepares its graphs on a background thread
            (``encoder_cuda_graph_background_capture``); default False. Such an adapter must
            capture in CUDA's thread-local mode, which vLLM's manager does not offer (it
            captures in the global mode, where another thread's CUDA work breaks the
            capture), so it gets the torch backend, in vLLM too.

    Returns:
        The backend for one adapter.

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
    if background_capture:
        logger.info(
            "omnitrace: using the torch graph backend (background capture captures in CUDA's "
            "thread-local mode; vLLM's encoder graph manager captures in the global mode only)"
        )
        return TorchGraphBackend()
    from omnitrace.graphs.backends.vllm import VllmGraphBackend

    return VllmGraphBackend(vllm_config)
