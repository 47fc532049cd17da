"""Helpers for testing code that uses omnitrace, without a GPU.

``SimulatedGraphBackend`` simulates a CUDA device on CPU tensors: it is for tests and the
CPU demo, never for serving. ``capture_events`` records what a bus emits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omnitrace.bus import EventBus
from omnitrace.events import Event
from omnitrace.graphs.backends.simulated import SimulatedGraph, SimulatedGraphBackend

__all__ = ["SimulatedGraph", "SimulatedGraphBackend", "capture_events"]


@contextlib.contextmanager
def capture_events(bus: EventBus) -> Iterator[list[Event]]:
    """Yield a list that receives, in order, every event ``bus`` emits inside the block."""
    if not isinstance(bus, EventBus):
        raise TypeError(f"capture_events needs an EventBus, got {type(bus).__name__}")
    events: list[Event] = []
    fold = events.append
    bus.add_fold(fold)
    try:
        yield events
    finally:
        bus.remove_fold(fold)
