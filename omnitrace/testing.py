"""Helpers for testing code that uses omnitrace, without a GPU: the simulated graph backend,
``capture_events``, and hand-made signatures (``sig``) and captures (``captured``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omnitrace.bus import EventBus
from omnitrace.events import Event, GraphCaptured
from omnitrace.graphs.backends.simulated import SimulatedGraph, SimulatedGraphBackend
from omnitrace.signature import Signature

__all__ = ["SimulatedGraph", "SimulatedGraphBackend", "capture_events", "captured", "sig"]


def sig(text: str) -> Signature:
    """Return the signature written ``text`` (``"float32[1,80,100] @cuda:0 s=0"``).

    For events built by hand in tests: ``GraphReplayed("audio", sig("float32[1,4]"), ...)``.

    Args:
        text: a signature's text form, as ``Signature.text`` writes it.

    Raises:
        SignatureParseError: ``text`` is not a signature's text form.
    """
    return Signature.parse(text)


def captured(
    adapter: str,
    signature: str,
    *,
    epoch_ns: int = 0,
    graph_index: int = 0,
    free_bytes: int | None = None,
) -> GraphCaptured:
    """Return a hand-made ``GraphCaptured`` of ``signature`` (its text form) on the CPU:
    10 ms of capture, 1 KiB reserved, 64 static bytes, ``free_bytes`` free before it.

    Args:
        adapter: the adapter's name.
        signature: the signature's text form (see :func:`sig`).
        epoch_ns: both its clocks (monotonic and epoch); default 0.
        graph_index: graphs the adapter held before it; default 0.
        free_bytes: device-free memory before the capture; default None (not read).

    Raises:
        SignatureParseError: ``signature`` is not a signature's text form.
    """
    return GraphCaptured(
        adapter,
        sig(signature),
        monotonic_ns=epoch_ns,
        epoch_ns=epoch_ns,
        duration_s=0.01,
        pool_id=0,
        device="cpu",
        stream=0,
        capture_stream=1,
        bytes_reserved=1024,
        static_bytes=64,
        graph_index=graph_index,
        free_bytes=free_bytes,
    )


@contextlib.contextmanager
def capture_events(bus: EventBus) -> Iterator[list[Event]]:
    """Yield a list that receives, in order, every event ``bus`` emits inside the block.

    The list is a fold of ``bus`` (see :meth:`EventBus.add_fold`) until the block ends.

    Args:
        bus: the bus to listen to.

    Raises:
        TypeError: ``bus`` is not an :class:`EventBus`.
    """
    if not isinstance(bus, EventBus):
        raise TypeError(f"capture_events needs an EventBus, got {type(bus).__name__}")
    events: list[Event] = []
    fold = events.append
    bus.add_fold(fold)
    try:
        yield events
    finally:
        bus.remove_fold(fold)
