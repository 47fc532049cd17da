"""The in-process event bus between the graph adapters and every consumer: ``emit()`` never
blocks or raises, every event is delivered or counted as dropped (docs/architecture.md, "The
event bus")."""

from __future__ import annotations

from omnitrace.bus._bus import (
    DRAIN_INTERVAL_RANGE_S,
    DROP_REASONS,
    MAX_QUEUE_SIZE,
    TIMEOUT_RANGE_S,
    BusStatistics,
    EventBus,
    EventsNotWritten,
    Fold,
    Sink,
    SinkStatistics,
)

__all__ = [
    "DRAIN_INTERVAL_RANGE_S",
    "DROP_REASONS",
    "MAX_QUEUE_SIZE",
    "TIMEOUT_RANGE_S",
    "BusStatistics",
    "EventBus",
    "EventsNotWritten",
    "Fold",
    "Sink",
    "SinkStatistics",
]
