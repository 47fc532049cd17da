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
    """Static buffers around a forward that is re-run on every replay.

    Made by :meth:`SimulatedGraphBackend.capture`.

    Args:
        backend: the backend that captured it (it counts the replays).
        forward: the forward each replay runs again.
        static_inputs, static_outputs: the graph's static buffers.
        spec: how the output leaves nest (from the warm-up's layout).
        bytes_reserved: the memory the capture is reported to have taken.
    """

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
        """Copy ``inputs`` in, run the forward on the static inputs, and return its outputs.

        Args:
            inputs: the call's inputs, of the captured signature.

        Returns:
            Fresh clones of the static outputs, nested as the forward returns them.
        """
        self.copy_in(inputs)
        leaves, _ = flatten_outputs(self._forward(*self._static_inputs))
        for dst, src in zip(self._static_outputs, leaves, strict=True):
            dst.copy_(src)
        self._backend.replays += 1
        return self.clone_out()


class SimulatedGraphBackend:
    """Simulate a CUDA device on CPU tensors (tests and the CPU demo only).

    The current stream and the capturing state are per thread, as CUDA's are.

    Args:
        free_bytes: device-free memory reported to the memory floor check; a settable
            attribute, and every capture consumes ``graph_bytes`` of it. Default 80 GiB.
        graph_bytes: memory each capture takes from ``free_bytes``; default 64 MiB.
        fail_on_capture: make captures raise: ``True`` raises a ``RuntimeError``, an
            exception instance or class raises that. Default False.
        capture_delay: seconds each capture takes (a slow compile and capture), for tests
            of what calls do meanwhile; default 0.0.
        warmup_delay: seconds each warm-up takes; default 0.0.
        cached_bytes: memory the simulated allocator holds cached, reported with a memory
            deferral; a settable attribute. Default 0.

    :attr:`allocated_bytes` and :attr:`peak_bytes` are the simulated allocator's allocated
    memory now and at its peak (both 0 at first): a test's forward raises ``peak_bytes``
    to simulate what an eager call allocates.

    Raises:
        ConfigError: ``free_bytes``, ``graph_bytes`` or ``cached_bytes`` is not a
            nonnegative integer, or a delay is not a nonnegative number of seconds.
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
        cached_bytes: int = 0,
    ) -> None:
        self.free_bytes = check_int("free_bytes", free_bytes)
        self.cached_bytes = check_int("cached_bytes", cached_bytes)
        self.allocated_bytes = 0
        self.peak_bytes = 0
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
        self.expandable: list[bool] = []
        """Whether each capture asked for expandable segments, in order."""
        self._local = threading.local()

    # -- knobs for tests -------------------------------------------------------------------

    @contextlib.contextmanager
    def stream(self, stream_id: int) -> Iterator[None]:
        """Make ``stream_id`` the current (replay) stream inside the block, on this thread.

        Args:
            stream_id: the stream's id (the default stream is 0).
        """
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
        """Return True: every device is a graph device here.

        Args:
            device: the call's device (any).
        """
        return True

    def is_capturing(self, device: torch.device) -> bool:
        """Return whether this thread is inside :meth:`capturing` (or a capture).

        Args:
            device: the call's device (any; the state is per thread only).
        """
        return bool(getattr(self._local, "capturing", False))

    def stream_id(self, device: torch.device) -> int:
        """Return this thread's current stream id (see :meth:`stream`; 0 by default).

        Args:
            device: the call's device (any; the stream is per thread only).
        """
        return int(getattr(self._local, "stream", 0))

    def device_clock(self, device: torch.device) -> HostClock:
        """Return a clock that times calls on the host (there is no device to time).

        Args:
            device: the call's device (any).
        """
        return HostClock()

    def device_free_bytes(self, device: torch.device) -> int:
        """Return :attr:`free_bytes`.

        Args:
            device: the call's device (any).
        """
        return self.free_bytes

    def device_cached_bytes(self, device: torch.device) -> int:
        """Return :attr:`cached_bytes`.

        Args:
            device: the call's device (any).
        """
        return self.cached_bytes

    def device_allocated_bytes(self, device: torch.device) -> tuple[int, int]:
        """Return :attr:`allocated_bytes` and :attr:`peak_bytes`.

        Args:
            device: the call's device (any).
        """
        return self.allocated_bytes, self.peak_bytes

    def new_pool(self, device: torch.device) -> Any:
        """Return a new pool token, ``("simulated-pool", n)``, counting it.

        Args:
            device: the pool's device (any).
        """
        self.pools_created += 1
        return ("simulated-pool", self.pools_created)

    def new_capture_stream(self, device: torch.device) -> tuple[Any, int]:
        """Return a new capture stream token and its id (unique in the process), counting it.

        Args:
            device: the stream's device (any).
        """
        self.capture_streams_created += 1
        stream_id = next(_stream_ids)
        return ("simulated-stream", stream_id), stream_id

    def warm_up(
        self, forward: Callable[..., Any], inputs: Sequence[torch.Tensor | None]
    ) -> OutputLayout:
        """Sleep ``warmup_delay``, run ``forward`` once and return its output layout.

        Args:
            forward: the forward to warm up.
            inputs: its inputs.
        """
        if self.warmup_delay:
            time.sleep(self.warmup_delay)
        return warm_up(forward, inputs)

    def capture(self, request: CaptureRequest) -> SimulatedGraph:
        """Record the capture, warm up unless ``request`` has a layout, and run the forward
        into static buffers; ``graph_bytes`` of :attr:`free_bytes` are taken.

        Args:
            request: what to capture.

        Returns:
            The graph, whose replays run the forward again.

        Raises:
            RuntimeError: ``fail_on_capture`` is True, or the forward returned other
                outputs than at warm-up.
            BaseException: the exception (or an instance of the class) ``fail_on_capture``
                names.
        """
        forward, inputs, capture_error_mode = (
            request.forward,
            request.inputs,
            request.capture_error_mode,
        )
        self.capture_modes.append(capture_error_mode)
        self.expandable.append(request.expandable)
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
