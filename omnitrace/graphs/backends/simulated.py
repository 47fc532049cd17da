"""A graph backend that simulates a device on the CPU, for tests and the CPU demo: everything
around the graph is reproduced exactly, but "replay" runs the forward again."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from omnitrace._validate import check_int, check_number
from omnitrace.graphs.backends.base import (
    CaptureRequest,
    OutputLayout,
    StaticBuffers,
    flatten_outputs,
    static_copies,
    warm_up,
)
from omnitrace.graphs.timing import HostClock

__all__ = ["SimulatedGraph", "SimulatedGraphBackend"]

_stream_ids = itertools.count(1_000_001)


class SimulatedGraph(StaticBuffers):
    """Static buffers around a forward that is re-run on every replay."""

    __slots__ = ("_backend", "_forward")

    def __init__(
        self,
        backend: SimulatedGraphBackend,
        forward: Callable[..., Any],
        static_inputs: list[torch.Tensor | None],
        static_outputs: list[torch.Tensor],
        spec: Any,
        bytes_reserved: int,
    ) -> None:
        super().__init__(static_inputs, static_outputs, spec, bytes_reserved)
        self._backend = backend
        self._forward = forward

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> Any:
        self.copy_in(inputs)
        leaves, _ = flatten_outputs(self._forward(*self._static_inputs))
        for dst, src in zip(self._static_outputs, leaves, strict=True):
            dst.copy_(src)
        self._backend.replays += 1
        return self.clone_out()


class SimulatedGraphBackend:
    """Simulate a CUDA device on CPU tensors (tests and the CPU demo only).

    Args:
        free_bytes: device-free memory reported to the memory floor check; a settable
            attribute, and every capture consumes ``graph_bytes`` of it.
        graph_bytes: memory each capture takes from ``free_bytes``.
        fail_on_capture: make captures raise: ``True`` raises a ``RuntimeError``, an
            exception instance or class raises that.
        capture_delay: seconds each capture takes (a slow compile and capture), for tests
            of what calls do meanwhile.

    The current stream and the capturing state are per thread, as CUDA's are.
    """

    name = "simulated"
    error_modes: tuple[str, ...] = ("thread_local", "global")
    simulated = True

    def __init__(
        self,
        *,
        free_bytes: int = 80 << 30,
        graph_bytes: int = 64 << 20,
        fail_on_capture: bool | BaseException | type[BaseException] = False,
        capture_delay: float = 0.0,
        warmup_delay: float = 0.0,
    ) -> None:
        self.free_bytes = check_int("free_bytes", free_bytes)
        self.graph_bytes = check_int("graph_bytes", graph_bytes)
        self.fail_on_capture = fail_on_capture
        self.capture_delay = check_number("capture_delay", capture_delay, positive=False)
        self.warmup_delay = check_number("warmup_delay", warmup_delay, positive=False)
        self.captures = 0
        self.replays = 0
        self.pools_created = 0
        self.capture_streams_created = 0
        self.capture_modes: list[str] = []
        """``capture_error_mode`` of every capture, in order."""
        self._local = threading.local()

    # -- knobs for tests -------------------------------------------------------------------

    @contextlib.contextmanager
    def stream(self, stream_id: int) -> Iterator[None]:
        """Make ``stream_id`` the current (replay) stream inside the block."""
        previous = getattr(self._local, "stream", 0)
        self._local.stream = stream_id
        try:
            yield
        finally:
            self._local.stream = previous

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Pretend the current stream is capturing a graph inside the block."""
        previous = getattr(self._local, "capturing", False)
        self._local.capturing = True
        try:
            yield
        finally:
            self._local.capturing = previous

    # -- GraphBackend ----------------------------------------------------------------------

    def is_graph_device(self, device: torch.device) -> bool:
        return True

    def is_capturing(self, device: torch.device) -> bool:
        return bool(getattr(self._local, "capturing", False))

    def stream_id(self, device: torch.device) -> int:
        return int(getattr(self._local, "stream", 0))

    def device_clock(self, device: torch.device) -> HostClock:
        return HostClock()

    def device_free_bytes(self, device: torch.device) -> int:
        return self.free_bytes

    def new_pool(self, device: torch.device) -> Any:
        self.pools_created += 1
        return ("simulated-pool", self.pools_created)

    def new_capture_stream(self, device: torch.device) -> tuple[Any, int]:
        self.capture_streams_created += 1
        stream_id = next(_stream_ids)
        return ("simulated-stream", stream_id), stream_id

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        if self.warmup_delay:
            time.sleep(self.warmup_delay)
        return warm_up(forward, inputs)

    def capture(self, request: CaptureRequest) -> SimulatedGraph:
        forward, inputs, capture_error_mode = (
            request.forward,
            request.inputs,
            request.capture_error_mode,
        )
        self.capture_modes.append(capture_error_mode)
        static_inputs = static_copies(inputs)
        layout = request.layout
        if layout is None:
            layout = self.warm_up(forward, static_inputs)
        static_outputs = layout.empty(request.device)
        with self.capturing():
            if self.capture_delay:
                time.sleep(self.capture_delay)
            failure = self.fail_on_capture
            if failure is True:
                raise RuntimeError("simulated CUDA graph capture failure")
            if isinstance(failure, BaseException):
                raise failure
            if isinstance(failure, type) and issubclass(failure, BaseException):
                raise failure("simulated CUDA graph capture failure")
            captured, _ = flatten_outputs(forward(*static_inputs))
            layout.check(captured)
            for dst, src in zip(static_outputs, captured, strict=True):
                dst.copy_(src)
        self.captures += 1
        self.free_bytes = max(0, self.free_bytes - self.graph_bytes)
        return SimulatedGraph(
            self, forward, static_inputs, static_outputs, layout.spec, self.graph_bytes
        )
