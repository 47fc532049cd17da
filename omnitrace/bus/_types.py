"""What the bus shows of itself: the sink protocol, fold type, drop reasons and counters."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from omnitrace.events import Event

__all__ = ["DROP_REASONS", "BusStatistics", "EventsNotWritten", "Fold", "Sink", "SinkStatistics"]

Fold = Callable[[Event], None]

#: Why a sink lost events (the keys of :attr:`SinkStatistics.dropped_by`):
#: ``queue_full`` the pending queue or the sink's queue was full;
#: ``sink_error`` the sink raised and was disabled (its failing batch and every later event);
#: ``not_flushed`` still queued when ``close()`` reached its deadline;
#: ``abandoned`` inside the sink's ``handle`` when ``close()`` gave up waiting for it (final:
#: a sink that finishes the batch later moves no counter);
#: ``after_close`` emitted after ``close()``;
#: ``forked`` undelivered in the parent at a ``fork()`` (the child's copy is discarded);
#: ``write_failed`` the sink stayed usable but could not write these (:class:`EventsNotWritten`).
DROP_REASONS = (
    "queue_full",
    "sink_error",
    "not_flushed",
    "abandoned",
    "after_close",
    "forked",
    "write_failed",
)


class EventsNotWritten(Exception):
    """Raised by a sink's ``handle`` that wrote its batch but ``count`` of its events.

    The sink stays attached: the bus counts those events as dropped (``write_failed``) and
    the rest as delivered, so ``delivered`` stays what the sink really holds. A sink raises
    it for a loss it recovers from on its own (a full disk that frees up again).

    Args:
        count: events of the batch not written.
        reason: why, for the message (``"{count} events not written: {reason}"``).
    """

    def __init__(self, count: int, reason: str) -> None:
        super().__init__(f"{count} events not written: {reason}")
        self.count = count
        self.reason = reason


@runtime_checkable
class Sink(Protocol):
    """An asynchronous consumer of events.

    ``handle`` receives events in emission order, in batches. It may be a plain method (it
    then runs on a daemon thread of its own, so a slow sink never stalls the others) or a
    coroutine function (awaited on the bus loop). An optional ``close()`` is called once
    when the bus closes (on the sink's thread for a plain sink); an optional ``name`` names
    the sink in statistics and logs.

    An optional ``abandon(events) -> int`` is called by ``close()`` when it stops waiting
    for the batch ``events`` inside ``handle``: from then on the sink must write nothing
    more of it, and it returns how many of its events it has written (counted as delivered,
    the rest as ``abandoned``). It is called from the closing thread, must return promptly
    and must not call the bus. Without it the whole batch counts as abandoned, whatever the
    sink still does with it.
    """

    def handle(self, events: Sequence[Event]) -> Any:
        """Consume one batch of events.

        Args:
            events: the batch, in emission order.

        Returns:
            Nothing the bus reads; a coroutine function's call returns the awaitable.

        Raises:
            EventsNotWritten: some of the batch was not written; the sink stays attached.
                Any other exception disables the sink (``sink_error``).
        """
        ...


@dataclass(frozen=True, slots=True)
class SinkStatistics:
    """Delivery counters of one sink.

    Once the bus is closed, ``delivered + dropped == offered`` and ``queued == 0``.

    Args:
        name, capacity, queued, peak_queued, delivered, dropped, disabled, error: the sink's
            name, queue capacity, events queued now and at most, events delivered and lost,
            whether it was disabled and the error that disabled it (None if none).
        offered: events emitted while the sink was attached; default 0.
        dropped_by: ``dropped`` by reason; default an empty dict.
    """

    name: str
    capacity: int
    queued: int
    """Events waiting for the sink or inside its ``handle`` right now."""
    peak_queued: int
    delivered: int
    dropped: int
    """Events the sink lost, whatever the reason (see ``dropped_by``)."""
    disabled: bool
    error: str | None
    offered: int = 0
    """Events emitted while the sink was attached (all of them for a sink attached first)."""
    dropped_by: Mapping[str, int] = field(default_factory=dict, hash=False)
    """``dropped`` by reason, one of :data:`DROP_REASONS` (reasons with no loss are absent)."""


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """A frozen snapshot of the bus counters.

    Args:
        emitted: events emitted.
        rejected: objects passed to ``emit()`` that were not events.
        emitted_after_close: events emitted after ``close()``.
        disabled_folds: folds disabled because they raised.
        sinks: each sink's counters.
    """

    emitted: int
    rejected: int
    """Objects passed to ``emit()`` that were not omnitrace events (ignored)."""
    emitted_after_close: int
    """Events emitted after ``close()``: folded, but no longer delivered to sinks."""
    disabled_folds: int
    sinks: tuple[SinkStatistics, ...]

    @property
    def dropped(self) -> int:
        """Events lost by every sink together."""
        return sum(s.dropped for s in self.sinks)
