"""Before vLLM serves: graphs prepared for an earlier run's shapes, and compiling stopped
where a compile would stall a request (``encoder_cuda_graph_prepare_from``, ``compile``)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
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
#: When this module was imported: a process's start where /proc cannot tell it.
_IMPORTED = time.monotonic()
#: What vLLM's start-up still does after its worker's warm-up, and how much later than the
#: API servers' clock a worker's process may have started: the preparation ends this long
#: (or 5 % of the timeout, if more) before vLLM's engine-ready timeout.
_MARGIN_S = 30.0


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


def prepare_before_serving(
    adapters: list[EncoderCudaGraph], device: Any, vllm_config: Any = None
) -> None:
    """Prepare the adapters' recorded shapes on ``device``, then stop their compiling.

    In the startup phase and inference mode, as the engine's calls will run. A capture that
    fails raises (vLLM's start-up fails with it, rather than the first request). Where
    several API servers wait for the engine (``--api-server-count``), each gives up after
    ``VLLM_ENGINE_READY_TIMEOUT_S`` from its start: the preparation stops in time, and the
    shapes left are captured while serving.

    Args:
        adapters: the process's adapters; those without ``prepare_from`` only stop compiling.
        device: the worker's device, None where it names none.
        vllm_config: the worker's ``VllmConfig``, None where it has none.
    """
    import torch

    from omnitrace.graphs.startup import prepare_adapters

    wanted = [adapter for adapter in adapters if adapter.config.prepare_from]
    if wanted and device is not None:
        timeout = _ready_timeout_s(vllm_config)
        seconds = None if timeout is None else _seconds_left(timeout)
        with in_phase(wanted, Phase.STARTUP), torch.inference_mode():
            outcomes = prepare_adapters(wanted, torch.device(device), seconds=seconds)
        if any("left: time" in counts for counts in outcomes.values()):
            logger.warning(
                "omnitrace: vLLM's API servers wait VLLM_ENGINE_READY_TIMEOUT_S=%d s for the "
                "engine to start; raise it to prepare every recorded shape before serving",
                timeout,
            )
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


def _ready_timeout_s(vllm_config: Any) -> int | None:
    """How long vLLM's API servers wait for the engine to start, in seconds; None where
    none waits with a timeout.

    One API server waits for the engine's start with no timeout and only then for its first
    message; with several, each waits ``VLLM_ENGINE_READY_TIMEOUT_S`` from its own start.
    A config that does not say how many API servers there are counts as several.
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    servers = getattr(parallel, "_api_process_count", None)
    if isinstance(servers, int) and servers <= 1:
        return None
    try:
        import vllm.envs

        timeout = getattr(vllm.envs, "VLLM_ENGINE_READY_TIMEOUT_S", None)
    except (ImportError, ValueError):  # vLLM's own start fails on a malformed value
        return None
    return timeout if isinstance(timeout, int) and not isinstance(timeout, bool) else None


def _seconds_left(timeout: int) -> float:
    """Seconds this process may still spend before the API servers' ``timeout`` runs out,
    counted from the process's start, less a margin (negative when none is left)."""
    age = _process_age_s()
    if age is None:
        age = time.monotonic() - _IMPORTED
    seconds = timeout - age - max(_MARGIN_S, 0.05 * timeout)
    logger.info(
        "omnitrace: preparing recorded shapes in the %.0f s left before vLLM's API servers "
        "stop waiting for the engine (VLLM_ENGINE_READY_TIMEOUT_S=%d s)",
        max(0.0, seconds),
        timeout,
    )
    return seconds


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), None where that is not known."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            # Fields after the command name's closing parenthesis; the start is field 22.
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as uptime:
            up = float(uptime.read().split()[0])
        return max(0.0, up - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _wrap(method: Callable[..., Any], adapters: Callable[[], list[EncoderCudaGraph]]) -> Any:
    @functools.wraps(method)
    def warm_up_then_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        prepare_before_serving(
            adapters(), getattr(self, "device", None), getattr(self, "vllm_config", None)
        )
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
