"""The sink channels: one bounded queue per sink, and where each event offered to it went;
counters change under the bus lock, and nothing here waits or starts anything."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque

from omnitrace.bus._types import Sink, SinkStatistics
from omnitrace.events import Event

__all__ = ["SinkChannel", "SinkChannels", "sink_name"]

logger = logging.getLogger(__name__)

_DROP_REPORT_INTERVAL_S = 10.0


class SinkChannel:
    """One sink's bounded queue and counters; mutated under the bus lock."""

    __slots__ = (
        "abandoning",
        "base",
        "batch",
        "capacity",
        "delivered",
        "disabled",
        "dropped_reported",
        "drops",
        "error",
        "in_flight",
        "is_async",
        "last_drop_report",
        "name",
        "peak",
        "queue",
        "seq",
        "sink",
        "sink_closed",
    )

    def __init__(self, sink: Sink, name: str, capacity: int) -> None:
        self.sink = sink
        self.name = name
        self.capacity = capacity
        self.queue: deque[Event] = deque()
        self.base = 0
        self.delivered = 0
        self.drops: dict[str, int] = {}
        self.dropped_reported = 0
        self.last_drop_report = 0.0
        self.peak = 0
        self.in_flight = 0
        self.seq = 0
        # The batch inside the sink's handle(), and the seq of one close() is giving up on
        # (its count is then close()'s to make, whatever the sink reports meanwhile).
        self.batch: list[Event] | None = None
        self.abandoning = -1
        self.disabled = False
        self.sink_closed = False
        self.error: str | None = None
        self.is_async = inspect.iscoroutinefunction(sink.handle)

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    def drop(self, reason: str, count: int) -> None:
        if count > 0:
            self.drops[reason] = self.drops.get(reason, 0) + count

    def statistics(self, pending: int, emitted: int) -> SinkStatistics:
        return SinkStatistics(
            name=self.name,
            capacity=self.capacity,
            queued=len(self.queue) + self.in_flight + (0 if self.disabled else pending),
            peak_queued=self.peak,
            delivered=self.delivered,
            dropped=self.dropped,
            disabled=self.disabled,
            error=self.error,
            offered=emitted - self.base,
            dropped_by=dict(self.drops),
        )


def _written_before_abandon(channel: SinkChannel, batch: list[Event] | None) -> int:
    """Tell the sink of ``channel`` that close() gives up on ``batch``; return how many of
    its events the sink says it wrote (0 for a sink without ``abandon``)."""
    abandon = getattr(channel.sink, "abandon", None)
    if batch is None or not callable(abandon):
        return 0
    try:
        written = abandon(batch)
    except BaseException:
        logger.exception("sink %s raised in abandon()", channel.name)
        return 0
    if type(written) is not int or written < 0:
        logger.error("sink %s: abandon() returned %r, not a count", channel.name, written)
        return 0
    return written


def sink_name(sink: object) -> str:
    """Return the name ``sink`` gives itself, else its class name."""
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name else type(sink).__name__


class SinkChannels:
    """The pending queue shared by all sinks, then one channel per sink.

    ``emit()`` appends to ``pending`` only, whatever the number of sinks (while
    ``accepting``; else ``refuse_locked()`` counts the loss); ``distribute()`` later copies a
    batch of pending events into every channel.

    Args:
        lock: the bus lock (replaced in a forked child).
        queue_size: capacity of the pending queue.
    """

    __slots__ = (
        "accepting",
        "after_close",
        "channels",
        "closed",
        "emitted",
        "lock",
        "pending",
        "queue_size",
    )

    def __init__(self, lock: threading.Lock, queue_size: int) -> None:
        self.lock = lock
        self.queue_size = queue_size
        self.channels: tuple[SinkChannel, ...] = ()
        self.pending: deque[Event] = deque()
        self.emitted = 0
        self.after_close = 0
        self.closed = False
        # Whether emitted events go to the pending queue: open, with a sink to deliver to.
        self.accepting = False

    # -- hot path -------------------------------------------------------------------------

    def refuse_locked(self) -> None:
        """Count the loss of an event emitted after close or past the pending queue's bound.

        ``EventBus.emit()`` counts the event and appends it to ``pending`` itself, inline:
        the hot path is that one method.
        """
        if self.closed:
            self.after_close += 1
            for channel in self.channels:
                channel.drop("after_close", 1)
        else:
            # Degraded path only: the pump is behind, every sink loses this event.
            for channel in self.channels:
                channel.drop("queue_full", 1)

    # -- attaching and distributing -------------------------------------------------------

    def attach_locked(self, sink: Sink, capacity: int) -> SinkChannel:
        """Add a channel for ``sink``; it is offered every event from now on.

        Raises:
            RuntimeError: the channels are closed.
        """
        if self.closed:
            raise RuntimeError("cannot add a sink to a closed EventBus")
        channel = SinkChannel(sink, sink_name(sink), capacity)
        # Events still pending go to every sink attached when they are distributed.
        channel.base = self.emitted - len(self.pending)
        self.channels = (*self.channels, channel)
        self.accepting = True
        return channel

    def distribute(self) -> list[SinkChannel]:
        """Move pending events into the sink queues; return the channels that got some."""
        with self.lock:
            if not self.pending:
                return []
            batch = list(self.pending)
            self.pending.clear()
            woken = []
            for channel in self.channels:
                if channel.disabled:
                    channel.drop("sink_error", len(batch))
                    continue
                queue = channel.queue
                room = max(channel.capacity - len(queue), 0)
                if room < len(batch):
                    channel.drop("queue_full", len(batch) - room)
                    queue.extend(batch[:room])
                else:
                    queue.extend(batch)
                channel.peak = max(channel.peak, len(queue))
                woken.append(channel)
        return woken

    def behind(self, target: int) -> tuple[bool, list[SinkChannel]]:
        """Whether a sink still lacks events emitted before ``target``, and which of those
        have events queued."""
        with self.lock:
            busy = [
                c
                for c in self.channels
                if not c.disabled and c.delivered + c.dropped < target - c.base
            ]
            queued = [c for c in busy if c.queue]
        return bool(busy), queued

    # -- one batch's way through a sink ---------------------------------------------------

    def take(self, channel: SinkChannel) -> tuple[list[Event], int] | None:
        """Take the sink's whole queue as the batch in flight; None when there is nothing."""
        with self.lock:
            # One batch in flight per sink: after a hand-over the old loop's task may still
            # be finishing its batch.
            if channel.disabled or channel.in_flight or not channel.queue:
                return None
            batch = list(channel.queue)
            channel.queue.clear()
            channel.seq += 1
            channel.in_flight = len(batch)
            channel.batch = batch
            seq = channel.seq
            unreported = channel.dropped - channel.dropped_reported
            total = channel.dropped
            # By reason: a full disk (write_failed) is not a full queue.
            reasons = ", ".join(f"{r} {n}" for r, n in sorted(channel.drops.items()))
        if unreported and time.monotonic() - channel.last_drop_report >= _DROP_REPORT_INTERVAL_S:
            channel.dropped_reported += unreported
            channel.last_drop_report = time.monotonic()
            logger.warning(
                "sink %s dropped %d events (%d dropped in all: %s; queue capacity %d)",
                channel.name,
                unreported,
                total,
                reasons,
                channel.capacity,
            )
        return batch, seq

    def delivered(self, channel: SinkChannel, seq: int, not_written: int = 0) -> None:
        """Count batch ``seq`` as delivered, but ``not_written`` of its events as dropped
        (``write_failed``: the sink said it could not write them)."""
        with self.lock:
            # A batch close() gave up on is counted by close() alone: after it returns,
            # no counter moves, whenever the sink finishes.
            if channel.seq == seq and channel.in_flight and channel.abandoning != seq:
                lost = min(max(not_written, 0), channel.in_flight)
                channel.delivered += channel.in_flight - lost
                channel.drop("write_failed", lost)
                channel.in_flight = 0
                channel.batch = None

    def abandon(self, channel: SinkChannel, seq: int) -> None:
        """Count batch ``seq``, whose delivery was cancelled, as abandoned."""
        with self.lock:
            if channel.seq == seq and channel.in_flight and channel.abandoning != seq:
                channel.drop("abandoned", channel.in_flight)
                channel.in_flight = 0
                channel.batch = None

    def disable(self, channel: SinkChannel, exc: BaseException, seq: int) -> None:
        """Disable the sink that raised ``exc`` on batch ``seq``, report it and close it.

        A batch ``close()`` gave up on is accounted for already: the sink raising on it
        afterwards is logged, and changes no counter.
        """
        with self.lock:
            if channel.disabled:
                return
            late = self.closed and (channel.seq != seq or channel.abandoning == seq)
            if not late:
                channel.disabled = True
                channel.error = f"{type(exc).__name__}: {exc}"
                lost = len(channel.queue) + (channel.in_flight if channel.seq == seq else 0)
                channel.drop("sink_error", lost)
                channel.queue.clear()
                channel.in_flight = 0
                channel.batch = None
        if late:
            logger.error(
                "sink %s raised %s: %s on the batch close() had given up on",
                channel.name,
                type(exc).__name__,
                exc,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
        else:
            logger.error(
                "sink %s raised %s and is disabled; its events are dropped from now on",
                channel.name,
                channel.error,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
        self.close_sink(channel)

    def close_sink(self, channel: SinkChannel) -> None:
        """Call the sink's own ``close()``, once; what it raises is logged."""
        with self.lock:
            if channel.sink_closed:
                return
            channel.sink_closed = True
        close = getattr(channel.sink, "close", None)
        if close is None:
            return
        try:
            close()
        except BaseException:
            # Even SystemExit: on the bus loop it would end delivery to every other sink.
            logger.exception("sink %s raised while closing", channel.name)

    # -- closing and forking --------------------------------------------------------------

    def close(self) -> bool:
        """Stop taking events; count what is still queued as not flushed.

        Returns:
            False if they were closed already.
        """
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            self.accepting = False
            pending = len(self.pending)
            self.pending.clear()
            for channel in self.channels:
                channel.drop("sink_error" if channel.disabled else "not_flushed", pending)
                channel.drop("not_flushed", len(channel.queue))
                channel.queue.clear()
        return True

    def abandon_in_flight(self) -> dict[str, int]:
        """Count batches still inside a sink as abandoned; return each sink's loss at close.

        A sink with an ``abandon(events)`` method is told first, outside the lock (it writes
        nothing more of the batch, and says how many of its events it has written: those
        count as delivered). Either way the count made here is final: a sink that finishes
        the batch later moves no counter.
        """
        with self.lock:
            stuck = [(c, c.seq, c.batch) for c in self.channels if c.in_flight]
            for channel, seq, _ in stuck:
                channel.abandoning = seq
        kept = [_written_before_abandon(channel, batch) for channel, _, batch in stuck]
        with self.lock:
            for (channel, seq, _), written in zip(stuck, kept, strict=True):
                if channel.seq == seq and channel.in_flight:
                    written = min(written, channel.in_flight)
                    channel.delivered += written
                    channel.drop("abandoned", channel.in_flight - written)
                    channel.in_flight = 0
                    channel.batch = None
            for channel in self.channels:
                channel.seq += 1
            return {
                c.name: n
                for c in self.channels
                if (n := c.drops.get("not_flushed", 0) + c.drops.get("abandoned", 0))
            }

    def forget_parent(self) -> None:
        """In a forked child (one thread, a new lock): count what the parent had not
        delivered as dropped (``forked``) and empty the queues."""
        self.pending.clear()
        for channel in self.channels:
            # The parent delivers what it had not yet; the child's copy is discarded and
            # counted. Reckoned from the counters rather than the queues: a thread of the
            # parent may have been moving a batch between them, lock held, at the fork.
            undelivered = self.emitted - channel.base - channel.delivered - channel.dropped
            channel.drop("forked", undelivered)
            channel.queue.clear()
            channel.in_flight = 0
            channel.seq += 1

    def statistics_locked(self) -> tuple[SinkStatistics, ...]:
        """Return every sink's counters."""
        pending = len(self.pending)
        return tuple(c.statistics(pending, self.emitted) for c in self.channels)
