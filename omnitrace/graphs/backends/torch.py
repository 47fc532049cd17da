"""Pure-PyTorch graph backend on ``torch.cuda.CUDAGraph``."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from omnitrace._validate import check_int
from omnitrace.graphs.backends.base import (
    CaptureRequest,
    OutputLayout,
    StaticBuffers,
    capture_ordering,
    flatten_outputs,
    static_copies,
    warm_up,
)

__all__ = [
    "CudaDeviceQuestions",
    "CudaEventClock",
    "TorchCudaGraph",
    "TorchGraphBackend",
    "allocated_total",
    "expandable_segments",
]

logger = logging.getLogger(__name__)

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


class TorchCudaGraph(StaticBuffers):
    """A captured ``torch.cuda.CUDAGraph`` with static inputs and outputs.

    The static buffers live outside the graph pool, so the pool only holds transient
    capture allocations that later captures into a shared pool can reuse.
    """

    __slots__ = ("_device_index", "_launch")

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        static_inputs: list[torch.Tensor | None],
        static_outputs: list[torch.Tensor],
        spec: Any,
        device_index: int,
        bytes_reserved: int,
    ) -> None:
        super().__init__(static_inputs, static_outputs, spec, bytes_reserved)
        # The graph's bound replay (which keeps the graph alive): one lookup less per hit.
        self._launch = graph.replay
        self._device_index = device_index

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        # The raw query: CUDA is initialised (this graph was captured), and this runs per hit.
        if _current_device() != self._device_index:
            with torch.cuda.device(self._device_index):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        self.copy_in(inputs)
        self._launch()
        # Clones keep a caller's tensors valid after the next replay overwrites the buffers.
        return self.clone_out()


def allocated_total(device: torch.device) -> int:
    """Bytes the caching allocator has taken from ``device`` so far, in all.

    A counter that only grows (``reserved_bytes.all.allocated``): its growth across a
    capture is the memory the capture took from the device, whatever the allocator freed
    meanwhile, so no capture has to empty the allocator's cache to be measured. Without that
    statistic (another allocator backend), the bytes reserved now.

    Args:
        device: the CUDA device.
    """
    total = torch.cuda.memory_stats(device).get("reserved_bytes.all.allocated")
    if total is None:
        return int(torch.cuda.memory_reserved(device))
    return int(total)


def _configured_settings() -> list[tuple[str, str]]:
    """The process's allocator settings (``PYTORCH_ALLOC_CONF``, else the older
    ``PYTORCH_CUDA_ALLOC_CONF``): each item as written, and its key in lower case."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    items = [item.strip() for item in conf.split(",") if item.strip()]
    return [(item, item.split(":", 1)[0].strip().lower()) for item in items]


def _allocator_setter() -> Callable[[str], None] | None:
    """PyTorch's setter of allocator settings at run time; None where it has none."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # before PyTorch 2.9
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    return setter


#: Settings never given again around a capture: the switch itself, and the allocator
#: backend, which PyTorch fixes at start-up (a setter may refuse to be told it again).
_SWITCHED = frozenset({"expandable_segments", "backend"})


@contextlib.contextmanager
def expandable_segments(on: bool) -> Iterator[None]:
    """Let the caching allocator create expandable segments in the block, then fixed ones
    again: a capture's pool becomes one growing range of mapped pages, so a larger capture
    in it reuses blocks that smaller ones freed, where fixed segments sized for smaller
    tensors cannot serve it.

    Nothing changes where ``on`` is false, where the process configured expandable
    segments itself (left as they are), with another allocator backend, or on a build
    without PyTorch's CUDA caching allocator. The process's other settings are given
    again with each switch, since some PyTorch versions reset the settings a call leaves
    out. A setter that raises is logged as a warning and the capture goes on in fixed
    segments. Callers hold the capture lock, so blocks never nest.

    Args:
        on: switch them on for the block.
    """
    settings = _configured_settings()
    configured = any(
        key == "expandable_segments" and item.split(":", 1)[-1].strip().lower() == "true"
        for item, key in settings
    )
    setter = _allocator_setter() if on and not configured else None
    if setter is None or not _native_allocator():
        yield
        return
    kept = [item for item, key in settings if key not in _SWITCHED]
    switched = _switch(setter, [*kept, "expandable_segments:True"], "on for a capture")
    try:
        yield
    finally:
        if switched:
            _switch(setter, [*kept, "expandable_segments:False"], "off")


def _native_allocator() -> bool:
    """Whether PyTorch's own caching allocator serves CUDA memory (False on a build
    without one, such as a CPU build, which cannot say)."""
    try:
        return bool(torch.cuda.memory.get_allocator_backend() == "native")
    except (AttributeError, RuntimeError):
        return False


def _switch(setter: Callable[[str], None], settings: list[str], what: str) -> bool:
    """Give ``settings`` to the allocator; an allocator that refuses is a logged warning
    (the capture goes on as before), never a failed capture."""
    try:
        setter(",".join(settings))
    except Exception as exc:
        logger.warning("omnitrace: expandable segments not switched %s: %s", what, exc)
        return False
    return True


@contextlib.contextmanager
def _quiet_capture(
    graph: torch.cuda.CUDAGraph, *, pool: Any, stream: Any, capture_error_mode: str
) -> Iterator[None]:
    """``torch.cuda.graph`` without its device synchronisation and its emptying of the
    device and pinned-host allocators' caches."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            yield
        finally:
            graph.capture_end()


class CudaEventClock:
    """CUDA events as device-time markers, recorded on the current stream, reused."""

    __slots__ = ("_device", "_free", "_index")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._free: deque[torch.cuda.Event] = deque()

    def mark(self) -> torch.cuda.Event:
        try:
            event = self._free.pop()
        except IndexError:
            with torch.cuda.device(self._index):
                event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        if torch.cuda.current_device() != self._index:
            event.record(torch.cuda.current_stream(self._index))
        else:
            event.record()
        return event

    def passed(self, marker: torch.cuda.Event) -> bool:
        return bool(marker.query())  # type: ignore[no-untyped-call]

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def release(self, marker: torch.cuda.Event) -> None:
        self._free.append(marker)


class CudaDeviceQuestions:
    """The device questions of a :class:`~omnitrace.graphs.backends.base.GraphBackend`,
    answered by ``torch.cuda``.

    Shared by the backends that capture CUDA graphs (this module's and the vLLM one).
    """

    def is_graph_device(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def is_capturing(self, device: torch.device) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def stream_id(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 0  # not a graph device: no stream to tell apart, and no CUDA to ask
        # The raw-pointer query skips building a Stream object: this runs on every call.
        if _raw_stream is not None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return int(_raw_stream(index))
        return int(torch.cuda.current_stream(device).cuda_stream)

    def device_free_bytes(self, device: torch.device) -> int:
        return int(torch.cuda.mem_get_info(device)[0])

    def device_cached_bytes(self, device: torch.device) -> int:
        """Bytes the caching allocator holds on ``device`` without a tensor in them.

        Read for a memory deferral only: the statistics are a dictionary built per call.

        Args:
            device: the CUDA device.
        """
        stats = torch.cuda.memory_stats(device)
        reserved = stats.get("reserved_bytes.all.current", 0)
        return max(0, int(reserved) - int(stats.get("allocated_bytes.all.current", 0)))

    def device_allocated_bytes(self, device: torch.device) -> tuple[int, int]:
        """The caching allocator's allocated bytes on ``device``: now, and the peak since
        the process started or its peak statistics were last reset (never by omnitrace).

        Read around the eager calls of a key that has no graph yet, to bound what its
        capture will allocate: the statistics are a dictionary built per call.

        Args:
            device: the CUDA device.
        """
        stats = torch.cuda.memory_stats(device)
        return (
            int(stats.get("allocated_bytes.all.current", 0)),
            int(stats.get("allocated_bytes.all.peak", 0)),
        )

    def new_pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_capture_stream(self, device: torch.device) -> tuple[Any, int]:
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return stream, int(stream.cuda_stream)

    def device_clock(self, device: torch.device) -> CudaEventClock:
        return CudaEventClock(device)


class TorchGraphBackend(CudaDeviceQuestions):
    """Capture with ``torch.cuda.graph`` on a side stream into a given pool.

    Args:
        warmup_iters: eager runs before capture, as PyTorch documents (lazy initialisation
            and autotuning stay out of the graph). They run on the replay stream, never on
            the capture stream: see :mod:`omnitrace.graphs.backends.base` for why.
    """

    name = "torch"
    error_modes: tuple[str, ...] = ("thread_local", "global")
    simulated = False

    def __init__(self, *, warmup_iters: int = 1) -> None:
        self.warmup_iters = check_int("warmup_iters", warmup_iters)

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        return warm_up(forward, inputs, self.warmup_iters)

    def capture(self, request: CaptureRequest) -> TorchCudaGraph:
        with torch.cuda.device(request.device):
            return self._capture(request)

    def _capture(self, request: CaptureRequest) -> TorchCudaGraph:
        forward, device, pool = request.forward, request.device, request.pool
        capture_stream = request.capture_stream
        replay_stream = torch.cuda.current_stream(device)
        static_inputs = static_copies(request.inputs)
        # Warm up on the replay stream, where eager calls of this encoder already run,
        # unless a background preparation did already (on a side stream).
        layout = request.layout
        if layout is None:
            layout = self.warm_up(forward, static_inputs)
        static_outputs = layout.empty(device)

        if not request.quiet:
            torch.cuda.synchronize(device)
        # The caches stay: emptying them would make an engine's next steps allocate afresh.
        allocated_before = allocated_total(device)
        graph = torch.cuda.CUDAGraph()
        original: BaseException | None = None
        try:
            with (
                capture_ordering(replay_stream, capture_stream, torch.cuda.stream),
                expandable_segments(request.expandable),
                _quiet_capture(
                    graph,
                    pool=pool,
                    stream=capture_stream,
                    capture_error_mode=request.capture_error_mode,
                ),
            ):
                try:
                    out = forward(*static_inputs)
                    out_leaves, _ = flatten_outputs(out)
                    layout.check(out_leaves)
                    for dst, src in zip(static_outputs, out_leaves, strict=True):
                        dst.copy_(src)
                    del out, out_leaves
                except BaseException as exc:
                    original = exc
                    raise
        except BaseException:
            if original is not None:
                # Leaving torch.cuda.graph may raise its own error about the invalidated
                # capture; the caller must see the encoder's original exception.
                raise original from None
            raise
        bytes_reserved = max(0, allocated_total(device) - allocated_before)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return TorchCudaGraph(
            graph, static_inputs, static_outputs, layout.spec, index, bytes_reserved
        )
