"""Before vLLM serves: graphs prepared for an earlier run's shapes, and compiling stopped
where a compile would stall a request (``encoder_cuda_graph_prepare_from``, ``compile``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from omnitrace.events import Phase

if TYPE_CHECKING:
    from omnitrace.graphs.adapter import EncoderCudaGraph

__all__ = ["WARM_UP_METHOD", "hook_warm_up", "in_phase", "prepare_before_serving"]

logger = logging.getLogger(__name__)

#: vLLM's workers (0.26 and 0.33): their warm-up runs once the KV cache is allocated, last
#: before the engine serves. The CPU worker overrides the GPU worker's.
_WORKERS = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))
WARM_UP_METHOD = "compile_or_warm_up_model"
_PATCHED = "_omnitrace_patched"
_lock = threading.Lock()


@contextlib.contextmanager
def in_phase(adapters: Iterable[EncoderCudaGraph], phase: Phase) -> Iterator[None]:
    """Put ``adapters`` in ``phase`` inside the block, then restore their phases, even when
    the block raises (vLLM's profiling run, and the preparation before serving)."""
    saved = [(adapter, adapter.phase) for adapter in adapters]
    for adapter, _ in saved:
        adapter.set_phase(phase)
    try:
        yield
    finally:
        for adapter, before in saved:
            adapter.set_phase(before)


def prepare_before_serving(adapters: list[EncoderCudaGraph], device: Any) -> None:
    """Prepare the adapters' recorded shapes on ``device``, then stop their compiling.

    In the startup phase and inference mode, as the engine's calls will run. A capture that
    fails raises (vLLM's start-up fails with it, rather than the first request).
    """
    import torch

    from omnitrace.graphs.startup import prepare_adapters

    wanted = [adapter for adapter in adapters if adapter.config.prepare_from]
    if wanted and device is not None:
        with in_phase(wanted, Phase.STARTUP), torch.inference_mode():
            prepare_adapters(wanted, torch.device(device))
    elif wanted:
        logger.warning("omnitrace: the worker names no device; no graph is prepared")
    for adapter in adapters:
        if adapter.config.compile and not adapter.config.background_capture:
            adapter.stop_compiling()
            logger.info(
                "omnitrace: %r holds %d graphs before serving; shapes first seen while "
                "serving are captured without torch.compile, which would stall their "
                "requests (encoder_cuda_graph_prepare_from names the shapes to compile at "
                "start-up)",
                adapter.name,
                adapter.num_graphs,
            )


def _wrap(method: Callable[..., Any], adapters: Callable[[], list[EncoderCudaGraph]]) -> Any:
    @functools.wraps(method)
    def warm_up_then_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        prepare_before_serving(adapters(), getattr(self, "device", None))
        return result

    setattr(warm_up_then_prepare, _PATCHED, True)
    return warm_up_then_prepare


def hook_warm_up(adapters: Callable[[], list[EncoderCudaGraph]]) -> bool:
    """Wrap the warm-up of each of vLLM's worker classes already imported, once per process.

    Called after a model load (the loading worker's module is imported by then). Returns
    whether one was wrapped; where none is, the plugin logs it and nothing is prepared.
    """
    wrapped = False
    for module_name, class_name in _WORKERS:
        worker = getattr(sys.modules.get(module_name), class_name, None)
        if not isinstance(worker, type):
            continue
        with _lock:
            method = worker.__dict__.get(WARM_UP_METHOD)
            if not callable(method):
                continue
            if not getattr(method, _PATCHED, False):
                setattr(worker, WARM_UP_METHOD, _wrap(method, adapters))
        wrapped = True
    return wrapped
