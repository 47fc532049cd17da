"""Pick the graph backend for an adapter: vLLM's manager when it can be used, else torch."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from omnitrace.config import ConfigError
from omnitrace.graphs.backends.base import GraphBackend
from omnitrace.graphs.backends.torch import TorchGraphBackend

__all__ = ["COMPILE_BESIDE_VLLM", "select_backend"]

#: Why a compile on a preparation thread is refused inside vLLM. While it traces, PyTorch's
#: FX tracer patches ``torch.nn.Module.__call__`` for the whole process; vLLM's custom ops
#: run ``torch.compile``'d methods, and one reached meanwhile from the engine's thread (an
#: eager encoder call, say) raises, which stops the engine. Seen on an H200 with vLLM 0.26 and
#: Qwen2.5-Omni's vision tower.
COMPILE_BESIDE_VLLM = (
    "encoder_cuda_graph_compile with encoder_cuda_graph_background_capture cannot run inside "
    "vLLM: a compile on the preparation thread patches torch.nn.Module calls process-wide "
    "while it traces, and vLLM's own torch.compile'd ops called meanwhile on the engine's "
    "thread raise 'Detected that you are using FX to symbolically trace a dynamo-optimized "
    "function', which stops the engine; keep one of the two (compile captures synchronously, "
    "background capture without compile prepares plain graphs)"
)

logger = logging.getLogger(__name__)


def select_backend(
    vllm_config: Any = None, *, background_capture: bool = False, compile: bool = False
) -> GraphBackend:
    """Return the vLLM backend when vLLM is importable, ``vllm_config`` is given and
    ``background_capture`` is off.

    Otherwise return the pure-torch backend and log one line saying why. vLLM is imported
    only on the first branch, so choosing the torch backend never imports it.

    Args:
        vllm_config: the engine's ``VllmConfig``; default None (the torch backend).
        background_capture: the adapter prepares its graphs on a background thread
            (``encoder_cuda_graph_background_capture``); default False. Such an adapter must
            capture in CUDA's thread-local mode, which vLLM's manager does not offer (it
            captures in the global mode, where another thread's CUDA work breaks the
            capture), so it gets the torch backend, in vLLM too.
        compile: the adapter captures ``torch.compile`` of its encoder
            (``encoder_cuda_graph_compile``); default False.

    Returns:
        The backend for one adapter.

    Raises:
        ConfigError: ``background_capture`` and ``compile`` together in vLLM (see
            :data:`COMPILE_BESIDE_VLLM`).
        UnsupportedVllmError: vLLM is importable and a config was given, but the installed
            vLLM's encoder graph API is not supported (the message names the version).
    """
    if vllm_config is None:
        logger.info("omnitrace: using the torch graph backend (no vllm_config was given)")
        return TorchGraphBackend()
    if importlib.util.find_spec("vllm") is None:
        logger.info("omnitrace: using the torch graph backend (vLLM is not importable)")
        return TorchGraphBackend()
    if background_capture and compile:
        raise ConfigError(COMPILE_BESIDE_VLLM)
    if background_capture:
        logger.info(
            "omnitrace: using the torch graph backend (background capture captures in CUDA's "
            "thread-local mode; vLLM's encoder graph manager captures in the global mode only)"
        )
        return TorchGraphBackend()
    from omnitrace.graphs.backends.vllm import VllmGraphBackend

    return VllmGraphBackend(vllm_config)
