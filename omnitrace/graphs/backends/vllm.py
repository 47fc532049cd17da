"""Graph backend on vLLM's ``EncoderCudaGraphManager``: one manager per exact input shape,
capturing on the adapter's own stream and pool, with vLLM's counters merged into the stats
(docs/vllm.md, "Backends and statistics", says why)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnitrace.config import ConfigError
from omnitrace.events import MissReason
from omnitrace.graphs.backends.base import (
    CaptureRequest,
    OutputLayout,
    capture_ordering,
    static_copies,
    warm_up,
)
from omnitrace.graphs.backends.torch import (
    CudaDeviceQuestions,
    allocated_total,
    expandable_segments,
)
from omnitrace.graphs.backends.vllm_protocol import (
    ExactShapeEncoder,
    UnsupportedVllmError,
    VllmApi,
    caches_kept,
    captured_budget_graph,
    copy_vllm_config,
    default_capture_stream,
    detect_vllm_api,
    load_vllm_api,
)
from omnitrace.stats import STATS_KEYS

__all__ = [
    "ExactShapeEncoder",
    "ManagerStats",
    "UnsupportedVllmError",
    "VllmApi",
    "VllmCapturedGraph",
    "VllmGraphBackend",
    "captured_budget_graph",
    "copy_vllm_config",
    "default_capture_stream",
    "detect_vllm_api",
    "load_vllm_api",
]

_current_device: Any = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """vLLM's own counters, summed over the managers of one backend."""

    managers: int
    graph_hits: int
    graph_misses: int
    num_budgets: int


class VllmCapturedGraph:
    """One key's manager, with its exact-shape model, replayed through the manager's graph.

    ``manager.execute()`` is generic: it sorts and packs several items into padded budgets,
    selects and slices inputs, and post-processes a list, tens of microseconds of Python per
    call that an exact-shape key never needs. A hit therefore replays the graph the manager
    captured directly: the inputs go into the manager's own input buffers (the static
    buffers this backend gave it), its graph replays, its output buffer is cloned through the
    model's unpacking, and the hit is counted in the manager's own ``graph_hits``, as
    ``execute()`` would count it. When a vLLM release lays its captured graphs out otherwise,
    replays go through ``execute()``.
    """

    __slots__ = (
        "_buffers",
        "_device_index",
        "_meta",
        "_unpack",
        "bytes_reserved",
        "manager",
        "static_bytes",
    )

    def __init__(
        self,
        manager: Any,
        model: ExactShapeEncoder,
        device_index: int | None,
        bytes_reserved: int,
        static_bytes: int,
    ) -> None:
        self.manager = manager
        # The model's output unpacking, bound once: one lookup less per hit.
        self._unpack = model.unpack
        self._device_index = device_index
        self.bytes_reserved = bytes_reserved
        self.static_bytes = static_bytes
        self._meta = captured_budget_graph(manager)
        # (input position, the manager's buffer for it), for the direct replay.
        self._buffers: tuple[tuple[int, torch.Tensor], ...] = ()
        if self._meta is not None:
            buffers = self._meta.input_buffers
            self._buffers = tuple(
                (int(name.removeprefix("input_")), buffers[name]) for name in model.input_names
            )

    @property
    def direct(self) -> bool:
        """Whether hits replay the manager's graph directly (else through ``execute()``)."""
        return self._meta is not None

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        index = self._device_index
        if index is not None and _current_device() != index:
            with torch.cuda.device(index):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        meta = self._meta
        if meta is None:
            mm_kwargs = {f"input_{i}": x for i, x in enumerate(inputs) if x is not None}
            return self.manager.execute(mm_kwargs)[0]
        for position, buffer in self._buffers:
            buffer.copy_(inputs[position])  # type: ignore[arg-type]
        meta.graph.replay()
        self.manager.graph_hits += 1
        # The output buffer is overwritten by the next replay; callers keep embeddings.
        return self._unpack(meta.output_buffer.clone())


class VllmGraphBackend(CudaDeviceQuestions):
    """Capture and replay through vLLM's ``EncoderCudaGraphManager``, one per exact key.

    Args:
        vllm_config: the engine's ``VllmConfig``; each manager gets a modified copy.
        api: the vLLM API to use (detected from the installed vLLM when omitted).

    Raises:
        UnsupportedVllmError: vLLM is missing or its encoder graph API is not supported.
    """

    name = "vllm"
    error_modes: tuple[str, ...] = ("global",)
    simulated = False

    def __init__(self, vllm_config: Any, *, api: VllmApi | None = None) -> None:
        if vllm_config is None:
            raise TypeError("VllmGraphBackend needs a vllm_config (the engine's VllmConfig)")
        self.api = api if api is not None else load_vllm_api()
        self.vllm_config = vllm_config
        self._graphs: list[VllmCapturedGraph] = []
        self._lock = threading.Lock()

    @property
    def vllm_version(self) -> str:
        return self.api.version

    # -- hooks a CPU test double overrides --------------------------------------------------

    def _device_scope(self, device: torch.device) -> Any:
        return torch.cuda.device(device)

    def _current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def _stream_scope(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _allocated(self, device: torch.device) -> int:
        """Bytes the allocator has taken from the device so far, in all."""
        return allocated_total(device)

    def _device_index(self, device: torch.device) -> int | None:
        return device.index if device.index is not None else torch.cuda.current_device()

    # -- GraphBackend: capture ---------------------------------------------------------------

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        # Capture runs the forward itself, in the manager's mode; this only serves the
        # protocol: adapters refuse background preparation for this backend.
        return warm_up(forward, inputs)

    def capture(self, request: CaptureRequest) -> VllmCapturedGraph:
        if request.capture_error_mode != "global":
            # vLLM's manager opens torch.cuda.graph itself, always in the global mode.
            raise ConfigError(
                f"capture_error_mode: vLLM's encoder graph manager captures in the 'global' "
                f"mode only, got {request.capture_error_mode!r}"
            )
        forward, inputs, device = request.forward, request.inputs, request.device
        pool, capture_stream = request.pool, request.capture_stream
        with self._device_scope(device):
            replay_stream = self._current_stream(device)
            static_inputs = static_copies(inputs)
            # One run of the forward on the replay stream at the static inputs, in inference
            # mode as the manager's capture: code torch.compile built inside the forward
            # (vLLM's custom ops compile their native forwards) guards on inference tensors,
            # and its recompile and autotuning would run inside the capture, where their
            # device synchronisation invalidates it. Its output sizes the manager's model,
            # and the manager's own warm-up runs nothing (warmed).
            with torch.inference_mode():
                layout = warm_up(forward, static_inputs)
            model = ExactShapeEncoder(
                self.api,
                forward,
                static_inputs,
                layout.spec,
                layout.leaves,
                warmup_scope=lambda: self._stream_scope(replay_stream),
                capturing=self._capturing,
                warmed=True,
            )
            dtype = _encoder_dtype(static_inputs, layout.leaves)
            manager = self.api.manager_cls(
                copy_vllm_config(self.vllm_config, model.token_budget), device, dtype, model
            )
            allocated_before = self._allocated(device)
            with (
                capture_ordering(replay_stream, capture_stream, self._stream_scope),
                default_capture_stream(capture_stream),
                caches_kept(),
                expandable_segments(request.expandable),
            ):
                manager.capture(pool)
            grown = self._allocated(device) - allocated_before
        static_bytes = sum(t.nbytes for t in static_inputs if t is not None) + model.output_bytes
        graph = VllmCapturedGraph(
            manager, model, self._device_index(device), max(0, grown), static_bytes
        )
        with self._lock:
            self._graphs.append(graph)
        return graph

    # -- statistics ---------------------------------------------------------------------------

    def manager_stats(self) -> ManagerStats:
        """Sum vLLM's own counters over every manager this backend built."""
        with self._lock:
            graphs = list(self._graphs)
        hits = misses = budgets = 0
        for graph in graphs:
            stats = graph.manager.get_cumulative_stats()
            hits += int(stats.get("graph_hits", 0))
            misses += int(stats.get("graph_misses", 0))
            budgets += int(stats.get("num_budgets", 0))
        return ManagerStats(len(graphs), hits, misses, budgets)

    def merged_stats(self, adapter_stats: Mapping[str, int | float]) -> dict[str, int | float]:
        """Merge vLLM's counters with the calls the adapter rejected before any manager.

        ``adapter_stats`` is the adapter's ``get_cumulative_stats()``. Hits and graph count
        come from vLLM's managers; misses are the adapter's (ineligible, capacity, warm-up
        and memory calls never reach a manager) plus any miss a manager counted itself (none,
        in exact-shape use). The result has the keys of ``get_cumulative_stats()`` and, when
        the backend and adapter agree, equals it.
        """
        manager = self.manager_stats()
        pre_manager = {
            key: int(adapter_stats[key]) for key in (reason.stats_key for reason in MissReason)
        }
        misses = sum(pre_manager.values()) + manager.graph_misses
        calls = manager.graph_hits + misses
        merged: dict[str, int | float] = {
            "graph_hits": manager.graph_hits,
            "graph_misses": misses,
            "hit_rate": manager.graph_hits / calls if calls else 0.0,
            "num_graphs": manager.managers,
            **pre_manager,
            "capture_failures": int(adapter_stats["capture_failures"]),
        }
        return {key: merged[key] for key in STATS_KEYS}


def _encoder_dtype(
    inputs: Sequence[torch.Tensor | None], outputs: Sequence[tuple[torch.Size, torch.dtype]]
) -> torch.dtype:
    # The manager uses its dtype for dummy inputs and data-parallel gather buffers, neither
    # of which exact-shape use needs; pass the encoder's floating dtype for consistency.
    for _, dtype in outputs:
        if dtype.is_floating_point:
            return dtype
    for x in inputs:
        if x is not None and x.dtype.is_floating_point:
            return x.dtype
    return torch.get_default_dtype()
