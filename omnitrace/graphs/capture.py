"""Capturing one key's graph for an adapter: its pool and capture stream, the backend's capture
under the capture lock, the graph kept for hits, and ``GraphCaptured`` or the failure."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from omnitrace.events import GraphCaptured
from omnitrace.graphs.backends.base import CAPTURE_LOCK, CaptureRequest
from omnitrace.graphs.compiling import compile_lock
from omnitrace.graphs.pools import PoolRegistry
from omnitrace.graphs.timing import CAPTURES

if TYPE_CHECKING:
    import torch

    from omnitrace.config import EncoderGraphConfig
    from omnitrace.graphs.backends.base import CapturedGraph, GraphBackend, OutputLayout
    from omnitrace.graphs.hooks import AdapterHooks
    from omnitrace.signature import Signature

__all__ = ["Capturer", "Due", "Entry"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running during a capture.

    A collection may free an unreachable CUDA graph (a dropped adapter's, a vLLM manager's):
    destroying a graph is not permitted while a stream captures, and the capture under way
    fails with ``cudaErrorStreamCaptureInvalidated``. ``torch.cuda.graph`` collects before
    it captures only when ``torch.compiler.config.force_cudagraph_gc`` is set; pausing the
    collector costs nothing. Captures hold the capture lock, so they never nest here.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
        hooks: the adapter's name, lock and callbacks (a failed capture goes to its
            ``fail`` before the error propagates).
        backend: the adapter's graph backend.
        config: the adapter's settings (``share_pools``, ``expandable_pools``; ``compile``:
            torch.compile's lock is held too).
        error_mode: the CUDA capture error mode the backend is asked for.
        forward: returns the forward to capture (the encoder, or torch.compile of it).
    """

    def __init__(
        self,
        hooks: AdapterHooks,
        backend: GraphBackend,
        config: EncoderGraphConfig,
        *,
        error_mode: str,
        forward: Callable[[], Callable[..., Any]],
    ) -> None:
        self._hooks = hooks
        self._backend = backend
        self._pools = PoolRegistry(backend, share=config.share_pools)
        self._error_mode = error_mode
        self._compiled = config.compile
        self._expandable = config.expandable_pools
        self._forward = forward
        #: The held graphs by key, in capture order; never removed, so the call path may
        #: read an entry without the adapter's lock.
        self.graphs: dict[Hashable, Entry] = {}
        # A compiled graph's capture may take less than an eager forward of smaller inputs
        # (its kernels are fused), and inside vLLM both kinds share a pool: no reuse is
        # assumed with compile.
        self._reuse = config.share_pools and not config.compile

    def pool_holds_larger(self, signature: Signature) -> bool:
        """Whether the shared pool a capture of ``signature`` would use holds a graph whose
        inputs are at least as large in every dimension (same count, dtypes, ranks,
        devices and replay stream). The transient memory of that graph's capture is free
        in the pool between captures, and a capture of smaller inputs allocates no more,
        so it reuses that memory (on an H100, the 11 such captures of a MiniCPM-o run's
        vision and audio shapes grew their pools by 0 or 2 MiB). False without shared pools,
        and with ``compile``.

        Args:
            signature: the signature of the key due for capture.
        """
        if not self._reuse:
            return False
        return any(entry.signature.covers(signature) for entry in self.graphs.values())

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
        start_mono, start_epoch, start_perf = (
            time.monotonic_ns(),
            time.time_ns(),
            time.perf_counter(),
        )
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
                expandable=self._expandable,
                layout=layout,
            )
            with (
                CAPTURE_LOCK,
                compile_lock(self._compiled),
                CAPTURES.capturing(),
                _collector_paused(),
            ):
                graph = self._backend.capture(request)
        except BaseException as exc:
            self._hooks.fail(exc, signature, device, stream)
            raise
        index = len(self.graphs)
        self.graphs[key] = Entry(graph, signature)
        self._hooks.emit(
            GraphCaptured(
                self._hooks.name,
                signature,
                start_mono,
                start_epoch,
                time.perf_counter() - start_perf,
                slot.pool_id,
                str(device),
                stream,
                slot.capture_stream_id,
                int(graph.bytes_reserved),
                int(graph.static_bytes),
                index,
                free_bytes,
                phase=self._hooks.phase(),
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
            name = self._hooks.name
            logger.debug("omnitrace: %r cannot read free memory of %s: %s", name, device, exc)
            return None
