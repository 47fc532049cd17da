"""Capturing one key's graph for an adapter, keeping it and reporting it.

The adapter decides (eligibility, admission) and, with its lock held, hands a key that is
due for a graph to its :class:`Capturer`: this picks the key's pool and capture stream
(``pools.py``), asks the backend for the capture under the process-wide capture lock (and
torch.compile's, with a compiled forward), keeps the graph in the table the call path looks
hits up in, and emits ``GraphCaptured`` with the capture's host time, memory and pool. A
capture that raises goes to the adapter's failure contract (``CaptureFailed``, terminal) and
propagates untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from omnitrace.events import Event, GraphCaptured, Phase
from omnitrace.graphs.backends.base import (
    CAPTURE_LOCK,
    CapturedGraph,
    CaptureRequest,
    GraphBackend,
    OutputLayout,
)
from omnitrace.graphs.compiling import compile_lock
from omnitrace.graphs.pools import PoolRegistry
from omnitrace.signature import Signature

__all__ = ["Capturer", "Due", "Entry"]

logger = logging.getLogger(__name__)

_mono = time.monotonic_ns
_epoch = time.time_ns
_perf = time.perf_counter


class Entry:
    """A captured graph and the signature it was captured for."""

    __slots__ = ("graph", "signature")

    def __init__(self, graph: CapturedGraph, signature: Signature) -> None:
        self.graph = graph
        self.signature = signature


class Due(NamedTuple):
    """A call whose key is due for a graph: what a capture or a preparation starts from."""

    key: Hashable
    inputs: tuple[Any, ...]
    device: torch.device
    stream: int
    signature: Signature


class Capturer:
    """One adapter's captured graphs, and the capture of each.

    Args:
        name: the adapter's name, for events and log lines.
        backend: the adapter's graph backend.
        share_pools: one pool per device and replay stream (else one per graph).
        error_mode: the CUDA capture error mode the backend is asked for.
        compiled: whether the forward is compiled (torch.compile's lock is held too).
        forward: returns the forward to capture (the encoder, or torch.compile of it).
        emit: the adapter's event path (its stats fold, then the bus).
        phase: the engine phase events are tagged with, read when a capture is reported.
        fail: the adapter's capture-failure contract, called before the error propagates.
    """

    def __init__(
        self,
        name: str,
        backend: GraphBackend,
        *,
        share_pools: bool,
        error_mode: str,
        compiled: bool,
        forward: Callable[[], Callable[..., Any]],
        emit: Callable[[Event], None],
        phase: Callable[[], Phase],
        fail: Callable[[BaseException, Signature, torch.device, int], object],
    ) -> None:
        self._name = name
        self._backend = backend
        self._pools = PoolRegistry(backend, share=share_pools)
        self._error_mode = error_mode
        self._compiled = compiled
        self._forward = forward
        self._emit = emit
        self._phase = phase
        self._fail = fail
        #: The held graphs by key, in capture order; never removed, so the call path may
        #: read an entry without the adapter's lock.
        self.graphs: dict[Hashable, Entry] = {}

    def capture(
        self,
        due: Due,
        layout: OutputLayout | None,
        *,
        prepared: bool,
        free_bytes: int | None,
    ) -> CapturedGraph:
        """Capture ``due``'s key, hold the graph and report it; return the graph.

        ``prepared``: the key was warmed up in the background (``layout`` is the warm-up's
        output layout, or None to warm up again). ``free_bytes``: the device-free memory
        admission read for this call, reused in the report (None: read it now).
        """
        key, inputs, device, stream, signature = due
        slot = self._pools.slot_for(device, stream)
        if free_bytes is None:
            # No floor read for this call (floor off, or a prepared key admitted earlier):
            # one read now, outside the capture's timing.
            free_bytes = self._device_free_bytes(device)
        start_mono, start_epoch, start_perf = _mono(), _epoch(), _perf()
        try:
            request = CaptureRequest(
                self._forward(),
                inputs,
                device,
                slot.pool,
                slot.capture_stream,
                capture_error_mode=self._error_mode,
                # A prepared key: the device was settled by the preparation, and a call
                # must not stall on a device-wide sync.
                quiet=prepared,
                layout=layout,
            )
            with CAPTURE_LOCK, compile_lock(self._compiled):
                graph = self._backend.capture(request)
        except BaseException as exc:
            self._fail(exc, signature, device, stream)
            raise
        index = len(self.graphs)
        self.graphs[key] = Entry(graph, signature)
        self._emit(
            GraphCaptured(
                self._name,
                signature,
                start_mono,
                start_epoch,
                _perf() - start_perf,
                slot.pool_id,
                str(device),
                stream,
                slot.capture_stream_id,
                int(graph.bytes_reserved),
                int(graph.static_bytes),
                index,
                free_bytes,
                phase=self._phase(),
            )
        )
        return graph

    def _device_free_bytes(self, device: torch.device) -> int | None:
        """Device-free memory for a capture's event; None when the backend cannot tell.

        Only captures call it (rare): a hit never reads device memory.
        """
        try:
            return int(self._backend.device_free_bytes(device))
        except Exception as exc:  # a report must never fail the capture it describes
            logger.debug("omnitrace: %r cannot read free memory of %s: %s", self._name, device, exc)
            return None
